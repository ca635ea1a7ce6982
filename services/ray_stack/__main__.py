"""`python -m services.ray_stack`: parse -> build -> run -> close.

Places the stack on the Ray cluster, prints one JSON line (the API URL, every
service's address, node and pid) once the coordinator is ready, and keeps it
up until SIGTERM or Ctrl-C, which stop it again (coordinator first).
"""
from __future__ import annotations

import json
import signal
import sys
import threading

from services.common.process.service_config import parse_service_config
from services.common.process.structured_logging import configure_logging
from services.ray_stack.config import RayStackConfig
from services.ray_stack.launcher import RayStack


def main(argv: list[str] | None = None) -> int:
    config = parse_service_config(RayStackConfig, env_prefix="LOCKSTEP_RAY_STACK", argv=argv)
    configure_logging("ray_stack", "info")
    stack = RayStack(config)
    stop = threading.Event()
    try:
        stack.connect()
        for sig in (signal.SIGTERM, signal.SIGINT):  # after connect(): ray.init replaces SIGTERM's handler
            signal.signal(sig, lambda *_: stop.set())
        ready = stack.start()
        print(json.dumps(ready), flush=True)
        while not stop.wait(1.0):  # a timed wait, so the signal handler gets to run
            pass
    except RuntimeError as exc:
        print(f"ray_stack: {exc}", file=sys.stderr)
        return 1
    finally:
        stack.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
