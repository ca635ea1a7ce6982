"""The step of a streaming run (async.mode streaming, async.max_staleness K > 0) and the rollouts it
streams.

The replicas generate the rollouts of the coming steps continuously, and a weight sync pauses them at a
token boundary instead of waiting for them. Step s trains on the trajectories of its rollout whose every
token is of a version in [s-1-K, s-1] (streaming.py has the admission); the others are dropped and
counted.

`GenerationGate` keeps Generate calls and weight syncs apart on the replicas: a sync stops new calls,
asks every live replica to pause the one in flight (PauseGeneration; the call returns its unfinished
samples with finish_reason 'paused'), and waits for every call to return before the weights change.
`StreamGenerator` is one background task that makes the rollouts of steps in order, up to a horizon the
step advances (the step training + K): each is sent again, asking only for its unfinished samples
(`sample_ids`) and listing its paused ones as `resumed`, until every sample finished, so a sample's
tokens may come from several versions (each reported per token). Every finished rollout is scored and
kept on disk (KeptRollouts) before any step uses it; what was in flight when the coordinator died is
generated again by the next one.
"""
from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from proto import lockstep_pb2 as pb
from services.coordinator.clients import RolloutClient
from services.coordinator.run.errors import RunFailed
from services.coordinator.run.fixed_lag import BusyIntervals
from services.coordinator.run.prompts import group_id
from services.coordinator.run.step_context import StepContext
from services.coordinator.run.streaming import admit, merge_round, token_versions
from services.coordinator.state.event_log import PhaseTimer

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


class StreamGenerator:
    """The background task of a streaming run: the step context gives a step's prompts, sampling plan and
    scoring (StepContext.problems, training_plan, score_rollout) and the version the replicas hold
    (replicas_at, read only inside the gate, where it cannot change); `busy` gets every Generate round."""

    def __init__(self, ctx: StepContext, gate: GenerationGate, busy: BusyIntervals) -> None:
        self.ctx, self.gate, self.busy = ctx, gate, busy
        self.fleet, self.kept, self.last_step = ctx.fleet, ctx.kept, ctx.spec.steps
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
        ctx = self.ctx
        problems, plan = ctx.problems(step), ctx.training_plan(step)
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
                self.busy.begin(began)
                try:
                    got, _ = await self.fleet.generate(
                        [problems[i] for i in pending], plan, ctx.tokens.encode, step=step,
                        policy_version=ctx.replicas_at, indices=pending,
                        resumed=[s for s in paused.values() if index_of[s.group_id] in pending], only=only)
                finally:
                    self.busy.add(began, asyncio.get_running_loop().time())
            answered = {pending[i] for i, _ in got}
            # A replica that never answered: its samples are dropped, as in sync.
            lost += sum(len(missing(i)) for i in pending if i not in answered)
            merge_round(done, paused, [s for _, s in got])
            pending, first = [i for i in sorted(answered) if missing(i)], False
        samples = sorted(((i, done[f"{group_id(step, i)}/{j}"]) for i in range(len(problems)) for j in range(spp)
                          if f"{group_id(step, i)}/{j}" in done), key=lambda x: (x[0], x[1].index))
        trajectories, counts = await ctx.score_rollout(step, samples, lost)
        version = min((t.policy_version for t in trajectories), default=ctx.replicas_at)
        await asyncio.to_thread(self.kept.put, step, version, trajectories, counts)


