"""`python -m services.trainer`: parse -> build -> run -> close (see server.serve)."""
from __future__ import annotations

import asyncio

from services.common.auth import load_token_or_exit
from services.common.process.service_config import parse_service_config
from services.common.process.structured_logging import configure_logging
from services.trainer.config import TrainerServiceConfig
from services.trainer.server import serve


def main(argv: list[str] | None = None) -> int:
    config = parse_service_config(TrainerServiceConfig, env_prefix="LOCKSTEP_TRAINER", argv=argv)
    token = load_token_or_exit(config.auth_token_file)
    configure_logging("trainer", config.log_level)
    asyncio.run(serve(config, token))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
