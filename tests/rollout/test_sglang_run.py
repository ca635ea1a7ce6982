"""Whole runs with engine=sglang through the coordinator's REST API (issue 3 acceptance).

The real stack on loopback (coordinator + embedded Redis, trainer, one rollout
service); the rollout service launches its SGLang server from the SGLang
virtualenv. The runs share the stack: a clean 3-step run, one whose weights
are broadcast over a gloo group into the SGLang server, and one whose SGLang
server is SIGKILLed while a Generate is in flight.
"""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from services.common.tiny_model import build_model_dir
from services.local_stack import LocalStack
from services.rollout.registry import ENGINES
from services.rollout.sglang_config import default_python
from tests.conftest import require

pytestmark = pytest.mark.slow
STEPS, PROMPTS, SAMPLES = 3, 4, 4


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    require(Path(default_python()).is_file(),
            f"SGLang virtualenv not built ({default_python()} missing): run `make sglang-venv`")
    require("sglang" in ENGINES, "services/rollout/registry.py does not register the 'sglang' engine")
    with LocalStack(tmp_path_factory.mktemp("stack"), path_roots=[tmp_path_factory.getbasetemp()]) as s:
        yield s


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return build_model_dir(tmp_path_factory.mktemp("model") / "tiny", seed=0)


@pytest.fixture
def client(stack):
    c = stack.client()
    yield c
    c.close()


KILL_STEPS = 8


def spec(model_dir: Path, name: str, max_new_tokens: int = 4, steps: int = STEPS) -> dict:
    return {
        "name": name,
        "model_path": str(model_dir),
        "seed": 7,
        "steps": steps,
        "task": {"name": "arithmetic", "options": {"digits": 2, "heldout_size": 8}},
        "rollout": {
            "engine": "sglang",
            "engine_options": {"platform": "cpu"},
            "prompts_per_step": PROMPTS, "samples_per_prompt": SAMPLES,
            "sampling": {"temperature": 1.0, "max_new_tokens": max_new_tokens},
        },
        "trainer": {"lr": 1e-3, "temperature": 1.0},
        "eval": {"every": 0, "heldout_size": 8},
    }


def assert_every_trajectory_once(client, run_id: str, n_steps: int = STEPS) -> list[dict]:
    steps = client.metrics(run_id)["steps"]
    assert [s["step"] for s in steps] == list(range(1, n_steps + 1))  # each step recorded once
    for s in steps:
        m = s["metrics"]
        assert m["trajectories_trained"] + m["trajectories_dropped"] == PROMPTS * SAMPLES, m
        assert m["trajectories_dropped"] == 0, m  # re-dispatched, not dropped
        # Trainer and SGLang hold the same weights at every step (synced from disk).
        assert abs(m["iw_mean"] - 1) <= 1e-4, m
    return steps


def test_three_step_run_with_sglang_through_rest(client, model_dir, stack, tmp_path):
    run = client.submit(spec(model_dir, "sglang-3"))
    done = client.wait(run["id"], timeout_s=900)
    assert done["status"] == "completed", (done, stack.rollouts[0].tail())
    steps = assert_every_trajectory_once(client, run["id"])
    print("\niw_mean / logprob_abs_diff_max per step:",
          [(s["metrics"]["iw_mean"], s["metrics"]["logprob_abs_diff_max"]) for s in steps])
    assert steps[0]["metrics"]["logprob_abs_diff_max"] <= 1e-4, steps[0]


def test_three_step_run_with_sglang_over_the_broadcast_source(client, model_dir, stack):
    # The SGLang server joins a gloo group with the trainer every sync and loads the buckets it broadcasts.
    body = spec(model_dir, "sglang-broadcast")
    body["rollout"]["weight_sync"] = "broadcast"
    run = client.submit(body)
    done = client.wait(run["id"], timeout_s=900)
    assert done["status"] == "completed", (done, stack.rollouts[0].tail())
    steps = assert_every_trajectory_once(client, run["id"])
    # Every step's samples are scored by SGLang as the trainer scores them with that version's weights.
    assert all(s["metrics"]["logprob_abs_diff_max"] <= 1e-4 for s in steps), steps
    synced = [e for e in client.run(run["id"])["events"] if e["event"] == "weights_synced"]
    assert [e["policy_version"] for e in synced] == [1, 2, 3]
    # No sha256 of the bytes on this path: the replica reports SGLang's checksum of what it serves.
    assert all(e["digest"].startswith("engine:") and len(e["digest"]) == 7 + 64 for e in synced), synced
    log = (stack.run_dir / "logs" / "rollout0.log").read_text()
    assert log.count('"via": "ReceiveWeights"') >= 3


def sglang_server_of(rollout_pid: int) -> tuple[int, int]:
    """(pid, port) of the SGLang server the rollout service launched (its child)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        ppid = int(stat[stat.rindex(")") + 2:].split()[1])
        if ppid == rollout_pid and any(b"sglang.launch_server" in a for a in argv):
            return int(entry.name), int(argv[argv.index(b"--port") + 1])
    raise LookupError(f"no SGLang server child of rollout pid {rollout_pid}")


def running_requests(port: int) -> float:
    """SGLang's own gauge of requests in the running batch (--enable-metrics)."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("sglang:num_running_reqs"))


def test_sglang_killed_mid_batch_run_completes_with_every_trajectory_once(client, model_dir, stack, tmp_path):
    # Longer responses and more steps keep Generate in flight long enough for the
    # poll below to catch a running batch even on a fast, idle machine.
    run = client.submit(spec(model_dir, "sglang-kill", max_new_tokens=100, steps=KILL_STEPS))
    rollout_pid = stack.rollouts[0].proc.pid
    deadline = time.monotonic() + 600
    killed = None
    while killed is None:
        assert time.monotonic() < deadline, "never saw step 2's batch in flight"
        state = client.run(run["id"])
        assert state["status"] in ("pending", "running"), state
        # Kill once the weights of step 1 are synced, so the restart must reload them.
        if state["step"] >= 1:
            try:
                pid, port = sglang_server_of(rollout_pid)
                if running_requests(port) > 0:
                    os.kill(pid, signal.SIGKILL)
                    killed = pid
                    print(f"\nSIGKILL sglang pid {pid} during step {state['step'] + 1} with requests running")
                    break
            except (LookupError, httpx.HTTPError):
                pass
        time.sleep(0.05)

    done = client.wait(run["id"], timeout_s=900)
    assert done["status"] == "completed", (done, stack.rollouts[0].tail())
    steps = assert_every_trajectory_once(client, run["id"], KILL_STEPS)
    print("iw_mean per step:", [s["metrics"]["iw_mean"] for s in steps])
    events = [e["event"] for e in client.run(run["id"])["events"]]
    print("events:", events)
    assert "generate_redispatched" in events, events
    new_pid, _ = sglang_server_of(rollout_pid)
    assert new_pid != killed
