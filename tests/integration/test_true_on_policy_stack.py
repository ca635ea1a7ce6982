"""True on-policy through the real stack: the rollout's log-probs equal the trainer's recompute bit for bit.

The torch engine decodes with its KV cache; the trainer scores the same tokens packed, several
sequences per microbatch. In `numerics: true_on_policy` every op on that path is batch-invariant, so
at every step (not only before the first update) each response token's log-prob from the trainer is
the rollout's, in float32 and in bfloat16, and every importance weight is exactly 1. In `fast` mode the
same bfloat16 run does not agree bitwise, which is what makes the mode necessary (the parity gate's
tolerance is the safety net there).
"""
from __future__ import annotations

from pathlib import Path

import pytest

from services.common.tiny_model import TinyQwen3Config, build_model_dir

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    # A wider init than Qwen3's default, so every token's distribution depends on its context.
    return build_model_dir(tmp_path_factory.mktemp("model") / "tiny", TinyQwen3Config(initializer_range=0.2), seed=0)


@pytest.fixture(scope="module")
def client(one_replica_stack):
    c = one_replica_stack.client()  # the shared stack (tests/integration/conftest.py)
    yield c
    c.close()


def spec(model_dir: Path, numerics: str, dtype: str) -> dict:
    return {
        "name": f"{numerics}-{dtype}",
        "model_path": str(model_dir),
        "seed": 5,
        "steps": 2,
        "numerics": numerics,
        "task": {"name": "arithmetic", "options": {"digits": 3, "heldout_size": 8}},
        "rollout": {"prompts_per_step": 6, "samples_per_prompt": 4, "engine_options": {"dtype": dtype},
                    "sampling": {"temperature": 1.0, "max_new_tokens": 10}},
        # Small microbatches: the 24 sequences are packed several to a buffer, in several buffers.
        "trainer": {"lr": 1e-3, "temperature": 1.0, "dtype": dtype, "batching": "packed",
                    "microbatch_tokens": 96,
                    "parity_gate": {"iw_mean_tolerance": 1.0, "iw_max": 1e6, "logprob_abs_diff_mean": 1.0}},
        "eval": {"every": 0, "heldout_size": 8},
    }


def step_metrics(client, run_spec: dict) -> list[dict]:
    run = client.submit(run_spec)
    done = client.wait(run["id"], timeout_s=600)
    assert done["status"] == "completed", done
    steps = client.metrics(run["id"])["steps"]
    assert [s["step"] for s in steps] == [1, 2]
    return [s["metrics"] for s in steps]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_true_on_policy_log_probs_are_bitwise_the_rollouts_at_every_step(client, model_dir, dtype):
    for m in step_metrics(client, spec(model_dir, "true_on_policy", dtype)):
        assert m["tokens_response"] > 0
        assert m["logprob_abs_diff_max"] == 0.0, m
        assert m["iw_min"] == 1.0 and m["iw_max"] == 1.0 and m["iw_mean"] == 1.0, m


def test_fast_mode_in_bfloat16_does_not_agree_bitwise(client, model_dir):
    first = step_metrics(client, spec(model_dir, "fast", "bfloat16"))[0]
    assert first["logprob_abs_diff_max"] > 0.0, first
