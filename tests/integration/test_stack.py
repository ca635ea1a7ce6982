"""The real services on loopback: real gRPC, real HTTP, a real Redis server.

One stack serves the module's tests (starting it costs ~10 s of two CPU cores);
runs are submitted through the REST API exactly as a user would.
"""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from recipes.tiny_model import build_model_dir
from services.cli.client import ApiError
from services.local_stack import LocalStack

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return build_model_dir(tmp_path_factory.mktemp("model") / "tiny", seed=0)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with LocalStack(tmp_path_factory.mktemp("stack"), path_roots=[tmp_path_factory.getbasetemp()]) as s:
        yield s


@pytest.fixture
def client(stack):
    c = stack.client()
    yield c
    c.close()


def spec(model_dir: Path, **over) -> dict:
    base = {
        "name": "it",
        "model_path": str(model_dir),
        "seed": 7,
        "steps": 3,
        "task": {"name": "arithmetic", "options": {"digits": 2, "heldout_size": 16}},
        "rollout": {"prompts_per_step": 4, "samples_per_prompt": 4,
                    "sampling": {"temperature": 1.0, "max_new_tokens": 4}},
        "trainer": {"lr": 1e-3, "temperature": 1.0},
        "eval": {"every": 0, "heldout_size": 16},
    }
    base.update(over)
    return base


def test_three_step_run_through_rest(client, model_dir, stack):
    run = client.submit(spec(model_dir))
    done = client.wait(run["id"], timeout_s=300)
    assert done["status"] == "completed", done
    steps = client.metrics(run["id"])["steps"]
    assert [s["step"] for s in steps] == [1, 2, 3]
    first = steps[0]["metrics"]
    # Step 1: trainer and rollout hold the same weights, so IW must be 1.
    assert abs(first["iw_mean"] - 1) <= 1e-4, first
    assert first["logprob_abs_diff_max"] <= 1e-3, first
    assert first["trajectories_trained"] == 16 and first["trajectories_dropped"] == 0
    # The policy moved: later steps are scored against synced weights, still IW ~ 1.
    assert abs(steps[2]["metrics"]["iw_mean"] - 1) <= 1e-3
    assert "eval_accuracy" in steps[2]["metrics"]
    assert client.run(run["id"])["eval_initial"] is not None
    ckpt = stack.run_dir / "coordinator" / run["id"] / "checkpoints" / "step_000003"
    assert (ckpt / "model.safetensors").is_file() and (ckpt / "config.json").is_file()


def test_same_seed_gives_bitwise_identical_metrics(client, model_dir):
    a = client.submit(spec(model_dir, name="det-a", steps=2))
    assert client.wait(a["id"], timeout_s=300)["status"] == "completed"
    b = client.submit(spec(model_dir, name="det-b", steps=2))
    assert client.wait(b["id"], timeout_s=300)["status"] == "completed"
    ma = [s["metrics"] for s in client.metrics(a["id"])["steps"]]
    mb = [s["metrics"] for s in client.metrics(b["id"])["steps"]]
    assert ma == mb  # floats round-trip exactly through JSON: equality is bitwise
    assert client.metrics(a["id"])["eval_initial"] == client.metrics(b["id"])["eval_initial"]


@pytest.mark.parametrize(
    "override, field",
    [
        ({"steps": 0}, "steps"),
        ({"model_path": "/nonexistent/model"}, "model_path"),
        ({"task": {"name": "nope"}}, "task"),
        ({"rollout": {"samples_per_prompt": 1}}, "rollout.samples_per_prompt"),
        ({"trainer": {"lr": -1, "temperature": 1.0}}, "trainer.lr"),
        ({"trainer": {"temperature": 0.5}}, "(body)"),  # must equal the sampling temperature
        ({"unknown_field": 1}, "unknown_field"),
    ],
)
def test_invalid_spec_is_422_naming_the_field_and_stores_nothing(client, model_dir, override, field):
    before = len(client.runs())
    with pytest.raises(ApiError) as err:
        client.submit(spec(model_dir, **override))
    assert err.value.status == 422
    fields = [f["field"] for f in err.value.body["fields"]]
    assert any(f == field or f.startswith(field + ".") for f in fields), err.value.body
    assert all(f["reason"] for f in err.value.body["fields"])
    assert len(client.runs()) == before


