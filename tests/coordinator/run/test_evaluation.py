"""The pure parts of periodic eval: avg@k, pass@k, the unbiased pass@j estimator, grouping, sampling plans,
and the arithmetic task's eval-set reader."""
from __future__ import annotations

import math

import pytest

from proto import lockstep_pb2 as pb
from services.coordinator.run.evaluation import (
    EvalReport,
    EvalSetResult,
    avg_at_k,
    greedy_plan,
    metric_key,
    pass_at_j_unbiased,
    pass_at_k,
    rewards_by_problem,
    sampled_plan,
)
from services.coordinator.run.prompts import derived_seed
from services.coordinator.run_spec import RolloutSpec, RunSpec
from services.coordinator.spec_sections import EvalSpec
from services.coordinator.tasks.arithmetic import ArithmeticConfig, ArithmeticTask, parse_eval_lines

# Three problems, four samples each.
REWARDS = [[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]]


def test_avg_at_k_is_the_mean_over_problems_of_the_mean_over_samples():
    assert avg_at_k(REWARDS) == (0.5 + 0.0 + 1.0) / 3 == 0.5
    # Means per problem first: a problem's weight does not depend on anything but being one problem.
    assert avg_at_k([[1.0], [0.0, 0.0, 0.0, 1.0]]) == (1.0 + 0.25) / 2
    with pytest.raises(ValueError):
        avg_at_k([])
    with pytest.raises(ValueError):
        avg_at_k([[1.0], []])


def test_pass_at_k_counts_problems_with_a_correct_sample():
    assert pass_at_k(REWARDS, 1.0) == 2 / 3
    # "Correct" is a reward at least the task's success reward, not any positive reward.
    assert pass_at_k([[0.5, 0.0], [0.0, 0.0]], 1.0) == 0.0
    assert pass_at_k([[0.5, 0.0], [0.0, 0.0]], 0.5) == 0.5
    with pytest.raises(ValueError):
        pass_at_k([], 1.0)


def test_unbiased_pass_at_j_against_hand_computed_values():
    assert pass_at_j_unbiased(4, 1, 2) == 1 - 3 / 6 == 0.5          # C(3,2)/C(4,2)
    assert math.isclose(pass_at_j_unbiased(5, 2, 2), 1 - 3 / 10)   # C(3,2)/C(5,2)
    assert pass_at_j_unbiased(4, 1, 1) == 0.25                     # j = 1: the fraction correct
    assert pass_at_j_unbiased(4, 0, 4) == 0.0
    # j = n: any-correct, which is what pass@k reports for exactly k samples.
    assert [pass_at_j_unbiased(4, int(sum(r)), 4) for r in REWARDS] == [1.0, 0.0, 1.0]
    for bad in ((4, 5, 2), (4, 1, 0), (4, 1, 5)):
        with pytest.raises(ValueError):
            pass_at_j_unbiased(*bad)


def _sample(index: int) -> pb.Sample:
    return pb.Sample(index=index)


def test_rewards_are_grouped_per_problem_in_sample_order_and_must_be_complete():
    samples = [(1, _sample(1)), (0, _sample(0)), (1, _sample(0)), (0, _sample(1))]
    assert rewards_by_problem(samples, [0.1, 0.2, 0.3, 0.4], 2, 2) == [[0.2, 0.4], [0.3, 0.1]]
    with pytest.raises(ValueError, match=r"problem 0: samples \[0\]"):
        rewards_by_problem(samples[:3], [0.1, 0.2, 0.3], 2, 2)
    with pytest.raises(ValueError):
        rewards_by_problem(samples, [0.1], 2, 2)  # a reward for every sample


def test_report_metric_keys():
    report = EvalReport(0.25, (EvalSetResult("heldout", 4, 8, 0.125, 0.5), EvalSetResult("amc", 4, 2, 0.0, 0.0)))
    assert report.metrics() == {"eval_accuracy": 0.25, "eval/heldout/avg@4": 0.125, "eval/heldout/pass@4": 0.5,
                                "eval/amc/avg@4": 0.0, "eval/amc/pass@4": 0.0}
    assert metric_key("math500", "pass", 16) == "eval/math500/pass@16"


