"""The run loop, short enough to read as the algorithm:

    for step in next_step(trainer version, cursor) .. steps:
        prompts   = step_problems(train, seed, step)         # deterministic
        readmit evicted replicas that answer again (after syncing their weights)
        samples   = fleet.generate(prompts, policy_version=step-1)  # live replicas, re-dispatched on loss
        rewards   = task.score(...)                           # verifiable
        adv       = group-normalised advantages
        metrics   = trainer.train(trajectories)               # policy_version -> step
        fleet.sync_weights(step)                              # replicas pull from the trainer
        eval (avg@k, pass@k per held-out set: evaluation.py) when due; checkpoint when due
        record step exactly once (Redis, log, Prometheus: event_log.py)
        (trainer lost: wait for it, resume it from the last checkpoint, go on from there)
        (checkpoint disk full: retry, then pause the run until resumed; the step is recorded once)

The step is a SynchronousStep (below), the algorithm above. With async.max_staleness K > 0 it is a
FixedLagStep (fixed_lag_step.py): step s samples with policy version max(0, s-1-K) instead, the replicas
are synced to s-1 at the start of step s, and they generate the rollouts of later steps while step s
trains. With async.mode streaming it is a StreamingStep (streaming_step.py): the replicas generate
continuously, the sync to s-1 pauses the sequences in flight and continues them under the new weights,
and step s trains on the trajectories whose every token is of a version >= s-1-K. The kind is chosen
once per run, from its spec (step_kind); each orders the phases of step_context.StepContext.

The collaborators, held by the StepContext: fleet.RolloutFleet (replicas, eviction, readmission, reload,
weight sync), trainer_session.TrainerSession (configure, train, replay, checkpoint, waiting for a lost
trainer) and event_log.EventLog (every event written to Redis, the log and Prometheus in one call).

Resuming: the trainer keeps its state across a coordinator restart and treats
a TrainStep for a step it already applied as a replay (it returns that step's
recorded metrics and does not train again), so a coordinator killed anywhere
inside step s redoes step s without double-applying it.

A trainer that stops answering is waited for (trainer_recovery_timeout_s), then
re-configured from the run's last checkpoint (RunDriver._recover): it comes back
at that checkpoint's version k, the replicas are brought back to k, and steps
k+1 .. cursor are recomputed. Prompts and sampling seeds are functions of (seed,
step), so on deterministic hardware a recomputed step reproduces the recorded
one bit for bit; the recorded history is never rewritten, and a
`step_recomputed` event says whether the recomputation matched it.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from pathlib import Path

from services.common.records.fingerprint import run_fingerprint
from services.coordinator.clients import RolloutClient, TrainerClient, TrainerUnavailable
from services.coordinator.fleet import RolloutFleet
from services.coordinator.replicas import NoLiveReplica
from services.coordinator.rewards.scoring import RewardScoring
from services.coordinator.run.errors import CancelCheck, RunCancelled, RunFailed, RunPaused
from services.coordinator.run.evaluation import Evaluator, build_eval_sets
from services.coordinator.run.fixed_lag_step import FixedLagStep
from services.coordinator.run.step_context import PromptTokens, StepContext, StepKind, eval_rollout
from services.coordinator.run.streaming_step import StreamingStep
from services.coordinator.run.trainer_session import SpaceRetry, TrainerSession
from services.coordinator.run_spec import RunSpec
from services.coordinator.sft.dataset import read_sft_dataset
from services.coordinator.sft.step import SftStep
from services.coordinator.state.event_log import EventLog, PhaseTimer
from services.coordinator.state.exporter import CoordinatorExporter
from services.coordinator.state.kept_rollouts import KeptRollouts
from services.coordinator.state.store import RunStore
from services.coordinator.tasks import build_task
from services.coordinator.ipc_weights import IpcWeights
from services.coordinator.tasks.chat_template import ChatTemplate
from services.coordinator.tracking.run_tracking import RunTracking
from services.coordinator.tracking.step_samples import StepSamples, read_samples
from services.coordinator.tracking.trackers import RunIdentity, TrackingTargets
from services.coordinator.weight_sources import BroadcastWeights, SharedPathWeights

__all__ = ["RunCancelled", "RunDriver", "RunFailed", "RunPaused", "SpaceRetry", "next_step"]

log = logging.getLogger("lockstep.coordinator.run")


def next_step(trainer_version: int, cursor: int) -> int:
    """The step to run next, from the trainer's policy version and the last recorded step.

    The trainer may be behind the cursor (it came back from an older
    checkpoint: recompute from there), at it, or one step ahead (it applied a
    step that was never recorded: replay it). Further ahead is inconsistent."""
    if trainer_version > cursor + 1:
        raise RunFailed(f"trainer holds policy version {trainer_version}, but only {cursor} steps are recorded")
    return min(trainer_version, cursor) + 1


class SynchronousStep:
    """async.max_staleness 0: step s samples with version s - 1, the version it trains from."""

    def __init__(self, ctx: StepContext) -> None:
        self.ctx = ctx

    async def run_step(self, step: int, trainer_version: int) -> None:
        """Sample, score, train, sync, eval, checkpoint, record. A step the trainer applied already (before
        the previous coordinator died) is replayed: its recorded metrics, not a second update."""
        ctx = self.ctx
        await ctx.fleet.readmit(step, trainer_version)
        timer = PhaseTimer()
        header = ctx.header(step)
        if trainer_version == step:
            result, counts = await ctx.trainer.replay(header)
        elif trainer_version == step - 1:
            trajectories, counts = await ctx.sample_and_score(step, timer)
            result, _ = await ctx.train(header, trajectories, counts, timer)
        else:
            raise RunFailed(f"step {step}: trainer holds policy version {trainer_version}, expected {step - 1}")
        with timer.phase("weight_sync"):
            await ctx.fleet.sync_weights(step)
        metrics = {**result.metrics, **counts}
        report = await ctx.eval_and_checkpoint(step, timer, metrics)
        await ctx.record(step, metrics, timer.finish(), counts, report)

    async def replicas_start(self, trainer_version: int) -> int:
        return trainer_version

    async def stop(self) -> None:
        return None  # nothing runs between steps


def step_kind(ctx: StepContext) -> StepKind:
    """The run's kind of step, from its spec: streaming and fixed_lag need async.max_staleness > 0; a
    supervised run's (kind sft) trains its dataset's examples (services/coordinator/sft/step.py)."""
    if ctx.spec.kind == "sft":
        return SftStep(ctx, read_sft_dataset(ctx.spec.sft, ctx.spec.model_path))
    if ctx.spec.async_.mode == "streaming" and ctx.max_staleness > 0:
        return StreamingStep(ctx)
    if ctx.max_staleness > 0:
        return FixedLagStep(ctx)
    return SynchronousStep(ctx)


class RunDriver:
    def __init__(
        self,
        run_id: str,
        spec: RunSpec,
        store: RunStore,
        rollouts: Sequence[RolloutClient],
        trainer: TrainerClient,
        exporter: CoordinatorExporter,
        run_dir: Path,
        generate_retries: int,
        tokenizer_loader: Callable[[str], object],
        *,
        trainer_recovery_timeout_s: float = 0.0,
        replica_recovery_timeout_s: float = 0.0,
        space_retry: SpaceRetry = SpaceRetry(),
        tracking_targets: TrackingTargets = TrackingTargets(),
        tracking_call_timeout_s: float = 30.0,
        scorers: Sequence[RolloutClient] = (),
    ) -> None:
        self.run_id, self.spec, self.store = run_id, spec, store
        self._check_cancelled = CancelCheck(store, run_id)
        events = EventLog(run_id, store, exporter, log)
        # 'ipc' and 'auto' decide at each configure (IpcWeights.choose); the others' objects serve 'auto''s fallback.
        source = spec.rollout.non_ipc_source
        shared = (SharedPathWeights(trainer, run_id, run_dir / "weights")
                  if source == "shared_path" else None)
        # The torch engine receives in its own process and checks the trainer's digest before applying.
        broadcast = (BroadcastWeights(trainer, run_id, digest_trailer=spec.rollout.engine == "torch")
                     if source == "broadcast" else None)
        ipc = (IpcWeights(trainer, run_id, configured=spec.rollout.weight_sync, fallback=source,
                          engine=spec.rollout.engine) if spec.rollout.weight_sync in ("ipc", "auto") else None)
        fleet = RolloutFleet(run_id, spec, rollouts, trainer.weights_address, events,
                             generate_retries=generate_retries, recovery_timeout_s=replica_recovery_timeout_s,
                             check_cancelled=self._check_cancelled, shared_weights=shared, broadcast_weights=broadcast,
                             ipc_weights=ipc)
        session = TrainerSession(run_id, spec, trainer, store, events, run_dir,
                                 recovery_timeout_s=trainer_recovery_timeout_s,
                                 check_cancelled=self._check_cancelled, space_retry=space_retry)
        task = build_task(spec.task.name, spec.task.options)
        for split in ("train", "heldout"):  # built now, in the constructing thread, not at step 1 on the event loop
            task.split(split)
        chat = ChatTemplate.from_model_dir(spec.model_path) if getattr(task, "chat_prompts", False) else None
        tokens = PromptTokens(tokenizer_loader(spec.model_path), chat)
        kept = KeptRollouts(run_id, run_dir / "rollouts", model_path=spec.model_path, seed=spec.seed)
        eval_sets = build_eval_sets(spec, task)
        if chat is not None:  # rendered here, in the constructing thread: the event loop only finds them cached
            for problems in (task.split("train"), *(s.problems for s in eval_sets)):
                for problem in problems:
                    tokens.encode(problem)
        evaluator = Evaluator(spec, task, eval_sets, eval_rollout(fleet, tokens), tokens.decode, tokens.stop_ids())
        self.context = StepContext(run_id, spec, store, run_dir, task, fleet, session, events, kept, tokens,
                                   evaluator)
        if spec.reward.kind != "rule":
            self.context.rewards = RewardScoring(run_id, spec.reward, scorers, exporter)
        self.context.samples, self.context.tracking = self._observers(run_dir, exporter, tokens, tracking_targets,
                                                                      tracking_call_timeout_s)
        self.steps = step_kind(self.context)

    def _observers(self, run_dir: Path, exporter: CoordinatorExporter, tokens: PromptTokens,
                   targets: TrackingTargets, call_timeout_s: float) -> tuple[StepSamples | None, RunTracking | None]:
        """What watches the run without steering it: its kept samples and its experiment trackers."""
        spec, run_id = self.spec, self.run_id

        def decode(ids) -> str:
            return tokens.tokenizer.decode(list(ids), skip_special_tokens=False)
        samples = (StepSamples(run_dir, spec.samples.keep_steps, decode, keep_bytes=spec.samples.keep_mib << 20)
                   if spec.samples.keep_steps else None)
        tracking = None
        if spec.tracking.backends:
            tracking = RunTracking(RunIdentity(run_id, spec.name, spec.tracking.project, run_dir), spec.tracking,
                                   targets, last_step=spec.steps, read_samples=lambda s: read_samples(run_dir, s),
                                   on_failure=lambda tracker, _why: exporter.tracking_failure(run_id, tracker),
                                   call_timeout_s=call_timeout_s)
        return samples, tracking

    # ------------------------------------------------------------------ loop --
    async def run(self) -> None:
        try:
            await self._run()
        finally:
            if self.context.fleet.shared_weights is not None:
                await self.context.fleet.shared_weights.cancel_early()
            await self.steps.stop()
            await asyncio.to_thread(self.context.task.close)
            if self.context.tracking is not None:
                await self._close_tracking()

    async def _close_tracking(self) -> None:
        """The trackers flushed (or given up), then a `trackers_closed` event: from then on what they wrote
        is whole, for anyone reading it."""
        ended = await asyncio.to_thread(self.context.tracking.close)
        try:
            await self.context.events.record("trackers_closed", "trackers closed", trackers=ended)
        except Exception as exc:  # noqa: BLE001 - the run's own ending (or its error) is what matters here
            log.warning("run %s: trackers_closed not recorded: %r", self.run_id, exc)

    async def _run(self) -> None:
        run = await self.store.get_run(self.run_id)
        assert run is not None
        if not await self.store.set_status(self.run_id, "running"):
            raise RunCancelled(self.run_id)  # cancelled (or ended) before the driver started
        try:
            trainer_version = await self._configure_services()
        except TrainerUnavailable as exc:
            trainer_version = await self._recover(run.step + 1, exc)
        await self._initial_eval(trainer_version)
        # Every run exports its bound (0 for a synchronous run), so a dashboard shows it for any run.
        self.context.events.exporter.max_staleness(self.run_id, self.context.max_staleness)
        cursor = run.step
        while (step := next_step(trainer_version, cursor)) <= self.spec.steps:
            await self._check_cancelled()
            try:
                await self.steps.run_step(step, trainer_version)
            except NoLiveReplica as exc:
                raise RunFailed(f"step {step}: {exc}") from None
            except TrainerUnavailable as exc:
                trainer_version = await self._recover(step, exc)
                continue
            trainer_version, cursor = step, max(cursor, step)
        if not await self.store.set_status(self.run_id, "completed"):
            raise RunCancelled(self.run_id)  # cancelled while the last step ran
        self.context.events.note("run completed", steps=self.spec.steps)

    async def _recover(self, step: int, lost: TrainerUnavailable) -> int:
        """Wait for a lost trainer, then configure the services again (the trainer resumes from the run's
        last checkpoint); the version it came back at."""
        recovery = await self.context.trainer.lost(step, lost)
        while True:
            await recovery.trainer_back()
            try:
                version = await self._configure_services()
                break
            except TrainerUnavailable as exc:
                await recovery.retry(exc)
        await recovery.recovered(version)
        return version

    # ------------------------------------------------------------- phases --
    async def _configure_services(self) -> int:
        """The trainer configured for the run and every replica brought to its version; that version."""
        ctx = self.context
        await self.steps.stop()  # streaming: what is in flight is generated again at the new start
        version = await ctx.trainer.configure()
        if ctx.fleet.shared_weights is not None:
            ctx.fleet.shared_weights.trainer_configured()
        if ctx.fleet.ipc_weights is not None:  # before any replica syncs: the trainer may have come back elsewhere
            await ctx.fleet.ipc_weights.choose(ctx.fleet.pool.all(), ctx.events)
        start = await self.steps.replicas_start(version)
        try:
            live = await ctx.fleet.start_at(start)
        except NoLiveReplica as exc:
            raise RunFailed(str(exc)) from None
        ctx.replicas_at = start
        if ctx.rewards is not None:  # the scorer models loaded, and what they are, before any step uses them
            await ctx.events.record("scorers_loaded", "scorer models loaded", scorers=await ctx.rewards.start())
        await ctx.events.record("services_configured", "services configured", policy_version=version,
                                rollouts=[c.address for c in live])
        await self._record_fingerprint(live)
        return version

    async def _record_fingerprint(self, live: Sequence[RolloutClient]) -> None:
        """The platform the run trains on now (every configure: a recovered service may be another)."""
        answers = await asyncio.gather(*(c.info() for c in live), return_exceptions=True)
        # A replica lost since start_at is the fleet's to notice at the next step, not a reason to fail here.
        replicas = [dict(a.details) for a in answers if not isinstance(a, BaseException)]
        fingerprint = run_fingerprint(self.spec.model_dump(mode="json", by_alias=True), self.context.trainer.details,
                                      replicas)
        if self.context.rewards is not None:  # a compared run shows when its reward changed
            fingerprint["reward_scorers"] = self.context.rewards.identity()
        if self.context.tokens.chat is not None:  # chat prompts: which template rendered them
            fingerprint["chat_template_sha256"] = self.context.tokens.chat.sha256
        await self.store.set_aux(self.run_id, "fingerprint", fingerprint)
        if self.context.tracking is not None:
            self.context.tracking.config({"run_spec": self.spec.model_dump(mode="json", by_alias=True),
                                          "platform_fingerprint": fingerprint})

    async def _initial_eval(self, policy_version: int) -> None:
        if await self.store.get_aux(self.run_id, "eval_initial") is None:
            report = await self.context.evaluator.evaluate(step=0, policy_version=policy_version)
            await self.store.set_aux(self.run_id, "eval_initial", {"accuracy": report.greedy_accuracy, "step": 0,
                                                                   "metrics": report.metrics()})
            self.context.events.exporter.on_eval(self.run_id, report)
            if self.context.tracking is not None:
                self.context.tracking.eval_initial(report.metrics())
