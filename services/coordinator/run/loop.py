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

With async.max_staleness K > 0 (fixed_lag.py) step s samples with policy version max(0, s-1-K)
instead: the replicas are synced to s-1 at the start of step s, and generate the rollouts of later
steps while step s trains (_one_lagged_step). With async.mode streaming they generate continuously
(stream_generator.py): the sync to s-1 pauses the sequences in flight and continues them under the new
weights, and step s trains on the trajectories whose every token is of a version >= s-1-K
(_one_streaming_step). Both step bodies are in async_steps.py.

The collaborators: fleet.RolloutFleet (replicas, eviction, readmission, reload, weight sync),
trainer_session.TrainerSession (configure, train, replay, checkpoint, recovery) and
event_log.EventLog (every event written to Redis, the log and Prometheus in one call).

Resuming: the trainer keeps its state across a coordinator restart and treats
a TrainStep for a step it already applied as a replay (it returns that step's
recorded metrics and does not train again), so a coordinator killed anywhere
inside step s redoes step s without double-applying it.

A trainer that stops answering is waited for (trainer_recovery_timeout_s), then
re-configured from the run's last checkpoint: it comes back at that
checkpoint's version k, the replicas are brought back to k, and steps k+1 ..
cursor are recomputed. Prompts and sampling seeds are functions of (seed,
step), so on deterministic hardware a recomputed step reproduces the recorded
one bit for bit; the recorded history is never rewritten, and a
`step_recomputed` event says whether the recomputation matched it.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

from contract.advantages import group_advantages
from contract.wire_tensors import array_from_proto as from_proto
from contract.wire_tensors import ids_to_proto
from proto import lockstep_pb2 as pb
from services.common.records.fingerprint import run_fingerprint
from services.common.records.step_record import StepRecordMeta, write_step_record
from services.coordinator.run.async_steps import AsyncSteps
from services.coordinator.clients import RolloutClient, TrainerClient, TrainerUnavailable
from services.coordinator.run.dynamic_sampling import select_informative
from services.coordinator.run.evaluation import EvalReport, Evaluator, build_eval_sets
from services.coordinator.state.event_log import EventLog, PhaseTimer
from services.coordinator.state.exporter import CoordinatorExporter
from services.coordinator.run.fixed_lag import BusyIntervals, behaviour_version
from services.coordinator.fleet import RolloutFleet
from services.coordinator.state.kept_rollouts import KeptRollouts
from services.coordinator.run.prompts import SamplingPlan, step_problems
from services.coordinator.replicas import NoLiveReplica, ReplicaPool
from services.coordinator.run.errors import RunCancelled, RunFailed, RunPaused
from services.coordinator.run_spec import RunSpec
from services.coordinator.state.store import RunStore
from services.coordinator.run.stream_generator import GenerationGate, StreamGenerator
from services.coordinator.tasks import Problem, Task, build_task
from services.coordinator.tasks.episodic import EpisodicTask, episode_metrics
from services.coordinator.run.trainer_session import SpaceRetry, TrainerSession
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


