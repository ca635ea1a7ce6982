"""`python -m services.trainer` as a real subprocess on loopback, driven over real gRPC."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
import torch
from safetensors.torch import load_file
from trainer_support import make_episodes, rollout_logprobs

from grpc_health.v1 import health_pb2, health_pb2_grpc

from proto import lockstep_pb2 as pb
from proto import lockstep_pb2_grpc as pb_grpc
from services.common.auth import TOKEN_ENV, BearerToken, generate_token
from services.common.grpc.options import sync_channel
from services.common.metric_defs import STEP_METRIC_HELP
from services.common.models.loading import load_causal_lm
from services.common.tensors import ids_to_proto, logprobs_to_proto
from services.common.weights.stream import WeightStreamAssembler
from services.trainer.loss.surrogate import group_advantages
from tests.support.rounding_bounds import response_logprob_bounds

REPO = Path(__file__).resolve().parents[2]
RUN = "itest"
TOKEN = BearerToken(generate_token())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from trainer_process(tmp_path_factory.getbasetemp())


@pytest.fixture(scope="module")
def parity_server(tmp_path_factory):
    """A second trainer: the end-to-end test below needs a fresh one."""
    yield from trainer_process(tmp_path_factory.getbasetemp())


def trainer_process(roots: Path, extra_env: dict[str, str] | None = None):
    """A trainer reading models and writing checkpoints under `roots` only; every call carries TOKEN."""
    grpc_port, metrics_port = free_port(), free_port()
    env = dict(os.environ, LOCKSTEP_TRAINER_METRICS_PORT=str(metrics_port), PYTHONPATH=str(REPO),
               LOCKSTEP_TRAINER_MODEL_ROOTS=str(roots), LOCKSTEP_TRAINER_CHECKPOINT_ROOTS=str(roots),
               **{TOKEN_ENV: TOKEN.secret}, **(extra_env or {}))
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.trainer", "--grpc-port", str(grpc_port), "--num-threads", "1"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    channel = sync_channel(f"127.0.0.1:{grpc_port}", TOKEN)
    stub = pb_grpc.TrainerStub(channel)
    stub.channel = channel  # for the stubs of other services on the same server
    deadline = time.monotonic() + 60
    while True:
        try:
            stub.Health(pb.HealthRequest(), timeout=1)
            break
        except grpc.RpcError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"trainer did not come up:\n{proc.stdout.read()}")
            time.sleep(0.2)
    yield stub, proc, metrics_port
    channel.close()
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def trajectories(model, step: int, *, seed: int) -> list[pb.Trajectory]:
    eps = make_episodes(seed=seed)
    adv = group_advantages([e["reward"] for e in eps], [e["group_id"] for e in eps])
    return [
        pb.Trajectory(
            run_id=RUN, step=step, policy_version=step - 1, group_id=e["group_id"], sample_id=e["sample_id"],
            prompt_token_ids=ids_to_proto(e["prompt"]), response_token_ids=ids_to_proto(e["response"]),
            rollout_logprobs=logprobs_to_proto(rollout_logprobs(model, e["prompt"], e["response"])),
            reward=e["reward"], advantage=a, finish_reason="length",
        )
        for e, a in zip(eps, adv)
    ]


def logprob_bounds(model, *, seed: int) -> torch.Tensor:
    """Per response token of trajectories(model, _, seed=seed): how far float32 rounding alone may move
    the trainer's log-prob from the rollout's under the same weights (tests/support/rounding_bounds.py).
    |IW mean - 1| <= mean(e^b - 1)."""
    return response_logprob_bounds(model, [(e["prompt"], e["response"]) for e in make_episodes(seed=seed)])


def train(stub, step: int, trajs: list[pb.Trajectory], *, run_id: str = RUN) -> pb.StepMetrics:
    header = pb.TrainStepHeader(run_id=run_id, step=step, policy_version=step - 1, num_trajectories=len(trajs))
    chunks = [pb.TrainStepChunk(header=header)] + [pb.TrainStepChunk(trajectory=t) for t in trajs]
    return stub.TrainStep(iter(chunks), timeout=60)


def get_weights(stub, chunk_bytes: int = 2048) -> tuple[int, dict[str, torch.Tensor]]:
    asm = WeightStreamAssembler()
    for chunk in stub.GetWeights(pb.GetWeightsRequest(run_id=RUN, chunk_bytes=chunk_bytes), timeout=60):
        asm.add(chunk)
    return asm.policy_version, asm.finish()


def code_of(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code(), info.value.details()


def check_parity(stub, step: int, trajs: list[pb.Trajectory], *, run_id: str = RUN) -> pb.ParityReport:
    header = pb.TrainStepHeader(run_id=run_id, step=step, policy_version=step - 1, num_trajectories=len(trajs))
    chunks = [pb.TrainStepChunk(header=header)] + [pb.TrainStepChunk(trajectory=t) for t in trajs]
    return stub.CheckParity(iter(chunks), timeout=60)


def test_check_parity_on_demand_trains_nothing(parity_server, tiny_model_dir):
    stub, _, _ = parity_server
    run = "parity-run"
    stub.ConfigureRun(pb.ConfigureRunRequest(run_id=run, model_path=str(tiny_model_dir), seed=1,
                                             trainer_config_json=json.dumps({"microbatch_tokens": 32})))
    model = load_causal_lm(tiny_model_dir)
    trajs = trajectories(model, 1, seed=2)
    for t in trajs:
        t.run_id = run
    report = check_parity(stub, 1, trajs, run_id=run)
    assert report.passed, report.message
    assert abs(report.stats["iw_mean"] - 1) <= logprob_bounds(model, seed=2).expm1().mean().item()
    assert report.stats["tokens"] > 0
    assert report.attention_backend == "reference" and report.logprob_backend == "reference"
    assert len(report.worst_tokens) > 0 and report.worst_tokens[0].sample_id
    # Rollout log-probs that are off: the report fails and says why; still nothing trained.
    for t in trajs:
        lp = torch.frombuffer(bytearray(t.rollout_logprobs.data), dtype=torch.float32) - 0.5
        t.rollout_logprobs.CopyFrom(logprobs_to_proto(lp))
    bad = check_parity(stub, 1, trajs, run_id=run)
    assert not bad.passed and "step-1 parity gate FAILED" in bad.message and "IW mean" in bad.message
    assert stub.Info(pb.InfoRequest()).policy_version == 0


def test_standard_grpc_health_check_is_served(parity_server):
    stub, _, _ = parity_server
    check = health_pb2_grpc.HealthStub(stub.channel).Check
    for service in ("", "lockstep.v1.Trainer"):
        reply = check(health_pb2.HealthCheckRequest(service=service), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING, service
    code, _ = code_of(lambda: check(health_pb2.HealthCheckRequest(service="lockstep.v1.Rollout"), timeout=10))
    assert code == grpc.StatusCode.NOT_FOUND  # a probe aimed at the wrong service fails


def test_replay_with_other_trajectories_is_refused_naming_the_step(parity_server, tiny_model_dir):
    stub, _, _ = parity_server
    run = "replay-run"
    stub.ConfigureRun(pb.ConfigureRunRequest(run_id=run, model_path=str(tiny_model_dir), seed=1,
                                             trainer_config_json=json.dumps({"microbatch_tokens": 32})))
    trajs = trajectories(load_causal_lm(tiny_model_dir), 1, seed=4)
    for t in trajs:
        t.run_id = run
    m = dict(train(stub, 1, trajs, run_id=run).metrics)
    replay = train(stub, 1, list(reversed(trajs)), run_id=run)  # same trajectories, another arrival order
    assert replay.replayed and dict(replay.metrics) == m
    other = [pb.Trajectory(), *trajs[1:]]
    other[0].CopyFrom(trajs[0])
    other[0].reward = 1.0 - trajs[0].reward
    code, msg = code_of(lambda: train(stub, 1, other, run_id=run))
    assert code == grpc.StatusCode.FAILED_PRECONDITION, (code, msg)
    assert msg.startswith("step 1: replayed with trajectories other than the ones it was trained on"), msg
    assert stub.Info(pb.InfoRequest()).policy_version == 1


def test_paths_outside_the_roots_and_foreign_directories_are_refused(parity_server, tiny_model_dir, tmp_path):
    """The trainer reads models and writes checkpoints only inside its configured roots, and never
    deletes or replaces a directory its run did not create."""
    stub, _, _ = parity_server
    run = "parity-run"  # configured by the test above
    stub.ConfigureRun(pb.ConfigureRunRequest(run_id=run, model_path=str(tiny_model_dir), seed=1,
                                             trainer_config_json=json.dumps({"microbatch_tokens": 32})))
    for field, request in (
        ("model_path", pb.ConfigureRunRequest(run_id="other", model_path="/usr")),
        ("model_path", pb.ConfigureRunRequest(run_id="other", model_path=str(tiny_model_dir) + "/.." * 40 + "/etc")),
        ("resume_checkpoint", pb.ConfigureRunRequest(run_id="other", model_path=str(tiny_model_dir),
                                                     resume_checkpoint="/etc")),
    ):
        code, msg = code_of(lambda: stub.ConfigureRun(request))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and msg.startswith(f"{field}: ") and "outside the allowed roots" in msg
    for rpc in (lambda d: stub.SaveCheckpoint(pb.SaveCheckpointRequest(run_id=run, directory=d)),
                lambda d: stub.LoadCheckpoint(pb.LoadCheckpointRequest(run_id=run, directory=d))):
        code, msg = code_of(lambda: rpc("/tmp/../etc/lockstep-ckpt"))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and msg.startswith("directory: ") and "outside" in msg

    # An existing directory that is not this run's checkpoint: refused, every file left as it was.
    foreign = tmp_path / "precious"
    (foreign / "sub").mkdir(parents=True)
    (foreign / "data.txt").write_text("keep me")
    (foreign / "sub" / "more.bin").write_bytes(b"\x00\x01")
    code, msg = code_of(lambda: stub.SaveCheckpoint(pb.SaveCheckpointRequest(run_id=run, directory=str(foreign))))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and msg.startswith("directory: ") and "not a Lockstep checkpoint" in msg
    assert sorted(p.relative_to(foreign).as_posix() for p in foreign.rglob("*")) == ["data.txt", "sub", "sub/more.bin"]
    assert (foreign / "data.txt").read_text() == "keep me"
    assert [p.name for p in tmp_path.iterdir()] == ["precious"]  # no temporary directory left behind

    # Its own checkpoint is replaced (a re-saved step), one of another run is not.
    own = tmp_path / "ckpt"
    first = stub.SaveCheckpoint(pb.SaveCheckpointRequest(run_id=run, directory=str(own)))
    again = stub.SaveCheckpoint(pb.SaveCheckpointRequest(run_id=run, directory=str(own)))
    assert first.directory == again.directory == str(own) and (own / "model.safetensors").is_file()
    state = own / "lockstep_trainer_state.json"
    state.write_text(state.read_text().replace(f'"run_id": "{run}"', '"run_id": "someone-else"'))
    code, msg = code_of(lambda: stub.SaveCheckpoint(pb.SaveCheckpointRequest(run_id=run, directory=str(own))))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "a checkpoint of another run" in msg
    assert '"run_id": "someone-else"' in state.read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "precious"]


def test_trainer_service_end_to_end(server, tiny_model_dir, tmp_path):
    stub, proc, metrics_port = server
    assert stub.Health(pb.HealthRequest()).status == "not_loaded"
    assert stub.Info(pb.InfoRequest()).policy_version == -1
    assert code_of(lambda: train(stub, 1, []))[0] == grpc.StatusCode.FAILED_PRECONDITION

    # Bad configuration is refused naming the field; the server keeps serving.
    code, msg = code_of(lambda: stub.ConfigureRun(pb.ConfigureRunRequest(
        run_id=RUN, model_path=str(tiny_model_dir), trainer_config_json='{"clip_eps_low": 2}')))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and msg.startswith("trainer_config_json.clip_eps_low:")

    config = json.dumps({"lr": 1e-2, "microbatch_tokens": 16})
    request = pb.ConfigureRunRequest(run_id=RUN, model_path=str(tiny_model_dir), seed=5, trainer_config_json=config)
    info = stub.ConfigureRun(request).info
    assert (info.service, info.run_id, info.policy_version) == ("trainer", RUN, 0)

    # Version-0 weights are the model directory's, bit for bit, through a verified stream.
    model = load_causal_lm(tiny_model_dir)
    version, w0 = get_weights(stub)
    assert version == 0 and set(w0) == set(model.state_dict())
    assert all(torch.equal(w0[k], v) for k, v in model.state_dict().items())

    trajs = trajectories(model, 1, seed=1)
    # Mismatched lengths and non-finite log-probs: INVALID_ARGUMENT naming the field, nothing applied.
    n = len(trajs[3].response_token_ids.data) // 4
    short = pb.Trajectory()
    short.CopyFrom(trajs[3])
    short.rollout_logprobs.CopyFrom(logprobs_to_proto([-1.0] * (n - 1)))
    code, msg = code_of(lambda: train(stub, 1, trajs[:3] + [short] + trajs[4:]))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert msg == f"trajectory[3].rollout_logprobs: {n - 1} values for {n} response tokens"
    nan = pb.Trajectory()
    nan.CopyFrom(trajs[0])
    n0 = len(trajs[0].response_token_ids.data) // 4
    nan.rollout_logprobs.CopyFrom(logprobs_to_proto([float("nan")] + [-1.0] * (n0 - 1)))
    code, msg = code_of(lambda: train(stub, 1, [nan] + trajs[1:]))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and msg.startswith("trajectory[0].rollout_logprobs[0]: not finite")
    assert stub.Info(pb.InfoRequest()).policy_version == 0

    # The valid step right after: on-policy, so IW is 1 at step 1.
    result = train(stub, 1, trajs)
    m = dict(result.metrics)
    assert (result.step, result.policy_version, result.replayed) == (1, 1, False)
    assert set(m) == set(STEP_METRIC_HELP) - {"eval_accuracy"}
    bound = logprob_bounds(model, seed=1)
    assert abs(m["iw_mean"] - 1) <= bound.expm1().mean().item()
    assert m["logprob_abs_diff_max"] <= bound.max().item()

    # Replay (coordinator restarted after the update): recorded metrics, nothing trained.
    replay = train(stub, 1, [])
    assert replay.replayed and dict(replay.metrics) == m and replay.policy_version == 1
    assert stub.ConfigureRun(request).info.policy_version == 1  # same run: state kept
    code, msg = code_of(lambda: train(stub, 3, trajectories(model, 3, seed=3)))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "holds policy_version 1; step 3 needs 2" in msg

    version, w1 = get_weights(stub)
    assert version == 1 and any(not torch.equal(w0[k], w1[k]) for k in w0)

    # Checkpoint round trip: save at 1, train step 2, load -> back to version 1 and its weights.
    saved = stub.SaveCheckpoint(pb.SaveCheckpointRequest(run_id=RUN, directory=str(tmp_path / "ckpt1")))
    assert saved.policy_version == 1 and (Path(saved.directory) / "model.safetensors").is_file()
    model.load_state_dict(w1)
    assert train(stub, 2, trajectories(model, 2, seed=2)).policy_version == 2
    assert stub.LoadCheckpoint(pb.LoadCheckpointRequest(run_id=RUN, directory=saved.directory)).policy_version == 1
    version, again = get_weights(stub)
    assert version == 1 and all(torch.equal(w1[k], again[k]) for k in w1)
    code, msg = code_of(lambda: stub.LoadCheckpoint(pb.LoadCheckpointRequest(run_id=RUN, directory=str(tmp_path))))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and msg.startswith("directory:")

    body = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    assert 'lockstep_trainer_steps_total{outcome="trained",service="trainer"} 2.0' in body
    assert 'lockstep_trainer_steps_total{outcome="replayed",service="trainer"} 1.0' in body
    assert 'lockstep_trainer_policy_version{service="trainer"} 1.0' in body

    # SIGTERM: graceful shutdown, exit status 0.
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0



def _named_weights(stub, run: str, version: int) -> tuple[int, str, dict[str, torch.Tensor]]:
    """GetWeights naming `version`: the version streamed, its digest and its tensors."""
    asm, last = WeightStreamAssembler(), None
    for chunk in stub.GetWeights(pb.GetWeightsRequest(run_id=run, policy_version=version), timeout=60):
        asm.add(chunk)
        last = chunk
    return asm.policy_version, last.total_sha256, asm.finish()


def test_a_step_that_keeps_its_previous_weights_serves_them_by_version(parity_server, tiny_model_dir, tmp_path):
    """fixed_lag: a TrainStep with keep_previous_weights keeps version s-1, and GetWeights and WriteWeights
    naming s-1 serve that copy, bit for bit, after the trainer moved to s. A version the trainer neither holds
    nor kept is NOT_FOUND naming both; a step without keep, or a newer cut, leaves nothing of the old one."""
    stub, _, _ = parity_server
    run = "keep-run"
    stub.ConfigureRun(pb.ConfigureRunRequest(run_id=run, model_path=str(tiny_model_dir), seed=1,
                                             trainer_config_json=json.dumps({"microbatch_tokens": 32})))
    model = load_causal_lm(tiny_model_dir)

    def step(s: int, keep: bool) -> None:
        trajs = trajectories(model, s, seed=s)
        for t in trajs:
            t.run_id = run
        header = pb.TrainStepHeader(run_id=run, step=s, policy_version=s - 1, num_trajectories=len(trajs),
                                    keep_previous_weights=keep)
        chunks = [pb.TrainStepChunk(header=header)] + [pb.TrainStepChunk(trajectory=t) for t in trajs]
        assert stub.TrainStep(iter(chunks), timeout=60).policy_version == s

    version, digest0, w0 = _named_weights(stub, run, 0)  # the current weights, named
    assert version == 0 and all(torch.equal(w0[k], v) for k, v in model.state_dict().items())
    step(1, keep=True)
    version, digest, kept = _named_weights(stub, run, 0)
    assert (version, digest) == (0, digest0) and all(torch.equal(kept[k], w0[k]) for k in w0)
    written = stub.WriteWeights(pb.WriteWeightsRequest(run_id=run, directory=str(tmp_path / "v0"), policy_version=0))
    assert (written.policy_version, written.total_sha256) == (0, digest0)
    assert stub.Info(pb.InfoRequest()).policy_version == 1
    on_disk = load_file(Path(written.directory) / "model.safetensors")
    assert all(torch.equal(on_disk[k], w0[k]) for k in on_disk)

    # The current weights (unnamed) are version 1: cut anew, which retires the kept copy of 0.
    current = WeightStreamAssembler()
    for chunk in stub.GetWeights(pb.GetWeightsRequest(run_id=run), timeout=60):
        current.add(chunk)
    w1 = current.finish()
    assert current.policy_version == 1 and any(not torch.equal(w1[k], w0[k]) for k in w0)
    code, msg = code_of(lambda: _named_weights(stub, run, 0))
    assert code == grpc.StatusCode.NOT_FOUND, (code, msg)
    assert msg.startswith(f"policy_version: the trainer holds version 1 of run {run!r} and keeps no copy of version 0")
    code, msg = code_of(lambda: stub.WriteWeights(pb.WriteWeightsRequest(
        run_id=run, directory=str(tmp_path / "again"), policy_version=0)))
    assert code == grpc.StatusCode.NOT_FOUND and "keeps no copy of version 0" in msg
    assert not (tmp_path / "again").exists()

    # A step without keep withdraws the copy of the weights it started from.
    assert _named_weights(stub, run, 1)[0] == 1
    step(2, keep=False)
    assert code_of(lambda: _named_weights(stub, run, 1))[0] == grpc.StatusCode.NOT_FOUND
