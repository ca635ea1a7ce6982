"""A short run of the tool demo (recipes/tiny_tools) through the real stack: warm start, 3-turn calculator
episodes in numerics true_on_policy, the final checkpoint's held-out check and summary.json.

Whether RL raises accuracy by the README's margin is a measured claim of the full demo, not asserted here:
two steps of a few episodes check the pipeline and the summary's fields.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console

from recipes.tiny_tools.demo import RECIPE, run_on
from services.cli.client import load_recipe

REPO = Path(__file__).resolve().parents[3]


def test_a_short_tool_run_calls_the_tool_and_writes_the_summary(one_replica_stack, tmp_path_factory):
    t0, load_before = time.monotonic(), os.getloadavg()
    # Every scripted episode calls the tool, so 30 small warm-start steps teach the call's text well enough
    # that about a third of temperature-1 turns call it (the demo's own mix calls it in a quarter of them).
    model = tmp_path_factory.mktemp("tools") / "model"
    prep = subprocess.run([sys.executable, "-m", "recipes.tiny_tools.prepare", "--out", str(model), "--seed", "0",
                           "--steps", "30", "--tool-fraction", "1.0", "--batch-size", "16", "--heldout-size", "8"], cwd=REPO, capture_output=True, text=True,
                          timeout=600)
    assert prep.returncode == 0, prep.stderr[-3000:]
    info = json.loads(prep.stdout.strip().splitlines()[-1])
    spec = load_recipe(RECIPE, {"model_path": str(model), "steps": 2, "rollout.prompts_per_step": 4,
                                "rollout.samples_per_prompt": 4, "eval.every": 2, "eval.heldout_size": 8,
                                "debug.record_trajectories": True})
    path, summary = run_on(one_replica_stack, spec, prep=info, cached=False, console=Console(quiet=True), t0=t0,
                           load_before=load_before)
    assert path == one_replica_stack.run_dir / "summary.json" and json.loads(path.read_text()) == summary
    assert summary["status"] == "completed" and summary["steps"] == 2
    # Parity across turns: the trainer's recompute of every model token is the rollout's bits.
    assert summary["step1_iw_min"] == summary["step1_iw_max"] == 1.0 and summary["step1_logprob_abs_diff_max"] == 0.0
    for key in ("initial_accuracy", "final_accuracy", "initial_tool_call_rate", "final_tool_call_rate",
                "initial_correct_tool_call_rate", "final_correct_tool_call_rate", "initial_check_accuracy",
                "final_check_accuracy"):
        assert 0.0 <= summary[key] <= 1.0, key
    # Tool calls happened and their results came back as environment tokens between model turns.
    assert summary["train_tool_calls_mean_first_step"] > 0
    client = one_replica_stack.client()
    try:
        view = client.episodes(summary["run_id"], 1)["episodes"]
    finally:
        client.close()
    called = [e for e in view if e["tool_calls"] > 0]
    assert called and all(e["turns"] >= 2 and e["environment_tokens"] > 0 for e in called)
    assert summary["wall_s"] > summary["rl_s"] > 0 and len(summary["loadavg_before"]) == 3
