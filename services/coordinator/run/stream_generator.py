"""Streaming rollouts (async.mode streaming): the replicas generate the rollouts of the coming steps
continuously, and a weight sync pauses them at a token boundary instead of waiting for them.

`GenerationGate` keeps Generate calls and weight syncs apart on the replicas: a sync stops new calls,
asks every live replica to pause the one in flight (PauseGeneration; the call returns its unfinished
samples with finish_reason 'paused'), and waits for every call to return before the weights change.
`StreamGenerator` is one background task that makes the rollouts of steps in order, up to a horizon the
run loop advances (the step training + K): each is sent again, asking only for its unfinished samples
(`sample_ids`) and listing its paused ones as `resumed`, until every sample finished, so a sample's
tokens may come from several versions (each reported per token). Every finished rollout is scored and
kept on disk (KeptRollouts) before any step uses it; what was in flight when the coordinator died is
generated again by the next one.
"""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

from proto import lockstep_pb2 as pb
from services.coordinator.fleet import RolloutFleet
from services.coordinator.state.kept_rollouts import KeptRollouts
from services.coordinator.run.prompts import group_id
from services.coordinator.run.streaming import merge_round

# How often a sync asks again for a pause while a Generate call is still in flight: a call sent just
# before the pause was asked had not reached its engine's decode loop, so that pause found nothing.
PAUSE_RETRY_S = 0.05


class GenerationGate:
    def __init__(self, pause: Callable[[], Awaitable[None]]) -> None:
        self._pause = pause
        self._cond = asyncio.Condition()
        self._in_flight = 0
        self._syncing = False

    @contextlib.asynccontextmanager
    async def generating(self) -> AsyncIterator[None]:
        """Around one Generate round: waits while a sync holds the replicas."""
        async with self._cond:
            await self._cond.wait_for(lambda: not self._syncing)
            self._in_flight += 1
        try:
            yield
        finally:
            async with self._cond:
                self._in_flight -= 1
                self._cond.notify_all()

    @contextlib.asynccontextmanager
    async def syncing(self) -> AsyncIterator[None]:
        """Around a weight sync: no Generate call runs inside (those in flight are paused first)."""
        async with self._cond:
            self._syncing = True
        try:
            while True:
                async with self._cond:
                    if self._in_flight == 0:
                        break
                await self._pause()
                async with self._cond:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._cond.wait_for(lambda: self._in_flight == 0), PAUSE_RETRY_S)
            yield
        finally:
            async with self._cond:
                self._syncing = False
                self._cond.notify_all()


ScoreRollout = Callable[[int, list[tuple[int, pb.Sample]], int], Awaitable[tuple[list[pb.Trajectory], dict]]]


class StreamGenerator:
    """The background task of a streaming run. `problems_of(step)` gives a step's prompts, `plan_of(step)`
    its sampling plan, `score(step, samples, lost)` its trajectories and counts; `version()` the version
    the replicas hold (read only inside the gate, where it cannot change); `on_busy(start, None)` when a
    Generate round begins and `on_busy(start, end)` when it returned."""

    def __init__(self, fleet: RolloutFleet, gate: GenerationGate, kept: KeptRollouts, *, last_step: int,
                 problems_of, plan_of, encode, score: ScoreRollout, version: Callable[[], int],
                 on_busy: Callable[[float, float | None], None]) -> None:
        self.fleet, self.gate, self.kept, self.last_step = fleet, gate, kept, last_step
        self.problems_of, self.plan_of, self.encode, self.score = problems_of, plan_of, encode, score
        self.version, self.on_busy = version, on_busy
        self._horizon = 0
        self._changed = asyncio.Condition()
        self._task: asyncio.Task | None = None

    def start(self, first_step: int) -> None:
        if self._task is None:
            self._task = asyncio.ensure_future(self._run(first_step))

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def advance(self, horizon: int) -> None:
        """Let the task generate the rollouts of steps up to `horizon`."""
        async with self._changed:
            self._horizon = max(self._horizon, min(horizon, self.last_step))
            self._changed.notify_all()

    async def ready(self, step: int) -> None:
        """Wait until step `step`'s rollout is kept; the task's failure is raised here."""
        async with self._changed:
            while not self.kept.has(step):
                if self._task is None or self._task.done():
                    if self._task is not None and not self._task.cancelled() and self._task.exception():
                        raise self._task.exception()
                    raise RuntimeError(f"step {step}: the streaming rollout task is not running")
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), 1.0)

    async def regenerate(self, step: int) -> None:
        """Make step `step`'s rollout again now (its kept one was dropped), beside the task's own work."""
        await self._rollout(step)

    async def _run(self, step: int) -> None:
        try:
            while step <= self.last_step:
                async with self._changed:
                    await self._changed.wait_for(lambda: step <= self._horizon)
                if not self.kept.has(step):
                    await self._rollout(step)
                async with self._changed:
                    self._changed.notify_all()
                step += 1
        finally:
            async with self._changed:  # wake a waiting ready(): it raises this task's failure
                self._changed.notify_all()

    async def _rollout(self, step: int) -> None:
        problems, plan = self.problems_of(step), self.plan_of(step)
        spp = plan.samples_per_prompt
        done: dict[str, pb.Sample] = {}
        paused: dict[str, pb.Sample] = {}
        index_of = {group_id(step, i): i for i in range(len(problems))}

        def missing(i: int) -> list[str]:
            return [f"{group_id(step, i)}/{j}" for j in range(spp) if f"{group_id(step, i)}/{j}" not in done]

        pending, lost, first = list(range(len(problems))), 0, True
        while pending:
            # After the first round only the samples still missing are asked for: a finished one is kept.
            only = set() if first else {s for i in pending for s in missing(i)}
            async with self.gate.generating():
                began = asyncio.get_running_loop().time()
                self.on_busy(began, None)
                try:
                    got, _ = await self.fleet.generate(
                        [problems[i] for i in pending], plan, self.encode, step=step, policy_version=self.version(),
                        indices=pending, resumed=[s for s in paused.values() if index_of[s.group_id] in pending],
                        only=only)
                finally:
                    self.on_busy(began, asyncio.get_running_loop().time())
            answered = {pending[i] for i, _ in got}
            # A replica that never answered: its samples are dropped, as in sync.
            lost += sum(len(missing(i)) for i in pending if i not in answered)
            merge_round(done, paused, [s for _, s in got])
            pending, first = [i for i in sorted(answered) if missing(i)], False
        samples = sorted(((i, done[f"{group_id(step, i)}/{j}"]) for i in range(len(problems)) for j in range(spp)
                          if f"{group_id(step, i)}/{j}" in done), key=lambda x: (x[0], x[1].index))
        trajectories, counts = await self.score(step, samples, lost)
        version = min((t.policy_version for t in trajectories), default=self.version())
        await asyncio.to_thread(self.kept.put, step, version, trajectories, counts)
