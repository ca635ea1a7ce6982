"""Container healthchecks for docker-compose.yml: exit 0 when the service answers, 1 otherwise.

    python3 deploy/docker/healthcheck.py grpc rollout 127.0.0.1:50051
    python3 deploy/docker/healthcheck.py grpc trainer 127.0.0.1:50052
    python3 deploy/docker/healthcheck.py http http://127.0.0.1:8000/healthz

The gRPC form calls the service's own Health RPC (proto/lockstep.proto), which
both servers answer even while a batch or a train step runs, so a busy service
is healthy and a wedged event loop is not. "not_loaded" (no run yet) is
healthy. The call carries the deployment's bearer token ($LOCKSTEP_AUTH_TOKEN_FILE,
services/common/auth.py), like every call to these services. The HTTP form is for the coordinator: /healthz says the process
serves requests; /readyz would also require every rollout and the trainer, and
a healthcheck that depends on other containers restarts the wrong one.

Uses the standard library plus grpcio (already in the image), not curl: the
SGLang base images do not promise one.
"""
from __future__ import annotations

import sys
import urllib.request
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

TIMEOUT_S = 5.0


def check_grpc(service: str, address: str) -> tuple[bool, str]:
    import grpc

    from proto import lockstep_pb2 as pb
    from proto import lockstep_pb2_grpc as pb_grpc

    stubs = {"rollout": pb_grpc.RolloutStub, "trainer": pb_grpc.TrainerStub}
    if service not in stubs:
        return False, f"unknown service {service!r}; expected one of {sorted(stubs)}"
    from services.common.auth import AuthConfigError, load_token
    from services.common.grpc_options import sync_channel

    try:
        token = load_token()  # the container's own token (compose secret)
    except AuthConfigError as exc:
        return False, str(exc)
    with sync_channel(address, token) as channel:
        try:
            reply = stubs[service](channel).Health(pb.HealthRequest(), timeout=TIMEOUT_S)
        except grpc.RpcError as exc:
            return False, f"{service} at {address}: {exc.code().name} {exc.details()}"
    return reply.ok, f"{service} at {address}: {reply.status or ('ok' if reply.ok else 'not ok')}"


def check_http(url: str) -> tuple[bool, str]:
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as r:
            return 200 <= r.status < 300, f"{url}: HTTP {r.status}"
    except OSError as exc:  # URLError, HTTPError, timeouts, refused connections
        return False, f"{url}: {exc}"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) == 3 and args[0] == "grpc":
        ok, msg = check_grpc(args[1], args[2])
    elif len(args) == 2 and args[0] == "http":
        ok, msg = check_http(args[1])
    else:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    print(msg)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
