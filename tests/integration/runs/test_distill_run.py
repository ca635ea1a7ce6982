"""On-policy distillation through the real stack on CPU: coordinator, a torch rollout replica, the trainer
with its teacher beside the student, Redis, gRPC and REST between real processes.

In numerics 'true_on_policy' the student's rollout log-probs and the trainer's are the same bits at every
step (IW exactly 1), with the teacher's signal in the update, and each step reports the distillation
metrics, also on the coordinator's /metrics beside the others. (That the teacher's log-probs of a sequence
are the same bits alone and batched is tests/trainer/test_teacher.py, on the trainer's own scoring path.)
"""
from __future__ import annotations

import math
from pathlib import Path

import httpx
import pytest

from recipes.tiny_model import TinyQwen3Config, build_model_dir

pytestmark = pytest.mark.slow

DISTILL_METRICS = ("distill_reverse_kl", "distill_argmax_agreement", "teacher_scoring_seconds")


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("distill_models")
    student = build_model_dir(root / "student", TinyQwen3Config(initializer_range=0.2), seed=0)
    teacher = build_model_dir(root / "teacher", TinyQwen3Config(hidden_size=160, num_hidden_layers=3,
                                                                initializer_range=0.2), seed=1)
    return student, teacher


@pytest.fixture(scope="module")
def stack(one_replica_stack):
    return one_replica_stack  # the shared stack (tests/integration/conftest.py)


def spec(student: Path, teacher: Path, **teacher_settings) -> dict:
    return {
        "name": "distill", "model_path": str(student), "seed": 3, "steps": 2, "numerics": "true_on_policy",
        "task": {"name": "arithmetic", "options": {"digits": 2, "heldout_size": 8}},
        "rollout": {"prompts_per_step": 4, "samples_per_prompt": 2,
                    "sampling": {"temperature": 1.0, "max_new_tokens": 8}},
        "trainer": {"lr": 1e-3, "temperature": 1.0, "microbatch_tokens": 96},
        "eval": {"every": 0, "heldout_size": 8},
        "teacher": {"model_path": str(teacher), **teacher_settings},
    }


def test_a_true_on_policy_distillation_run_is_bitwise_on_policy_and_reports_the_teacher(stack, models):
    client = stack.client()
    try:
        run = client.submit(spec(*models, reward_weight=0.5, discount=0.5))
        done = client.wait(run["id"], timeout_s=600)
        assert done["status"] == "completed", done
        steps = [s["metrics"] for s in client.metrics(run["id"])["steps"]]
    finally:
        client.close()
    assert len(steps) == 2
    for m in steps:
        assert m["tokens_response"] > 0
        # The student's behaviour log-probs are the rollout's, and the trainer's are the same bits.
        assert m["logprob_abs_diff_max"] == 0.0 and m["iw_min"] == m["iw_max"] == m["iw_mean"] == 1.0, m
        assert math.isfinite(m["distill_reverse_kl"]) and m["distill_reverse_kl"] != 0.0, m
        assert 0.0 <= m["distill_argmax_agreement"] <= 1.0
        assert m["teacher_scoring_seconds"] > 0
        # Random tiny models earn no reward: the task term is 0, and the teacher's term alone moves the weights.
        assert m["reward_mean"] == 0.0 and m["grad_norm"] > 0, m
    exported = httpx.get(f"{stack.api_url}/metrics", timeout=10).text
    for key in DISTILL_METRICS:
        assert f'lockstep_step_{key}{{run_id="{run["id"]}"}}' in exported, key
