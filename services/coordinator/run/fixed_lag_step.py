"""The step of a fixed_lag run (async.max_staleness K > 0, async.mode fixed_lag).

Step s trains on the rollout policy version max(0, s-1-K) made, while the replicas sync to s-1 and
generate the rollouts of later steps beside it (fixed_lag.py has the arithmetic). Every rollout is kept
(StepContext.kept) from when it is generated until its step is trained and checkpointed.
"""
from __future__ import annotations

import asyncio
import time

from services.coordinator.run.errors import RunFailed
from services.coordinator.run.fixed_lag import BusyIntervals, behaviour_version, rollouts_at
from services.coordinator.run.step_context import StepContext
from services.coordinator.state.event_log import PhaseTimer


class FixedLagStep:
    def __init__(self, ctx: StepContext) -> None:
        self.ctx = ctx

    async def stop(self) -> None:
        return None  # nothing runs between steps

    async def replicas_start(self, trainer_version: int) -> int:
        """The version to start the replicas at. The trainer's, unless a step it has not trained lacks its
        kept rollout and an older version makes it: the coordinator died while that rollout was generated,
        and the replicas, which were not synced since, still hold that version (a replica that holds
        another cannot be brought to it, and the run fails naming the step)."""
        ctx = self.ctx
        last = min(trainer_version + ctx.max_staleness, ctx.spec.steps)
        missing = [behaviour_version(t, ctx.max_staleness) for t in range(trainer_version + 1, last + 1)
                   if behaviour_version(t, ctx.max_staleness) < trainer_version and not ctx.kept.has(t)]
        return min(missing, default=trainer_version)

    async def run_step(self, step: int, trainer_version: int) -> None:
        """The synchronous step with K > 0: the replicas are brought to the trainer's version s-1, step s
        trains on the rollout version max(0, s-1-K) made (generated in an earlier step, or now if the run
        just started), and meanwhile the replicas generate the rollouts of the steps that version s-1
        makes (s+K in steady state)."""
        ctx = self.ctx
        await ctx.fleet.readmit(step, trainer_version)
        timer, busy = PhaseTimer(), BusyIntervals()
        header = ctx.header(step)
        train_span = None
        if trainer_version == step:
            result, counts = await ctx.trainer.replay(header)
        elif trainer_version == step - 1:
            # Rollouts older versions make that no earlier step kept (a restarted coordinator's replicas
            # still hold the version: replicas_start), before the replicas move on.
            for t in range(step, min(step + ctx.max_staleness, ctx.spec.steps) + 1):
                if behaviour_version(t, ctx.max_staleness) < step - 1 and not ctx.kept.has(t):
                    await self._lagged_rollout(t, ctx.replicas_at, busy)
            beside = ctx.kept.has(step) and ctx.sync_beside_training
            if beside:
                # The trainer keeps version s-1 as this step's TrainStep begins (keep_previous_weights) and
                # serves it from that copy while it trains: the replicas sync to s-1 (pulled over gRPC, or
                # written once and loaded) and then generate with it, the whole sync beside training.
                ahead = asyncio.ensure_future(self._sync_and_roll_ahead(step, busy, timer))
            else:
                with timer.phase("weight_sync"):
                    await ctx.fleet.sync_weights(step - 1)
                ctx.replicas_at = step - 1
                if not ctx.kept.has(step):  # the run's first steps
                    await self._lagged_rollout(step, step - 1, busy)
                ahead = asyncio.ensure_future(self._roll_ahead(step, busy))
            trajectories, counts = await asyncio.to_thread(ctx.kept.get, step)
            counts = {**counts, "weight_sync_beside_training": int(beside)}
            result, train_span = await ctx.train_beside(header, trajectories, counts, timer, ahead)
            await ahead  # its failure (a sync, a rollout) fails the step here, before anything is recorded
            if ctx.spec.checkpoint.every == 0:  # no checkpoint to come back to before the run's end
                await asyncio.to_thread(ctx.kept.drop_through, step)
        else:
            raise RunFailed(f"step {step}: trainer holds policy version {trainer_version}, expected {step - 1}")
        metrics = {**result.metrics, **counts}

        async def to_step() -> None:  # only the last step's: async runs evaluate at its end alone
            await ctx.fleet.sync_weights(step)
            ctx.replicas_at = step

        report = await ctx.eval_and_checkpoint(step, timer, metrics, sync=to_step, drop_kept=True)
        timings = timer.finish()
        if busy.spans:
            timings["rollout"] = busy.busy_seconds()
        timings["overlap"] = busy.overlap_with(train_span) if train_span else 0.0
        await ctx.record(step, metrics, timings, counts, report)

    async def _sync_and_roll_ahead(self, step: int, busy: BusyIntervals, timer: PhaseTimer) -> None:
        """While step `step` trains: the replicas get version step - 1 from the copy the trainer kept (the
        TrainStep header's keep_previous_weights), then generate the rollouts that version makes. A sync
        that fails (the trainer lost, a write refused, digests that differ) fails the step once training
        returns, before anything is recorded. Its seconds are the step's weight_sync, though they overlap
        training."""
        with timer.phase("weight_sync"):
            await self.ctx.fleet.sync_weights(step - 1)
        self.ctx.replicas_at = step - 1
        await self._roll_ahead(step, busy)

    async def _roll_ahead(self, step: int, busy: BusyIntervals) -> None:
        """While step `step` trains: the rollouts of later steps that the replicas' version (step - 1) makes."""
        ctx = self.ctx
        for later in rollouts_at(step - 1, step, ctx.max_staleness, ctx.spec.steps):
            if not ctx.kept.has(later):
                await self._lagged_rollout(later, step - 1, busy)

    async def _lagged_rollout(self, step: int, replicas_version: int, busy: BusyIntervals) -> None:
        """Generate and keep step `step`'s rollout with the replicas at `replicas_version`, which must be the
        version fixed_lag assigns the step: no other version may make it."""
        ctx = self.ctx
        wanted = behaviour_version(step, ctx.max_staleness)
        if wanted != replicas_version:
            raise RunFailed(f"step {step}: its rollout must come from policy version {wanted} "
                            f"(async.max_staleness {ctx.max_staleness}), but the replicas hold {replicas_version} "
                            "and cannot go back: a rollout lost once the trainer and every replica moved past its "
                            "version cannot be generated again")
        began = time.monotonic()
        trajectories, counts = await ctx.sample_and_score(step, PhaseTimer())
        await asyncio.to_thread(ctx.kept.put, step, wanted, trajectories, counts)
        busy.add(began, time.monotonic())
