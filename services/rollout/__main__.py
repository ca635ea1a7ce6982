"""`python -m services.rollout`: parse -> build -> run -> close (the work is in server.serve)."""
from __future__ import annotations

import asyncio

from services.common.auth import load_token_or_exit
from services.common.determinism import configure_determinism
from services.common.process.service_config import parse_service_config
from services.common.process.structured_logging import configure_logging
from services.rollout.config import ENV_PREFIX, RolloutServiceConfig
from services.rollout.server import serve


def main(argv: list[str] | None = None) -> None:
    config = parse_service_config(RolloutServiceConfig, env_prefix=ENV_PREFIX, argv=argv)
    token = load_token_or_exit(config.auth_token_file)
    configure_logging("rollout", config.log_level)
    # Deterministic kernels and a pinned thread count: same request -> same bits.
    # Sampling never touches the global RNG (each sample has its own generator),
    # so the seed here only fixes anything a library might draw.
    configure_determinism(0, num_threads=config.num_threads or None)
    asyncio.run(serve(config, token))


if __name__ == "__main__":
    main()
