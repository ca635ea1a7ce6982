"""Periodic evaluation: avg@k and pass@k on held-out sets, sampled through the rollout service.

An eval point (before step 1, every eval.every steps, after the last) samples
eval.k responses per problem of each set at eval.temperature (0 = greedy) and
rewards them with the task's scorer:

    avg@k  = mean over problems of (mean reward over the k samples)
    pass@k = fraction of problems with at least one correct sample

A sample is correct when its reward is at least the task's `success_reward`
(1.0: the tasks reward 1.0 for a correct answer, 0.0 otherwise). pass@k is the
plain any-correct fraction over exactly k samples, so no estimator is needed;
pass@j for j < k would need the unbiased one (`pass_at_j_unbiased`).

Sets: `heldout` is the first eval.heldout_size problems of the task's own
held-out split; eval.sets adds local JSONL files read with the task's reader.
Metrics of a set are `eval/<set>/avg@<k>` and `eval/<set>/pass@<k>`, stored
with the step's metrics. `eval_accuracy` stays the greedy accuracy on
`heldout` (avg@1 when eval is greedy with k = 1, else one more greedy pass).

Seeds: sample j of problem i of set S at step t is drawn with
derived_seed("eval", run seed, t, S, i) + j, so a rerun of the same spec
samples the same responses and reports the same numbers bit for bit. The
greedy pass sends exactly the request the greedy held-out eval always sent.
"""
from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace

from proto import lockstep_pb2 as pb
from services.coordinator.run.prompts import SamplingPlan
from services.coordinator.run_spec import RunSpec
from services.coordinator.spec_sections import HELDOUT_SET
from services.coordinator.tasks import Problem, Task, read_eval_set
from services.coordinator.tasks.episodic import EpisodicTask

EvalRollout = Callable[[list[Problem], int, SamplingPlan], Awaitable[list[tuple[int, pb.Sample]]]]
"""(problems, policy version, plan) -> every sample as (index in problems, sample); raises if any was lost."""


def avg_at_k(rewards: Sequence[Sequence[float]]) -> float:
    """Mean over problems of the mean reward of each problem's samples."""
    if not rewards or any(not r for r in rewards):
        raise ValueError("avg@k needs at least one problem and one sample per problem")
    return math.fsum(math.fsum(r) / len(r) for r in rewards) / len(rewards)


def pass_at_k(rewards: Sequence[Sequence[float]], success_reward: float) -> float:
    """Fraction of problems with at least one sample whose reward is at least `success_reward`."""
    if not rewards or any(not r for r in rewards):
        raise ValueError("pass@k needs at least one problem and one sample per problem")
    return sum(any(x >= success_reward for x in r) for r in rewards) / len(rewards)


def pass_at_j_unbiased(n: int, c: int, j: int) -> float:
    """Unbiased pass@j of one problem from n samples of which c are correct: 1 - C(n-c, j) / C(n, j)."""
    if not 0 <= c <= n or not 1 <= j <= n:
        raise ValueError(f"need 0 <= c <= n and 1 <= j <= n, got n={n}, c={c}, j={j}")
    return 1.0 - math.comb(n - c, j) / math.comb(n, j)


def metric_key(set_name: str, stat: str, k: int) -> str:
    """'eval/<set>/avg@<k>' or 'eval/<set>/pass@<k>'."""
    return f"eval/{set_name}/{stat}@{k}"


@dataclass(frozen=True)
class EvalSet:
    name: str
    problems: tuple[Problem, ...]


@dataclass(frozen=True)
class EvalSetResult:
    name: str
    k: int
    problems: int
    avg_at_k: float
    pass_at_k: float


@dataclass(frozen=True)
class EvalReport:
    greedy_accuracy: float
    sets: tuple[EvalSetResult, ...]

    def metrics(self) -> dict[str, float]:
        """The step-metrics entries: eval_accuracy and each set's avg@k / pass@k."""
        out = {"eval_accuracy": self.greedy_accuracy}
        for r in self.sets:
            out[metric_key(r.name, "avg", r.k)] = r.avg_at_k
            out[metric_key(r.name, "pass", r.k)] = r.pass_at_k
        return out


def build_eval_sets(spec: RunSpec, task: Task) -> list[EvalSet]:
    """`heldout` then the spec's extra sets, each problem id prefixed with its set's name (two files of one
    name in different directories would otherwise give the same ids). Blocking: reads the files."""
    sets = [EvalSet(HELDOUT_SET, tuple(task.split(HELDOUT_SET)[: spec.eval.heldout_size]))]
    for i, eval_set in enumerate(spec.eval.sets):
        problems = read_eval_set(spec.task.name, spec.task.options, eval_set.path, f"eval.sets.{i}.path")
        sets.append(EvalSet(eval_set.name, tuple(replace(p, problem_id=f"{eval_set.name}/{p.problem_id}")
                                                 for p in problems)))
    return sets


