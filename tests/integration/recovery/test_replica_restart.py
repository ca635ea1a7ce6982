"""The only rollout replica dies mid-run and is restarted once the run has found it gone (holding no model):
the run waits for it, gives it the run's model and current weights, and completes. Real processes throughout."""
from __future__ import annotations

import time

import pytest

from recipes.tiny_model import build_model_dir
from services.cli.client import CoordinatorClient
from services.local_stack import LocalStack

pytestmark = pytest.mark.slow
STEPS, PROMPTS, SAMPLES = 12, 4, 2


def test_single_replica_killed_and_restarted_is_reloaded_and_the_run_completes(tmp_path):
    model = build_model_dir(tmp_path / "model", seed=3)
    with LocalStack(tmp_path / "stack", rollout_replicas=1, path_roots=[tmp_path]) as stack:
        client = stack.client(timeout_s=120)
        try:
            run = client.submit({
                "name": "replica-restart", "model_path": str(model), "seed": 5, "steps": STEPS,
                "task": {"name": "arithmetic", "options": {"heldout_size": 8}},
                "rollout": {"prompts_per_step": PROMPTS, "samples_per_prompt": SAMPLES,
                            "sampling": {"max_new_tokens": 4}},
                "eval": {"every": 4, "heldout_size": 8},
            })
            deadline = time.monotonic() + 300
            while (at := client.run(run["id"]))["step"] < 2:
                assert at["status"] in ("pending", "running") and time.monotonic() < deadline, at
                time.sleep(0.05)
            victim = stack.rollouts[0]
            victim.kill()  # SIGKILL: the run's only replica, its model and weights gone
            killed_at = client.run(run["id"])["step"]
            # The run finds its only replica gone (evicted) and waits for it: only then is it started again.
            while not any(e["event"] == "replica_evicted" for e in client.run(run["id"])["events"]):
                assert client.run(run["id"])["status"] == "running" and time.monotonic() < deadline, at
                time.sleep(0.05)
            victim.start()  # same port, a fresh process with no model loaded
            done = client.wait(run["id"], timeout_s=300)
            assert done["status"] == "completed", done
            assert killed_at < STEPS, "run finished before the replica was killed; the test shows nothing"

            steps = client.metrics(run["id"])["steps"]
            assert [s["step"] for s in steps] == list(range(1, STEPS + 1))
            for s in steps:  # nothing was dropped, and every sample came from the step's weights
                m = s["metrics"]
                assert (m["trajectories_trained"], m["trajectories_dropped"]) == (PROMPTS * SAMPLES, 0), s
                assert abs(m["iw_mean"] - 1) <= 1e-3, s
            events = client.run(run["id"])["events"]
            names = [e["event"] for e in events]
            back = [e for e in events if e["event"] in ("replica_readmitted", "replica_reloaded")]
            assert back and all(e["replica"] == f"127.0.0.1:{stack.rollout_ports[0]}" for e in back), events
            assert back[0]["step"] >= killed_at and "failed" not in names, names
        finally:
            client.close()
