"""Whole runs with engine=sglang through the coordinator's REST API.

The real stack on loopback (coordinator + embedded Redis, trainer, one rollout
service); the rollout service launches its SGLang server from the SGLang
virtualenv. The runs share the stack: a clean 3-step run whose run-chosen
server values sit at the edge of the command-line grammar, one whose weights
are broadcast over a gloo group into the SGLang server, and one whose SGLang
server is SIGKILLed while a Generate is in flight; a multi-turn run then reuses
the server the previous run with the same options left. A spec that would put its
own flags on the server's command line is refused before any process starts.
Last, a run rewarded by a judge on SGLang: the stack's scorer replica attaches to
the session's SGLang server (tests/rollout/conftest.py), so no server starts for it.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import httpx
import pytest

from contract.engine_options import SGLangEngineConfig
from contract.platforms import SGLangPlatformConfig
from contract.sglang_command import engine_run_options, server_command
from proto import lockstep_pb2 as pb
from proto import lockstep_pb2_grpc as pb_grpc
from recipes.tiny_model import build_model_dir
from services.cli.client import ApiError
from services.common.grpc.options import sync_channel
from services.common.records.step_record import read_step_record
from services.common.platform import Platform, sglang_launch_plan
from services.local_stack import LocalStack
from services.rollout.registry import ENGINES
from tests.conftest import require, require_sglang_python

pytestmark = pytest.mark.slow
STEPS, PROMPTS, SAMPLES = 3, 4, 4


@pytest.fixture(scope="module")
def stack(tmp_path_factory, sglang_engine):
    require_sglang_python()
    require("sglang" in ENGINES, "services/rollout/registry.py does not register the 'sglang' engine")
    # The judge's scorer replica attaches to the session's SGLang server (tests/rollout/conftest.py) with the
    # operator's flags (--sglang-url, --sglang-api-key-file) instead of starting a server of its own: a start
    # is a minute of CPU here. That server's model directory is the judge's, so it is inside the stack's roots.
    session = sglang_engine
    key = tmp_path_factory.mktemp("judge_key") / "sglang_api_key"
    key.touch(mode=0o600)
    key.write_text(session._api_key)  # the session engine's generated key, held in memory only
    scorer = ("services.rollout", "--sglang-url", session.url, "--sglang-api-key-file", str(key))
    roots = [tmp_path_factory.getbasetemp(), Path(session.model_path).parent]
    try:
        with LocalStack(tmp_path_factory.mktemp("stack"), path_roots=roots, scorers=[scorer]) as s:
            yield s
    finally:
        # The judge's load put the session model's weights on the server as version 0: the session engine's
        # own weights and version go back, for the modules that use the server after this one.
        session.update_weights_from_path(session.weights_path, session.policy_version)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return build_model_dir(tmp_path_factory.mktemp("model") / "tiny", seed=0)


@pytest.fixture
def client(stack):
    c = stack.client()
    yield c
    c.close()


KILL_STEPS = 4


def spec(model_dir: Path, name: str, max_new_tokens: int = 4, steps: int = STEPS, server: dict | None = None) -> dict:
    return {
        "name": name,
        "model_path": str(model_dir),
        "seed": 7,
        "steps": steps,
        "task": {"name": "arithmetic", "options": {"digits": 2, "heldout_size": 8}},
        "rollout": {
            "engine": "sglang",
            "engine_options": {"platform": "cpu", "server": server or {}},
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


# Run-chosen values at the edge of the command-line grammar: a model directory whose name starts with '-'
# and holds '=' and a flag's spelling, the smallest tensor-parallel degree, and the KV-cache size as a number
# the run chose. Each must reach the server as the value of its own flag, one element each. (A negative
# value, chunked_prefill_size -1, renders as `--chunked-prefill-size=-1` and SGLang's parser reads it
# (test_sglang_command_line.py), but SGLang 0.5.23 on CPU then sizes its memory below zero and exits.)
EDGE_SERVER = {"cpu_max_total_tokens": 4096}


@pytest.fixture(scope="module")
def edge_model_dir(tmp_path_factory) -> Path:
    return build_model_dir(tmp_path_factory.mktemp("edge") / "-m=--trust-remote-code", seed=0)


def test_three_step_run_with_sglang_through_rest(client, edge_model_dir, stack, tmp_path):
    body = spec(edge_model_dir, "sglang-3", server=EDGE_SERVER)
    body["rollout"]["engine_options"]["tp_size"] = 1
    run = client.submit(body)
    done = client.wait(run["id"], timeout_s=900)
    assert done["status"] == "completed", (done, stack.rollouts[0].tail())
    steps = assert_every_trajectory_once(client, run["id"])
    print("\niw_mean / logprob_abs_diff_max per step:",
          [(s["metrics"]["iw_mean"], s["metrics"]["logprob_abs_diff_max"]) for s in steps])
    assert steps[0]["metrics"]["logprob_abs_diff_max"] <= 1e-4, steps[0]

    # The server this run launched, as the kernel holds its command line.
    pid, _ = sglang_server_of(stack.rollouts[0].proc.pid)
    argv = [a.decode() for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[:-1]]
    parsed = argv[4:]  # after python -c BOOTSTRAP <rollout pid>: what SGLang's argparse reads
    # No element stands alone that a value could occupy: every one is a flag, the run's values joined to theirs.
    assert all(a.startswith("--") for a in parsed), parsed
    assert f"--model-path={edge_model_dir.resolve()}" in parsed
    assert "--max-total-tokens=4096" in parsed and "--tp-size=1" in parsed
    # ... and the flags are exactly those the builder gives this config: none the run spelled itself.
    expected = server_command("/py", sglang_launch_plan(Platform.CPU, SGLangPlatformConfig(**EDGE_SERVER), {}),
                              model_path="/m", host="h", port=1, weight_version="0", parent_pid=1,
                              run_options=engine_run_options(SGLangEngineConfig(tp_size=1)))[4:]
    assert sorted(a.split("=", 1)[0] for a in parsed) == sorted(a.split("=", 1)[0] for a in expected)
    assert "--trust-remote-code" not in parsed


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
            return int(entry.name), int(next(a for a in argv if a.startswith(b"--port=")).removeprefix(b"--port="))
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


# ------------------------------------------------------------------- a spec that brings its own flags --

REMOTE_CODE = """
import pathlib
pathlib.Path({marker!r}).write_text("ran")
from transformers import PretrainedConfig
class EvilConfig(PretrainedConfig):
    model_type = "evil"
