"""What a step of the run loop works with, and the phases every kind of step is made of.

`StepContext` holds the run's collaborators (the rollout fleet, the trainer session, the event log, the
kept rollouts, the evaluator, the tokenizer) and the version the replicas hold. Its methods are the
phases: sample and score (with dynamic sampling's extra rounds), train (or train beside the replicas'
sync and rollouts), evaluate and checkpoint when due, record. A `StepKind` orders them into one step:
loop.SynchronousStep, fixed_lag_step.FixedLagStep or streaming_step.StreamingStep, chosen once per run.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from contract.advantages import group_advantages
from contract.wire_tensors import array_from_proto as from_proto
from contract.wire_tensors import ids_to_proto
from proto import lockstep_pb2 as pb
from services.common.records.step_record import StepRecordMeta, write_step_record
from services.coordinator.fleet import RolloutFleet
from services.coordinator.rewards.scorers import ScoreInput
from services.coordinator.rewards.scoring import RewardScoring, reward_counts, write_ledger
from services.coordinator.run.dynamic_sampling import select_informative
from services.coordinator.run.errors import RunFailed
from services.coordinator.run.evaluation import EvalReport, EvalRollout, Evaluator
from services.coordinator.run.fixed_lag import behaviour_version, staleness_metrics
from services.coordinator.run.prompts import SamplingPlan, step_problems
from services.coordinator.run.streaming import token_staleness_metrics
from services.coordinator.run.trainer_session import TrainerSession
from services.coordinator.run_spec import RunSpec
from services.coordinator.state.event_log import EventLog, PhaseTimer
from services.coordinator.state.kept_rollouts import KeptRollouts
from services.coordinator.state.store import RunStore
from services.coordinator.tasks import Problem, Task
from services.coordinator.tasks.chat_template import ChatTemplate
from services.coordinator.tasks.episodic import EpisodicTask, episode_metrics
from services.coordinator.tracking.run_tracking import RunTracking
from services.coordinator.tracking.step_samples import StepSamples

log = logging.getLogger("lockstep.coordinator.run")


class StepKind(Protocol):
    """How the run loop makes one step: synchronous, fixed_lag or streaming."""

    async def run_step(self, step: int, trainer_version: int) -> None:
        """Make and record step `step`, the trainer holding `trainer_version` (step - 1, or step to replay)."""

    async def replicas_start(self, trainer_version: int) -> int:
        """While the services are configured, the trainer at `trainer_version`: the version to start the
        replicas at."""

    async def stop(self) -> None:
        """Stop what the step kind runs in the background (before a configure, and at the run's end)."""


class PromptTokens:
    """The run's tokenizer as the steps use it: each prompt encoded once, responses decoded for the task."""

    def __init__(self, tokenizer: object, chat: ChatTemplate | None = None) -> None:
        self.tokenizer, self.chat = tokenizer, chat
        self._prompt_ids: dict[str, list[int]] = {}

    def encode(self, problem: Problem) -> list[int]:
        ids = self._prompt_ids.get(problem.problem_id)
        if ids is None:
            # The task (or the chat template, for a chat) owns the whole prompt text: no special tokens are
            # added to it, as apply_chat_template encodes what it rendered.
            text = problem.prompt if problem.messages is None else self._chat().render(problem.messages)
            ids = list(self.tokenizer.encode(text, add_special_tokens=False))
            self._prompt_ids[problem.problem_id] = ids
        return ids

    def _chat(self) -> ChatTemplate:
        if self.chat is None:
            raise RunFailed("a chat prompt reached a run without its model's chat template")
        return self.chat

    def decode(self, sample: pb.Sample) -> str:
        ids = from_proto(sample.response_token_ids, field="response_token_ids").tolist()
        # Keep special tokens: the task decides where a response ends (eos) and
        # must see a pad or bos inside an answer, which skipping would splice out
        # ("1<pad>5" would read as a correct "15").
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def response_text(self, sample: pb.Sample) -> str:
        """What a scorer model reads as the response: decode()'s text without the stop token that ended it
        (the scorer's own template marks where a response ends)."""
        ids = from_proto(sample.response_token_ids, field="response_token_ids").tolist()
        if sample.finish_reason == "stop" and ids and ids[-1] in self.stop_ids():
            ids = ids[:-1]
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def stop_ids(self) -> list[int]:
        eos = getattr(self.tokenizer, "eos_token_id", None)
        return [eos] if eos is not None else []


def eval_rollout(fleet: RolloutFleet, tokens: PromptTokens) -> EvalRollout:
    """The evaluator's sampling through the run's replicas: every sample, or RunFailed if any was lost."""
    async def rollout(problems: list[Problem], policy_version: int, plan: SamplingPlan) -> list[tuple[int, pb.Sample]]:
        # step 0 for the group ids, as the eval always used: eval requests never share a call with a step's.
        samples, dropped = await fleet.generate(problems, plan, tokens.encode, step=0, policy_version=policy_version,
                                                first_index=0)
        if dropped:
            raise RunFailed(f"evaluation lost {dropped} samples: rollout unavailable")
        return samples
    return rollout


@dataclass
class StepContext:
    run_id: str
    spec: RunSpec
    store: RunStore
    run_dir: Path
    task: Task
    fleet: RolloutFleet
    trainer: TrainerSession
    events: EventLog
    kept: KeptRollouts
    """fixed_lag and streaming: each step's scored rollout, from when it is generated until its step is
    trained (and checkpointed, when checkpoint.every > 0: a resumed trainer trains them again); on disk,
    since the version that made it may be gone when a restarted coordinator needs it."""
    tokens: PromptTokens
    evaluator: Evaluator
    replicas_at: int = 0
    """fixed_lag and streaming: the version every live replica holds."""
    _task_counts: dict[int, dict[str, float | list[str]]] = field(default_factory=dict, init=False, repr=False)
    """Per step: the task's own counts of the responses scored for it so far (Task.score_with_metrics)."""
    samples: StepSamples | None = None
    """Each step's samples as trained, kept for the samples API (the last spec.samples.keep_steps steps)."""
    tracking: RunTracking | None = None
    """The run's experiment trackers, fed off the step path (tracking/run_tracking.py)."""
    rewards: RewardScoring | None = None
    """The run's scorer models (reward.kind other than 'rule'); None: the task's rule alone rewards."""

    @property
    def max_staleness(self) -> int:
        return self.spec.async_.max_staleness

    @property
    def sync_beside_training(self) -> bool:
        """K > 0: the replicas sync to s-1 while step s trains, from the copy of s-1 the trainer keeps (in
        streaming when step s's rollout is complete as the step begins). Not with broadcast, which sends
        from the live weights under the trainer's lock, nor with ipc, which packs them there."""
        return self.max_staleness > 0 and self.fleet.weight_source not in ("broadcast", "ipc")

    def header(self, step: int) -> pb.TrainStepHeader:
        """The TrainStep header of `step`: the oldest version its tokens may come from and the run's bound,
        which the trainer enforces on every token."""
        return pb.TrainStepHeader(run_id=self.run_id, step=step,
                                  policy_version=behaviour_version(step, self.max_staleness),
                                  max_staleness=self.max_staleness, streaming=self.spec.async_.mode == "streaming",
                                  keep_previous_weights=self.sync_beside_training)

    # ------------------------------------------------------- sample, score --
    def problems(self, step: int, round: int = 0) -> list[Problem]:
        """The step's prompts (`round` > 0: dynamic sampling's further draws), from (seed, step) alone."""
        return step_problems(self.task.split("train"), seed=self.spec.seed, step=step,
                             count=self.spec.rollout.prompts_per_step, round=round)

    def training_plan(self, step: int) -> SamplingPlan:
        s = self.spec.rollout.sampling
        params = pb.SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                                   max_new_tokens=s.max_new_tokens, stop_token_ids=self.tokens.stop_ids(),
                                   greedy=False)
        episode = self.task.episode_settings() if isinstance(self.task, EpisodicTask) else None
        return SamplingPlan(params, self.spec.rollout.samples_per_prompt, ("sample", self.spec.seed, step), episode)

    async def rollout(self, problems: list[Problem], *, step: int, policy_version: int,
                      first_index: int = 0) -> tuple[list[tuple[int, pb.Sample]], int]:
        """The step's training samples as (index in `problems`, sample) in problem order, and the dropped count."""
        # A model reward starts scoring each replica's samples as they arrive, while the others still generate.
        on_shard = None if self.rewards is None or isinstance(self.task, EpisodicTask) else (
            lambda samples: self.rewards.score_soon(step, self._score_inputs(problems, samples)))
        return await self.fleet.generate(problems, self.training_plan(step), self.tokens.encode, step=step,
                                         policy_version=policy_version, first_index=first_index, on_shard=on_shard)

    async def score(self, problems: list[Problem], samples: list[tuple[int, pb.Sample]],
                    step: int, policy_version: int) -> list[pb.Trajectory]:
        """`policy_version`: the version that generated `samples` (every replica reported it: fleet.generate).
        An episode carries its own prompt, response mask and reward; one without a model token (its
        environment failed in reset()) is dropped here, counted by its end reason in the step's metrics."""
        if isinstance(self.task, EpisodicTask):
            samples = [(i, s) for i, s in samples if s.response_token_ids.shape and s.response_token_ids.shape[0]]
            rewards = [float(s.episode_reward) for _, s in samples]
        else:
            texts = [self.tokens.decode(s) for _, s in samples]
            rewards: list[float] | None = None
            if self.rewards is None or "rule" in self.spec.reward.sources():
                rewards, task_counts = await self.task.score_with_metrics(
                    [(problems[i], text) for (i, _), text in zip(samples, texts)])
                self._add_task_counts(step, task_counts)
            if self.rewards is not None:
                samples, rewards = await self._model_rewards(problems, samples, rewards, step)
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
            if s.HasField("routed_experts"):  # MoE: the trainer checks it (and replays it when asked)
                t.routed_experts.CopyFrom(s.routed_experts)
            if s.HasField("response_mask"):
                t.prompt_token_ids.CopyFrom(s.prompt_token_ids)
                t.response_mask.CopyFrom(s.response_mask)
                t.episode.CopyFrom(pb.EpisodeRecord(turns=s.turns, turn_rewards=s.turn_rewards,
                                                    tool_calls=s.tool_calls, tool_errors=s.tool_errors,
                                                    end_reason=s.end_reason))
            else:
                t.prompt_token_ids.CopyFrom(ids_to_proto(self.tokens.encode(problems[i])))
            out.append(t)
        return out

    async def _model_rewards(self, problems: list[Problem], samples: list[tuple[int, pb.Sample]],
                             rule_rewards: list[float] | None, step: int
                             ) -> tuple[list[tuple[int, pb.Sample]], list[float]]:
        """The scorer models' rewards (rewards/scoring.py): the samples they scored and their rewards; the
        others are dropped here, counted in the step's metrics, and their calls written to the reward ledger."""
        scored = await self.rewards.score(step, self._score_inputs(problems, samples), rule_rewards)
        await asyncio.to_thread(write_ledger, self.run_dir, step, self.rewards.identity(), scored)
        self._add_task_counts(step, reward_counts(scored))
        kept = [k for k, sample in enumerate(scored) if sample.reward is not None]
        return [samples[k] for k in kept], [scored[k].reward for k in kept]

    def _score_inputs(self, problems: list[Problem], samples: list[tuple[int, pb.Sample]]) -> list[ScoreInput]:
        return [ScoreInput(s.sample_id, problems[i].prompt, self.tokens.response_text(s), problems[i].answer)
                for i, s in samples]

    def _add_task_counts(self, step: int, counts: dict[str, float | list[str]]) -> None:
        """The task's numbers of one scoring call into the step's (dynamic sampling scores several rounds):
        counts summed, per-response lists joined in scoring order."""
        into = self._task_counts.setdefault(step, {})
        for key, value in counts.items():
            into[key] = into.get(key, [] if isinstance(value, list) else 0.0) + value

    def pop_task_counts(self, step: int) -> dict[str, float | list[str]]:
        return self._task_counts.pop(step, {})

    async def score_rollout(self, step: int, samples: list[tuple[int, pb.Sample]],
                            lost: int) -> tuple[list[pb.Trajectory], dict]:
        """A streamed rollout of `step` (`lost`: its samples no replica answered), scored at the replicas'
        version: its trajectories and counts."""
        trajectories = await self.score(self.problems(step), samples, step, self.replicas_at)
        return trajectories, {"trajectories_trained": len(trajectories), "trajectories_dropped": lost,
                              **self.pop_task_counts(step)}

    async def sample_and_score(self, step: int, timer: PhaseTimer) -> tuple[list[pb.Trajectory], dict]:
        """The step's trajectories (scored, with advantages) and their counts."""
        spec = self.spec
        version = behaviour_version(step, self.max_staleness)
        problems = self.problems(step)
        with timer.phase("rollout"):
            samples, dropped = await self.rollout(problems, step=step, policy_version=version)
        with timer.phase("reward"):
            trajectories = await self.score(problems, samples, step, version)
        if not trajectories:
            raise RunFailed(f"step {step}: every trajectory was dropped ({dropped} samples)")
        dropped += len(samples) - len(trajectories)  # episodes that failed in reset(): no model token
        counts = {"trajectories_trained": len(trajectories), "trajectories_dropped": dropped}
        if spec.rollout.dynamic_sampling.enabled:
            with timer.phase("dynamic_sampling"):
                trajectories, counts = await self._informative_groups(step, trajectories, dropped)
        if isinstance(self.task, EpisodicTask):  # the first round's episodes: what the policy does at this step
            counts.update(episode_metrics([s for _, s in samples]))
        counts.update(self.pop_task_counts(step))
        if self.max_staleness:
            counts.update(self.staleness(step, trajectories))
        return trajectories, counts

    async def _informative_groups(self, step: int, first: list[pb.Trajectory],
                                  dropped: int) -> tuple[list[pb.Trajectory], dict]:
        """Dynamic sampling: extra rounds of prompts until prompts_per_step groups have differing rewards."""
        spec = self.spec
        want, max_rounds = spec.rollout.prompts_per_step, spec.rollout.dynamic_sampling.max_rounds
        rounds = [first]
        selection = select_informative(rounds, want)
        while selection.groups < want and len(rounds) <= max_rounds:
            r = len(rounds)
            extra = self.problems(step, round=r)
            version = behaviour_version(step, self.max_staleness)
            samples, lost = await self.rollout(extra, step=step, policy_version=version, first_index=r * want)
            scored = await self.score(extra, samples, step, version)
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

    def staleness(self, step: int, trajectories: list[pb.Trajectory]) -> dict:
        """The step's per-trajectory and per-token staleness metrics; a version outside the bound fails the
        run, naming the step."""
        try:
            out = staleness_metrics(step, [t.policy_version for t in trajectories], self.max_staleness)
        except ValueError as exc:
            raise RunFailed(str(exc)) from None
        return {**out, **token_staleness_metrics(step, trajectories)}

    # ---------------------------------------------------------------- train --
    async def train(self, header: pb.TrainStepHeader, trajectories: list[pb.Trajectory], counts: dict[str, int],
                    timer: PhaseTimer) -> tuple[pb.StepMetrics, tuple[float, float]]:
        """Record the step's input when the run asks for it, then train it: the trainer's answer and the
        (start, end) of the train call on the monotonic clock."""
        header.num_trajectories = len(trajectories)
        if self.spec.debug.record_trajectories:
            await asyncio.to_thread(self._record_step_input, header, trajectories)
        began = time.monotonic()
        with timer.phase("train"):
            result = await self.trainer.train(header, trajectories, counts)
        span = (began, time.monotonic())
        if self.samples is not None:  # with the IW range the trainer measured on each
            weights = {w.sample_id: (w.iw_min, w.iw_max) for w in result.sample_weights}
            await asyncio.to_thread(self._keep_samples, header.step, trajectories, weights)
        return result, span

    def _record_step_input(self, header: pb.TrainStepHeader, trajectories: list[pb.Trajectory]) -> None:
        spec = self.spec
        meta = StepRecordMeta(run_id=self.run_id, step=header.step, policy_version=header.policy_version,
                              model_path=spec.model_path, seed=spec.seed,
                              trainer_config_json=spec.trainer.model_dump_json(),
                              reward_scorers_json=json.dumps(self.rewards.identity()) if self.rewards else "")
        chunks = [pb.TrainStepChunk(header=header), *(pb.TrainStepChunk(trajectory=t) for t in trajectories)]
        write_step_record(self.run_dir / "trajectories" / f"step_{header.step:06d}.pb", meta, chunks)

    def _keep_samples(self, step: int, trajectories: list[pb.Trajectory],
                      weights: dict[str, tuple[float, float]]) -> None:
        # A view for people, not run state: a disk that refuses it costs the view (logged), never the step.
        try:
            self.samples.put(step, trajectories, weights)
        except OSError as exc:
            log.warning("step %d: samples not kept: %s", step, exc)

    async def train_beside(self, header: pb.TrainStepHeader, trajectories: list[pb.Trajectory], counts: dict,
                           timer: PhaseTimer, ahead: asyncio.Future) -> tuple[pb.StepMetrics, tuple]:
        """Train the step while `ahead` (the replicas' sync and rollouts) runs. If training fails, `ahead` is
        cancelled, or its own failure logged, and training's error is raised. Then version s is written
        early (write_early)."""
        try:
            result, span = await self.train(header, trajectories, counts, timer)
        except BaseException:
            if not ahead.done():
                ahead.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await ahead
            elif not ahead.cancelled() and ahead.exception() is not None:
                # Training's error is the one raised; the sync's (or the rollout's) is logged, not lost.
                log.error("step %d: the work beside training failed as well: %r", header.step, ahead.exception())
            raise
        self.write_early(header.step)
        return result, span

    def write_early(self, step: int) -> None:
        """shared_path with K > 0: the trainer, idle until the replicas finish, writes version `step` now, and
        the replicas prefetch it while they generate, for step + 1's sync to find read and only apply it."""
        if self.fleet.shared_weights is not None and self.sync_beside_training and step < self.spec.steps:
            self.fleet.shared_weights.write_early(step, self.fleet.pool.live())

    # ------------------------------------------- eval, checkpoint, record --
    async def eval_and_checkpoint(self, step: int, timer: PhaseTimer, metrics: dict, *,
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
                await asyncio.to_thread(self.kept.drop_through, step)
        return report

    def _eval_due(self, step: int) -> bool:
        every = self.spec.eval.every
        return step == self.spec.steps or (every > 0 and step % every == 0)

    def _checkpoint_due(self, step: int) -> bool:
        every, final = self.spec.checkpoint.every, self.spec.checkpoint.final
        return (final and step == self.spec.steps) or (every > 0 and step % every == 0)

    async def record(self, step: int, metrics: dict, timings: dict, counts: dict,
                     report: EvalReport | None) -> None:
        """Record the step exactly once; a step recorded before (recomputed after a trainer loss) is
        compared with its record instead."""
        if not await self.events.record_step(step, metrics, timings, counts, report):
            await self._note_recomputed(step, metrics)
        elif self.tracking is not None:  # queued for the trackers' threads: nothing here waits on them
            self.tracking.step(step, metrics)

    async def _note_recomputed(self, step: int, metrics: dict) -> None:
        """A step recorded before the trainer was lost, computed again: say whether the bits matched."""
        recorded = await self.store.step_metrics(self.run_id, step)
        same = recorded is not None and json.dumps(recorded, sort_keys=True) == json.dumps(metrics, sort_keys=True)
        differing = sorted(k for k in metrics
                           if recorded is None or json.dumps(recorded.get(k)) != json.dumps(metrics[k]))
        await self.events.record("step_recomputed", "step recomputed",
                                 export=lambda exporter: exporter.step_recomputed(self.run_id, same),
                                 step=step, matches_recorded=same, differing_metrics=differing)
