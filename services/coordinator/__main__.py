"""`python -m services.coordinator`: parse -> build -> run -> close."""
from __future__ import annotations

import os

# The code task's sandbox forks this process (to run bubblewrap as nobody), and with gRPC's fork support on
# (grpcio's default) a forked child may restart gRPC's poller threads and race them against closing its
# descriptors: measured, 5 of 300 such forks of a process holding a gRPC server and channel failed
# ("epoll_wait error: Bad file descriptor"), 0 of 300 with it off. Nothing here uses gRPC across a fork.
# It must be set before gRPC is first imported.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

import gc  # noqa: E402

import uvicorn  # noqa: E402

from services.common.auth import load_token_or_exit  # noqa: E402
from services.common.process.service_config import parse_service_config  # noqa: E402
from services.common.process.structured_logging import configure_logging  # noqa: E402
from services.coordinator.config import CoordinatorConfig  # noqa: E402
from services.coordinator.http.api import create_app  # noqa: E402
from services.coordinator.tasks import preload_tasks  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    config = parse_service_config(CoordinatorConfig, env_prefix="LOCKSTEP_COORDINATOR", argv=argv)
    token = load_token_or_exit(config.auth_token_file)
    configure_logging("coordinator", config.log_level)
    try:
        app = create_app(config, token)
    except ValueError as exc:  # a named configuration field that cannot be used
        raise SystemExit(f"configuration error: {exc}") from None
    preload_tasks()
    # Everything imported so far (torch, transformers, sympy, ...) lives as long as the process: out of the
    # cyclic collector's reach, a full collection that submit-time validation triggers in its worker thread
    # (it allocates a lot) does not walk it while holding the GIL, which stalls the event loop.
    gc.freeze()
    # uvicorn turns SIGTERM into a graceful shutdown: the lifespan stops the
    # scheduler (the run stays `running` in Redis and resumes on restart),
    # closes channels and stops the embedded Redis, which flushes its AOF.
    uvicorn.run(app, host=config.host, port=config.port, log_config=None, access_log=False)


if __name__ == "__main__":
    main()