class StreamingStep:
    def __init__(self, ctx: StepContext) -> None:
        self.ctx = ctx
        self.gate = GenerationGate(self._pause_replicas)
        self.busy = BusyIntervals()  # when the replicas generated (this step's window and later)
        self.stream = StreamGenerator(ctx, self.gate, self.busy)

    async def stop(self) -> None:
        """What is in flight is generated again at the next start."""
        await self.stream.stop()

    async def replicas_start(self, trainer_version: int) -> int:
        """The trainer's version; a kept rollout with tokens of a later version was made by weights the
        trainer no longer has (it resumed from an older checkpoint), so it is dropped, to be made again."""
        await asyncio.to_thread(self._drop_lost_versions, trainer_version)
        return trainer_version

    def _drop_lost_versions(self, version: int) -> None:
        kept = self.ctx.kept
        for t in [t for t in range(version + 1, self.ctx.spec.steps + 1) if kept.has(t)]:
            if max((v for traj in kept.get(t)[0] for v in token_versions(traj)), default=-1) > version:
                kept.drop(t)

    async def run_step(self, step: int, trainer_version: int) -> None:
        """The replicas, generating the rollouts of the coming steps all along, are brought to s-1 (their
        sequences in flight paused and then continued under it; evicted replicas that answer again are
        readmitted inside that sync, while nothing generates), and step s trains on the trajectories of its
        rollout whose every token is of a version in [s-1-K, s-1]; the others are dropped and counted (the
        rollout is made again if none is left). When the rollout is complete and has trajectories to train
        as the step begins, nothing is in flight for the sync to pause: it runs beside training, from the
        copy of s-1 the trainer keeps, and the replicas go on generating once it is done."""
        ctx = self.ctx
        timer, header, train_span, began_step = PhaseTimer(), ctx.header(step), None, time.monotonic()
        if trainer_version == step:
            result, counts = await ctx.trainer.replay(header)
        elif trainer_version == step - 1:
            # Admitted now only when the sync may run beside training (not with broadcast).
            kept = await self._admitted(step) if ctx.sync_beside_training and ctx.kept.has(step) else None
            beside = kept is not None
            if not beside:
                with timer.phase("weight_sync"):
                    await self._sync(step - 1)
                await self._stream_ahead(step)
                kept = await self._streamed_rollout(step, timer)
            self.busy.forget_before(began_step)
            trajectories, counts = kept
            counts["weight_sync_beside_training"] = int(beside)
            if beside:
                ahead = asyncio.ensure_future(self._sync_and_stream_ahead(step, timer))
                result, train_span = await ctx.train_beside(header, trajectories, counts, timer, ahead)
                await ahead  # its failure (the sync) fails the step here, before anything is recorded
            else:
                result, train_span = await ctx.train(header, trajectories, counts, timer)
                ctx.write_early(step)
            if ctx.spec.checkpoint.every == 0:
                await asyncio.to_thread(ctx.kept.drop_through, step)
        else:
            raise RunFailed(f"step {step}: trainer holds policy version {trainer_version}, expected {step - 1}")
        metrics = {**result.metrics, **counts}
        report = await ctx.eval_and_checkpoint(step, timer, metrics, sync=lambda: self._sync(step), drop_kept=True)
        timings = timer.finish()
        if self.busy.spans or self.busy.in_flight:  # seconds the replicas generated within this step
            timings["rollout"] = self.busy.overlap_with((began_step, time.monotonic()))
        timings["overlap"] = self.busy.overlap_with(train_span) if train_span else 0.0
        await ctx.record(step, metrics, timings, counts, report)

    async def _stream_ahead(self, step: int) -> None:
        """Let the replicas, at version step - 1, generate the rollouts up to step + K."""
        self.stream.start(step)
        await self.stream.advance(step + self.ctx.max_staleness)

    async def _sync_and_stream_ahead(self, step: int, timer: PhaseTimer) -> None:
        """While step `step` trains: the replicas get version step - 1 from the copy the trainer kept, then
        generate ahead with it. Its seconds are the step's weight_sync, though they overlap training."""
        with timer.phase("weight_sync"):
            await self._sync(step - 1)
        await self._stream_ahead(step)

    async def _streamed_rollout(self, step: int, timer: PhaseTimer) -> tuple[list[pb.Trajectory], dict]:
        """Step `step`'s admitted trajectories and counts, once its rollout is kept; made again at the
        replicas' version if none of it is within the bound (kept from before a trainer recovery, say)."""
        kept_rollouts = self.ctx.kept
        with timer.phase("rollout"):  # waiting for it: zero once the replicas run ahead
            await self.stream.ready(step)
        kept = await self._admitted(step)
        if kept is None:
            dropped = len((await asyncio.to_thread(kept_rollouts.get, step))[0])  # every one of them stale
            await asyncio.to_thread(kept_rollouts.drop, step)
            with timer.phase("rollout"):
                await self.stream.regenerate(step)
            kept = await self._admitted(step, dropped_before=dropped)
            if kept is None:
                raise RunFailed(f"step {step}: no trajectory of its rollout is within async.max_staleness")
        return kept

    async def _admitted(self, step: int, dropped_before: int = 0) -> tuple[list[pb.Trajectory], dict] | None:
        """The kept rollout of `step` cut to the trajectories whose every token is within the bound, with
        its counts and staleness metrics (`dropped_before`: stale ones of a rollout made before this one);
        None when no trajectory is."""
        ctx = self.ctx
        trajectories, counts = await asyncio.to_thread(ctx.kept.get, step)
        trajectories, stale = admit(step, trajectories, ctx.max_staleness)
        if not trajectories:
            return None
        counts = {**counts, "trajectories_trained": len(trajectories),
                  "trajectories_dropped_stale": dropped_before + stale, **ctx.staleness(step, trajectories)}
        return trajectories, counts

    async def _sync(self, version: int) -> None:
        """Bring the replicas to `version`, pausing what they generate meanwhile (continued afterwards). With
        shared_path they pause once the version is written and prefetched (StepContext.write_early), only to
        apply it."""
        fleet = self.ctx.fleet
        if fleet.shared_weights is not None:
            await fleet.shared_weights.settled(version)
        async with self.gate.syncing():
            await fleet.readmit(version + 1, version)
            await fleet.sync_weights(version)
            self.ctx.replicas_at = version

    async def _pause_replicas(self) -> None:
        """PauseGeneration on every live replica; one that does not answer is left to the Generate call's
        own failure handling (eviction, re-dispatch)."""
        async def pause(client: RolloutClient) -> None:
            with contextlib.suppress(Exception):
                await client.pause_generation(self.ctx.run_id)
        await asyncio.gather(*(pause(c) for c in self.ctx.fleet.pool.live()))
