"""Packed sequences attending across boundaries, end to end: in `numerics: fast` a
run whose attention ignores sequence boundaries is stopped at step 1 by the
parity gate, through the real services.

The trainer loads a test-only attention plugin (tests.support.boundary_blind_plugin)
that registers a boundary-blind backend *claiming* to honour boundaries, so the
registry cannot refuse it: only the gate stands between it and a garbage update.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from services.common.tiny_model import TinyQwen3Config, build_model_dir
from services.local_stack import LocalStack
from tests.support.boundary_blind_attention import NAME as BLIND

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    # A larger init than Qwen3's default so each token's distribution depends on
    # its context, which is what leaking context across sequences corrupts.
    return build_model_dir(tmp_path_factory.mktemp("model") / "tiny", TinyQwen3Config(initializer_range=0.2), seed=0)


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    env = {"LOCKSTEP_TRAINER_ATTENTION_PLUGINS": "tests.support.boundary_blind_plugin"}
    with LocalStack(tmp_path_factory.mktemp("stack"), extra_env=env, path_roots=[tmp_path_factory.getbasetemp()]) as stack:
        c = stack.client()
        yield c
        c.close()


def spec(model_dir: Path, backend: str) -> dict:
    return {
        "name": f"gate-{backend}",
        "model_path": str(model_dir),
        "seed": 3,
        "steps": 2,
        # The fast mode, where rollout and trainer agree up to rounding: the gate is the safety net there.
        "numerics": "fast",
        "task": {"name": "arithmetic", "options": {"digits": 3, "heldout_size": 8}},
        "rollout": {"prompts_per_step": 8, "samples_per_prompt": 4,
                    "sampling": {"temperature": 1.0, "max_new_tokens": 8}},
        "trainer": {"lr": 1e-3, "temperature": 1.0, "batching": "packed", "attention": {"backend": backend}},
        "eval": {"every": 0, "heldout_size": 8},
    }


def test_boundary_blind_attention_fails_the_run_at_step_1_naming_it(client, model_dir):
    run = client.submit(spec(model_dir, BLIND))
    done = client.wait(run["id"], timeout_s=300)
    assert done["status"] == "failed", done
    error = done["error"]
    print(error)  # the diagnostic a user sees, kept in the test log
    assert "step-1 parity gate FAILED" in error
    assert f"attention backend: {BLIND}" in error
    assert "logprob backend: reference" in error
    assert "worst tokens" in error and "position" in error
    assert client.metrics(run["id"])["steps"] == []  # nothing was trained or recorded


def test_same_run_with_the_reference_attention_passes_the_gate(client, model_dir):
    run = client.submit(spec(model_dir, "reference"))
    done = client.wait(run["id"], timeout_s=300)
    assert done["status"] == "completed", done
    first = client.metrics(run["id"])["steps"][0]["metrics"]
    assert abs(first["iw_mean"] - 1) <= 1e-4 and first["logprob_abs_diff_max"] <= 1e-3, first