class RunDriver(AsyncSteps):
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
    ) -> None:
        self.run_id, self.spec, self.store = run_id, spec, store
        self.run_dir = run_dir
        self.events = EventLog(run_id, store, exporter, log)
        shared = (SharedPathWeights(trainer, run_id, run_dir / "weights")
                  if spec.rollout.weight_sync == "shared_path" else None)
        # The torch engine receives in its own process and checks the trainer's digest before applying.
        broadcast = (BroadcastWeights(trainer, run_id, digest_trailer=spec.rollout.engine == "torch")
                     if spec.rollout.weight_sync == "broadcast" else None)
        self.fleet = RolloutFleet(run_id, spec, rollouts, trainer.weights_address, self.events,
                                  generate_retries=generate_retries, recovery_timeout_s=replica_recovery_timeout_s,
                                  check_cancelled=self._check_cancelled, shared_weights=shared,
                                  broadcast_weights=broadcast)
        self.trainer = TrainerSession(run_id, spec, trainer, store, self.events, run_dir,
                                      recovery_timeout_s=trainer_recovery_timeout_s,
                                      check_cancelled=self._check_cancelled, space_retry=space_retry)
        self.task: Task = build_task(spec.task.name, spec.task.options)
        for split in ("train", "heldout"):  # built now, in the constructing thread, not at step 1 on the event loop
            self.task.split(split)
        self.tokenizer = tokenizer_loader(spec.model_path)
        self.max_staleness = spec.async_.max_staleness
        # fixed_lag: each step's scored rollout, from when it is generated until its step is trained (and
        # checkpointed, when checkpoint.every > 0: a resumed trainer trains them again); on disk, since the
        # version that made it may be gone when a restarted coordinator needs it.
        self._rollouts = KeptRollouts(run_id, run_dir / "rollouts", model_path=spec.model_path, seed=spec.seed)
        self._replicas_at = 0  # fixed_lag: the version every live replica holds
        # K > 0: the replicas sync to s-1 while step s trains, from the copy of s-1 the trainer keeps (in
        # streaming when step s's rollout is complete as the step begins). Not with broadcast, which sends from
        # the live weights under the trainer's lock.
        self._sync_beside_training = self.max_staleness > 0 and spec.rollout.weight_sync != "broadcast"
        self.streaming = spec.async_.mode == "streaming" and self.max_staleness > 0
        self._gate = GenerationGate(self._pause_replicas)
        self._busy = BusyIntervals()  # streaming: when the replicas generated (this step's window and later)
        self._stream = StreamGenerator(
            self.fleet, self._gate, self._rollouts, last_step=spec.steps,
            problems_of=lambda t: step_problems(self.task.split("train"), seed=spec.seed, step=t,
                                                count=spec.rollout.prompts_per_step),
            plan_of=self._training_plan, encode=self._encode, score=self._score_streamed,
            version=lambda: self._replicas_at,
            on_busy=lambda a, b: self._busy.begin(a) if b is None else self._busy.add(a, b))
        self._prompt_ids: dict[str, list[int]] = {}
        self.evaluator = Evaluator(spec, self.task, build_eval_sets(spec, self.task), self._eval_rollout,
                                   self._decode, self._stop_ids())

    @property
    def replicas(self) -> ReplicaPool:
        return self.fleet.pool

    # ------------------------------------------------------------------ loop --
    async def run(self) -> None:
        try:
            await self._run()
        finally:
            if self.fleet.shared_weights is not None:
                await self.fleet.shared_weights.cancel_early()
            await self._stream.stop()
            await asyncio.to_thread(self.task.close)

    async def _run(self) -> None:
        run = await self.store.get_run(self.run_id)
        assert run is not None
        if not await self.store.set_status(self.run_id, "running"):
            raise RunCancelled(self.run_id)  # cancelled (or ended) before the driver started
        try:
            trainer_version = await self._configure_services()
        except TrainerUnavailable as exc:
            trainer_version = await self.trainer.recover(run.step + 1, exc, self._configure_services)
        await self._initial_eval(trainer_version)
        # Every run exports its bound (0 for a synchronous run), so a dashboard shows it for any run.
        self.events.exporter.max_staleness(self.run_id, self.max_staleness)
        cursor = run.step
        while (step := next_step(trainer_version, cursor)) <= self.spec.steps:
            await self._check_cancelled()
            try:
                if not self.streaming:  # streaming readmits inside its weight sync, while nothing generates
                    await self.fleet.readmit(step, trainer_version)
                if self.streaming:
                    await self._one_streaming_step(step, trainer_version)
                elif self.max_staleness:
                    await self._one_lagged_step(step, trainer_version)
                else:
                    await self._one_step(step, trainer_version)
            except NoLiveReplica as exc:
                raise RunFailed(f"step {step}: {exc}") from None
            except TrainerUnavailable as exc:
                trainer_version = await self.trainer.recover(step, exc, self._configure_services)
                continue
            trainer_version, cursor = step, max(cursor, step)
        if not await self.store.set_status(self.run_id, "completed"):
            raise RunCancelled(self.run_id)  # cancelled while the last step ran
        self.events.note("run completed", steps=self.spec.steps)

    async def _one_step(self, step: int, trainer_version: int) -> None:
        """Sample, score, train, sync, record. A step the trainer applied already (before the previous
        coordinator died) is replayed: its recorded metrics, not a second update."""
        timer = PhaseTimer()
        header = self._header(step)
        if trainer_version == step:
            result, counts = await self.trainer.replay(header)
        elif trainer_version == step - 1:
            trajectories, counts = await self._sample_and_score(step, timer)
            result, _ = await self._train(header, trajectories, counts, timer)
        else:
            raise RunFailed(f"step {step}: trainer holds policy version {trainer_version}, expected {step - 1}")
        with timer.phase("weight_sync"):
            await self.fleet.sync_weights(step)
        metrics = {**result.metrics, **counts}
        report = await self._eval_and_checkpoint(step, timer, metrics)
        await self._record(step, metrics, timer.finish(), counts, report)

    async def _eval_and_checkpoint(self, step: int, timer: PhaseTimer, metrics: dict, *,
                                   sync: Callable[[], Awaitable[None]] | None = None,
                                   drop_kept: bool = False) -> EvalReport | None:
        """The end of a step: evaluate when due (after `sync` brings the replicas to `step`: an async run's
        are behind it), its metrics into `metrics`; checkpoint when due, and with `drop_kept` let the kept
        rollouts through `step` go (a resumed trainer starts after it)."""
        report = None
        if self._eval_due(step):
            if sync is not None:
                with timer.phase("weight_sync"):
                    await sync()
            with timer.phase("eval"):
                report = await self.evaluator.evaluate(step=step, policy_version=step)
            metrics.update(report.metrics())
        if self._checkpoint_due(step):
            with timer.phase("checkpoint"):
                await self.trainer.checkpoint(step)
            if drop_kept:
                await asyncio.to_thread(self._rollouts.drop_through, step)
        return report

    async def _sample_and_score(self, step: int, timer: PhaseTimer) -> tuple[list[pb.Trajectory], dict]:
        """The step's trajectories (scored, with advantages) and their counts."""
        spec = self.spec
        version = behaviour_version(step, self.max_staleness)
        problems = step_problems(self.task.split("train"), seed=spec.seed, step=step,
                                 count=spec.rollout.prompts_per_step)
        with timer.phase("rollout"):
            samples, dropped = await self._rollout(problems, step=step, policy_version=version)
        with timer.phase("reward"):
            trajectories = await self._score(problems, samples, step, version)
        if not trajectories:
            raise RunFailed(f"step {step}: every trajectory was dropped ({dropped} samples)")
        dropped += len(samples) - len(trajectories)  # episodes that failed in reset(): no model token
        counts = {"trajectories_trained": len(trajectories), "trajectories_dropped": dropped}
        if spec.rollout.dynamic_sampling.enabled:
            with timer.phase("dynamic_sampling"):
                trajectories, counts = await self._informative_groups(step, trajectories, dropped)
        if isinstance(self.task, EpisodicTask):  # the first round's episodes: what the policy does at this step
            counts.update(episode_metrics([s for _, s in samples]))
        if self.max_staleness:
            counts.update(self._staleness(step, trajectories))
        return trajectories, counts

    def _header(self, step: int) -> pb.TrainStepHeader:
        """The TrainStep header of `step`: the oldest version its tokens may come from and the run's bound,
        which the trainer enforces on every token."""
        return pb.TrainStepHeader(run_id=self.run_id, step=step,
                                  policy_version=behaviour_version(step, self.max_staleness),
                                  max_staleness=self.max_staleness, streaming=self.spec.async_.mode == "streaming",
                                  keep_previous_weights=self._sync_beside_training)

    async def _record(self, step: int, metrics: dict, timings: dict, counts: dict,
                      report: EvalReport | None) -> None:
        """Record the step exactly once; a step recorded before (recomputed after a trainer loss) is
        compared with its record instead."""
        if not await self.events.record_step(step, metrics, timings, counts, report):
            await self._note_recomputed(step, metrics)

    async def _initial_eval(self, policy_version: int) -> None:
        if await self.store.get_aux(self.run_id, "eval_initial") is None:
            report = await self.evaluator.evaluate(step=0, policy_version=policy_version)
            await self.store.set_aux(self.run_id, "eval_initial", {"accuracy": report.greedy_accuracy, "step": 0,
                                                                   "metrics": report.metrics()})
            self.events.exporter.on_eval(self.run_id, report)

    async def _informative_groups(self, step: int, first: list[pb.Trajectory],
                                  dropped: int) -> tuple[list[pb.Trajectory], dict]:
        """Dynamic sampling: extra rounds of prompts until prompts_per_step groups have differing rewards."""
        spec = self.spec
        want, max_rounds = spec.rollout.prompts_per_step, spec.rollout.dynamic_sampling.max_rounds
        rounds = [first]
        selection = select_informative(rounds, want)
        while selection.groups < want and len(rounds) <= max_rounds:
            r = len(rounds)
            extra = step_problems(self.task.split("train"), seed=spec.seed, step=step, count=want, round=r)
            version = behaviour_version(step, self.max_staleness)
            samples, lost = await self._rollout(extra, step=step, policy_version=version, first_index=r * want)
            scored = await self._score(extra, samples, step, version)
            dropped += lost + len(samples) - len(scored)
            rounds.append(scored)
            selection = select_informative(rounds, want)
        kept = selection.kept
        if selection.groups < want:
            await self.events.record("dynamic_sampling_short", "dynamic sampling short of informative groups",
                                     step=step, groups=selection.groups, wanted=want, rounds=len(rounds))
            if not kept:  # no signal anywhere: the first round's batch, whose advantages are all zero
                kept = first
        counts = {"trajectories_trained": len(kept), "trajectories_dropped": dropped,
                  "trajectories_filtered": selection.filtered - (len(first) if kept is first else 0),
                  "trajectories_surplus": selection.surplus, "rollout_rounds": len(rounds)}
        return kept, counts

    async def _train(self, header: pb.TrainStepHeader, trajectories: list[pb.Trajectory], counts: dict[str, int],
                     timer: PhaseTimer) -> tuple[pb.StepMetrics, tuple[float, float]]:
        """Record the step's input when the run asks for it, then train it: the trainer's answer and the
        (start, end) of the train call on the monotonic clock."""
        header.num_trajectories = len(trajectories)
        if self.spec.debug.record_trajectories:
            await asyncio.to_thread(self._record_step_input, header, trajectories)
        began = time.monotonic()
        with timer.phase("train"):
            result = await self.trainer.train(header, trajectories, counts)
        return result, (began, time.monotonic())

    def _record_step_input(self, header: pb.TrainStepHeader, trajectories: list[pb.Trajectory]) -> None:
        spec = self.spec
        meta = StepRecordMeta(run_id=self.run_id, step=header.step, policy_version=header.policy_version,
                              model_path=spec.model_path, seed=spec.seed,
                              trainer_config_json=spec.trainer.model_dump_json())
        chunks = [pb.TrainStepChunk(header=header), *(pb.TrainStepChunk(trajectory=t) for t in trajectories)]
        write_step_record(self.run_dir / "trajectories" / f"step_{header.step:06d}.pb", meta, chunks)

    async def _note_recomputed(self, step: int, metrics: dict) -> None:
        """A step recorded before the trainer was lost, computed again: say whether the bits matched."""
        recorded = await self.store.step_metrics(self.run_id, step)
        same = recorded is not None and json.dumps(recorded, sort_keys=True) == json.dumps(metrics, sort_keys=True)
        differing = sorted(k for k in metrics if recorded is None or json.dumps(recorded.get(k)) != json.dumps(metrics[k]))
        await self.events.record("step_recomputed", "step recomputed",
                                 export=lambda exporter: exporter.step_recomputed(self.run_id, same),
                                 step=step, matches_recorded=same, differing_metrics=differing)

    # ------------------------------------------------------------- phases --
    async def _configure_services(self) -> int:
        """The trainer configured for the run and every replica brought to its version; that version."""
        await self._stream.stop()  # streaming: what is in flight is generated again at the new start
        version = await self.trainer.configure()
        if self.fleet.shared_weights is not None:
            self.fleet.shared_weights.trainer_configured()
        if self.streaming:
            await asyncio.to_thread(self._drop_lost_versions, version)
        start = await self._replicas_start_version(version) if self.max_staleness and not self.streaming \
            else version
        try:
            live = await self.fleet.start_at(start)
        except NoLiveReplica as exc:
            raise RunFailed(str(exc)) from None
        self._replicas_at = start
        await self.events.record("services_configured", "services configured", policy_version=version,
                                 rollouts=[c.address for c in live])
        await self._record_fingerprint(live)
        return version

    async def _record_fingerprint(self, live: Sequence[RolloutClient]) -> None:
        """The platform the run trains on now (every configure: a recovered service may be another)."""
        answers = await asyncio.gather(*(c.info() for c in live), return_exceptions=True)
        # A replica lost since start_at is the fleet's to notice at the next step, not a reason to fail here.
        replicas = [dict(a.details) for a in answers if not isinstance(a, BaseException)]
        fingerprint = run_fingerprint(self.spec.model_dump(mode="json", by_alias=True), self.trainer.details,
                                      replicas)
        await self.store.set_aux(self.run_id, "fingerprint", fingerprint)

    async def _replicas_start_version(self, trainer_version: int) -> int:
        """fixed_lag: the version to start the replicas at. The trainer's, unless a step it has not trained
        lacks its kept rollout and an older version makes it: the coordinator died while that rollout was
        generated, and the replicas, which were not synced since, still hold that version (a replica that
        holds another cannot be brought to it, and the run fails naming the step)."""
        last = min(trainer_version + self.max_staleness, self.spec.steps)
        missing = [behaviour_version(t, self.max_staleness) for t in range(trainer_version + 1, last + 1)
                   if behaviour_version(t, self.max_staleness) < trainer_version and not self._rollouts.has(t)]
        return min(missing, default=trainer_version)

    def _training_plan(self, step: int) -> SamplingPlan:
        s = self.spec.rollout.sampling
        params = pb.SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                                   max_new_tokens=s.max_new_tokens, stop_token_ids=self._stop_ids(), greedy=False)
        episode = self.task.episode_settings() if isinstance(self.task, EpisodicTask) else None
        return SamplingPlan(params, self.spec.rollout.samples_per_prompt, ("sample", self.spec.seed, step), episode)

    async def _rollout(self, problems: list[Problem], *, step: int, policy_version: int,
                       plan: SamplingPlan | None = None,
                       first_index: int = 0) -> tuple[list[tuple[int, pb.Sample]], int]:
        """Samples as (index in `problems`, sample) in problem order, and the dropped count.
        `plan` None: the step's training samples."""
        plan = self._training_plan(step) if plan is None else plan
        return await self.fleet.generate(problems, plan, self._encode, step=step, policy_version=policy_version,
                                         first_index=first_index)

    async def _score(self, problems: list[Problem], samples: list[tuple[int, pb.Sample]],
                     step: int, policy_version: int) -> list[pb.Trajectory]:
        """`policy_version`: the version that generated `samples` (every replica reported it: fleet.generate).
        An episode carries its own prompt, response mask and reward; one without a model token (its
        environment failed in reset()) is dropped here, counted by its end reason in the step's metrics."""
        if isinstance(self.task, EpisodicTask):
            samples = [(i, s) for i, s in samples if s.response_token_ids.shape and s.response_token_ids.shape[0]]
            rewards = [float(s.episode_reward) for _, s in samples]
        else:
            rewards = await self.task.score([(problems[i], self._decode(s)) for i, s in samples])
        advantages = group_advantages(rewards, [s.group_id for _, s in samples],
                                      std_normalization=self.spec.trainer.advantage_std_normalization)
        out = []
        for (i, s), r, a in zip(samples, rewards, advantages):
            t = pb.Trajectory(
                run_id=self.run_id, step=step, group_id=s.group_id,
                # The replica's per-token versions, as reported: the trainer refuses any outside the bound.
                policy_version=s.policy_versions[0] if s.policy_versions else policy_version,
                token_policy_versions=s.policy_versions,
                sample_id=s.sample_id, response_token_ids=s.response_token_ids, rollout_logprobs=s.logprobs,
                reward=float(r), advantage=float(a), finish_reason=s.finish_reason,
            )
            if s.HasField("response_mask"):
                t.prompt_token_ids.CopyFrom(s.prompt_token_ids)
                t.response_mask.CopyFrom(s.response_mask)
                t.episode.CopyFrom(pb.EpisodeRecord(turns=s.turns, turn_rewards=s.turn_rewards,
                                                    tool_calls=s.tool_calls, tool_errors=s.tool_errors,
                                                    end_reason=s.end_reason))
            else:
                t.prompt_token_ids.CopyFrom(ids_to_proto(self._encode(problems[i])))
            out.append(t)
        return out

    async def _eval_rollout(self, problems: list[Problem], policy_version: int,
                            plan: SamplingPlan) -> list[tuple[int, pb.Sample]]:
        # step 0 for the group ids, as the eval always used: eval requests never share a call with a step's.
        samples, dropped = await self._rollout(problems, step=0, policy_version=policy_version, plan=plan)
        if dropped:
            raise RunFailed(f"evaluation lost {dropped} samples: rollout unavailable")
        return samples

    # ------------------------------------------------------------ helpers --
    def _eval_due(self, step: int) -> bool:
        every = self.spec.eval.every
        return step == self.spec.steps or (every > 0 and step % every == 0)

    def _checkpoint_due(self, step: int) -> bool:
        every, final = self.spec.checkpoint.every, self.spec.checkpoint.final
        return (final and step == self.spec.steps) or (every > 0 and step % every == 0)

    async def _check_cancelled(self) -> None:
        run = await self.store.get_run(self.run_id)
        if run is None or run.status == "cancelled":
            raise RunCancelled(self.run_id)

    def _encode(self, problem: Problem) -> list[int]:
        ids = self._prompt_ids.get(problem.problem_id)
        if ids is None:
            ids = list(self.tokenizer.encode(problem.prompt, add_special_tokens=False))  # the task owns the whole prompt text
            self._prompt_ids[problem.problem_id] = ids
        return ids

    def _decode(self, sample: pb.Sample) -> str:
        ids = from_proto(sample.response_token_ids, field="response_token_ids").tolist()
        # Keep special tokens: the task decides where a response ends (eos) and
        # must see a pad or bos inside an answer, which skipping would splice out
        # ("1<pad>5" would read as a correct "15").
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def _stop_ids(self) -> list[int]:
        eos = getattr(self.tokenizer, "eos_token_id", None)
        return [eos] if eos is not None else []


