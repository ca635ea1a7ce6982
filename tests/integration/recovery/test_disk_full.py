"""A full checkpoint disk is a state a run comes back from. Real processes throughout (coordinator, an
external redis-server, trainer, rollout replica on loopback); the coordinator's data directory, where the
checkpoints go, is a small tmpfs that a ballast file fills up.

- Retried: the trainer refuses the checkpoint (RESOURCE_EXHAUSTED, nothing written), the run records
  each refusal as an event and tries again; the ballast goes, the run completes.
- Paused: past the retry window (0 here) the run is held as `paused`, survives a coordinator restart
  as such, and `POST /v1/runs/{id}/resume` (authenticated) drives it on once space is back.
Either way each step is recorded once and trained once (the step whose checkpoint waited is replayed
by the trainer, not trained again).
"""
from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from recipes.tiny_model import build_model_dir
from services.cli.client import ApiError, CoordinatorClient
from services.common.process.ports import free_port
from services.coordinator.state.embedded_redis import EmbeddedRedis
from services.local_stack import LocalStack
from services.trainer.checkpoint import read_state
from tests.support.small_disk import fill, small_tmpfs

pytestmark = pytest.mark.slow
STEPS, CHECKPOINT_EVERY, PROMPTS, SAMPLES = 4, 2, 4, 2
DISK_BYTES = 64 << 20  # the tiny model's checkpoints are ~5 MB each
STATUS_EVENTS = {"submitted", "pending", "running", "paused", "resumed", "completed", "failed", "cancelled"}
RETRY_ENV = {  # short waits, a long window: the run retries until the ballast goes
    "LOCKSTEP_COORDINATOR_CHECKPOINT_RETRY_WINDOW_S": "600",
    "LOCKSTEP_COORDINATOR_CHECKPOINT_RETRY_INTERVAL_S": "0.2",
    "LOCKSTEP_COORDINATOR_CHECKPOINT_RETRY_INTERVAL_MAX_S": "0.5",
}


def _spec(model: Path, name: str) -> dict:
    return {
        "name": name, "model_path": str(model), "seed": 5, "steps": STEPS,
        "task": {"name": "arithmetic", "options": {"heldout_size": 8}},
        "rollout": {"prompts_per_step": PROMPTS, "samples_per_prompt": SAMPLES, "sampling": {"max_new_tokens": 4}},
        "eval": {"every": 0, "heldout_size": 8},
        "checkpoint": {"every": CHECKPOINT_EVERY},
    }


def _wait_for(client: CoordinatorClient, run_id: str, what: str, done: Callable[[dict], bool],
              timeout_s: float = 300) -> dict:
    deadline = time.monotonic() + timeout_s
    while not done(run := client.run(run_id)):
        assert run["status"] not in ("failed", "cancelled", "completed"), run
        assert time.monotonic() < deadline, f"run {run_id} never reached {what}: {run['status']}, {run['events'][-3:]}"
        time.sleep(0.05)
    return run


def _events(run: dict, name: str) -> list[dict]:
    return [e for e in run["events"] if e["event"] == name]


def _trained_steps(stack: LocalStack) -> dict[str, float]:
    """The trainer's lockstep_trainer_steps_total by outcome, read from its /metrics."""
    body = httpx.get(f"http://127.0.0.1:{stack.metrics_ports['trainer']}/metrics", timeout=10).text
    return {s.labels["outcome"]: s.value for family in text_string_to_metric_families(body)
            for s in family.samples if s.name == "lockstep_trainer_steps_total"}


def _files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*") if p.is_file()) if directory.exists() else []


def _assert_completed_once_each(client: CoordinatorClient, checkpoints: Path, run_id: str) -> None:
    steps = client.metrics(run_id)["steps"]
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1)), steps
    assert all(s["metrics"]["trajectories_trained"] == PROMPTS * SAMPLES for s in steps), steps
    # Every checkpoint complete, nothing half-written beside them.
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_000002", "step_000004"]
    assert [read_state(checkpoints / f"step_{s:06d}").policy_version for s in (2, 4)] == [2, 4]


@pytest.fixture
def stack_on_a_small_disk(tmp_path):
    """The stack, its data directory (checkpoints) a small tmpfs, its Redis elsewhere: a full disk there
    must not also stop the run's state from being written."""
    model = build_model_dir(tmp_path / "model", seed=3)
    redis = EmbeddedRedis(tmp_path / "redis", port=free_port()).start()
    try:
        with small_tmpfs(tmp_path / "stack" / "coordinator", DISK_BYTES) as data_dir, \
                LocalStack(tmp_path / "stack", redis_url=redis.url, redis_password=redis.password,
                           extra_env=RETRY_ENV, path_roots=[tmp_path]) as stack:
            yield stack, data_dir, model
    finally:
        redis.stop()


