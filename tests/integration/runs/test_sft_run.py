"""Supervised fine-tuning through the real stack on CPU, then RL from its checkpoint.

A kind 'sft' run on prompt/completion pairs of the arithmetic task's train split (JSON Lines, inside the
data roots): REST submit, TrainStep on the completion tokens, weight sync, evaluation on the task's
held-out split, checkpoint, per-step metrics, as an RL run has them; its loss falls. A kind 'rl' run then
starts from that run's checkpoint by naming it: its model_path is the checkpoint, and its first evaluation
(before any update) is exactly the SFT run's last.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from recipes.tiny_arith import MODEL, TASK_OPTIONS
from recipes.tiny_model import build_model_dir
from services.coordinator.tasks import build_task

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack(one_replica_stack):
    return one_replica_stack


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("sft_data")
    model = build_model_dir(root / "model", MODEL, seed=0)
    task = build_task("arithmetic", TASK_OPTIONS)
    try:
        train = task.split("train")[:2000]
    finally:
        task.close()
    path = root / "train.jsonl"
    path.write_text("".join(json.dumps({"prompt": p.prompt, "completion": p.answer}) + "\n" for p in train))
    return model, path


def sft_spec(model: Path, path: Path) -> dict:
    return {
        "name": "sft", "kind": "sft", "model_path": str(model), "seed": 0, "steps": 12,
        "task": {"name": "arithmetic", "options": TASK_OPTIONS},
        "sft": {"path": str(path), "batch_size": 64},
        "trainer": {"lr": 2e-3, "temperature": 1.0, "betas": [0.9, 0.99]},
        "rollout": {"sampling": {"temperature": 1.0, "max_new_tokens": 4}},
        "eval": {"every": 0, "heldout_size": 32},
    }


def test_an_sft_run_learns_and_its_checkpoint_starts_an_rl_run(stack, data):
    client = stack.client()
    try:
        sft = client.submit(sft_spec(*data))
        done = client.wait(sft["id"], timeout_s=900)
        assert done["status"] == "completed", done
        steps = [s["metrics"] for s in client.metrics(sft["id"])["steps"]]
        assert len(steps) == 12
        losses = [m["loss"] for m in steps]
        assert sum(losses[-3:]) < 0.8 * sum(losses[:3]), losses  # the completions' NLL falls
        assert all(m["trajectories_trained"] == 64 for m in steps)
        sft_final_accuracy = steps[-1]["eval_accuracy"]

        rl = {"name": "rl-after-sft", "start_from": {"run": sft["id"]}, "seed": 1, "steps": 2,
              "task": {"name": "arithmetic", "options": TASK_OPTIONS},
              "rollout": {"prompts_per_step": 4, "samples_per_prompt": 4,
                          "sampling": {"temperature": 1.0, "max_new_tokens": 4}},
              "trainer": {"lr": 3e-4, "temperature": 1.0}, "eval": {"every": 0, "heldout_size": 32}}
        run = client.submit(rl)
        stored = client.run(run["id"])["spec"]
        assert stored["model_path"] == str(stack.run_dir / "coordinator" / sft["id"] / "checkpoints" / "step_000012")
        done = client.wait(run["id"], timeout_s=900)
        assert done["status"] == "completed", done
        initial = client.run(run["id"])["eval_initial"]
        # The same weights, the same held-out split, greedy: the same accuracy before any RL update.
        assert initial["accuracy"] == sft_final_accuracy
        assert [s["step"] for s in client.metrics(run["id"])["steps"]] == [1, 2]
    finally:
        client.close()
