"""A rollout replica dies mid-run: it is evicted, the run goes on with the other replica, and once
the replica is back it is synced to the current weights and re-admitted. Real processes throughout."""
from __future__ import annotations

import time

import pytest

from proto import lockstep_pb2 as pb
from proto import lockstep_pb2_grpc as pb_grpc
from recipes.tiny_model import build_model_dir
from services.cli.client import CoordinatorClient
from services.common.auth import BearerToken
from services.common.grpc.options import sync_channel
from services.local_stack import LocalStack

pytestmark = pytest.mark.slow
STEPS, PROMPTS, SAMPLES = 1000, 4, 2  # never reached: the test cancels once the replica is back


def _wait_step(client: CoordinatorClient, run_id: str, step: int, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while (run := client.run(run_id))["step"] < step:
        assert run["status"] in ("pending", "running"), run
        assert time.monotonic() < deadline, f"run did not reach step {step}"
        time.sleep(0.1)


def _info(port: int, token: BearerToken) -> pb.ServiceInfo:
    with sync_channel(f"127.0.0.1:{port}", token) as ch:
        return pb_grpc.RolloutStub(ch).Info(pb.InfoRequest(), timeout=10)


def test_dead_replica_is_evicted_and_readmitted_after_restart(tmp_path):
    model = build_model_dir(tmp_path / "model", seed=3)
    with LocalStack(tmp_path / "stack", rollout_replicas=2, path_roots=[tmp_path]) as stack:
        client = stack.client()
        try:
            run = client.submit({
                "name": "evict", "model_path": str(model), "seed": 5, "steps": STEPS,
                "task": {"name": "arithmetic", "options": {"heldout_size": 8}},
                "rollout": {"prompts_per_step": PROMPTS, "samples_per_prompt": SAMPLES,
                            "sampling": {"max_new_tokens": 4}},
                "eval": {"every": 0, "heldout_size": 8},
            })
            _wait_step(client, run["id"], 2)
            victim = stack.rollouts[1]
            victim.kill()  # SIGKILL: no goodbye, the port just stops answering
            _wait_step(client, run["id"], 4)
            victim.start()  # same port, a fresh process with no model loaded
            deadline = time.monotonic() + 240
            while not (readmitted := [e for e in client.run(run["id"])["events"] if e["event"] == "replica_readmitted"]):
                assert client.run(run["id"])["status"] == "running", "run ended before the replica came back"
                assert time.monotonic() < deadline, "restarted replica was never readmitted"
                time.sleep(0.2)
            back_at = readmitted[0]["step"]
            # Back in service: it is synced after every later step like any live replica.
            _wait_step(client, run["id"], back_at + 2)
            info = _info(stack.rollout_ports[1], stack.token)
            assert info.run_id == run["id"] and info.policy_version >= back_at + 1, info
            client.cancel(run["id"])  # the run has shown what it had to; no need to finish all its steps
            done = client.wait(run["id"], timeout_s=120)
            assert done["status"] == "cancelled", done
            steps = client.metrics(run["id"])["steps"]
            assert [s["step"] for s in steps] == list(range(1, len(steps) + 1)) and len(steps) >= back_at + 2
            for s in steps:  # a lost shard is re-dispatched to the live replica, never dropped
                m = s["metrics"]
                assert (m["trajectories_trained"], m["trajectories_dropped"]) == (PROMPTS * SAMPLES, 0), s
                assert abs(m["iw_mean"] - 1) <= 1e-3, s  # every replica that sampled held the step's weights
            events = client.run(run["id"])["events"]
            address = f"127.0.0.1:{stack.rollout_ports[1]}"
            evicted = [e for e in events if e["event"] == "replica_evicted"]
            assert evicted and all(e["replica"] == address and e["live"] == 1 for e in evicted), events
            assert readmitted[0]["replica"] == address and readmitted[0]["live"] == 2
            assert back_at > evicted[0]["step"] >= 2
        finally:
            client.close()