"""


def remote_code_model(directory: Path) -> Path:
    """A model directory whose config names code of its own: loading it with remote code allowed runs
    evil.py, which writes `ran` in the directory."""
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps({"model_type": "evil",
                                                       "auto_map": {"AutoConfig": "evil.EvilConfig"}}))
    (directory / "evil.py").write_text(REMOTE_CODE.format(marker=str(directory / "ran")))
    return directory


def processes_of(parent: int) -> dict[int, bytes]:
    """{pid: command line} of `parent`'s children."""
    out = {}
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if entry.name.isdigit() and int(stat[stat.rindex(")") + 2:].split()[1]) == parent:
            out[int(entry.name)] = cmdline
    return out


def test_a_spec_that_brings_its_own_server_flags_is_refused_before_anything_runs(client, model_dir, stack):
    """The replayed exploit: LoRA target modules whose later items are flags (remote code allowed, the model
    loaded from a directory outside every root). Refused at submit (422 naming the field) and again by the
    rollout's LoadModel (INVALID_ARGUMENT); no process starts and the directory's code never runs."""
    with tempfile.TemporaryDirectory() as outside:  # outside the stack's roots
        control, evil = remote_code_model(Path(outside) / "control"), remote_code_model(Path(outside) / "evil")
        # Control: the payload is live. Loaded as SGLang would with --trust-remote-code, its code runs.
        done = subprocess.run([sys.executable, "-c", "import sys; from transformers import AutoConfig; "
                               "AutoConfig.from_pretrained(sys.argv[1], trust_remote_code=True)", str(control)],
                              capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HOME": outside})
        assert (control / "ran").exists(), done.stderr[-2000:]

        rollout_pid = stack.rollouts[0].proc.pid
        children = processes_of(rollout_pid)
        server = {"max_lora_rank": 8, "lora_target_modules": ["all", "--trust-remote-code", "--model-path", str(evil)]}
        body = spec(model_dir, "exploit", server=server)
        body["rollout"]["engine_options"]["platform"] = "cuda"  # where LoRA serving is not refused outright
        before = len(client.runs())
        with pytest.raises(ApiError) as refused:
            client.submit(body)
        assert refused.value.status == 422, refused.value
        named = [f["field"] for f in refused.value.body["fields"]]
        assert named and all(n.startswith("rollout.engine_options.server.lora_target_modules.") for n in named), named
        assert len(client.runs()) == before

        # LoadModel, the launch side, refuses the same options on its own.
        with sync_channel(f"127.0.0.1:{stack.rollout_ports[0]}", stack.token) as channel:
            load = channel.unary_unary("/lockstep.v1.Rollout/LoadModel",
                                       request_serializer=pb.LoadModelRequest.SerializeToString,
                                       response_deserializer=pb.LoadModelResponse.FromString)
            engine = {"engine": "sglang", **body["rollout"]["engine_options"]}
            with pytest.raises(grpc.RpcError) as err:
                load(pb.LoadModelRequest(run_id="exploit", model_path=str(model_dir), policy_version=0,
                                         engine_config_json=json.dumps(engine)), timeout=120)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value
        assert "engine_config.server.lora_target_modules.1" in err.value.details(), err.value.details()

        assert processes_of(rollout_pid) == children  # no server started (nor any other process)
        assert not any(str(evil).encode() in cmdline for cmdline in processes_of(rollout_pid).values())
        assert not (evil / "ran").exists()


def test_a_multi_turn_run_goes_through_the_sglang_server(client, model_dir, stack):
    # number_guess needs several turns of feedback: each turn is one /generate of the episodes' contexts as
    # input_ids, and the trajectories keep the sampled tokens with the observations masked out of the loss.
    try:  # the server an earlier run with the same options left (none when this test runs alone)
        left = sglang_server_of(stack.rollouts[0].proc.pid)[0]
    except LookupError:
        left = None
    body = spec(model_dir, "sglang-episodes", max_new_tokens=6, steps=1)
    body["task"] = {"name": "number_guess", "options": {"heldout_size": 4, "episode": {
        "max_turns": 3, "max_episode_tokens": 96, "step_timeout_s": 10.0}}}
    body["eval"] = {"every": 0, "heldout_size": 4}
    run = client.submit(body)
    done = client.wait(run["id"], timeout_s=900)
    assert done["status"] == "completed", (done, stack.rollouts[0].tail())
    (step,) = client.metrics(run["id"])["steps"]
    m = step["metrics"]
    assert m["episodes"] == PROMPTS * SAMPLES and m["trajectories_trained"] == PROMPTS * SAMPLES
    assert m["episode_turns_max"] == 3 and 0 < m["episode_model_token_fraction"] < 1
    # Trainer and SGLang hold the same weights: over the model's tokens the log-probs agree to rounding.
    assert abs(m["iw_mean"] - 1) <= 1e-4 and m["logprob_abs_diff_max"] <= 1e-4, m
    # Same options, same model: the run was served by that server, not by a new one.
    assert left is None or sglang_server_of(stack.rollouts[0].proc.pid)[0] == left


# ------------------------------------------------------------------------------- a judge on SGLang --

JUDGE_TEMPLATE = "{prompt}{response}={reference}:"
JUDGE_PATTERN = r"(\d)"


def sglang_counter(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def test_a_scorer_refuses_a_reward_model_on_sglang_before_launching_anything(stack, tmp_path):
    from tests.coordinator.rewards.test_reward_spec import reward_model_dir

    rm = reward_model_dir(tmp_path)
    scorer_pid = stack.scorer_replicas[0].proc.pid
    children = processes_of(scorer_pid)
    with sync_channel(stack.scorer_addresses[0], stack.token) as channel:
        with pytest.raises(grpc.RpcError) as err:
            pb_grpc.RolloutStub(channel).LoadModel(pb.LoadModelRequest(
                run_id="rm-on-sglang", model_path=str(rm), policy_version=0,
                engine_config_json=json.dumps({"engine": "sglang", "platform": "cpu"})), timeout=120)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value
    assert err.value.details().startswith("engine_config_json.engine: SGLang cannot serve"), err.value.details()
    assert "Qwen3ForSequenceClassification" in err.value.details()
    assert processes_of(scorer_pid) == children  # no server launched


def test_a_judge_served_by_sglang_rewards_a_run_traced_to_its_score_calls(client, model_dir, stack, sglang_engine):
    # The untrained session model is the judge: what it writes is whatever it writes, so the test holds the
    # accounting to what the verdicts were (a digit is a score, anything else an unparsable drop), not to a value.
    judge_model = Path(sglang_engine.model_path).resolve()
    requests_before = sglang_counter(sglang_engine.url, "sglang:num_requests_total")
    body = spec(model_dir, "sglang-judge", steps=1)
    body["debug"] = {"record_trajectories": True}
    body["reward"] = {"kind": "judge", "max_attempts": 1, "max_failed_fraction": 1.0, "judge": {
        "model_path": str(judge_model), "engine": "sglang", "engine_options": {"platform": "cpu"},
        "template": JUDGE_TEMPLATE, "parser": {"kind": "regex", "pattern": JUDGE_PATTERN},
        "score_range": {"low": 0, "high": 9}, "max_new_tokens": 16}}
    run = client.submit(body)
    done = client.wait(run["id"], timeout_s=900)
    assert done["status"] == "completed", (done, stack.scorer_replicas[0].tail())
    identity = client.run(run["id"])["fingerprint"]["reward_scorers"]
    assert [(i["engine"], i["model_path"], i["template_sha256"]) for i in identity] == [
        ("sglang", str(judge_model), hashlib.sha256(JUDGE_TEMPLATE.encode()).hexdigest())]

    # The scorer replica serves the judge through the session's server, attached as the operator configured it.
    with sync_channel(stack.scorer_addresses[0], stack.token) as channel:
        info = pb_grpc.RolloutStub(channel).Info(pb.InfoRequest(), timeout=30)
    assert (info.details["role"], info.details["engine"], info.details["attached"], info.details["url"]) == (
        "scorer", "sglang", "true", sglang_engine.url)

    # Every sample's reward is its verdict's digit, from a Score call the scorer logged; no digit: dropped.
    lines = (stack.run_dir / "coordinator" / run["id"] / "rewards" / "step_000001.jsonl").read_text().splitlines()
    rows = {r["sample_id"]: r for r in map(json.loads, lines[1:])}
    assert len(rows) == PROMPTS * SAMPLES
    logged = {json.loads(line).get("call_id") for line in
              (stack.run_dir / "logs" / "scorer0.log").read_text().splitlines() if '"scored"' in line}
    rewards = {}
    for sample_id, row in rows.items():
        part = row["parts"]["judge"]
        assert part["call_id"] in logged and part["call_id"].startswith(f"{run['id']}/s1/judge/"), part
        assert part["replica"] == stack.scorer_addresses[0] and part["attempts"] == 1 and not part.get("cached")
        found = re.search(JUDGE_PATTERN, part["verdict"])
        if found is None:
            assert row["dropped"] == "unparsable", row
        else:
            assert part["score"] == float(found.group(1)) and row["reward"] == part["score"], row
            rewards[sample_id] = row["reward"]
    assert rewards, "no verdict held a digit: nothing in the run was rewarded by the judge"
    (m,) = [s["metrics"] for s in client.metrics(run["id"])["steps"]]
    assert m["trajectories_trained"] == len(rewards), (m, rewards)
    assert m["reward_dropped"] == PROMPTS * SAMPLES - len(rewards) == m.get("reward_dropped_unparsable", 0), m
    record = stack.run_dir / "record.pb"
    record.write_bytes(client.step_record(run["id"], 1))
    _, chunks = read_step_record(record)
    assert {c.trajectory.sample_id: c.trajectory.reward for c in chunks if c.HasField("trajectory")} == rewards

    # One greedy /generate per item, on the session's server (SGLang's own request counter).
    deadline = time.monotonic() + 30
    while sglang_counter(sglang_engine.url, "sglang:num_requests_total") - requests_before < len(rows):
        assert time.monotonic() < deadline, "the session's SGLang server did not count the judge's requests"
        time.sleep(0.2)
    assert sglang_counter(sglang_engine.url, "sglang:num_requests_total") - requests_before == len(rows)
