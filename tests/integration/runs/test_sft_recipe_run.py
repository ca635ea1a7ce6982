"""recipes/tiny_arith_sft through the real stack: the demo's warm start, done as an SFT run over REST, reaches
the code-built warm start's held-out accuracy (the learning bar of the recipe: at least that accuracy - 0.05).

The code-built one is the session's `warm_model` (`python -m recipes.tiny_arith.prepare --seed 0`); the SFT
run trains as many steps as it took, from the same initial weights, with its optimizer settings, on the
same train split (its batches are a seeded shuffle rather than draws with replacement), and is evaluated
greedily on the same 200 held-out problems.

Why one-sided: the code-built warm start stops as soon as its train probe reaches 20% greedy accuracy, in the
middle of the steep rise of this task's learning curve, where a few steps move held-out accuracy by tenths;
the same step count with other batches lands elsewhere on that rise (measured at seed 0: 0.535 over REST
against 0.19 code-built, after the same steps). So the REST run is held to reaching it, not to landing on it,
within the code-built warm start's step count: it is evaluated every EVAL_EVERY steps and stopped at the first
evaluation that reaches it (tests/support/learning_bar.py; measured at seed 0: 0.15 at step 200 of 310).
"""
from __future__ import annotations

import json

import pytest

from recipes.tiny_arith_sft.prepare import prepare
from services.cli.client import load_recipe
from tests.conftest import REPO_ROOT
from tests.support.learning_bar import run_until_bar

pytestmark = pytest.mark.slow
EVAL_EVERY = 25


def test_the_sft_recipe_reproduces_the_code_built_warm_start(warm_model, one_replica_stack, tmp_path):
    inputs = prepare(tmp_path / "inputs", seed=0)
    steps = warm_model.report["warm_start_steps"]
    spec = load_recipe(REPO_ROOT / "recipes" / "tiny_arith_sft" / "recipe.yaml", {
        "model_path": inputs["model_dir"], "sft.path": inputs["dataset"], "steps": steps, "eval.every": EVAL_EVERY})
    code_built = warm_model.report["heldout_accuracy"]
    client = one_replica_stack.client()
    try:
        run = run_until_bar(client, spec, lambda _initial, accuracy: accuracy >= code_built - 0.05, timeout_s=1200)
    finally:
        client.close()
    print(json.dumps({"sft_rest_accuracy": run.accuracy, "code_built_accuracy": code_built, "steps": steps,
                      "stopped_at_step": run.stopped_at_step, "evals": run.evals}))
    assert run.ended_as_expected, run
    assert run.evals and run.evals[-1][0] <= steps, run.evals  # never more steps than the code-built one took
    assert run.accuracy >= code_built - 0.05, (run.accuracy, code_built)
    assert run.steps[-1]["loss"] < 0.5 * run.steps[0]["loss"]
