"""Redis goes away under a running coordinator: the run waits, resumes and completes with every step
recorded once. Real processes throughout: redis-server, coordinator, trainer and rollout on loopback."""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from recipes.tiny_model import build_model_dir
from services.cli.client import CoordinatorClient
from services.common.process.ports import free_port
from services.coordinator.state.embedded_redis import EmbeddedRedis
from services.local_stack import LocalStack

pytestmark = pytest.mark.slow
STEPS, PROMPTS, SAMPLES = 12, 4, 2


def _spec(model: Path, name: str) -> dict:
    return {
        "name": name, "model_path": str(model), "seed": 11, "steps": STEPS,
        "task": {"name": "arithmetic", "options": {"heldout_size": 8}},
        "rollout": {"prompts_per_step": PROMPTS, "samples_per_prompt": SAMPLES, "sampling": {"max_new_tokens": 4}},
        "eval": {"every": 0, "heldout_size": 8},
    }


def _wait_step(client: CoordinatorClient, run_id: str, step: int, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while (run := client.run(run_id))["step"] < step:
        assert run["status"] in ("pending", "running"), run
        assert time.monotonic() < deadline, f"run did not reach step {step}"
        time.sleep(0.05)


def _redis_children(parent_pid: int) -> list[int]:
    """Pids of the redis-server processes whose parent is `parent_pid` (from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        comm = stat[stat.index("(") + 1:stat.rindex(")")]
        ppid = int(stat[stat.rindex(")") + 2:].split()[1])
        if ppid == parent_pid and comm.startswith("redis-server"):
            found.append(int(entry.name))
    return found


def _trained_steps(stack: LocalStack) -> dict[str, float]:
    """The trainer's lockstep_trainer_steps_total by outcome, read from its /metrics."""
    body = httpx.get(f"http://127.0.0.1:{stack.metrics_ports['trainer']}/metrics", timeout=10).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(body):
        for sample in family.samples:
            if sample.name == "lockstep_trainer_steps_total":
                out[sample.labels["outcome"]] = sample.value
    return out


def _assert_every_step_once(client: CoordinatorClient, stack: LocalStack, run_id: str) -> None:
    steps = client.metrics(run_id)["steps"]
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1)), steps
    for s in steps:
        assert (s["metrics"]["trajectories_trained"], s["metrics"]["trajectories_dropped"]) == (PROMPTS * SAMPLES, 0)
    # Trained once each: a step redone after the outage is a replay, not a second update.
    assert _trained_steps(stack).get("trained") == STEPS, _trained_steps(stack)


def test_embedded_redis_killed_mid_run_is_restarted_and_the_run_completes(tmp_path):
    model = build_model_dir(tmp_path / "model", seed=3)
    with LocalStack(tmp_path / "stack", path_roots=[tmp_path]) as stack:
        client = stack.client(timeout_s=120)
        try:
            run = client.submit(_spec(model, "redis-killed"))
            _wait_step(client, run["id"], 2)
            (victim,) = _redis_children(stack.coordinator.proc.pid)
            killed_at = client.run(run["id"])["step"]
            os.kill(victim, signal.SIGKILL)
            assert killed_at < STEPS, "run finished before Redis was killed; the test shows nothing"
            done = client.wait(run["id"], timeout_s=300)
            assert done["status"] == "completed", done
            restarted = _redis_children(stack.coordinator.proc.pid)
            assert len(restarted) == 1 and restarted[0] != victim, (victim, restarted)
            _assert_every_step_once(client, stack, run["id"])
            assert httpx.get(f"{stack.api_url}/readyz", timeout=30).status_code == 200
        finally:
            client.close()


def test_external_redis_down_answers_503_and_the_run_completes_once_it_is_back(tmp_path):
    model = build_model_dir(tmp_path / "model", seed=3)
    redis = EmbeddedRedis(tmp_path / "external-redis", port=free_port()).start()  # stands in for compose's Redis
    try:
        with LocalStack(tmp_path / "stack", redis_url=redis.url, redis_password=redis.password,
                        path_roots=[tmp_path]) as stack:
            client = stack.client(timeout_s=120)
            try:
                run = client.submit(_spec(model, "redis-restarted"))
                _wait_step(client, run["id"], 2)
                killed_at = client.run(run["id"])["step"]
                os.kill(redis.pid, signal.SIGKILL)
                redis.stop()  # reaps it
                auth = {"Authorization": stack.token.header}

                r = httpx.get(f"{stack.api_url}/v1/runs/{run['id']}", headers=auth, timeout=120)
                assert r.status_code == 503, r.text
                assert r.json()["error"] == "run store unavailable" and r.headers["retry-after"]
                submit = httpx.post(f"{stack.api_url}/v1/runs", json=_spec(model, "during-outage"), headers=auth,
                                    timeout=120)
                assert submit.status_code == 503, submit.text
                # The scheduler meets the outage, survives it, and says so on /readyz.
                deadline = time.monotonic() + 240
                while True:
                    ready = httpx.get(f"{stack.api_url}/readyz", timeout=120)
                    assert ready.status_code == 503, ready.text
                    assert ready.json()["checks"]["redis"] is False, ready.text
                    if ready.json()["checks"]["scheduler"] is False:
                        break
                    assert time.monotonic() < deadline, f"scheduler never reported the outage: {ready.text}"
                    time.sleep(0.2)
                assert stack.coordinator.alive()
                assert killed_at < STEPS, "run finished before Redis was killed; the test shows nothing"

                redis.start()  # same port, same append-only file
                done = client.wait(run["id"], timeout_s=300)
                assert done["status"] == "completed", done
                _assert_every_step_once(client, stack, run["id"])
                assert [r["name"] for r in client.runs()] == ["redis-restarted"]  # the 503 submit stored nothing
                deadline = time.monotonic() + 120
                while (ready := httpx.get(f"{stack.api_url}/readyz", timeout=30)).status_code != 200:
                    assert time.monotonic() < deadline, ready.text
                    time.sleep(0.2)
                assert ready.json()["checks"]["scheduler"] is True
            finally:
                client.close()
    finally:
        redis.stop()
