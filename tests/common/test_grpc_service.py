"""The gRPC skeleton both servers share, on a real grpc.aio server over loopback: exceptions end an
RPC with their mapped status and are counted, the server keeps serving, and a graceful stop answers
NOT_SERVING on grpc.health.v1 while an in-flight RPC drains."""
from __future__ import annotations

import asyncio
import logging

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from proto import lockstep_pb2 as pb
from proto import lockstep_pb2_grpc as pb_grpc
from services.common.auth import BearerToken, generate_token
from services.common.grpc.options import insecure_channel
from services.common.grpc.service import (
    GrpcServiceHost,
    RpcErrors,
    RpcFailure,
    StatusMap,
    rpc_handler,
)
from services.common.metric_defs import ROLLOUT_METRICS, build_collectors

TOKEN = BearerToken(generate_token())
ERRORS = RpcErrors("rollout", StatusMap((KeyError, grpc.StatusCode.NOT_FOUND)), logging.getLogger("test.grpc"))
COUNTER = "lockstep_rollout_requests_total"


class Servicer(pb_grpc.RolloutServicer):
    """Generate fails as told by the request's run_id; Info blocks until released."""

    def __init__(self, metrics: dict) -> None:
        self.metrics = metrics
        self.info_entered = asyncio.Event()
        self.release_info = asyncio.Event()

    @rpc_handler(ERRORS, "Generate", counter=COUNTER)
    async def Generate(self, request, context):
        if request.run_id == "precondition":
            raise RpcFailure(grpc.StatusCode.FAILED_PRECONDITION, "run_id: not loaded")
        if request.run_id == "mapped":
            raise KeyError("no such thing")
        if request.run_id == "bug":
            raise RuntimeError("boom")
        return pb.GenerateResponse(policy_version=7)

    async def Info(self, request, context):
        self.info_entered.set()
        await self.release_info.wait()
        return pb.ServiceInfo(service="rollout")


def outcome(metrics: dict, name: str) -> float:
    return metrics[COUNTER].labels("rollout", name)._value.get()


def test_statuses_counters_and_a_graceful_stop():
    async def go() -> None:
        registry = CollectorRegistry()
        metrics = build_collectors(ROLLOUT_METRICS, registry)
        servicer = Servicer(metrics)
        host = GrpcServiceHost("rollout", lambda server: pb_grpc.add_RolloutServicer_to_server(servicer, server),
                               TOKEN, host="127.0.0.1", grpc_port=0, metrics_port=0, registry=registry,
                               shutdown_grace_s=60, logger=ERRORS.logger)
        await host.start()
        channel = insecure_channel(f"127.0.0.1:{host.grpc_port}", TOKEN)
        stub = pb_grpc.RolloutStub(channel)
        try:
            for run_id, code, message in (("precondition", grpc.StatusCode.FAILED_PRECONDITION, "run_id: not loaded"),
                                          ("mapped", grpc.StatusCode.NOT_FOUND, "'no such thing'"),
                                          ("bug", grpc.StatusCode.INTERNAL, "Generate: RuntimeError: boom")):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.Generate(pb.GenerateRequest(run_id=run_id))
                assert (err.value.code(), err.value.details()) == (code, message)
            assert (await stub.Generate(pb.GenerateRequest(run_id="fine"))).policy_version == 7  # still serving
            assert [outcome(metrics, k) for k in ("failed_precondition", "not_found", "internal", "ok")] == [1, 1, 1, 1]

            health = health_pb2.HealthCheckRequest(service="")
            assert (await health_pb2_grpc.HealthStub(channel).Check(health)).status == \
                health_pb2.HealthCheckResponse.SERVING
            in_flight = asyncio.ensure_future(stub.Info(pb.InfoRequest()))
            await servicer.info_entered.wait()
            stopping = asyncio.ensure_future(host.stop())
            # The server refuses new calls once it stops, so the health servicer is asked directly.
            while (await host.health.Check(health, None)).status != health_pb2.HealthCheckResponse.NOT_SERVING:
                await asyncio.sleep(0.05)
            assert not stopping.done()  # still draining the in-flight call
            servicer.release_info.set()
            assert (await in_flight).service == "rollout"  # the drained call completed
            await stopping
        finally:
            await channel.close()
            await host.stop()

    asyncio.run(go())
