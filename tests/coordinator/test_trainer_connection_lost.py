"""TrainerClient's reading of a failed call: UNAVAILABLE and DEADLINE_EXCEEDED are a lost trainer, and so are
UNKNOWN and INTERNAL when the trainer then fails a health probe too (a connection that dies under a call can end
"UNKNOWN: Stream removed", grpc/grpc#34076); the same codes from a trainer that still answers are its own
error and pass through. The stub is a stand-in that raises the statuses a real channel would."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from services.common.auth import BearerToken
from services.coordinator.clients import TrainerClient, TrainerUnavailable


def _status(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


class Stub:
    def __init__(self, info: grpc.aio.AioRpcError, health: grpc.aio.AioRpcError | None) -> None:
        self.info, self.health, self.probes = info, health, 0

    async def Info(self, request, timeout):  # noqa: N802 (the RPC's name)
        raise self.info

    async def Health(self, request, timeout):  # noqa: N802
        self.probes += 1
        if self.health is not None:
            raise self.health
        return object()


def _call(info, health):
    async def scenario():
        client = TrainerClient("127.0.0.1:1", 5.0, BearerToken("t" * 32))
        client._stub = Stub(info, health)
        try:
            await client.info()
        finally:
            await client.close()
    return asyncio.run(scenario())


@pytest.mark.parametrize("code", [grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL])
def test_a_dropped_connection_to_a_trainer_that_no_longer_answers_is_a_lost_trainer(code):
    with pytest.raises(TrainerUnavailable, match=f"info failed with {code.name}: Stream removed"):
        _call(_status(code, "Stream removed"), _status(grpc.StatusCode.UNAVAILABLE, "Connection refused"))


def test_the_same_code_from_a_trainer_that_still_answers_is_its_own_error():
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        _call(_status(grpc.StatusCode.INTERNAL, "handler raised"), None)
    assert not isinstance(raised.value, TrainerUnavailable) and raised.value.details() == "handler raised"
    # A probe refused for its own reason (here, authentication) still shows a live process.
    with pytest.raises(grpc.aio.AioRpcError):
        _call(_status(grpc.StatusCode.UNKNOWN, "handler raised"), _status(grpc.StatusCode.UNAUTHENTICATED, "no"))


def test_unavailable_is_a_lost_trainer_without_a_probe_and_other_codes_pass_through():
    with pytest.raises(TrainerUnavailable, match="UNAVAILABLE"):
        _call(_status(grpc.StatusCode.UNAVAILABLE, "Socket closed"), None)
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        _call(_status(grpc.StatusCode.FAILED_PRECONDITION, "no such run"), _status(grpc.StatusCode.UNAVAILABLE, ""))
    assert not isinstance(raised.value, TrainerUnavailable)
