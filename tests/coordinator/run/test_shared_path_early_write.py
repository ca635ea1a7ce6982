"""SharedPathWeights.write_early (fixed_lag, shared_path): the trainer writes version s right after step s
trained, and step s+1's sync finds it written instead of waiting for the write. A failed early write is
logged and written again by the sync, which fails loud if that fails too. The replicas then prefetch it,
and the sync's load of it waits for their prefetch. The trainer and replica are fakes that record each call
(the real calls are covered by tests/integration/test_true_on_policy_stack.py and
tests/integration/weights/test_shared_path_weights.py)."""
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


class FakeReplica:
    address = "127.0.0.1:1"

    def __init__(self, fail_prefetch: bool = False) -> None:
        self.calls: list[tuple[str, int, bool]] = []
        self.fail_prefetch = fail_prefetch
        self.prefetched = asyncio.Event()

    async def load_weights(self, run_id: str, version: int, directory: str, sha256: str, *, prefetch: bool = False):
        self.calls.append((directory, version, prefetch))
        if prefetch:
            await self.prefetched.wait()
            if self.fail_prefetch:
                raise RuntimeError("expected_sha256: does not match")
        return pb.UpdateWeightsResponse(policy_version=version, total_sha256=sha256, prefetched=not prefetch)


@pytest.mark.parametrize("fail_prefetch", [False, True])
def test_the_replicas_prefetch_the_early_write_and_the_sync_loads_after_them(tmp_path, caplog, fail_prefetch):
    async def scenario():
        trainer, replica = FakeTrainer(), FakeReplica(fail_prefetch)
        trainer.release.set()
        shared = SharedPathWeights(trainer, "run", tmp_path)
        shared.write_early(4, [replica])
        sync = asyncio.ensure_future(shared.load(replica, 4))
        for _ in range(5):
            await asyncio.sleep(0)
        # The prefetch is reading: the sync's load waits for it rather than read the directory beside it.
        assert [c[2] for c in replica.calls] == [True] and not sync.done()
        replica.prefetched.set()
        await sync
        await shared.settled(4)
        return trainer.calls, replica.calls

    with caplog.at_level(logging.WARNING, logger="lockstep.coordinator.weights"):
        written, loads = asyncio.run(scenario())
    directory = written[0][0]
    assert [v for _, v in written] == [4]
    assert loads == [(directory, 4, True), (directory, 4, False)]
    assert ("did not prefetch policy version 4 (its sync reads it)" in caplog.text) is fail_prefetch


def test_a_sync_finds_its_version_written_after_the_next_one_was_but_not_across_a_recovery(tmp_path):
    """fixed_lag: step s can train and write s before the sync to s-1 beside it comes to load s-1; that
    sync must find s-1 written (the trainer keeps no copy of s-1 to write it again). After the trainer is
    configured again (recovered), a version is written afresh."""
    async def scenario():
        trainer = FakeTrainer()
        trainer.release.set()
        shared = SharedPathWeights(trainer, "run", tmp_path)
        four, five = await shared.written(4), await shared.written(5)
        again = await shared.written(4)
        shared.trainer_configured()
        fresh = await shared.written(5)
        return trainer.calls, four, five, again, fresh

    calls, four, five, again, fresh = asyncio.run(scenario())
    assert again is four and [v for _, v in calls] == [4, 5, 5]
    assert fresh.directory != five.directory


def test_the_sync_to_an_older_version_waits_for_its_own_prefetch_after_the_next_early_write_began(tmp_path):
    """fixed_lag under load: step s trains faster than the sync to s-1 beside it comes to load, so the early
    write of s starts before that load; the load must still wait for s-1's prefetch, not race it."""
    async def scenario():
        trainer, replica = FakeTrainer(), FakeReplica()
        trainer.release.set()
        shared = SharedPathWeights(trainer, "run", tmp_path)
        shared.write_early(4, [replica])
        for _ in range(5):
            await asyncio.sleep(0)
        shared.write_early(5, [replica])
        sync = asyncio.ensure_future(shared.load(replica, 4))
        for _ in range(5):
            await asyncio.sleep(0)
        assert not sync.done() and (replica.calls[-1][1], replica.calls[-1][2]) == (5, True)
        replica.prefetched.set()
        await sync
        await shared.settled(5)
        await shared.cancel_early()
        return replica.calls

    calls = asyncio.run(scenario())
    assert [(v, prefetch) for _, v, prefetch in calls] == [(4, True), (5, True), (4, False)]
