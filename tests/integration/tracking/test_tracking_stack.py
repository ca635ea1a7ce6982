"""Samples, experiment trackers and their failures through the real stack (the shared one-replica stack).

One run with every tracker offline: each step's samples (REST and `lockstep samples`) are the trajectories
of its step record, and what W&B, TensorBoard and MLflow wrote, read back with each one's own reader
(W&B's record format, TensorBoard's EventAccumulator, MlflowClient), holds every step metric of every step
with the value `lockstep metrics` reports, bit for bit. Then the same spec on a coordinator whose trackers
raise and hang: the same steps, bit for bit, and lockstep_tracking_failures_total counts the failures.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from contract.wire_tensors import array_from_proto
from services.common.records.step_record import read_step_record
from services.coordinator.tracking.run_tracking import tracker_values
from services.coordinator.tracking.spec import TRACKER_PACKAGES, install_hint, tracker_installed
from tests.conftest import require
from tests.support import wandb_records

pytestmark = pytest.mark.slow
STEPS, PROMPTS, GROUP = 3, 4, 4


def spec(model: str, name: str, backends: list[str]) -> dict:
    return {
        "name": name, "model_path": model, "seed": 5, "steps": STEPS,
        "task": {"name": "arithmetic", "options": {"seed": 0, "digits": 2, "heldout_size": 200}},
        "rollout": {"prompts_per_step": PROMPTS, "samples_per_prompt": GROUP, "sampling": {"max_new_tokens": 5}},
        "trainer": {"lr": 3e-4},
        "eval": {"every": 2, "heldout_size": 8},
        "debug": {"record_trajectories": True},
        "tracking": {"backends": backends, "samples_every": 2, "samples_rows": 3},
    }


def expected_values(metrics: dict) -> dict[int, dict[str, float]]:
    """step -> what every tracker must hold for it (step 0: the evaluation before step 1)."""
    out = {0: tracker_values(metrics["eval_initial"]["metrics"])}
    out.update({s["step"]: tracker_values(s["metrics"]) for s in metrics["steps"]})
    return out


def failures(api_url: str, run_id: str) -> dict[str, float]:
    out = {}
    for family in text_string_to_metric_families(httpx.get(f"{api_url}/metrics", timeout=10).text):
        for sample in family.samples:
            if sample.name == "lockstep_tracking_failures_total" and sample.labels.get("run_id") == run_id:
                out[sample.labels["tracker"]] = sample.value
    return out


def trackers_closed(client, run_id: str) -> dict[str, bool]:
    """The run's trackers_closed event (recorded once its trackers flushed, after the run reads completed)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        closed = [e for e in client.run(run_id)["events"] if e["event"] == "trackers_closed"]
        if closed:
            return closed[0]["trackers"]
        time.sleep(0.2)
    raise AssertionError(f"run {run_id}: no trackers_closed event")


@pytest.fixture(scope="module")
def tracked_run(warm_model, one_replica_stack):
    missing = [name for name in TRACKER_PACKAGES if not tracker_installed(name)]
    require(not missing, f"trackers not installed: {[install_hint(name) for name in missing]}")
    client = one_replica_stack.client()
    try:
        run = client.submit(spec(str(warm_model.path), "tracked", ["wandb", "tensorboard", "mlflow"]))
        assert client.wait(run["id"], timeout_s=600)["status"] == "completed"
        assert trackers_closed(client, run["id"]) == {"wandb": True, "tensorboard": True, "mlflow": True}
        return run["id"], client.metrics(run["id"])
    finally:
        client.close()


def test_each_steps_samples_are_its_step_records_trajectories(tracked_run, one_replica_stack):
    run_id, _ = tracked_run
    run_dir = one_replica_stack.run_dir / "coordinator" / run_id
    client = one_replica_stack.client()
    try:
        for step in range(1, STEPS + 1):
            page = client.samples(run_id, step, limit=1000)
            _, chunks = read_step_record(run_dir / "trajectories" / f"step_{step:06d}.pb")
            record = [c.trajectory for c in chunks if c.WhichOneof("item") == "trajectory"]
            assert page["total"] == len(record) == PROMPTS * GROUP
            for sample, t in zip(page["samples"], record, strict=True):
                assert sample["sample_id"] == t.sample_id and sample["group_id"] == t.group_id
                assert sample["reward"] == float(t.reward) and sample["advantage"] == float(t.advantage)
                assert sample["prompt_token_ids"] == array_from_proto(t.prompt_token_ids, field="p").tolist()
                assert sample["response_token_ids"] == array_from_proto(t.response_token_ids, field="r").tolist()
                assert sample["length"] == len(sample["response_token_ids"])
                assert sample["finish_reason"] == t.finish_reason and sample["policy_version"] == step - 1
                assert sample["response"] and sample["prompt"]
            # Each sample's IW range, as the trainer measured it: its extremes are the step's, bit for bit.
            metrics = client.metrics(run_id)["steps"][step - 1]["metrics"]
            assert min(s["iw_min"] for s in page["samples"]) == metrics["iw_min"] == page["iw"]["iw_min"]
            assert max(s["iw_max"] for s in page["samples"]) == metrics["iw_max"] == page["iw"]["iw_max"]
            assert all(s["iw_min"] <= s["iw_max"] for s in page["samples"])
            worst = client.samples(run_id, step, order="worst", limit=1000)["samples"]
            assert [s["reward"] for s in worst] == sorted(s["reward"] for s in page["samples"])
            best = client.samples(run_id, step, order="best", limit=5, offset=2)
            assert [s["reward"] for s in best["samples"]] == \
                sorted((s["reward"] for s in page["samples"]), reverse=True)[2:7]
            group = page["samples"][-1]["group_id"]
            mine = client.samples(run_id, step, group=group)
            assert mine["total"] == GROUP and {s["group_id"] for s in mine["samples"]} == {group}
        with pytest.raises(Exception, match="404"):
            client.samples(run_id, STEPS + 1)
        worst_of_step2 = [s["sample_id"] for s in client.samples(run_id, 2, order="worst", limit=1000)["samples"]]
    finally:
        client.close()

    out = subprocess.run([sys.executable, "-m", "services.cli", "--url", one_replica_stack.api_url,
                          "--token-file", str(one_replica_stack.token_file), "samples", run_id, "--step", "2",
                          "--worst", "--limit", "1000", "--width", "0"],
                         capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "400"})
    assert out.returncode == 0, out.stderr
    cells = [line.split("│") for line in out.stdout.splitlines() if line.count("│") > 3]
    listed = [row[2].strip() for row in cells if "/" in row[2]]
    assert listed == worst_of_step2


