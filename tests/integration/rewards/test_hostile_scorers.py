"""Hostile scorers through the real stack: a scorer replica answering NaN, infinity, out-of-range scores,
garbage, hanging past the deadline, or killed mid-step. No such answer is read as a reward: the item is
retried up to reward.max_attempts, then dropped from its step and counted by reason; the counters equal what
the hostile scorer logged it injected, nothing unscored or twice is trained, and a step past
reward.max_failed_fraction fails the run naming the reasons. Deadlines are set short here (reward.timeout_s):
the hang is served late, never waited out in full.
"""
from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import httpx

from tests.integration.rewards.conftest import injected, write_faults
from tests.integration.rewards.test_reward_runs import base_spec, ledger, run_to_end, trained

REASON = {"nan": "non_finite", "inf": "non_finite", "out_of_range": "out_of_range", "garbage": "malformed",
          "hang": "timeout", "die": "scorer_unavailable"}


def rm_reward(reward_stack, replicas: list[str], **settings) -> dict:
    return {"kind": "reward_model", "reward_model": {"model_path": str(reward_stack.reward_model),
                                                    "replicas": replicas,
                                                    "score_range": {"low": -100, "high": 100}}, **settings}


def counters(api_url: str, run_id: str, name: str) -> Counter:
    text = httpx.get(f"{api_url}/metrics", timeout=10).text
    out: Counter = Counter()
    for labels, value in re.findall(rf"^lockstep_reward_{name}_total{{([^}}]*)}} (\S+)$", text, re.M):
        fields = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        if fields["run_id"] == run_id:
            out[fields["reason"]] += int(float(value))
    return out


def test_faults_are_retried_dropped_and_counted_as_injected(reward_stack, warm_model, tmp_path):
    stack, faults = reward_stack.stack, reward_stack.hostile_faults
    write_faults(faults, {
        "s1-g0/0": {"kind": "nan", "times": 2},           # both attempts: dropped, non_finite
        "s1-g0/1": {"kind": "out_of_range", "times": 1},  # the retry is scored
        "s1-g1/0": {"kind": "garbage", "times": 2},       # dropped, malformed
        "s1-g1/1": {"kind": "inf", "times": 1},
        "s2-g0/2": {"kind": "hang", "times": 1},          # past the deadline once, then scored
    }, hang_s=6.0)
    reward = rm_reward(reward_stack, [reward_stack.scorers[1]], batch_size=1, max_attempts=2, timeout_s=2.0,
                       max_failed_fraction=0.25)
    run, steps = run_to_end(stack, base_spec(warm_model.path, reward))
    assert run["status"] == "completed", run
    log = injected(faults, run["id"])
    assert Counter(r["kind"] for r in log) == {"nan": 2, "garbage": 2, "out_of_range": 1, "inf": 1, "hang": 1}
    assert counters(stack.api_url, run["id"], "failures") == Counter(REASON[r["kind"]] for r in log)
    assert counters(stack.api_url, run["id"], "dropped") == {"non_finite": 1, "malformed": 1}
    for step, dropped in ((1, {"s1-g0/0", "s1-g1/0"}), (2, set())):
        _, trajectories = trained(stack, run["id"], step, tmp_path)
        ids = [t.sample_id for t in trajectories]
        assert len(ids) == len(set(ids)) == 8 - len(dropped)  # nothing twice, nothing unscored
        assert not set(ids) & dropped
        _, rows = ledger(stack, run["id"], step)
        for sample_id in dropped:
            assert rows[sample_id]["reward"] is None and rows[sample_id]["parts"]["reward_model"]["attempts"] == 2
        for t in trajectories:  # a retried sample's reward is its successful attempt's score
            assert t.reward == rows[t.sample_id]["parts"]["reward_model"]["score"]
        m = steps[step - 1]["metrics"]
        assert m["reward_dropped"] == len(dropped) and m["trajectories_trained"] == 8 - len(dropped), m
    assert rows["s2-g0/2"]["parts"]["reward_model"]["attempts"] == 2


def test_a_step_past_the_failure_bound_fails_the_run_naming_the_reasons(reward_stack, warm_model):
    stack, faults = reward_stack.stack, reward_stack.hostile_faults
    write_faults(faults, {f"s1-g{g}/{j}": {"kind": "nan", "times": 9} for g, j in ((0, 0), (0, 1), (1, 2))})
    reward = rm_reward(reward_stack, [reward_stack.scorers[1]], batch_size=4, max_attempts=3,
                       max_failed_fraction=0.25)
    run, steps = run_to_end(stack, base_spec(warm_model.path, reward))
    assert run["status"] == "failed" and steps == [], run
    assert "step 1: 3 of 8 samples got no reward after 3 attempts (non_finite: 3)" in run["error"], run["error"]
    assert "reward.max_failed_fraction 0.25" in run["error"]
    assert counters(stack.api_url, run["id"], "failures") == {"non_finite": 9}
    assert counters(stack.api_url, run["id"], "dropped") == {"non_finite": 3}


def test_a_scorer_killed_mid_step_is_evicted_and_its_items_scored_elsewhere(reward_stack, warm_model, tmp_path):
    stack, faults = reward_stack.stack, reward_stack.victim_faults
    victim, healthy = reward_stack.scorers[2], reward_stack.scorers[0]
    write_faults(faults, {"s1-g0/1": {"kind": "die", "times": 1}})
    reward = rm_reward(reward_stack, [victim, healthy], batch_size=4, max_attempts=2)
    run, steps = run_to_end(stack, base_spec(warm_model.path, reward, steps=1))
    assert run["status"] == "completed", run
    log = injected(faults, run["id"])
    assert sorted(r["item_id"] for r in log) == ["s1-g0/0", "s1-g0/1", "s1-g0/2", "s1-g0/3"]
    assert counters(stack.api_url, run["id"], "failures") == {"scorer_unavailable": 4}
    assert counters(stack.api_url, run["id"], "dropped") == {}
    assert not stack.scorer_replicas[2].alive()
    _, trajectories = trained(stack, run["id"], 1, tmp_path)
    _, rows = ledger(stack, run["id"], 1)
    assert len({t.sample_id for t in trajectories}) == 8
    for item in ("s1-g0/0", "s1-g0/1", "s1-g0/2", "s1-g0/3"):  # retried on the healthy replica
        assert rows[item]["parts"]["reward_model"]["replica"] == healthy
        assert rows[item]["parts"]["reward_model"]["attempts"] == 2
