"""The code demo's learning bar through the real stack: from execution alone, held-out accuracy rises by at
least 0.2 (the demo's measured run: 0.047 -> 0.69 at step 5, 215 s for the whole demo on 2 shared cores,
recipes/tiny_code/README.md; no time is asserted here). The recipe's first 5 steps (one eval, at step 5), to
keep the suite's time: the committed 15 only add steps after the bar. At 5 steps the bar holds with margin on
every seed measured (`python -m recipes.tiny_code.demo --seed S --steps 5`, 2026-12-07): held-out accuracy
0.047 -> 0.69 (seed 0, the one tested here), 0.0 -> 0.55 (seed 1), 0.0 -> 0.48 (seed 2); sandbox passes in
the step's 128 samples 17 -> 77, 16 -> 58, 22 -> 69.

Also checks, end to end, that each step's sandbox outcomes reach the step records over REST.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console

from recipes.tiny_code.demo import OUTCOMES, RECIPE, run_on, spec_for
from services.common.sandbox import SandboxSettings, SandboxUnavailable
from services.common.sandbox.bwrap import probe
from tests.conftest import require

REPO = Path(__file__).resolve().parents[3]


def test_the_code_demo_learns_from_execution(one_replica_stack, tmp_path_factory):
    try:
        probe(SandboxSettings())
    except SandboxUnavailable as exc:
        require(False, f"no sandbox on this host: {exc}")
    t0, load_before = time.monotonic(), os.getloadavg()
    out = tmp_path_factory.mktemp("tiny_code") / "model"
    prep = subprocess.run([sys.executable, "-m", "recipes.tiny_code.prepare", "--out", str(out), "--seed", "0"],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert prep.returncode == 0, prep.stderr[-3000:]
    info = json.loads(prep.stdout.strip().splitlines()[-1])
    spec = spec_for(RECIPE, {"steps": 5}, out, info["problems_path"])
    path, summary = run_on(one_replica_stack, spec, prep=info, cached=False, console=Console(quiet=True), t0=t0,
                           load_before=load_before)
    assert summary["status"] == "completed" and summary["steps"] == spec["steps"]
    assert summary["final_accuracy"] >= summary["initial_accuracy"] + 0.2, summary
    # Every sampled response of every step was executed and given one named outcome.
    client = one_replica_stack.client()
    try:
        steps = client.metrics(summary["run_id"])["steps"]
    finally:
        client.close()
    per_step = spec["rollout"]["prompts_per_step"] * spec["rollout"]["samples_per_prompt"]
    for step in steps:
        assert sum(step["metrics"][f"code_{o}"] for o in OUTCOMES) == per_step, step["step"]
        outcomes = step["metrics"]["code_sample_outcomes"]
        assert len(outcomes) == per_step and set(outcomes) <= set(OUTCOMES)
        assert outcomes.count("passed") == step["metrics"]["code_passed"]
    assert steps[-1]["metrics"]["code_passed"] > steps[0]["metrics"]["code_passed"]