def test_a_full_checkpoint_disk_is_retried_then_paused_and_the_runs_complete_once_space_returns(
        stack_on_a_small_disk):
    stack, data_dir, model = stack_on_a_small_disk
    client = stack.client(timeout_s=120)
    try:
        # Retried: the disk is full from the start; the checkpoint after step 2 is refused, again and again.
        ballast = fill(data_dir)
        retried = client.submit(_spec(model, "disk-full-retried"))["id"]
        run = _wait_for(client, retried, "a second refused checkpoint",
                        lambda r: len(_events(r, "checkpoint_out_of_space")) >= 2)
        refused = _events(run, "checkpoint_out_of_space")
        assert [e["refusals"] for e in refused[:2]] == [1, 2] and {e["step"] for e in refused} == {CHECKPOINT_EVERY}
        assert all(e["then"] == "retry" and e["retry_in_s"] > 0 for e in refused), refused
        # The trainer's own words, naming the path.
        assert "No space left on device" in refused[0]["reason"] and refused[0]["path"] in refused[0]["reason"]
        assert refused[0]["path"] == str(data_dir / retried / "checkpoints" / "step_000002")
        assert run["status"] == "running" and run["step"] == CHECKPOINT_EVERY - 1  # step 2 waits, unrecorded
        assert _files(data_dir / retried) == []  # nothing half-written that could pass for a checkpoint
        ballast.unlink()
        done = client.wait(retried, timeout_s=300)
        assert done["status"] == "completed", done
        assert [e["step"] for e in _events(done, "checkpoint_space_recovered")] == [CHECKPOINT_EVERY]
        assert not _events(done, "paused") and not _events(done, "step_replayed")
        _assert_completed_once_each(client, data_dir / retried / "checkpoints", retried)
        assert _trained_steps(stack).get("trained") == STEPS

        # Paused: with no retry window the first refusal holds the run.
        stack.coordinator.stop()
        stack.coordinator.env["LOCKSTEP_COORDINATOR_CHECKPOINT_RETRY_WINDOW_S"] = "0"
        stack.restart_coordinator()
        ballast = fill(data_dir)
        paused = client.submit(_spec(model, "disk-full-paused"))["id"]
        # The client's wait returns a paused run: it would otherwise wait for an operator forever.
        run = client.wait(paused, timeout_s=300)
        assert run["status"] == "paused", run
        (refused,) = _events(run, "checkpoint_out_of_space")
        assert refused["then"] == "pause" and refused["retry_in_s"] is None and refused["step"] == CHECKPOINT_EVERY
        assert run["step"] == CHECKPOINT_EVERY - 1 and refused["path"] in run["error"], run
        assert f"/v1/runs/{paused}/resume" in run["error"] and "No space left on device" in run["error"], run["error"]
        assert _files(data_dir / paused) == []

        # A restart does not end it: still paused, still resumable. Only an authenticated resume moves it.
        stack.coordinator.stop()
        stack.restart_coordinator()
        assert client.run(paused)["status"] == "paused"
        assert httpx.post(f"{stack.api_url}/v1/runs/{paused}/resume", timeout=30).status_code == 401
        with pytest.raises(ApiError) as not_paused:
            client.resume(retried)
        assert not_paused.value.status == 409 and "completed, not paused" in str(not_paused.value.body)
        ballast.unlink()
        resumed = client.resume(paused)
        assert resumed["status"] == "pending" and resumed["error"] == "", resumed
        done = client.wait(paused, timeout_s=300)
        assert done["status"] == "completed", done
        statuses = [e["event"] for e in done["events"] if e["event"] in STATUS_EVENTS]
        assert statuses == ["submitted", "running", "paused", "resumed", "running", "completed"], statuses
        # The step whose checkpoint waited was trained before the pause and replayed after it, not trained again.
        assert [e["step"] for e in _events(done, "step_replayed")] == [CHECKPOINT_EVERY]
        _assert_completed_once_each(client, data_dir / paused / "checkpoints", paused)
        trained = _trained_steps(stack)
        assert trained.get("trained") == 2 * STEPS and trained.get("replayed") == 1, trained
    finally:
        client.close()