def _refusal(client, body: dict) -> list[dict]:
    with pytest.raises(ApiError) as err:
        client.submit(body)
    assert err.value.status == 422, err.value.body
    return err.value.body["fields"]


def test_paths_outside_the_roots_and_service_options_are_422_naming_the_field(client, model_dir, tmp_path):
    before = len(client.runs())
    escape = str(model_dir) + "/.." * 40 + "/etc"
    link = tmp_path / "link-to-usr"  # inside the roots, pointing out of them
    link.symlink_to("/usr")
    for model_path in ("/etc", escape, str(link)):
        fields = _refusal(client, spec(model_dir, model_path=model_path))
        assert [f["field"] for f in fields] == ["model_path"], fields
        assert "outside the allowed roots" in fields[0]["reason"], fields
    # A dataset that exists and one that does not are refused alike: no oracle for files outside the roots.
    reasons = []
    for path in ("/etc/shadow", "/nonexistent/problems.jsonl"):
        fields = _refusal(client, spec(model_dir, task={"name": "math", "options": {"path": path}}))
        assert [f["field"] for f in fields] == ["task"], fields
        assert "options.path" in fields[0]["reason"] and "outside the allowed roots" in fields[0]["reason"]
        reasons.append(fields[0]["reason"].replace(path, "<path>"))
    assert reasons[0] == reasons[1]
    # The SGLang interpreter (and the directories it writes) belong to the rollout service's configuration.
    for option, value in (("python", "/bin/sh"), ("weights_dir", "/etc/x"), ("extra_args", ["--help"])):
        fields = _refusal(client, spec(model_dir, rollout={"engine": "sglang", "engine_options": {option: value},
                                                           "prompts_per_step": 2, "samples_per_prompt": 2}))
        assert [f["field"] for f in fields] == [f"rollout.engine_options.{option}"], fields
        assert fields[0]["reason"].startswith("set by the rollout service"), fields
    assert len(client.runs()) == before


def test_unknown_run_is_404(client):
    for call in (client.run, client.metrics, client.cancel):
        with pytest.raises(ApiError) as err:
            call("does-not-exist")
        assert err.value.status == 404


def test_coordinator_sigkill_resumes_with_every_step_once(client, model_dir, stack):
    run = client.submit(spec(model_dir, name="resume", steps=5))
    deadline = time.monotonic() + 300
    while client.run(run["id"])["step"] < 2:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    stack.coordinator.proc.send_signal(signal.SIGKILL)
    stack.coordinator.proc.wait()
    stack.restart_coordinator()
    fresh = stack.client()
    try:
        done = fresh.wait(run["id"], timeout_s=300)
        assert done["status"] == "completed", done
        steps = fresh.metrics(run["id"])["steps"]
        assert [s["step"] for s in steps] == [1, 2, 3, 4, 5]
        for s in steps:  # every trajectory of every step accounted for, once
            assert s["metrics"]["trajectories_trained"] + s["metrics"]["trajectories_dropped"] == 16
        events = [e["event"] for e in fresh.run(run["id"])["events"]]
        assert events.count("services_configured") == 2  # once per coordinator life
    finally:
        fresh.close()


def test_crash_between_train_and_record_replays_the_step(client, model_dir, stack):
    """The trainer applied step 2 but the coordinator died before recording it:
    the restarted coordinator must replay step 2 (not train it twice) and go on.
    The crash comes from a test-only entry point (tests.support.crashing_coordinator)."""
    args = list(stack.coordinator.args)
    stack.coordinator.stop()
    assert args[1:3] == ["-m", "services.coordinator"], args
    stack.coordinator.args = [args[0], "-m", "tests.support.crashing_coordinator", "--crash-after-train-step", "2",
                              *args[3:]]
    stack.restart_coordinator()
    c = stack.client()
    try:
        run = c.submit(spec(model_dir, name="replay", steps=3))
        stack.coordinator.proc.wait(timeout=300)
        assert stack.coordinator.proc.returncode == 137
    finally:
        c.close()
    stack.coordinator.args = args
    stack.restart_coordinator()
    fresh = stack.client()
    try:
        assert fresh.wait(run["id"], timeout_s=300)["status"] == "completed"
        steps = fresh.metrics(run["id"])["steps"]
        assert [s["step"] for s in steps] == [1, 2, 3]
        assert steps[1]["metrics"]["trajectories_trained"] == 16
        events = [e["event"] for e in fresh.run(run["id"])["events"]]
        assert events.count("step_replayed") == 1
    finally:
        fresh.close()
    # The replayed run must equal an uninterrupted one with the same seed, bit for bit.
    ref = client.submit(spec(model_dir, name="replay-ref", steps=3))
    assert client.wait(ref["id"], timeout_s=300)["status"] == "completed"
    assert [s["metrics"] for s in client.metrics(ref["id"])["steps"]] == [s["metrics"] for s in steps]


