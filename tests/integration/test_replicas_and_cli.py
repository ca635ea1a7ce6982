"""Two rollout replicas behind one coordinator, driven through the `lockstep` CLI."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

from proto import lockstep_pb2 as pb
from proto import lockstep_pb2_grpc as pb_grpc
from recipes.tiny_model import build_model_dir
from services.common.grpc.options import sync_channel

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack(two_replica_stack):
    return two_replica_stack  # shared (tests/integration/conftest.py): these tests change nothing in it


def cli(stack, *args: str) -> subprocess.CompletedProcess:
    # Wide enough that `list` prints each run on one row, whatever other runs' errors the shared stack holds.
    return subprocess.run([sys.executable, "-m", "services.cli", "--url", stack.api_url,
                           "--token-file", str(stack.token_file), *args],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "COLUMNS": "250"})


def test_cli_run_on_two_replicas_syncs_weights_to_both(stack, tmp_path):
    model = build_model_dir(tmp_path / "model", seed=1)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({
        "name": "two-replicas", "model_path": "model", "seed": 11, "steps": 2,
        "task": {"name": "arithmetic", "options": {"heldout_size": 10}},
        "rollout": {"prompts_per_step": 5, "samples_per_prompt": 2, "sampling": {"max_new_tokens": 4}},
        "eval": {"every": 0, "heldout_size": 10},
    }))
    assert model.is_dir()
    out = cli(stack, "submit", str(recipe), "--set", "steps=2", "--watch")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "completed" in out.stdout
    run_id = next(line.split()[2] for line in out.stdout.splitlines() if line.startswith("submitted run"))
    listed = cli(stack, "list")
    # The run's own row (the shared stack lists other tests' runs too).
    row = next((line for line in listed.stdout.splitlines() if run_id in line), "")
    assert listed.returncode == 0 and "two-replicas" in row and "2/2" in row, listed.stdout
    metrics = json.loads(cli(stack, "metrics", run_id).stdout)
    assert [s["step"] for s in metrics["steps"]] == [1, 2]
    # 5 prompts split over two replicas (3 + 2); every sample trained, IW ~ 1 after a sync to both.
    for s in metrics["steps"]:
        assert s["metrics"]["trajectories_trained"] == 10 and abs(s["metrics"]["iw_mean"] - 1) <= 1e-4
    for port in stack.rollout_ports:
        with sync_channel(f"127.0.0.1:{port}", stack.token) as ch:
            info = pb_grpc.RolloutStub(ch).Info(pb.InfoRequest(), timeout=10)
        assert (info.run_id, info.policy_version) == (run_id, 2)


def test_cli_errors_are_reported_with_the_field(stack, tmp_path):
    recipe = tmp_path / "bad.yaml"
    recipe.write_text(yaml.safe_dump({"name": "bad", "model_path": str(tmp_path / "missing"), "steps": 1,
                                      "task": {"name": "arithmetic"}}))
    out = cli(stack, "submit", str(recipe))
    assert out.returncode == 2
    assert "422" in out.stdout and "model_path" in out.stdout
    missing = cli(stack, "cancel", "no-such-run")
    assert missing.returncode == 2 and "404" in missing.stdout
