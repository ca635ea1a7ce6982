"""Where a replica gets a policy version from: the trainer's gRPC stream (SyncWeights), a shared path,
or a collective broadcast from the trainer.

Shared path: the trainer writes the version once as a safetensors directory under the run's directory
(WriteWeights; inside the trainer's checkpoint_roots), and every replica that needs it reads that
directory itself (LoadWeights; inside the rollout's model_roots) and verifies the digest the trainer
reported.

Broadcast: the trainer plans the version into buckets (OpenWeightBroadcast: names, dtypes, shapes, a fresh
group name and the rendezvous of its own configuration), then hosts that group as rank 0 and broadcasts
every bucket (RunWeightBroadcast) while each replica being synced joins as rank 1..N and receives
(ReceiveWeights). One group per sync, of exactly the replicas that sync: a replica that missed versions
joins the next sync's group and gets the whole policy. The trainer waits for every rank, so as soon as a
replica's ReceiveWeights fails before the trainer answered, the coordinator tells the trainer to give up
on the group (AbortWeightBroadcast) rather than let it, and the replicas that did join, wait out the
broadcast timeout. Whichever the source, the weights' bytes never pass through the coordinator.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from proto import lockstep_pb2 as pb
from services.coordinator.clients import RolloutClient, TrainerClient, TrainerUnavailable, is_unavailable
from services.coordinator.run.errors import RunFailed

log = logging.getLogger("lockstep.coordinator.weights")

# An abort's reason names every failed replica's error, each cut to this many characters, and the whole to
# ABORT_REASON_CHARS (the trainer refuses a longer one).
ABORT_DETAIL_CHARS = 500
ABORT_REASON_CHARS = 8192


class SharedPathWeights:
    """One written directory per policy version, however many replicas load it. The newest two are kept:
    a replica serves the previous one until it has loaded the newest (an SGLang server that restarts
    meanwhile reloads the directory it serves from)."""

    def __init__(self, trainer: TrainerClient, run_id: str, root: Path) -> None:
        self.trainer, self.run_id, self.root = trainer, run_id, root
        self._written: list[pb.WriteWeightsResponse] = []  # oldest first
        # The versions the trainer wrote since it was last configured, by version: a sync may find its version
        # written even after the next one was (fixed_lag: step s trained and wrote s before the sync to s-1
        # beside it came to load). One written before a trainer recovery is not reused (trainer_configured).
        self._current: dict[int, pb.WriteWeightsResponse] = {}
        self._lock = asyncio.Lock()  # replicas synced at once wait for one write, not one each
        # write_early's tasks (the write, then the prefetches) by version: the sync to version s - 1 can come
        # to load after step s trained and its early write began, and must still wait for its own prefetch.
        self._early: dict[int, asyncio.Task] = {}

    def write_early(self, version: int, replicas: Sequence[RolloutClient] = ()) -> None:
        """Start writing `version` now, for the sync that needs it later to find written (fixed_lag: right
        after step `version` trained, while the replicas still generate), then have `replicas` prefetch it
        (read and verify it beside their generation; the sync's LoadWeights then only applies it). A
        failure is logged: the sync's own written() writes again, failing loud if that fails too, and a
        replica whose prefetch failed reads the directory when it loads it."""
        def logged(task: asyncio.Task) -> None:
            if not task.cancelled() and task.exception() is not None:
                log.warning("early write of policy version %d failed (the sync writes it again): %r",
                            version, task.exception())

        task = asyncio.ensure_future(self._write_and_prefetch(version, list(replicas)))
        task.add_done_callback(logged)
        self._early = {v: t for v, t in self._early.items() if not t.done()}
        self._early[version] = task

    async def _write_and_prefetch(self, version: int, replicas: list[RolloutClient]) -> None:
        written = await self.written(version)
        answers = await asyncio.gather(*(
            c.load_weights(self.run_id, version, written.directory, written.total_sha256, prefetch=True)
            for c in replicas), return_exceptions=True)
        for client, answer in zip(replicas, answers):
            if isinstance(answer, BaseException):
                log.warning("replica %s did not prefetch policy version %d (its sync reads it): %s",
                            client.address, version, rpc_details(answer))

    async def settled(self, version: int) -> None:
        """Once the early write of `version` and its prefetches are done (at once if none is running); a
        streaming sync waits here before it pauses the replicas, so that they pause only to apply."""
        if (task := self._early.get(version)) is not None:
            await asyncio.wait([task])

    async def cancel_early(self) -> None:
        running = [t for t in self._early.values() if not t.done()]
        self._early = {}
        for task in running:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def trainer_configured(self) -> None:
        """The trainer was (re)configured: what it wrote before is not reused, since a recovered trainer's
        version may differ from the one of that number it wrote before it was lost."""
        self._current.clear()

    async def written(self, version: int) -> pb.WriteWeightsResponse:
        async with self._lock:
            if version in self._current:
                return self._current[version]
            # A fresh name each time: a trainer that recovered may write a version again.
            directory = self.root / f"v{version:06d}-{uuid.uuid4().hex[:8]}"
            written = await self.trainer.write_weights(self.run_id, str(directory), version)
            if written.policy_version != version:
                raise RuntimeError(f"trainer wrote version {written.policy_version}, expected {version}")
            self._written.append(written)
            self._current[version] = written
            while len(self._written) > 2:
                gone = self._written.pop(0)
                if self._current.get(gone.policy_version) is gone:
                    del self._current[gone.policy_version]
                await asyncio.to_thread(shutil.rmtree, gone.directory, True)
            return written

    async def load(self, client: RolloutClient, version: int) -> pb.UpdateWeightsResponse:
        await self.settled(version)  # a prefetch of the version still reading: the load waits to use it
        written = await self.written(version)
        return await client.load_weights(self.run_id, version, written.directory, written.total_sha256)


@dataclass
class BroadcastRound:
    """One sync's group: what the trainer sent (or why it failed) and each replica's answer, in rank order."""

    plan: pb.BroadcastPlan
    sent: pb.UpdateWeightsResponse | BaseException
    received: list[pb.UpdateWeightsResponse | BaseException]


@dataclass(frozen=True)
class RoundVerdict:
    """What to do after a broadcast round, by replica index (rank - 1)."""

    evict: list[int]         # unreachable: out of service, as with any source
    accept: list[int]        # the broadcast went through: their answers are checked and kept
    regroup: list[int]       # sync these again in a fresh group
    failure: BaseException | None = None  # raised once the evictions are done


def rpc_details(exc: BaseException) -> str:
    return f"{exc.code().name}: {exc.details()}" if isinstance(exc, grpc.aio.AioRpcError) else str(exc)


def abort_reason(received: Sequence[pb.UpdateWeightsResponse | BaseException | None],
                 addresses: Sequence[str]) -> str | None:
    """Pure. Why the trainer should give up on a round it has not answered yet, or None: `received` holds each
    replica's answer so far (None: still running), and any that failed is a reason. The trainer waits for
    every rank, so a replica that failed before joining (refused the plan, unreachable) keeps the group
    from ever forming, and the replicas that did join wait with it; one that failed after the group formed
    broke it anyway (an abort then changes nothing)."""
    failed = [f"rank {i + 1} ({addresses[i]}): {rpc_details(r)[:ABORT_DETAIL_CHARS]}"
              for i, r in enumerate(received) if isinstance(r, BaseException)]
    if not failed:
        return None
    return ("ReceiveWeights failed: " + "; ".join(failed))[:ABORT_REASON_CHARS]


def _outcome(task: asyncio.Future) -> object:
    if not task.done():
        return None
    return task.exception() or task.result()


def judge_round(done: BroadcastRound, *, may_regroup: bool) -> RoundVerdict:
    """Pure. Unreachable replicas are evicted. A broadcast the trainer completed is accepted for the rest;
    a lost trainer is TrainerUnavailable (the run waits for it); a broadcast that failed because replicas
    were unreachable is retried once without them; any other failure fails the run."""
    evict = [i for i, r in enumerate(done.received) if is_unavailable(r)]
    rest = [i for i in range(len(done.received)) if i not in evict]
    if not isinstance(done.sent, BaseException):
        return RoundVerdict(evict, rest, [])
    if not rest:
        return RoundVerdict(evict, [], [])
    if isinstance(done.sent, TrainerUnavailable):
        return RoundVerdict(evict, [], [], done.sent)
    if evict and may_regroup:
        return RoundVerdict(evict, [], rest)
    # A replica that refused the plan never joined and the trainer gave up waiting: its answer names the cause.
    refused = "".join(f"; rank {i + 1}: {rpc_details(r)}" for i, r in enumerate(done.received)
                      if isinstance(r, BaseException) and i not in evict)
    return RoundVerdict(evict, [], [], RunFailed(
        f"version {done.plan.policy_version}: weight broadcast {done.plan.group_name} failed: "
        f"{rpc_details(done.sent)}{refused}"))


class BroadcastWeights:
    """`digest_trailer`: the replicas receive in their own process (torch engine) and check the trainer's
    digest, broadcast after the last bucket, before applying anything."""

    def __init__(self, trainer: TrainerClient, run_id: str, *, digest_trailer: bool) -> None:
        self.trainer, self.run_id, self.digest_trailer = trainer, run_id, digest_trailer

    async def round(self, clients: Sequence[RolloutClient], version: int) -> BroadcastRound:
        plan = await self.trainer.open_weight_broadcast(self.run_id, len(clients), digest_trailer=self.digest_trailer)
        if plan.policy_version != version:
            raise RuntimeError(f"trainer plans a broadcast of version {plan.policy_version}, expected {version}")
        sending = asyncio.ensure_future(self.trainer.run_weight_broadcast(self.run_id, plan.group_name))
        receiving = [asyncio.ensure_future(client.receive_weights(plan, rank))
                     for rank, client in enumerate(clients, start=1)]
        try:
            await self._abort_once_a_replica_fails(plan, sending, receiving, [c.address for c in clients])
            sent, *received = await asyncio.gather(sending, *receiving, return_exceptions=True)
        finally:
            for task in (sending, *receiving):
                task.cancel()  # only those still running: a round that was itself cancelled
        return BroadcastRound(plan, sent, list(received))

    async def _abort_once_a_replica_fails(self, plan: pb.BroadcastPlan, sending: asyncio.Future,
                                          receiving: Sequence[asyncio.Future], addresses: Sequence[str]) -> None:
        """Waits until the trainer answered or every replica did; the first failed replica before the
        trainer's answer makes the trainer give up on the group (abort_reason), so its answer comes now."""
        waiting = set(receiving)
        while waiting and not sending.done():
            _, waiting = await asyncio.wait({sending, *waiting}, return_when=asyncio.FIRST_COMPLETED)
            waiting.discard(sending)
            reason = abort_reason([_outcome(t) for t in receiving], addresses)
            if reason is not None and not sending.done():
                try:
                    await self.trainer.abort_weight_broadcast(self.run_id, plan.group_name, reason)
                except TrainerUnavailable:
                    pass  # then its RunWeightBroadcast fails the same way, and judge_round waits for it
                return
