"""Standard gRPC health checking (grpc.health.v1) for the Lockstep servers.

Orchestrators, load balancers and `grpc_health_probe` speak this protocol, so
the trainer and rollout servers serve it beside their own Health RPC (which
also says busy / not_loaded). The overall status ("") and the service's own
name (e.g. "lockstep.v1.Trainer") answer SERVING while the server runs, and
NOT_SERVING from the moment a graceful shutdown begins, so a probe stops
routing to a server that is draining its in-flight RPCs. Any other name
answers NOT_FOUND: a probe aimed at the wrong service fails.
"""
from __future__ import annotations

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from proto import lockstep_pb2 as pb

SERVICE_NAMES = {name.lower(): svc.full_name for name, svc in pb.DESCRIPTOR.services_by_name.items()}
"""Short name -> the fully qualified name a health check asks for: {'rollout': 'lockstep.v1.Rollout', ...}."""


async def add_health_service(server: grpc.aio.Server, service: str) -> health.aio.HealthServicer:
    """Serve grpc.health.v1 on `server`, SERVING for "" and `service` ('rollout' or 'trainer')."""
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    await servicer.set(SERVICE_NAMES[service], health_pb2.HealthCheckResponse.SERVING)
    return servicer