def greedy_plan(spec: RunSpec, stop_token_ids: Sequence[int]) -> SamplingPlan:
    """The greedy pass, requested as the greedy held-out eval always was (the rollout's temperature is sent
    but unused; seeds as for step 0's prompts)."""
    s = spec.rollout.sampling
    params = pb.SamplingParams(temperature=s.temperature, top_p=1.0, top_k=0,
                               max_new_tokens=spec.eval.max_new_tokens or s.max_new_tokens,
                               stop_token_ids=list(stop_token_ids), greedy=True)
    return SamplingPlan(params, 1, ("sample", spec.seed, 0))


def sampled_plan(spec: RunSpec, step: int, set_name: str, stop_token_ids: Sequence[int]) -> SamplingPlan:
    """eval.k samples per problem at eval.temperature, plain sampling (top_p 1, top_k off)."""
    params = pb.SamplingParams(temperature=spec.eval.temperature, top_p=1.0, top_k=0,
                               max_new_tokens=spec.eval.max_new_tokens or spec.rollout.sampling.max_new_tokens,
                               stop_token_ids=list(stop_token_ids), greedy=False)
    return SamplingPlan(params, spec.eval.k, ("eval", spec.seed, step, set_name))


def rewards_by_problem(samples: Sequence[tuple[int, pb.Sample]], rewards: Sequence[float], problems: int,
                       k: int) -> list[list[float]]:
    """Rewards grouped per problem, in sample-index order; ValueError unless every problem has k samples."""
    grouped: list[list[tuple[int, float]]] = [[] for _ in range(problems)]
    for (i, sample), reward in zip(samples, rewards, strict=True):
        grouped[i].append((sample.index, reward))
    for i, got in enumerate(grouped):
        if sorted(j for j, _ in got) != list(range(k)):
            raise ValueError(f"problem {i}: samples {sorted(j for j, _ in got)}, expected 0..{k - 1}")
    return [[r for _, r in sorted(got)] for got in grouped]


class Evaluator:
    """Runs one eval point over every set. `rollout` samples through the run's rollout replicas."""

    def __init__(self, spec: RunSpec, task: Task, sets: Sequence[EvalSet], rollout: EvalRollout,
                 decode: Callable[[pb.Sample], str], stop_token_ids: Sequence[int]) -> None:
        self.spec, self.task, self.sets = spec, task, tuple(sets)
        self._rollout, self._decode, self._stop_ids = rollout, decode, tuple(stop_token_ids)

    @property
    def greedy(self) -> bool:
        return self.spec.eval.temperature == 0

    async def evaluate(self, step: int, policy_version: int) -> EvalReport:
        """Evaluate the policy at `policy_version`, the eval point after `step` (0: before step 1)."""
        k = self.spec.eval.k
        results = []
        greedy_heldout: list[list[float]] | None = None
        for eval_set in self.sets:
            if self.greedy:
                plan = greedy_plan(self.spec, self._stop_ids)
            else:
                plan = sampled_plan(self.spec, step, eval_set.name, self._stop_ids)
            rewards = await self._rewards(eval_set.problems, policy_version, plan)
            if self.greedy and eval_set.name == HELDOUT_SET:
                greedy_heldout = rewards
            results.append(EvalSetResult(eval_set.name, k, len(rewards), avg_at_k(rewards),
                                         pass_at_k(rewards, self.task.success_reward)))
        if greedy_heldout is None:
            greedy_heldout = await self._rewards(self.sets[0].problems, policy_version,
                                                 greedy_plan(self.spec, self._stop_ids))
        return EvalReport(avg_at_k(greedy_heldout), tuple(results))

    async def _rewards(self, problems: Sequence[Problem], policy_version: int,
                       plan: SamplingPlan) -> list[list[float]]:
        problems = list(problems)
        if isinstance(self.task, EpisodicTask):
            plan = replace(plan, episode=self.task.episode_settings())
        samples = await self._rollout(problems, policy_version, plan)
        if isinstance(self.task, EpisodicTask):
            rewards = [float(s.episode_reward) for _, s in samples]
        else:
            rewards = await self.task.score([(problems[i], self._decode(s)) for i, s in samples])
        return rewards_by_problem(samples, rewards, len(problems), plan.samples_per_prompt)

