"""Container healthchecks for docker-compose.yml: exit 0 when the service answers, 1 otherwise.

    python3 deploy/docker/healthcheck.py grpc rollout 127.0.0.1:50051
    python3 deploy/docker/healthcheck.py grpc trainer 127.0.0.1:50052
    python3 deploy/docker/healthcheck.py http http://127.0.0.1:8000/healthz

The gRPC form is the standard health check (grpc.health.v1 Health/Check, the
protocol grpc_health_probe and orchestrators speak) for the service's full
name (lockstep.v1.Rollout / lockstep.v1.Trainer): SERVING while the server
runs, also while a batch or a train step does, so a busy service is healthy
and a wedged event loop is not; NOT_SERVING once it is shutting down; a
server of the other service answers NOT_FOUND. The HTTP form is for the
coordinator: /healthz says the process serves requests; /readyz would also
require every rollout and the trainer, and a healthcheck that depends on other
containers restarts the wrong one.

Uses the standard library plus grpcio and grpcio-health-checking (installed
with Lockstep), not curl: the SGLang base images do not promise one.
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
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from services.common.grpc.health import SERVICE_NAMES

    if service not in SERVICE_NAMES:
        return False, f"unknown service {service!r}; expected one of {sorted(SERVICE_NAMES)}"
    name = SERVICE_NAMES[service]
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=name),
                                                              timeout=TIMEOUT_S)
        except grpc.RpcError as exc:
            return False, f"{name} at {address}: {exc.code().name} {exc.details() or ''}".rstrip()
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return reply.status == health_pb2.HealthCheckResponse.SERVING, f"{name} at {address}: {status}"


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
