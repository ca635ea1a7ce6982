"""Periodic eval (avg@k, pass@k) through the real stack, on the demo's warm-started policy (about a quarter of
its greedy answers right, so sampled eval numbers are neither all 0 nor all 1).

Two runs of one spec (eval.k 4 at temperature 1.0 on the held-out split and an extra JSONL set) report the
same eval numbers bit for bit; the REST metrics and the coordinator's /metrics agree on them.
"""
from __future__ import annotations

import json

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.slow
K, HELDOUT, STEPS = 4, 8, 2
EXTRA_PAIRS = [(12, 34), (50, 50), (23, 45), (71, 18), (36, 27), (88, 11), (40, 59), (15, 62)]


def eval_keys(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if k.startswith("eval/") or k == "eval_accuracy"}


def scraped(api_url: str, name: str, run_id: str) -> dict[tuple[str, str], float]:
    """(set, k) -> value of gauge `name` for `run_id`, from the coordinator's /metrics."""
    text = httpx.get(f"{api_url}/metrics", timeout=10).text
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels.get("run_id") == run_id:
                out[(sample.labels["set"], sample.labels["k"])] = sample.value
    return out


def test_avg_and_pass_at_k_in_rest_and_prometheus_and_bitwise_on_rerun(warm_model, one_replica_stack, tmp_path):
    extra = tmp_path / "extra.jsonl"
    extra.write_text("".join(json.dumps({"a": a, "b": b}) + "\n" for a, b in EXTRA_PAIRS))

    def spec(name: str) -> dict:
        return {
            "name": name, "model_path": str(warm_model.path), "seed": 3, "steps": STEPS,
            "task": {"name": "arithmetic", "options": {"seed": 0, "digits": 2, "heldout_size": 200}},
            "rollout": {"prompts_per_step": 4, "samples_per_prompt": 4, "sampling": {"max_new_tokens": 5}},
            "trainer": {"lr": 3e-4},
            "eval": {"every": 1, "heldout_size": HELDOUT, "k": K, "temperature": 1.0,
                     "sets": [{"name": "extra", "path": str(extra)}]},
        }

    stack = one_replica_stack
    client = stack.client()
    try:
        runs = []
        for name in ("eval-a", "eval-b"):
            run = client.submit(spec(name))
            assert client.wait(run["id"], timeout_s=600)["status"] == "completed"
            runs.append((run["id"], client.metrics(run["id"])))
        (run_a, metrics_a), (run_b, metrics_b) = runs

        keys = {f"eval/{s}/{stat}@{K}" for s in ("heldout", "extra") for stat in ("avg", "pass")}
        evals = [metrics_a["eval_initial"]["metrics"]] + [s["metrics"] for s in metrics_a["steps"]]
        assert [s["step"] for s in metrics_a["steps"]] == [1, 2]
        for point in evals:  # every = 1: before step 1 and after each step
            assert keys | {"eval_accuracy"} <= set(point), point
            for s, n in (("heldout", HELDOUT), ("extra", len(EXTRA_PAIRS))):
                avg, passed = point[f"eval/{s}/avg@{K}"], point[f"eval/{s}/pass@{K}"]
                # Rewards are 0 or 1: avg@k counts correct samples out of n * k, pass@k problems out of n,
                # and a problem with a correct sample among k counts at least 1/k of it in avg@k.
                assert (avg * n * K).is_integer() and (passed * n).is_integer(), point
                assert avg <= passed <= min(1.0, K * avg), point
            assert metrics_a["eval_initial"]["accuracy"] == evals[0]["eval_accuracy"]
        values = [point[k] for point in evals for k in keys]
        assert 0 < sum(values) and any(v < 1 for v in values), evals  # the numbers carry information

        # The same spec again: the same eval numbers, bit for bit (seeds derive from run seed, step, problem).
        assert metrics_b["eval_initial"] == metrics_a["eval_initial"]
        assert [eval_keys(s["metrics"]) for s in metrics_b["steps"]] == \
               [eval_keys(s["metrics"]) for s in metrics_a["steps"]]

        # The coordinator's /metrics has the last evaluation of each set, labelled by set and k.
        last = metrics_a["steps"][-1]["metrics"]
        for stat, gauge in (("avg", "lockstep_eval_avg_at_k"), ("pass", "lockstep_eval_pass_at_k")):
            got = scraped(stack.api_url, gauge, run_a)
            assert got == {(s, str(K)): last[f"eval/{s}/{stat}@{K}"] for s in ("heldout", "extra")}, got
    finally:
        client.close()