def _spec(**eval_) -> RunSpec:
    # Only what the plans read (a full RunSpec needs a model directory on disk).
    return RunSpec.model_construct(seed=9, rollout=RolloutSpec(), eval=EvalSpec(**eval_))


def test_greedy_plan_is_the_request_the_greedy_heldout_eval_always_sent():
    spec = _spec()
    s = spec.rollout.sampling
    plan = greedy_plan(spec, [2])
    assert plan.params == pb.SamplingParams(temperature=s.temperature, top_p=1.0, top_k=0,
                                            max_new_tokens=s.max_new_tokens, stop_token_ids=[2], greedy=True)
    assert plan.samples_per_prompt == 1
    assert [plan.seed(i) for i in range(3)] == [derived_seed("sample", 9, 0, i) for i in range(3)]
    assert greedy_plan(_spec(max_new_tokens=3), [2]).params.max_new_tokens == 3


def test_sampled_plan_seeds_depend_on_run_seed_step_set_and_problem():
    spec = _spec(k=4, temperature=0.7, max_new_tokens=5)
    plan = sampled_plan(spec, 10, "amc", [2])
    assert plan.samples_per_prompt == 4 and not plan.params.greedy
    assert math.isclose(plan.params.temperature, 0.7, rel_tol=1e-7) and plan.params.max_new_tokens == 5
    assert (plan.params.top_p, plan.params.top_k) == (1.0, 0)
    assert plan.seed(3) == derived_seed("eval", 9, 10, "amc", 3) == sampled_plan(spec, 10, "amc", [2]).seed(3)
    seeds = [plan.seed(3), plan.seed(4), sampled_plan(spec, 11, "amc", [2]).seed(3),
             sampled_plan(spec, 10, "aime", [2]).seed(3),
             sampled_plan(RunSpec.model_construct(seed=10, rollout=RolloutSpec(), eval=spec.eval), 10, "amc",
                          [2]).seed(3)]
    assert len(set(seeds)) == len(seeds)


def test_arithmetic_eval_set_lines_are_written_as_the_task_writes_its_own():
    cfg = ArithmeticConfig(reverse_answer=True)
    problems = parse_eval_lines(['{"a": 12, "b": 39}', "", '{"b": 0, "a": 7}'], "/d/extra.jsonl", "f", cfg)
    assert [(p.prompt, p.answer) for p in problems] == [("12+39=", "15"), ("7+0=", "7")]
    assert len({p.problem_id for p in problems}) == 2
    task = ArithmeticTask(cfg)
    assert task.reward(problems[0], "15") == 1.0 and task.reward(problems[0], "51") == 0.0


@pytest.mark.parametrize("line,reason", [
    ("{nope", "line 1 of /d/x.jsonl is not JSON"),
    ("[1, 2]", "exactly the keys 'a' and 'b'"),
    ('{"a": 1, "b": 2, "c": 3}', "exactly the keys 'a' and 'b'"),
    ('{"a": true, "b": 2}', "'a' must be an integer"),
    ('{"a": 1, "b": -2}', "'b' must be an integer"),
    ('{"a": 1, "b": 2.0}', "'b' must be an integer"),
    ('{"a": 1000000000, "b": 2}', "'a' must be an integer"),
])
def test_arithmetic_eval_set_refuses_bad_lines_naming_the_field_and_line(line, reason):
    with pytest.raises(ValueError) as exc:
        parse_eval_lines([line], "/d/x.jsonl", "eval.sets.0.path", ArithmeticConfig())
    assert str(exc.value).startswith("eval.sets.0.path: ") and reason in str(exc.value)
    with pytest.raises(ValueError, match="holds no problems"):
        parse_eval_lines(["", " "], "/d/x.jsonl", "eval.sets.0.path", ArithmeticConfig())
