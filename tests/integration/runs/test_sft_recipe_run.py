"""recipes/tiny_arith_sft through the real stack: the demo's warm start, done as an SFT run over REST, reaches
the code-built warm start's held-out accuracy (the learning bar of the recipe: at least that accuracy - 0.05).

The code-built one is the session's `warm_model` (`python -m recipes.tiny_arith.prepare --seed 0`); the SFT
run trains as many steps as it took, from the same initial weights, with its optimizer settings, on the
same train split (its batches are a seeded shuffle rather than draws with replacement), and is evaluated
greedily on the same 200 held-out problems.

Why one-sided: the code-built warm start stops as soon as its train probe reaches 20% greedy accuracy, in the
middle of the steep rise of this task's learning curve, where a few steps move held-out accuracy by tenths;
the same step count with other batches lands elsewhere on that rise (measured at seed 0: 0.535 over REST
against 0.19 code-built, after the same steps). So the REST run is held to reaching it, not to landing on it.
"""
from __future__ import annotations

import json

import pytest

from recipes.tiny_arith_sft.prepare import prepare
from services.cli.client import load_recipe
from tests.conftest import REPO_ROOT

pytestmark = pytest.mark.slow


def test_the_sft_recipe_reproduces_the_code_built_warm_start(warm_model, one_replica_stack, tmp_path):
    inputs = prepare(tmp_path / "inputs", seed=0)
    steps = warm_model.report["warm_start_steps"]
    spec = load_recipe(REPO_ROOT / "recipes" / "tiny_arith_sft" / "recipe.yaml", {
        "model_path": inputs["model_dir"], "sft.path": inputs["dataset"], "steps": steps})
    client = one_replica_stack.client()
    try:
        run = client.submit(spec)
        done = client.wait(run["id"], timeout_s=1200)
        assert done["status"] == "completed", done
        metrics = [s["metrics"] for s in client.metrics(run["id"])["steps"]]
    finally:
        client.close()
    assert len(metrics) == steps
    accuracy, code_built = metrics[-1]["eval_accuracy"], warm_model.report["heldout_accuracy"]
    print(json.dumps({"sft_rest_accuracy": accuracy, "code_built_accuracy": code_built, "steps": steps}))
    assert accuracy >= code_built - 0.05, (accuracy, code_built)
    assert metrics[-1]["loss"] < 0.5 * metrics[0]["loss"]
