"""SharedPathWeights.write_early (fixed_lag, shared_path): the trainer writes version s right after step s
trained, and step s+1's sync finds it written instead of waiting for the write. A failed early write is
logged and written again by the sync, which fails loud if that fails too. The trainer is a fake that
records each WriteWeights (the real call is covered by tests/integration/test_true_on_policy_stack.py)."""
from __future__ import annotations

import asyncio
import logging

import pytest

from proto import lockstep_pb2 as pb
from services.coordinator.clients import TrainerUnavailable
from services.coordinator.weight_sources import SharedPathWeights


class FakeTrainer:
    def __init__(self, failures: int = 0) -> None:
        self.calls: list[tuple[str, int]] = []
        self.failures = failures
        self.release = asyncio.Event()

    async def write_weights(self, run_id: str, directory: str, policy_version: int) -> pb.WriteWeightsResponse:
        self.calls.append((directory, policy_version))
        await self.release.wait()
        if self.failures:
            self.failures -= 1
            raise TrainerUnavailable(f"write of {policy_version} failed")
        return pb.WriteWeightsResponse(directory=directory, policy_version=policy_version, total_sha256="d")


def test_the_sync_after_an_early_write_waits_for_it_and_writes_nothing_more(tmp_path):
    async def scenario():
        trainer = FakeTrainer()
        shared = SharedPathWeights(trainer, "run", tmp_path)
        shared.write_early(3)
        await asyncio.sleep(0)  # the early write is in flight
        sync = asyncio.ensure_future(shared.written(3))
        await asyncio.sleep(0)
        assert not sync.done() and len(trainer.calls) == 1
        trainer.release.set()
        written = await sync
        assert written.policy_version == 3 and written.directory == trainer.calls[0][0]
        assert [v for _, v in trainer.calls] == [3]

    asyncio.run(scenario())


def test_a_failed_early_write_is_logged_and_written_again_by_the_sync(tmp_path, caplog):
    async def scenario(failures: int):
        trainer = FakeTrainer(failures)
        trainer.release.set()
        shared = SharedPathWeights(trainer, "run", tmp_path)
        shared.write_early(5)
        await asyncio.sleep(0)
        try:
            return await shared.written(5), trainer.calls
        finally:
            await shared.cancel_early()

    with caplog.at_level(logging.WARNING, logger="lockstep.coordinator.weights"):
        written, calls = asyncio.run(scenario(failures=1))
    assert written.policy_version == 5 and [v for _, v in calls] == [5, 5]
    assert calls[0][0] != calls[1][0]  # a fresh directory each time
    assert "early write of policy version 5 failed (the sync writes it again)" in caplog.text
    with pytest.raises(TrainerUnavailable, match="write of 5 failed"):
        asyncio.run(scenario(failures=2))
