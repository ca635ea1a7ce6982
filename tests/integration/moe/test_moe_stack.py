"""A tiny Qwen3-MoE (8 experts, top-2, 2 layers) through the real stack (REST, Redis, gRPC, the torch engine and
the trainer as processes).

true_on_policy: at every step every response token's log-prob from the trainer is the rollout's bits (IW
exactly 1) and every token's experts in the trainer equal the rollout's on every layer (routing agreement
1.0), from the routed experts each sample carries over gRPC. fast with routing replay: the trainer routes to
the rollout's experts, the run trains, and the agreement metric reports how far the trainer's own router is.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from recipes.tiny_moe import TinyMoeConfig, build_moe_model_dir

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return build_moe_model_dir(tmp_path_factory.mktemp("moe") / "tiny_moe", TinyMoeConfig(initializer_range=0.2),
                               seed=0)


@pytest.fixture(scope="module")
def client(one_replica_stack):
    c = one_replica_stack.client()
    yield c
    c.close()


def spec(model_dir: Path, numerics: str, dtype: str, **trainer) -> dict:
    return {
        "name": f"moe-{numerics}-{dtype}", "model_path": str(model_dir), "seed": 3, "steps": 2,
        "numerics": numerics,
        "task": {"name": "arithmetic", "options": {"digits": 3, "heldout_size": 8}},
        "rollout": {"prompts_per_step": 4, "samples_per_prompt": 4, "engine_options": {"dtype": dtype},
                    "sampling": {"temperature": 1.0, "max_new_tokens": 10}},
        "trainer": {"lr": 1e-3, "temperature": 1.0, "dtype": dtype, "microbatch_tokens": 96,
                    "parity_gate": {"iw_mean_tolerance": 1.0, "iw_max": 1e6, "logprob_abs_diff_mean": 1.0},
                    **trainer},
        "eval": {"every": 0, "heldout_size": 8},
    }


def steps_of(client, run_spec: dict) -> list[dict]:
    run = client.submit(run_spec)
    done = client.wait(run["id"], timeout_s=600)
    assert done["status"] == "completed", done
    steps = client.metrics(run["id"])["steps"]
    assert [s["step"] for s in steps] == list(range(1, run_spec["steps"] + 1))
    return [s["metrics"] for s in steps]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_true_on_policy_moe_is_bitwise_and_routes_identically(client, model_dir, dtype):
    for m in steps_of(client, spec(model_dir, "true_on_policy", dtype)):
        assert m["tokens_response"] > 0
        assert m["iw_min"] == 1.0 and m["iw_max"] == 1.0 and m["logprob_abs_diff_max"] == 0.0, m
        assert m["moe_routing_agreement_layer_0"] == 1.0 and m["moe_routing_agreement_layer_1"] == 1.0, m
        assert m["moe_dropped_tokens"] == 0.0 and m["moe_expert_load_max"] >= m["moe_expert_load_mean"] > 0


def test_fast_moe_with_routing_replay_trains_on_the_rollouts_experts(client, model_dir):
    for m in steps_of(client, spec(model_dir, "fast", "bfloat16", moe={"routing_replay": True})):
        assert 0.0 < m["moe_routing_agreement_min"] <= 1.0, m
        assert m["tokens_response"] > 0