def test_every_tracker_holds_every_step_metric_bit_for_bit(tracked_run, one_replica_stack):
    run_id, metrics = tracked_run
    run_dir = one_replica_stack.run_dir / "coordinator" / run_id
    expected = expected_values(metrics)
    assert set(expected) == {0, 1, 2, 3} and all(expected[s] for s in expected)
    assert "lockstep_step_iw_mean" in expected[1] and "lockstep_eval_avg_at_k/heldout/1" in expected[2]

    # TensorBoard, through its own event reader: float64 tensors, so exact.
    from tensorboard.backend.event_processing import event_accumulator
    from tensorboard.util import tensor_util
    acc = event_accumulator.EventAccumulator(str(run_dir / "tracking" / "tensorboard"),
                                             size_guidance={event_accumulator.TENSORS: 0})
    acc.Reload()
    board: dict[int, dict[str, float]] = {}
    for tag in acc.Tags()["tensors"]:
        for event in acc.Tensors(tag):
            value = tensor_util.make_ndarray(event.tensor_proto)
            if value.dtype == np.float64:
                board.setdefault(event.step, {})[tag] = float(value)
    assert board == expected
    assert [e.step for e in acc.Tensors("samples")] == [2, 3]
    assert any(e.step == 0 for e in acc.Tensors("config/run_spec"))

    # MLflow, through its client on the local store.
    from mlflow.tracking import MlflowClient
    mlflow = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'tracking' / 'mlflow.db'}")
    (found,) = mlflow.search_runs([mlflow.get_experiment_by_name("lockstep").experiment_id],
                                  f"tags.`lockstep.run_id` = '{run_id}'")
    logged: dict[int, dict[str, float]] = {}
    for key in found.data.metrics:
        for m in mlflow.get_metric_history(found.info.run_id, key):
            logged.setdefault(m.step, {})[key] = m.value
    assert logged == expected
    artifacts = {a.path for a in mlflow.list_artifacts(found.info.run_id, "samples")}
    assert artifacts == {"samples/step_000002.json", "samples/step_000003.json"}

    # W&B, its offline run file read record by record (JSON numbers: Python's repr, so exact).
    (wandb_file,) = (run_dir / "tracking" / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb")
    history = wandb_records.history(wandb_file)
    scalars = {step: {k: json.loads(v) for k, v in row.items() if not k.startswith(("_", "samples"))}
               for step, row in history.items()}
    assert scalars == expected
    assert [s for s, row in sorted(history.items()) if "samples/nrows" in row] == [2, 3]
    assert json.loads(wandb_records.config(wandb_file)["run_spec"])["name"] == "tracked"
    assert failures(one_replica_stack.api_url, run_id) == {}


def test_raising_and_hanging_trackers_leave_the_steps_and_are_counted(tracked_run, warm_model, one_replica_stack):
    _, reference = tracked_run
    stack = one_replica_stack
    args = list(stack.coordinator.args)
    assert args[1:3] == ["-m", "services.coordinator"], args
    stack.coordinator.stop()
    stack.coordinator.args = [args[0], "-m", "tests.support.faulty_tracker_coordinator", "--raising", "tensorboard",
                              "--hanging", "mlflow", *args[3:], "--tracking-call-timeout-s", "1"]
    try:
        stack.restart_coordinator()
        client = stack.client()
        try:
            run = client.submit(spec(str(warm_model.path), "tracked", ["tensorboard", "mlflow"]))
            assert client.wait(run["id"], timeout_s=600)["status"] == "completed"
            metrics = client.metrics(run["id"])
            closed = trackers_closed(client, run["id"])
        finally:
            client.close()
        assert metrics["eval_initial"] == reference["eval_initial"]
        assert [s["metrics"] for s in metrics["steps"]] == [s["metrics"] for s in reference["steps"]]
        # tensorboard raised from config, step 0, every step's metrics and close; mlflow hung in its first call
        # and is given up on (each later call dropped and counted) at the latest when the run's end has waited
        # --tracking-call-timeout-s for it, before trackers_closed.
        counted = failures(stack.api_url, run["id"])
        assert counted["tensorboard"] >= 1 + 1 + STEPS + 1 and counted["mlflow"] >= 1, counted
        assert closed == {"tensorboard": True, "mlflow": False}
    finally:
        stack.coordinator.stop()
        stack.coordinator.args = args
        stack.restart_coordinator()
