"""recipes/tiny_judge through the real stack: the policy learns from a reward model's score alone.

The reward model is built by the recipe's own `python -m recipes.tiny_judge.reward_model` on the session's
`warm_model` (the demo's warm start, ~20% held-out greedy accuracy); the recipe runs unchanged but for its paths
and its scorer replica (the shared reward stack's real one). The exact rule never reaches the policy: it only
labelled the reward model's training answers and scores the held-out evaluation, which must rise by at least
0.15; the run is cancelled at the first evaluation that shows it. The reward model's build and the run's wall
times and its agreement with the rule are printed, not asserted (docs/rewards.md). (Measured seed 0: reward
model built in 116 s, accuracy 0.19 -> 0.355 at step 150 of the recipe's 200, 0.40 at 200 in 297 s.)
"""
from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from recipes.tiny_judge.demo import RECIPE, run_recipe
from services.cli.client import load_recipe
from tests.conftest import REPO_ROOT

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def trained_reward_model(warm_model, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("tiny_judge") / "reward_model"
    began = time.monotonic()
    made = subprocess.run([sys.executable, "-m", "recipes.tiny_judge.reward_model", "--policy", str(warm_model.path),
                           "--out", str(out), "--seed", "0"], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=1800)
    assert made.returncode == 0, made.stderr[-3000:]
    return {**json.loads(made.stdout.strip().splitlines()[-1]), "wall_seconds": round(time.monotonic() - began, 1)}


def test_held_out_accuracy_rises_on_the_reward_models_score_alone(reward_stack, warm_model, trained_reward_model):
    spec = load_recipe(RECIPE, {"model_path": str(warm_model.path),
                                "reward.reward_model.model_path": trained_reward_model["model_dir"],
                                "reward.reward_model.replicas": [reward_stack.scorers[0]]})
    # Stopped at the first evaluation that clears the bar: the rest of the recipe would only cost suite time.
    report = run_recipe(reward_stack.stack, spec, timeout_s=1800, stop_at_gain=0.15)
    print(json.dumps({"reward_model": trained_reward_model, "run": report}))
    assert report["status"] == "completed" or (report["status"] == "cancelled"
                                               and report["stopped_at_step"] is not None), report
    assert report["best_accuracy"] - report["initial_accuracy"] >= 0.15, report
