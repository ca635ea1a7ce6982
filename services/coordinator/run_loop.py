"""The run loop, short enough to read as the algorithm:

    for step in next_step(trainer version, cursor) .. steps:
        prompts   = step_problems(train, seed, step)         # deterministic
        readmit evicted replicas that answer again (after syncing their weights)
        samples   = rollout(prompts, policy_version=step-1)  # live replicas, re-dispatched on loss
        rewards   = task.score(...)                           # verifiable
        adv       = group-normalised advantages
        metrics   = trainer.train_step(trajectories)          # policy_version -> step
        sync weights to every live replica (a replica that stopped answering is evicted)
        (no replica left: wait for one to answer again, reload it at the current weights)
        eval (avg@k, pass@k per held-out set: evaluation.py) when due; checkpoint when due
        record step exactly once (Redis), export metrics
        (trainer lost: wait for it, resume it from the last checkpoint, go on from there)

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
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from contract.advantages import group_advantages
from contract.wire_tensors import array_from_proto as from_proto
from contract.wire_tensors import ids_to_proto
from proto import lockstep_pb2 as pb
from services.common.step_record import StepRecordMeta, write_step_record
from services.common.structured_logging import log_event
from services.coordinator.clients import RolloutClient, TrainerClient, TrainerUnavailable, is_unavailable
from services.coordinator.dynamic_sampling import select_informative
from services.coordinator.evaluation import Evaluator, build_eval_sets
from services.coordinator.exporter import CoordinatorExporter
from services.coordinator.prompts import SamplingPlan, group_id, step_problems
from services.coordinator.replicas import NoLiveReplica, ReplicaPool
from services.coordinator.run_spec import RunSpec
from services.coordinator.store import RunStore
from services.coordinator.tasks import Problem, Task, build_task
from services.coordinator.weight_sources import SharedPathWeights

log = logging.getLogger("lockstep.coordinator.run")


class RunCancelled(Exception):
    pass


class RunFailed(Exception):
    pass


def next_step(trainer_version: int, cursor: int) -> int:
    """The step to run next, from the trainer's policy version and the last recorded step.

    The trainer may be behind the cursor (it came back from an older
    checkpoint: recompute from there), at it, or one step ahead (it applied a
    step that was never recorded: replay it). Further ahead is inconsistent."""
    if trainer_version > cursor + 1:
        raise RunFailed(f"trainer holds policy version {trainer_version}, but only {cursor} steps are recorded")
    return min(trainer_version, cursor) + 1


@dataclass
class Shard:
    """Prompts sent to one replica in one Generate call."""

    problems: list[Problem]
    first_index: int  # index of problems[0] within the step


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
        crash_after_train_step: int = 0,
        *,
        trainer_recovery_timeout_s: float = 0.0,
        replica_recovery_timeout_s: float = 0.0,
    ) -> None:
        self.run_id, self.spec, self.store = run_id, spec, store
        self.replicas, self.trainer, self.exporter = ReplicaPool(rollouts), trainer, exporter
        self.run_dir = run_dir
        self.generate_retries = generate_retries
        self.crash_after_train_step = crash_after_train_step
        self.trainer_recovery_timeout_s = trainer_recovery_timeout_s
        self.replica_recovery_timeout_s = replica_recovery_timeout_s
        self._replica_recovery = asyncio.Lock()  # concurrent shards wait for one recovery, not one each
        self._reloads: dict[str, int] = {}  # replica address -> times it was found restarted and reloaded
        self._shared_weights = (SharedPathWeights(trainer, run_id, run_dir / "weights")
                                if spec.rollout.weight_sync == "shared_path" else None)
        self.task: Task = build_task(spec.task.name, spec.task.options)
        for split in ("train", "heldout"):  # built now, in the constructing thread, not at step 1 on the event loop
            self.task.split(split)
        self.tokenizer = tokenizer_loader(spec.model_path)
        self._prompt_ids: dict[str, list[int]] = {}
        self.evaluator = Evaluator(spec, self.task, build_eval_sets(spec, self.task), self._eval_rollout,
                                   self._decode, self._stop_ids())

    # ------------------------------------------------------------------ loop --
    async def run(self) -> None:
        try:
            await self._run()
        finally:
            await asyncio.to_thread(self.task.close)

    async def _run(self) -> None:
        spec = self.spec
        run = await self.store.get_run(self.run_id)
        assert run is not None
        if not await self.store.set_status(self.run_id, "running"):
            raise RunCancelled(self.run_id)  # cancelled (or ended) before the driver started
        try:
            trainer_version = await self._configure_services()
        except TrainerUnavailable as exc:
            trainer_version = await self._recover_trainer(run.step + 1, exc)
        if await self.store.get_aux(self.run_id, "eval_initial") is None:
            report = await self.evaluator.evaluate(step=0, policy_version=trainer_version)
            await self.store.set_aux(self.run_id, "eval_initial", {"accuracy": report.greedy_accuracy, "step": 0,
                                                                   "metrics": report.metrics()})
            self.exporter.on_eval(self.run_id, report)
        cursor = run.step
        while (step := next_step(trainer_version, cursor)) <= spec.steps:
            await self._check_cancelled()
            try:
                await self._readmit_replicas(step, trainer_version)
                await self._one_step(step, trainer_version)
            except NoLiveReplica as exc:
                raise RunFailed(f"step {step}: {exc}") from None
            except TrainerUnavailable as exc:
                trainer_version = await self._recover_trainer(step, exc)
                continue
            trainer_version, cursor = step, max(cursor, step)
        if not await self.store.set_status(self.run_id, "completed"):
            raise RunCancelled(self.run_id)  # cancelled while the last step ran
        log_event(log, "run completed", run_id=self.run_id, steps=spec.steps)

    async def _one_step(self, step: int, trainer_version: int) -> None:
        spec, t0 = self.spec, time.monotonic()
        timings: dict[str, float] = {}
        header = pb.TrainStepHeader(run_id=self.run_id, step=step, policy_version=step - 1)
        counts = {"trajectories_trained": 0, "trajectories_dropped": 0}
        if trainer_version == step:
            # The trainer applied this step before the previous coordinator died:
            # replay its recorded metrics instead of training twice.
            result = await self.trainer.train_step(header, [])
            if not result.replayed:
                raise RunFailed(f"step {step}: trainer at version {step} did not replay the step")
            pending = await self.store.get_aux(self.run_id, "pending_step")
            if pending is None or pending["step"] != step:
                raise RunFailed(f"step {step}: replayed by the trainer but its trajectory counts were not recorded")
            counts = pending["counts"]
            await self.store.add_event(self.run_id, "step_replayed", step=step)
        else:
            if trainer_version != step - 1:
                raise RunFailed(f"step {step}: trainer holds policy version {trainer_version}, expected {step - 1}")
            problems = step_problems(self.task.split("train"), seed=spec.seed, step=step,
                                     count=spec.rollout.prompts_per_step)
            tr = time.monotonic()
            samples, dropped = await self._rollout(problems, step=step, policy_version=step - 1)
            timings["rollout"] = time.monotonic() - tr
            tr = time.monotonic()
            trajectories = await self._score(problems, samples, step)
            timings["reward"] = time.monotonic() - tr
            if not trajectories:
                raise RunFailed(f"step {step}: every trajectory was dropped ({dropped} samples)")
            counts = {"trajectories_trained": len(trajectories), "trajectories_dropped": dropped}
            if spec.rollout.dynamic_sampling.enabled:
                tr = time.monotonic()
                trajectories, counts = await self._informative_groups(step, trajectories, dropped)
                timings["dynamic_sampling"] = time.monotonic() - tr
            header.num_trajectories = len(trajectories)
            # Written before the trainer applies the step, so a replay after a
            # coordinator crash still accounts for every trajectory exactly once.
            await self.store.set_aux(self.run_id, "pending_step", {"step": step, "counts": counts})
            if spec.debug.record_trajectories:
                await asyncio.to_thread(self._record_step_input, header, trajectories)
            tr = time.monotonic()
            result = await self.trainer.train_step(header, trajectories)
            timings["train"] = time.monotonic() - tr
            if step == self.crash_after_train_step:
                os._exit(137)  # fault injection: die between "applied" and "recorded"
        tr = time.monotonic()
        await self._sync_weights(step)
        timings["weight_sync"] = time.monotonic() - tr
        metrics = dict(result.metrics)
        metrics.update(counts)
        report = None
        if self._eval_due(step):
            tr = time.monotonic()
            report = await self.evaluator.evaluate(step=step, policy_version=step)
            metrics.update(report.metrics())
            timings["eval"] = time.monotonic() - tr
        if self._checkpoint_due(step):
            tr = time.monotonic()
            path = str(self.run_dir / "checkpoints" / f"step_{step:06d}")
            await self.trainer.save_checkpoint(self.run_id, path)
            # What a restarted trainer resumes from (the coordinator need not see the trainer's disk).
            await self.store.set_aux(self.run_id, "last_checkpoint", {"step": step, "path": path})
            timings["checkpoint"] = time.monotonic() - tr
        timings["total"] = time.monotonic() - t0
        if await self.store.record_step(self.run_id, step, metrics, timings):
            self.exporter.on_step(self.run_id, step, metrics, timings)
            if report is not None:
                self.exporter.on_eval(self.run_id, report)
            self.exporter.trajectories(self.run_id, "trained", counts["trajectories_trained"])
            self.exporter.trajectories(self.run_id, "dropped", counts["trajectories_dropped"])
            for outcome in ("filtered", "surplus"):
                self.exporter.trajectories(self.run_id, outcome, counts.get(f"trajectories_{outcome}", 0))
        else:
            await self._note_recomputed(step, metrics)
        log_event(log, "step recorded", run_id=self.run_id, step=step,
                  reward_mean=metrics.get("reward_mean"), iw_mean=metrics.get("iw_mean"),
                  eval_accuracy=metrics.get("eval_accuracy"), seconds=round(timings["total"], 3))

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
            samples, lost = await self._rollout(extra, step=step, policy_version=step - 1, first_index=r * want)
            dropped += lost
            rounds.append(await self._score(extra, samples, step))
            selection = select_informative(rounds, want)
        kept = selection.kept
        if selection.groups < want:
            await self.store.add_event(self.run_id, "dynamic_sampling_short", step=step, groups=selection.groups,
                                       wanted=want, rounds=len(rounds))
            if not kept:  # no signal anywhere: the first round's batch, whose advantages are all zero
                kept = first
        counts = {"trajectories_trained": len(kept), "trajectories_dropped": dropped,
                  "trajectories_filtered": selection.filtered - (len(first) if kept is first else 0),
                  "trajectories_surplus": selection.surplus, "rollout_rounds": len(rounds)}
        return kept, counts

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
        await self.store.add_event(self.run_id, "step_recomputed", step=step, matches_recorded=same,
                                   differing_metrics=differing)
        self.exporter.step_recomputed(self.run_id, same)
        log_event(log, "step recomputed", run_id=self.run_id, step=step, matches_recorded=same,
                  differing_metrics=differing)

    # ------------------------------------------------------------- trainer --
    async def _recover_trainer(self, step: int, lost: TrainerUnavailable) -> int:
        """Wait for the trainer to answer again, re-configure it from the last checkpoint; its version."""
        timeout = self.trainer_recovery_timeout_s
        await self.store.add_event(self.run_id, "trainer_lost", step=step, reason=str(lost),
                                   recovery_timeout_s=timeout)
        log_event(log, "trainer lost", run_id=self.run_id, step=step, reason=str(lost), recovery_timeout_s=timeout)
        if timeout <= 0:
            raise RunFailed(f"step {step}: {lost} (trainer_recovery_timeout_s is 0)")
        deadline, delay = time.monotonic() + timeout, 0.5
        while True:
            await self._check_cancelled()
            try:
                await self.trainer.health()
                version = await self._configure_services()
                break
            except TrainerUnavailable as exc:
                if time.monotonic() + delay > deadline:
                    raise RunFailed(f"step {step}: trainer did not come back within {timeout:.0f} s ({exc})") from None
                await asyncio.sleep(delay)
                delay = min(2 * delay, 5.0)
        checkpoint = await self.store.get_aux(self.run_id, "last_checkpoint")
        await self.store.add_event(self.run_id, "trainer_recovered", step=step, policy_version=version,
                                   resumed_from=checkpoint["path"] if checkpoint else "")
        self.exporter.trainer_recovered(self.run_id)
        log_event(log, "trainer recovered", run_id=self.run_id, step=step, policy_version=version)
        return version

    # ------------------------------------------------------------- phases --
    async def _configure_services(self) -> int:
        spec = self.spec
        # A trainer that still holds the run keeps its state; one that does not
        # (restarted) resumes from the last checkpoint, or starts from the model.
        checkpoint = await self.store.get_aux(self.run_id, "last_checkpoint")
        info = await self.trainer.configure(
            self.run_id, spec.model_path, spec.seed, spec.trainer.model_dump_json(),
            resume_checkpoint=checkpoint["path"] if checkpoint else "",
        )
        version = info.policy_version
        for client in self.replicas.all():
            try:
                await self._bring_up_to_date(client, version)
            except Exception as exc:
                if not is_unavailable(exc):
                    raise
                await self._evict(client, step=0, reason=f"unreachable at run start ({exc.code()})")
        try:
            await self._await_replica(0, version)
        except NoLiveReplica as exc:
            raise RunFailed(str(exc)) from None
        live = self.replicas.live()
        self._export_replicas()
        await self.store.add_event(self.run_id, "services_configured", policy_version=version,
                                   rollouts=[c.address for c in live])
        return version

    async def _bring_up_to_date(self, client: RolloutClient, version: int) -> None:
        """Load this run's model on `client` if it holds another, then have it pull `version` from the
        trainer unless it holds it already."""
        rinfo = await client.info()
        # Reload when the replica holds another run, nothing, or a version ahead
        # of the trainer (which came back from an older checkpoint): engines
        # refuse to step a version back, so it starts again from the model.
        if rinfo.run_id != self.run_id or not 0 <= rinfo.policy_version <= version:
            engine_json = json.dumps({"engine": self.spec.rollout.engine, **self.spec.rollout.engine_options})
            await client.load_model(self.run_id, self.spec.model_path, 0, engine_json)
            rinfo = await client.info()
        if rinfo.policy_version != version:
            await self._pull_weights(client, version)

    async def _pull_weights(self, client: RolloutClient, version: int) -> pb.UpdateWeightsResponse:
        """The replica streams `version` from the trainer itself (SyncWeights), or reads the directory the
        trainer wrote (shared_path): the weights' bytes never pass through the coordinator."""
        if self._shared_weights is not None:
            got = await self._shared_weights.load(client, version)
        else:
            got = await client.sync_weights(self.run_id, version, self.trainer.weights_address)
        if got.policy_version != version:
            raise RunFailed(f"replica {client.address} reports version {got.policy_version} after sync, expected {version}")
        return got

    async def _evict(self, client: RolloutClient, *, step: int, reason: str) -> None:
        if self.replicas.evict(client):
            await self.store.add_event(self.run_id, "replica_evicted", step=step, replica=client.address,
                                       reason=reason, live=len(self.replicas.live()))
            log_event(log, "rollout replica evicted", run_id=self.run_id, step=step, replica=client.address,
                      reason=reason, live=len(self.replicas.live()))
        self._export_replicas()

    def _export_replicas(self) -> None:
        self.exporter.replicas_live(self.run_id, len(self.replicas.live()), len(self.replicas.all()))

    async def _readmit_replicas(self, step: int, version: int) -> None:
        """Probe each evicted replica; one that answers is brought to `version` and put back in service."""
        for client in self.replicas.evicted():
            try:
                await client.health()
                await self._bring_up_to_date(client, version)
            except Exception as exc:
                if is_unavailable(exc):
                    continue  # still down: probed again before the next step
                raise
            self.replicas.readmit(client)
            await self.store.add_event(self.run_id, "replica_readmitted", step=step, replica=client.address,
                                       policy_version=version, live=len(self.replicas.live()))
            log_event(log, "rollout replica readmitted", run_id=self.run_id, step=step, replica=client.address)
        self._export_replicas()

    async def _await_replica(self, step: int, version: int) -> None:
        """With no live replica, wait up to replica_recovery_timeout_s for an evicted one to answer again
        (restarted by its supervisor), bring it to `version` and readmit it; NoLiveReplica if none does."""
        async with self._replica_recovery:
            if self.replicas.live():
                return
            timeout = self.replica_recovery_timeout_s
            deadline, delay = time.monotonic() + timeout, 0.5
            while True:
                await self._check_cancelled()
                await self._readmit_replicas(step, version)
                if self.replicas.live():
                    return
                if time.monotonic() + delay > deadline:
                    self.replicas.require_live(f"step {step} (waited {timeout:.0f} s for one to come back)")
                await asyncio.sleep(delay)
                delay = min(2 * delay, 5.0)

    async def _reload_if_restarted(self, client: RolloutClient, info: pb.ServiceInfo | None, *, step: int,
                                   version: int) -> bool:
        """A replica that answers but holds no model at all was restarted since it last served the run:
        load the run's model and weights at `version`. False (nothing done) for one holding a model.
        `info` None: ask the replica (under the recovery lock, so concurrent shards reload it once)."""
        async with self._replica_recovery:
            info = info if info is not None else await client.info()
            if info.run_id or info.policy_version >= 0:
                return False
            await self._bring_up_to_date(client, version)
            self._reloads[client.address] = self._reloads.get(client.address, 0) + 1
        await self.store.add_event(self.run_id, "replica_reloaded", step=step, replica=client.address,
                                   policy_version=version)
        log_event(log, "restarted rollout replica reloaded", run_id=self.run_id, step=step,
                  replica=client.address, policy_version=version)
        return True

    def _training_plan(self, step: int) -> SamplingPlan:
        s = self.spec.rollout.sampling
        params = pb.SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                                   max_new_tokens=s.max_new_tokens, stop_token_ids=self._stop_ids(), greedy=False)
        return SamplingPlan(params, self.spec.rollout.samples_per_prompt, ("sample", self.spec.seed, step))

    async def _rollout(self, problems: list[Problem], *, step: int, policy_version: int,
                       plan: SamplingPlan | None = None,
                       first_index: int = 0) -> tuple[list[tuple[int, pb.Sample]], int]:
        """Samples as (index in `problems`, sample) in problem order; returns also the dropped count.

        `plan` None: the step's training samples. `first_index` numbers the problems within the step (group
        ids and sampling seeds derive from it), so further rounds of one step never reuse a group id or a seed."""
        plan = self._training_plan(step) if plan is None else plan
        await self._await_replica(step, policy_version)
        n = len(self.replicas.live())
        size = -(-len(problems) // n)
        shards = [Shard(problems[i:i + size], first_index + i) for i in range(0, len(problems), size)]
        samples_per_prompt = plan.samples_per_prompt
        self.exporter.queue_depth(self.run_id, len(problems))
        results = await asyncio.gather(*(
            self._generate_shard(shard, k, step=step, policy_version=policy_version, plan=plan)
            for k, shard in enumerate(shards)
        ))
        self.exporter.queue_depth(self.run_id, 0)
        out: list[tuple[int, pb.Sample]] = []
        dropped = 0
        for shard, res in zip(shards, results):
            if res is None:
                dropped += len(shard.problems) * samples_per_prompt
                continue
            gids = {group_id(step, shard.first_index + j): shard.first_index - first_index + j
                    for j in range(len(shard.problems))}
            for s in res.samples:
                out.append((gids[s.group_id], s))
        return out, dropped

    async def _generate_shard(self, shard: Shard, replica: int, *, step: int, policy_version: int,
                              plan: SamplingPlan) -> pb.GenerateResponse | None:
        prompts = [
            pb.Prompt(group_id=group_id(step, shard.first_index + j),
                      token_ids=ids_to_proto(self._encode(p)), seed=plan.seed(shard.first_index + j))
            for j, p in enumerate(shard.problems)
        ]
        samples_per_prompt = plan.samples_per_prompt
        request = pb.GenerateRequest(
            run_id=self.run_id, step=step, policy_version=policy_version, prompts=prompts,
            samples_per_prompt=samples_per_prompt, sampling=plan.params,
        )
        attempts = self.generate_retries + 1
        for attempt in range(attempts):
            await self._await_replica(step, policy_version)
            candidates = self.replicas.live()
            client = candidates[(replica + attempt) % len(candidates)]
            reloads = self._reloads.get(client.address, 0)
            try:
                try:
                    return await client.generate(request)
                except Exception as exc:
                    # A refusal from a replica that lost its model (restarted between two calls) is
                    # answered by reloading it -- here, or by a concurrent shard meanwhile; any other
                    # refusal fails the run.
                    if is_unavailable(exc):
                        raise
                    if not await self._reload_if_restarted(client, None, step=step, version=policy_version) \
                            and self._reloads.get(client.address, 0) == reloads:
                        raise
                    continue
            except Exception as exc:
                if not is_unavailable(exc):
                    raise
                await self._evict(client, step=step, reason=f"generate failed ({exc.code()})")
                await self.store.add_event(self.run_id, "generate_redispatched", step=step, replica=client.address,
                                           attempt=attempt + 1, reason=str(exc.code()))
                log_event(log, "rollout replica unavailable; re-dispatching", run_id=self.run_id, step=step,
                          replica=client.address, attempt=attempt + 1)
                await asyncio.sleep(min(2.0 ** attempt, 10.0))
        await self.store.add_event(self.run_id, "trajectories_dropped", step=step,
                                   count=len(shard.problems) * samples_per_prompt,
                                   reason=f"rollout unavailable after {attempts} attempts")
        return None

    async def _score(self, problems: list[Problem], samples: list[tuple[int, pb.Sample]],
                     step: int) -> list[pb.Trajectory]:
        rewards = await self.task.score([(problems[i], self._decode(s)) for i, s in samples])
        advantages = group_advantages(rewards, [s.group_id for _, s in samples],
                                      std_normalization=self.spec.trainer.advantage_std_normalization)
        return [
            pb.Trajectory(
                run_id=self.run_id, step=step, policy_version=step - 1, group_id=s.group_id,
                sample_id=s.sample_id, prompt_token_ids=ids_to_proto(self._encode(problems[i])),
                response_token_ids=s.response_token_ids, rollout_logprobs=s.logprobs,
                reward=float(r), advantage=float(a), finish_reason=s.finish_reason,
            )
            for (i, s), r, a in zip(samples, rewards, advantages)
        ]

    async def _sync_weights(self, version: int) -> None:
        stale = []
        for client in self.replicas.live():
            try:
                info = await client.info()
                if not await self._reload_if_restarted(client, info, step=version, version=version) \
                        and info.policy_version != version:
                    stale.append(client)
            except Exception as exc:
                if not is_unavailable(exc):
                    raise
                await self._evict(client, step=version, reason=f"unreachable before weight sync ({exc.code()})")
        if stale:
            await self._sync_replicas(stale, version)
        await self._await_replica(version, version)

    async def _sync_replicas(self, clients: Sequence[RolloutClient], version: int) -> None:
        """Every stale replica pulls `version` at once; one that is unreachable is evicted. Each verified
        its stream against the digest the trainer computed while sending it; replicas that report
        different digests for one version did not get the same weights, and the run fails."""
        results = await asyncio.gather(*(self._pull_weights(c, version) for c in clients), return_exceptions=True)
        synced: dict[str, pb.UpdateWeightsResponse] = {}
        for c, r in zip(clients, results):
            if isinstance(r, BaseException):
                if not is_unavailable(r):
                    raise r
                await self._evict(c, step=version, reason=f"weight sync failed ({r.code()})")
            else:
                synced[c.address] = r
        digests = {address: r.total_sha256 for address, r in synced.items()}
        if len(set(digests.values())) > 1:
            raise RunFailed(f"step {version}: replicas report different weight digests for one version: {digests}")
        if synced:
            first = next(iter(synced.values()))
            await self.store.add_event(self.run_id, "weights_synced", policy_version=version,
                                       digest=first.total_sha256, bytes=first.bytes, replicas=sorted(synced))

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
        every = self.spec.checkpoint.every
        return step == self.spec.steps or (every > 0 and step % every == 0)

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