def test_cancel(client, model_dir):
    run = client.submit(spec(model_dir, name="cancel-me", steps=50))
    client.cancel(run["id"])
    done = client.wait(run["id"], timeout_s=120)
    assert done["status"] == "cancelled"
    with pytest.raises(ApiError) as err:
        client.cancel(run["id"])
    assert err.value.status == 409


def _math_dataset(path: Path, n: int) -> Path:
    path.write_text("".join(
        json.dumps({"question": f"{i}+1=", "answer": f"{i}+1 is {i + 1}\n#### {i + 1}"}) + "\n" for i in range(n)))
    return path


def test_math_task_run_scores_with_math_verify_in_the_coordinator(client, model_dir, tmp_path):
    data = _math_dataset(tmp_path / "math.jsonl", 40)
    task = {"name": "math", "options": {"path": str(data), "answer_marker": "####", "heldout_size": 8,
                                        "prompt_template": "{question}"}}
    run = client.submit(spec(model_dir, task=task, steps=2, eval={"every": 1, "heldout_size": 8}))
    done = client.wait(run["id"], timeout_s=300)
    assert done["status"] == "completed", done
    metrics = client.metrics(run["id"])
    steps = metrics["steps"]
    assert [s["step"] for s in steps] == [1, 2]
    for s in steps:
        m = s["metrics"]
        assert 0.0 <= m["reward_mean"] <= 1.0 and 0.0 <= m["eval_accuracy"] <= 1.0
        assert m["trajectories_trained"] == 16 and m["trajectories_dropped"] == 0
    assert 0.0 <= metrics["eval_initial"]["accuracy"] <= 1.0


def test_math_task_with_a_missing_dataset_is_refused_at_submit_naming_it(client, model_dir, tmp_path):
    before = len(client.runs())
    with pytest.raises(ApiError) as err:
        client.submit(spec(model_dir, task={"name": "math", "options": {"path": str(tmp_path / "nope.jsonl")}}))
    assert err.value.status == 422
    reasons = {f["field"]: f["reason"] for f in err.value.body["fields"]}
    assert "path: no such file" in reasons.get("task.options", ""), err.value.body
    assert len(client.runs()) == before


def _replay(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services.trainer.tools.replay", *args], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[2], timeout=300)


def test_recorded_steps_replay_alone_to_the_same_bits(client, model_dir, stack):
    run = client.submit(spec(model_dir, steps=3, debug={"record_trajectories": True}, checkpoint={"every": 1}))
    assert client.wait(run["id"], timeout_s=300)["status"] == "completed"
    recorded = {s["step"]: s["metrics"] for s in client.metrics(run["id"])["steps"]}
    run_dir = stack.run_dir / "coordinator" / run["id"]
    for step, checkpoint in ((1, ""), (3, str(run_dir / "checkpoints" / "step_000002"))):
        out = _replay("--record", str(run_dir / "trajectories" / f"step_{step:06d}.pb"), "--checkpoint", checkpoint)
        assert out.returncode == 0, out.stderr[-3000:]
        replayed = json.loads(out.stdout.strip().splitlines()[-1])
        assert (replayed["run_id"], replayed["step"], replayed["policy_version"]) == (run["id"], step, step)
        # Every trainer metric, bit for bit (floats round-trip exactly through JSON).
        assert replayed["metrics"] == {k: recorded[step][k] for k in replayed["metrics"]}
    wrong = _replay("--record", str(run_dir / "trajectories" / "step_000003.pb"),
                    "--checkpoint", str(run_dir / "checkpoints" / "step_000001"))
    assert wrong.returncode == 2 and "checkpoint: holds policy version 1; step 3 starts from 2" in wrong.stderr
