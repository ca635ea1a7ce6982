"""The trainer dies mid-run: the run waits for it, resumes it from the last checkpoint, recomputes the
steps after that checkpoint and finishes with the same bits as a run that never lost its trainer.
Real processes throughout (coordinator + Redis, trainer, rollout replica on loopback)."""
from __future__ import annotations

import time

import httpx
import pytest
from safetensors.torch import load_file

from recipes.tiny_model import build_model_dir
from services.local_stack import LocalStack

pytestmark = pytest.mark.slow
STEPS, CHECKPOINT_EVERY = 8, 2


def _spec(model, name: str, weight_sync: str | None = None) -> dict:
    """`weight_sync`: a fixed_lag run (K = 1) syncing that way, the replicas synced while each step trains."""
    spec = {
        "name": name, "model_path": str(model), "seed": 7, "steps": STEPS,
        "task": {"name": "arithmetic", "options": {"heldout_size": 8}},
        "rollout": {"prompts_per_step": 4, "samples_per_prompt": 2, "sampling": {"max_new_tokens": 4}},
        "eval": {"every": 4, "heldout_size": 8},
        "checkpoint": {"every": CHECKPOINT_EVERY},
    }
    if weight_sync is not None:
        spec["rollout"]["weight_sync"] = weight_sync
        spec.update({"async": {"max_staleness": 1, "mode": "fixed_lag"}, "eval": {"every": 0, "heldout_size": 8}})
        spec["trainer"] = {"mismatch_correction": {"mode": "truncate"}}
    return spec


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_model_dir(tmp_path_factory.mktemp("model"), seed=3)


@pytest.fixture(scope="module")
def stack(tmp_path_factory, model):
    """One stack for the recovery cases: each ends with its trainer started again and holding no run."""
    with LocalStack(tmp_path_factory.mktemp("stack"), path_roots=[model.parent]) as s:
        yield s


def _final_weights(stack: LocalStack, run_id: str) -> dict:
    return load_file(stack.run_dir / "coordinator" / run_id / "checkpoints" / f"step_{STEPS:06d}" / "model.safetensors")


@pytest.mark.parametrize("weight_sync", [None, "grpc", "shared_path"])
def test_killed_trainer_is_resumed_from_checkpoint_and_the_run_ends_bitwise_as_if_never_lost(stack, model,
                                                                                              weight_sync):
    """Also in fixed_lag (K = 1), where the replicas sync to s-1 from the copy the trainer keeps while step s
    trains: a trainer killed mid-step takes that copy with it, and the run recovers all the same."""
    client = stack.client()
    try:
        clean = client.submit(_spec(model, "clean", weight_sync))
        assert client.wait(clean["id"], timeout_s=300)["status"] == "completed"

        run = client.submit(_spec(model, "trainer-killed", weight_sync))
        deadline = time.monotonic() + 300
        while client.run(run["id"])["step"] < CHECKPOINT_EVERY + 1:  # a checkpoint and a step after it
            assert client.run(run["id"])["status"] in ("pending", "running")
            assert time.monotonic() < deadline, "run did not reach step 3"
            time.sleep(0.05)
        stack.trainer.kill()  # SIGKILL: weights, optimizer state and policy version are gone
        killed_at = client.run(run["id"])["step"]
        assert killed_at < STEPS, "run finished before the trainer could be killed; the test shows nothing"
        # The coordinator finds the trainer gone and waits for it: only then is it started again.
        while True:
            now = client.run(run["id"])
            if any(e["event"] == "trainer_lost" for e in now["events"]):
                break
            # A failed run names why (its error and last events): the trainer's loss read as something else.
            assert now["status"] == "running" and time.monotonic() < deadline, {
                k: now.get(k) for k in ("status", "step", "error")} | {"events": now["events"][-5:]}
            time.sleep(0.05)
        stack.trainer.start()  # same port, fresh process holding no run
        done = client.wait(run["id"], timeout_s=300)
        assert done["status"] == "completed", done

        events = client.run(run["id"])["events"]
        lost = [e for e in events if e["event"] == "trainer_lost"]
        recovered = [e for e in events if e["event"] == "trainer_recovered"]
        recomputed = [e for e in events if e["event"] == "step_recomputed"]
        assert lost and len(recovered) == 1, events
        resumed = recovered[0]["policy_version"]
        # It came back from the last checkpoint at or before the kill, not from scratch and not ahead.
        assert resumed % CHECKPOINT_EVERY == 0 and CHECKPOINT_EVERY <= resumed <= killed_at, recovered
        assert recovered[0]["resumed_from"].endswith(f"step_{resumed:06d}"), recovered
        # Steps recorded after that checkpoint were recomputed, each matching its record bit for bit.
        assert [e["step"] for e in recomputed] == list(range(resumed + 1, resumed + 1 + len(recomputed)))
        assert all(e["matches_recorded"] and e["differing_metrics"] == [] for e in recomputed), recomputed
        assert resumed + len(recomputed) >= killed_at

        # The coordinator's counters say the same as the events.
        exported = httpx.get(f"{stack.api_url}/metrics", timeout=10).text
        rid = run["id"]
        assert f'lockstep_trainer_recoveries_total{{run_id="{rid}"}} 1.0' in exported
        assert (f'lockstep_steps_recomputed_total{{outcome="matched",run_id="{rid}"}} {float(len(recomputed))}'
                in exported), exported[-2000:]
        assert f'outcome="differed",run_id="{rid}"' not in exported
        # The whole history and the final weights are those of the run that never lost its trainer.
        steps = client.metrics(run["id"])["steps"]
        assert [s["step"] for s in steps] == list(range(1, STEPS + 1))
        assert [s["metrics"] for s in steps] == [s["metrics"] for s in client.metrics(clean["id"])["steps"]]
        a, b = _final_weights(stack, clean["id"]), _final_weights(stack, run["id"])
        assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
    finally:
        client.close()
        if not stack.trainer.alive():  # a failure above left it killed: the next case must not wait on it
            stack.trainer.start()


def test_trainer_that_never_comes_back_fails_the_run_after_the_recovery_timeout_naming_it(tmp_path):
    model = build_model_dir(tmp_path / "model", seed=3)
    timeout_s = 3
    env = {"LOCKSTEP_COORDINATOR_TRAINER_RECOVERY_TIMEOUT_S": str(timeout_s)}
    with LocalStack(tmp_path / "stack", extra_env=env, path_roots=[tmp_path]) as stack:
        client = stack.client()
        try:
            run = client.submit(_spec(model, "trainer-gone") | {"steps": 1000})
            deadline = time.monotonic() + 300
            while client.run(run["id"])["step"] < 1:
                assert time.monotonic() < deadline, "run did not reach step 1"
                time.sleep(0.05)
            stack.trainer.kill()
            done = client.wait(run["id"], timeout_s=120)
            assert done["status"] == "failed", done
            assert f"trainer did not come back within {timeout_s} s" in done["error"], done["error"]
            assert f"127.0.0.1:{stack.trainer_port}" in done["error"], done["error"]
            events = [e["event"] for e in client.run(run["id"])["events"]]
            assert "trainer_lost" in events and "trainer_recovered" not in events, events
        finally:
            client.close()
