"""The step bodies of runs with async.max_staleness K > 0, mixed into the run loop's RunDriver.

fixed_lag (`_one_lagged_step`): step s trains on the rollout policy version max(0, s-1-K) made, while the
replicas sync to s-1 and generate the rollouts of later steps beside it (fixed_lag.py has the arithmetic).
streaming (`_one_streaming_step`): the replicas generate continuously (stream_generator.py), a sync pauses
the sequences in flight, and step s trains on the trajectories whose every token is of a version in
[s-1-K, s-1] (streaming.py has the admission). Both use the driver's state and phases (fleet, trainer,
kept rollouts, _train, _record, _header, _sample_and_score, _score), as its synchronous step does.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from proto import lockstep_pb2 as pb
from services.coordinator.clients import RolloutClient
from services.coordinator.state.event_log import PhaseTimer
from services.coordinator.run.fixed_lag import BusyIntervals, behaviour_version, rollouts_at, staleness_metrics
from services.coordinator.run.errors import RunFailed
from services.coordinator.run.streaming import admit, token_staleness_metrics, token_versions

log = logging.getLogger("lockstep.coordinator.run")


class AsyncSteps:
    """Mixed into RunDriver: every attribute and phase these methods use is the driver's."""

    async def _one_lagged_step(self, step: int, trainer_version: int) -> None:
        """_one_step with async.max_staleness K > 0: the replicas are brought to the trainer's version s-1,
        step s trains on the rollout version max(0, s-1-K) made (generated in an earlier step, or now if the
        run just started), and meanwhile the replicas generate the rollouts of the steps that version s-1
        makes (s+K in steady state)."""
        timer, busy = PhaseTimer(), BusyIntervals()
        header = self._header(step)
        train_span = None
        if trainer_version == step:
            result, counts = await self.trainer.replay(header)
        elif trainer_version == step - 1:
            # Rollouts older versions make that no earlier step kept (a restarted coordinator's replicas
            # still hold the version: _replicas_start_version), before the replicas move on.
            for t in range(step, min(step + self.max_staleness, self.spec.steps) + 1):
                if behaviour_version(t, self.max_staleness) < step - 1 and not self._rollouts.has(t):
                    await self._lagged_rollout(t, self._replicas_at, busy)
            beside = self._rollouts.has(step) and self._sync_beside_training
            if beside:
                # The trainer keeps version s-1 as this step's TrainStep begins (keep_previous_weights) and
                # serves it from that copy while it trains: the replicas sync to s-1 (pulled over gRPC, or
                # written once and loaded) and then generate with it, the whole sync beside training.
                ahead = asyncio.ensure_future(self._sync_and_roll_ahead(step, busy, timer))
            else:
                with timer.phase("weight_sync"):
                    await self.fleet.sync_weights(step - 1)
                self._replicas_at = step - 1
                if not self._rollouts.has(step):  # the run's first steps
                    await self._lagged_rollout(step, step - 1, busy)
                ahead = asyncio.ensure_future(self._roll_ahead(step, busy))
            trajectories, counts = await asyncio.to_thread(self._rollouts.get, step)
            counts = {**counts, "weight_sync_beside_training": int(beside)}
            result, train_span = await self._train_beside(header, trajectories, counts, timer, ahead)
            await ahead  # its failure (a sync, a rollout) fails the step here, before anything is recorded
            if self.spec.checkpoint.every == 0:  # no checkpoint to come back to before the run's end
                await asyncio.to_thread(self._rollouts.drop_through, step)
        else:
            raise RunFailed(f"step {step}: trainer holds policy version {trainer_version}, expected {step - 1}")
        metrics = {**result.metrics, **counts}

        async def to_step() -> None:  # only the last step's: async runs evaluate at its end alone
            await self.fleet.sync_weights(step)
            self._replicas_at = step

        report = await self._eval_and_checkpoint(step, timer, metrics, sync=to_step, drop_kept=True)
        timings = timer.finish()
        if busy.spans:
            timings["rollout"] = busy.busy_seconds()
        timings["overlap"] = busy.overlap_with(train_span) if train_span else 0.0
        await self._record(step, metrics, timings, counts, report)

    async def _one_streaming_step(self, step: int, trainer_version: int) -> None:
        """_one_step in async.mode streaming: the replicas, generating the rollouts of the coming steps all
        along, are brought to s-1 (their sequences in flight paused and then continued under it), and step s
        trains on the trajectories of its rollout whose every token is of a version in [s-1-K, s-1]; the
        others are dropped and counted (the rollout is made again if none is left). When the rollout is
        complete and has trajectories to train as the step begins, nothing is in flight for the sync to
        pause: it runs beside training, from the copy of s-1 the trainer keeps, and the replicas go on
        generating once it is done."""
        timer, header, train_span, began_step = PhaseTimer(), self._header(step), None, time.monotonic()
        if trainer_version == step:
            result, counts = await self.trainer.replay(header)
        elif trainer_version == step - 1:
            # Admitted now only when the sync may run beside training (not with broadcast).
            kept = await self._admitted(step) if self._sync_beside_training and self._rollouts.has(step) else None
            beside = kept is not None
            if not beside:
                with timer.phase("weight_sync"):
                    await self._sync_streaming(step - 1)
                await self._stream_ahead(step)
                kept = await self._streamed_rollout(step, timer)
            self._busy.forget_before(began_step)
            trajectories, counts = kept
            counts["weight_sync_beside_training"] = int(beside)
            if beside:
                ahead = asyncio.ensure_future(self._sync_and_stream_ahead(step, timer))
                result, train_span = await self._train_beside(header, trajectories, counts, timer, ahead)
                await ahead  # its failure (the sync) fails the step here, before anything is recorded
            else:
                result, train_span = await self._train(header, trajectories, counts, timer)
                self._write_early(step)
            if self.spec.checkpoint.every == 0:
                await asyncio.to_thread(self._rollouts.drop_through, step)
        else:
            raise RunFailed(f"step {step}: trainer holds policy version {trainer_version}, expected {step - 1}")
        metrics = {**result.metrics, **counts}
        report = await self._eval_and_checkpoint(step, timer, metrics, sync=lambda: self._sync_streaming(step),
                                                 drop_kept=True)
        timings = timer.finish()
        if self._busy.spans or self._busy.in_flight:  # seconds the replicas generated within this step
            timings["rollout"] = self._busy.overlap_with((began_step, time.monotonic()))
        timings["overlap"] = self._busy.overlap_with(train_span) if train_span else 0.0
        await self._record(step, metrics, timings, counts, report)

    async def _stream_ahead(self, step: int) -> None:
        """Let the replicas, at version step - 1, generate the rollouts up to step + K."""
        self._stream.start(step)
        await self._stream.advance(step + self.max_staleness)

    async def _sync_and_stream_ahead(self, step: int, timer: PhaseTimer) -> None:
        """While step `step` trains: the replicas get version step - 1 from the copy the trainer kept, then
        generate ahead with it. Its seconds are the step's weight_sync, though they overlap training."""
        with timer.phase("weight_sync"):
            await self._sync_streaming(step - 1)
        await self._stream_ahead(step)

    async def _streamed_rollout(self, step: int, timer: PhaseTimer) -> tuple[list[pb.Trajectory], dict]:
        """Step `step`'s admitted trajectories and counts, once its rollout is kept; made again at the
        replicas' version if none of it is within the bound (kept from before a trainer recovery, say)."""
        with timer.phase("rollout"):  # waiting for it: zero once the replicas run ahead
            await self._stream.ready(step)
        kept = await self._admitted(step)
        if kept is None:
            dropped = len((await asyncio.to_thread(self._rollouts.get, step))[0])  # every one of them stale
            await asyncio.to_thread(self._rollouts.drop, step)
            with timer.phase("rollout"):
                await self._stream.regenerate(step)
            kept = await self._admitted(step, dropped_before=dropped)
            if kept is None:
                raise RunFailed(f"step {step}: no trajectory of its rollout is within async.max_staleness")
        return kept

    async def _admitted(self, step: int, dropped_before: int = 0) -> tuple[list[pb.Trajectory], dict] | None:
        """The kept rollout of `step` cut to the trajectories whose every token is within the bound, with
        its counts and staleness metrics (`dropped_before`: stale ones of a rollout made before this one);
        None when no trajectory is."""
        trajectories, counts = await asyncio.to_thread(self._rollouts.get, step)
        trajectories, stale = admit(step, trajectories, self.max_staleness)
        if not trajectories:
            return None
        counts = {**counts, "trajectories_trained": len(trajectories),
                  "trajectories_dropped_stale": dropped_before + stale, **self._staleness(step, trajectories)}
        return trajectories, counts

    def _staleness(self, step: int, trajectories: list[pb.Trajectory]) -> dict:
        """The step's per-trajectory and per-token staleness metrics; a version outside the bound fails the
        run, naming the step."""
        try:
            out = staleness_metrics(step, [t.policy_version for t in trajectories], self.max_staleness)
        except ValueError as exc:
            raise RunFailed(str(exc)) from None
        return {**out, **token_staleness_metrics(step, trajectories)}

    async def _train_beside(self, header: pb.TrainStepHeader, trajectories: list[pb.Trajectory], counts: dict,
                            timer: PhaseTimer, ahead: asyncio.Future) -> tuple[pb.StepMetrics, tuple]:
        """Train the step while `ahead` (the replicas' sync and rollouts) runs. If training fails, `ahead` is
        cancelled, or its own failure logged, and training's error is raised. Then version s is written
        early (_write_early)."""
        try:
            result, span = await self._train(header, trajectories, counts, timer)
        except BaseException:
            if not ahead.done():
                ahead.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await ahead
            elif not ahead.cancelled() and ahead.exception() is not None:
                # Training's error is the one raised; the sync's (or the rollout's) is logged, not lost.
                log.error("step %d: the work beside training failed as well: %r", header.step, ahead.exception())
            raise
        self._write_early(header.step)
        return result, span

    def _write_early(self, step: int) -> None:
        """shared_path with K > 0: the trainer, idle until the replicas finish, writes version `step` now, and
        the replicas prefetch it while they generate, for step + 1's sync to find read and only apply it."""
        if self.fleet.shared_weights is not None and self._sync_beside_training and step < self.spec.steps:
            self.fleet.shared_weights.write_early(step, self.replicas.live())

    async def _sync_streaming(self, version: int) -> None:
        """Bring the replicas to `version`, pausing what they generate meanwhile (continued afterwards). With
        shared_path they pause once the version is written and prefetched (_write_early), only to apply it."""
        if self.fleet.shared_weights is not None:
            await self.fleet.shared_weights.settled(version)
        async with self._gate.syncing():
            await self.fleet.readmit(version + 1, version)
            await self.fleet.sync_weights(version)
            self._replicas_at = version

    def _drop_lost_versions(self, version: int) -> None:
        """Streaming, the trainer (back) at `version`: a kept rollout with tokens of a later version was made
        by weights the trainer no longer has (it resumed from an older checkpoint), so it is made again."""
        for t in [t for t in range(version + 1, self.spec.steps + 1) if self._rollouts.has(t)]:
            if max((v for traj in self._rollouts.get(t)[0] for v in token_versions(traj)), default=-1) > version:
                self._rollouts.drop(t)

    async def _pause_replicas(self) -> None:
        """PauseGeneration on every live replica; one that does not answer is left to the Generate call's
        own failure handling (eviction, re-dispatch)."""
        async def pause(client: RolloutClient) -> None:
            with contextlib.suppress(Exception):
                await client.pause_generation(self.run_id)
        await asyncio.gather(*(pause(c) for c in self.replicas.live()))

    async def _score_streamed(self, step: int, samples: list[tuple[int, pb.Sample]],
                              lost: int) -> tuple[list[pb.Trajectory], dict]:
        trajectories = await self._score(self._stream.problems_of(step), samples, step, self._replicas_at)
        return trajectories, {"trajectories_trained": len(trajectories), "trajectories_dropped": lost}

    async def _sync_and_roll_ahead(self, step: int, busy: BusyIntervals, timer: PhaseTimer) -> None:
        """While step `step` trains: the replicas get version step - 1 from the copy the trainer kept (the
        TrainStep header's keep_previous_weights), then generate the rollouts that version makes. A sync
        that fails (the trainer lost, a write refused, digests that differ) fails the step once training
        returns, before anything is recorded. Its seconds are the step's weight_sync, though they overlap
        training."""
        with timer.phase("weight_sync"):
            await self.fleet.sync_weights(step - 1)
        self._replicas_at = step - 1
        await self._roll_ahead(step, busy)

    async def _roll_ahead(self, step: int, busy: BusyIntervals) -> None:
        """While step `step` trains: the rollouts of later steps that the replicas' version (step - 1) makes."""
        for later in rollouts_at(step - 1, step, self.max_staleness, self.spec.steps):
            if not self._rollouts.has(later):
                await self._lagged_rollout(later, step - 1, busy)

    async def _lagged_rollout(self, step: int, replicas_version: int, busy: BusyIntervals) -> None:
        """Generate and keep step `step`'s rollout with the replicas at `replicas_version`, which must be the
        version fixed_lag assigns the step: no other version may make it."""
        wanted = behaviour_version(step, self.max_staleness)
        if wanted != replicas_version:
            raise RunFailed(f"step {step}: its rollout must come from policy version {wanted} "
                            f"(async.max_staleness {self.max_staleness}), but the replicas hold {replicas_version} "
                            "and cannot go back: a rollout lost once the trainer and every replica moved past its "
                            "version cannot be generated again")
        began = time.monotonic()
        trajectories, counts = await self._sample_and_score(step, PhaseTimer())
        await asyncio.to_thread(self._rollouts.put, step, wanted, trajectories, counts)
        busy.add(began, time.monotonic())
