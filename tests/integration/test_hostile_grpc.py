"""Hostile gRPC requests against real rollout and trainer processes.

Undecodable messages, deeply nested JSON, model directories that do not load
and devices the host does not have were UNKNOWN or INTERNAL: each must be
INVALID_ARGUMENT or FAILED_PRECONDITION naming what, with the server serving
on (checked after every case).
"""
from __future__ import annotations

import json
import os
import pickle
import re
import sys
import time
import uuid
from pathlib import Path

import grpc
import pytest

from proto import lockstep_pb2 as pb
from proto import lockstep_pb2_grpc as pb_grpc
from recipes.tiny_model import build_model_dir
from services.common.auth import TOKEN_FILE_ENV, read_token_file, write_token_file
from services.common.grpc.options import sync_channel
from services.common.models.weight_files import PICKLE_SINGLE, SAFETENSORS_INDEX
from services.common.process.ports import free_port
from services.local_stack import ServiceProcess, service_env

INVALID = grpc.StatusCode.INVALID_ARGUMENT
PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION
CORRUPT = b"\x0a\xff\xff\xff"  # field 1, length-delimited, with a length past the end


class Served:
    """A service with its own token, reading models (and, the trainer, checkpoints) anywhere under `roots`."""

    def __init__(self, service: str, root: Path, roots: Path) -> None:
        self.port = free_port()
        token_file = write_token_file(root / "auth_token")
        allowed = ["--model-roots", str(roots)] + (["--checkpoint-roots", str(roots)] if service == "trainer" else [])
        self.process = ServiceProcess(service, [
            sys.executable, "-m", f"services.{service}", "--grpc-port", str(self.port), "--metrics-port", "0",
            "--num-threads", "1", *allowed,
        ], service_env({**os.environ, TOKEN_FILE_ENV: str(token_file)}), root / f"{service}.log")
        self.channel = sync_channel(f"127.0.0.1:{self.port}", read_token_file(token_file))
        self.service = service

    def start(self) -> "Served":
        self.process.start()
        deadline = time.monotonic() + 90
        while True:
            try:
                self.health()
                return self
            except grpc.RpcError:
                if not self.process.alive() or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"{self.service} did not come up:\n{self.process.tail()}")
                time.sleep(0.2)

    def method(self, name: str) -> str:
        return f"/lockstep.v1.{self.service.capitalize()}/{name}"

    def health(self) -> pb.HealthResponse:
        call = self.channel.unary_unary(self.method("Health"), request_serializer=pb.HealthRequest.SerializeToString,
                                        response_deserializer=pb.HealthResponse.FromString)
        return call(pb.HealthRequest(), timeout=5)

    def stop(self) -> None:
        self.channel.close()
        self.process.stop()


def code_of(fn) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as err:
        fn()
    return err.value.code(), err.value.details()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return build_model_dir(tmp_path_factory.mktemp("model") / "tiny", seed=0)


@pytest.fixture(scope="module")
def bad_model_dirs(tmp_path_factory, model_dir) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bad_models")
    dirs = {}
    for name, config in (("garbage_config", "{not json"), ("empty_config", "{}"),
                         ("no_weights", (model_dir / "config.json").read_text())):
        d = root / name
        d.mkdir()
        (d / "config.json").write_text(config)
        dirs[name] = d
    corrupt = root / "corrupt_weights"
    corrupt.mkdir()
    for f in model_dir.iterdir():
        (corrupt / f.name).write_bytes(b"\x00garbage" if f.suffix == ".safetensors" else f.read_bytes())
    dirs["corrupt_weights"] = corrupt
    return dirs


class WritesMarker:
    """Unpickled by an unsafe loader, it creates the file `path` (pickle calls open(path, "w"))."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return open, (str(self.path), "w")


@pytest.fixture(scope="module")
def hostile_weight_dirs(tmp_path_factory, model_dir) -> tuple[dict[str, tuple[Path, str]], Path]:
    """Model directories whose weight file is hostile or broken, each with the file a refusal must name;
    and the marker file an unpickled payload would create."""
    import torch

    root = tmp_path_factory.mktemp("hostile_weights")
    marker = root / "MARKER-code-ran"
    dirs: dict[str, tuple[Path, str]] = {}

    def model_without_weights(name: str) -> Path:
        d = root / name
        d.mkdir()
        for f in model_dir.iterdir():
            if f.suffix != ".safetensors":
                (d / f.name).write_bytes(f.read_bytes())
        return d

    d = model_without_weights("pickle_runs_code")  # torch.save's zip format, as a real pytorch_model.bin
    torch.save({"model.embed_tokens.weight": WritesMarker(marker)}, d / PICKLE_SINGLE)
    dirs["pickle_runs_code"] = d, str(d / PICKLE_SINGLE)
    d = model_without_weights("legacy_pickle_runs_code")  # a bare pickle stream (torch's pre-zip format)
    (d / PICKLE_SINGLE).write_bytes(pickle.dumps({"model.embed_tokens.weight": WritesMarker(marker)}))
    dirs["legacy_pickle_runs_code"] = d, str(d / PICKLE_SINGLE)
    d = model_without_weights("truncated_pickle")
    torch.save({"model.embed_tokens.weight": torch.zeros(4)}, d / PICKLE_SINGLE)
    (d / PICKLE_SINGLE).write_bytes((d / PICKLE_SINGLE).read_bytes()[:100])
    dirs["truncated_pickle"] = d, str(d / PICKLE_SINGLE)
    d = model_without_weights("corrupt_safetensors_header")  # a plausible length, then a header that is no JSON
    weights = (model_dir / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(weights[:8] + b"{" * 16 + weights[24:])
    dirs["corrupt_safetensors_header"] = d, str(d / "model.safetensors")
    d = model_without_weights("index_leaves_directory")  # shards must be files of the directory itself
    (d / SAFETENSORS_INDEX).write_text(json.dumps({"weight_map": {"lm_head.weight": "../../model.safetensors"}}))
    dirs["index_leaves_directory"] = d, str(d / SAFETENSORS_INDEX)
    return dirs, marker


@pytest.fixture(scope="module")
def rollout(tmp_path_factory):
    s = Served("rollout", tmp_path_factory.mktemp("rollout"), tmp_path_factory.getbasetemp()).start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    s = Served("trainer", tmp_path_factory.mktemp("trainer"), tmp_path_factory.getbasetemp()).start()
    yield s
    s.stop()


@pytest.mark.parametrize("method, streaming", [
    ("LoadModel", False), ("Generate", False), ("Info", False), ("UpdateWeights", True),
])
def test_rollout_undecodable_message_is_invalid_argument(rollout, method, streaming):
    if streaming:
        call = rollout.channel.stream_unary(rollout.method(method))
        code, details = code_of(lambda: call(iter([CORRUPT]), timeout=30))
    else:
        call = rollout.channel.unary_unary(rollout.method(method))
        code, details = code_of(lambda: call(CORRUPT, timeout=30))
    assert code == INVALID and "undecodable" in details and method in details, (code, details)
    assert rollout.health().ok


def _load_model(rollout, **fields) -> tuple[grpc.StatusCode, str]:
    call = rollout.channel.unary_unary(rollout.method("LoadModel"),
                                       request_serializer=pb.LoadModelRequest.SerializeToString,
                                       response_deserializer=pb.LoadModelResponse.FromString)
    return code_of(lambda: call(pb.LoadModelRequest(run_id="r", policy_version=0, **fields), timeout=120))


@pytest.mark.parametrize("engine_config, code, fragment", [
    ("[" * 5000 + "]" * 5000, INVALID, "engine_config_json"),
    (json.dumps({"engine": "torch", "extra": {"a": {"a": {}}}}), INVALID, "engine_config.extra"),
    (json.dumps({"engine": "torch", "device": "cuda:99"}), PRECONDITION, "engine_config.device"),
    (json.dumps({"engine": "torch", "device": "banana"}), INVALID, "engine_config.device"),
    # Items that would become flags of the SGLang server (remote code, another model directory): refused
    # at LoadModel as at submit, before any process starts.
    (json.dumps({"engine": "sglang", "platform": "cuda", "server": {
        "max_lora_rank": 8, "lora_target_modules": ["all", "--trust-remote-code", "--model-path", "/tmp"]}}),
     INVALID, "engine_config.server.lora_target_modules.1"),
    # Where a server listens is the rollout service's setting.
    (json.dumps({"engine": "sglang", "host": "0.0.0.0"}), INVALID, "engine_config.host: set by the rollout service"),
])
def test_rollout_load_model_with_hostile_engine_config(rollout, model_dir, engine_config, code, fragment):
    got, details = _load_model(rollout, model_path=str(model_dir), engine_config_json=engine_config)
    assert got == code and fragment in details, (got, details)
    assert rollout.health().ok


@pytest.mark.parametrize("which", ["garbage_config", "empty_config", "no_weights", "corrupt_weights"])
def test_rollout_load_model_of_a_bad_model_directory_is_invalid_argument(rollout, bad_model_dirs, which):
    got, details = _load_model(rollout, model_path=str(bad_model_dirs[which]),
                               engine_config_json='{"engine": "torch"}')
    assert got == INVALID and "model_path" in details, (got, details)
    assert rollout.health().ok


HOSTILE_WEIGHTS = ["pickle_runs_code", "legacy_pickle_runs_code", "truncated_pickle", "corrupt_safetensors_header",
                   "index_leaves_directory"]


@pytest.mark.parametrize("which", HOSTILE_WEIGHTS)
def test_rollout_load_model_of_hostile_weight_files_is_invalid_argument_naming_the_file(rollout, hostile_weight_dirs,
                                                                                       which):
    dirs, marker = hostile_weight_dirs
    directory, culprit = dirs[which]
    got, details = _load_model(rollout, model_path=str(directory), engine_config_json='{"engine": "torch"}')
    assert got == INVALID and "model_path" in details and culprit in details, (got, details)
    assert not marker.exists(), "the pickle's payload ran"
    assert rollout.health().ok
    info = rollout.channel.unary_unary(rollout.method("Info"), request_serializer=pb.InfoRequest.SerializeToString,
                                       response_deserializer=pb.ServiceInfo.FromString)(pb.InfoRequest(), timeout=30)
    assert info.model_path != str(directory), info  # nothing of the refused directory was loaded


@pytest.mark.parametrize("method, kind", [
    ("ConfigureRun", "unary"), ("GetWeights", "unary_stream"), ("TrainStep", "stream"), ("CheckParity", "stream"),
    ("SaveCheckpoint", "unary"), ("LoadCheckpoint", "unary"),
])
def test_trainer_undecodable_message_is_invalid_argument(trainer, method, kind):
    if kind == "stream":
        call = trainer.channel.stream_unary(trainer.method(method))
        code, details = code_of(lambda: call(iter([CORRUPT]), timeout=30))
    elif kind == "unary_stream":
        call = trainer.channel.unary_stream(trainer.method(method))
        code, details = code_of(lambda: list(call(CORRUPT, timeout=30)))
    else:
        call = trainer.channel.unary_unary(trainer.method(method))
        code, details = code_of(lambda: call(CORRUPT, timeout=30))
    assert code == INVALID and "undecodable" in details and method in details, (code, details)
    assert trainer.health().ok


def _configure(trainer, **fields) -> tuple[grpc.StatusCode, str]:
    call = trainer.channel.unary_unary(trainer.method("ConfigureRun"),
                                       request_serializer=pb.ConfigureRunRequest.SerializeToString,
                                       response_deserializer=pb.ConfigureRunResponse.FromString)
    # A fresh run id each time: a config that were accepted must not turn the next case into a mismatch.
    request = pb.ConfigureRunRequest(run_id=f"r-{uuid.uuid4().hex}", seed=0, **fields)
    return code_of(lambda: call(request, timeout=120))


@pytest.mark.parametrize("which", ["garbage_config", "empty_config", "no_weights", "corrupt_weights"])
def test_trainer_configure_of_a_bad_model_directory_is_invalid_argument(trainer, bad_model_dirs, which):
    got, details = _configure(trainer, model_path=str(bad_model_dirs[which]))
    assert got == INVALID and "model_path" in details, (got, details)
    assert trainer.health().ok


@pytest.mark.parametrize("which", HOSTILE_WEIGHTS)
def test_trainer_configure_of_hostile_weight_files_is_invalid_argument_naming_the_file(trainer, hostile_weight_dirs,
                                                                                      which):
    dirs, marker = hostile_weight_dirs
    directory, culprit = dirs[which]
    got, details = _configure(trainer, model_path=str(directory))
    assert got == INVALID and "model_path" in details and culprit in details, (got, details)
    assert not marker.exists(), "the pickle's payload ran"
    assert trainer.health().ok


@pytest.mark.parametrize("config_json, fragment", [
    ("[" * 5000 + "]" * 5000, "trainer_config_json"),
    (json.dumps({"lr": True}), "trainer_config_json.lr"),
    (json.dumps({"lr": 1e308}), "trainer_config_json.lr"),
    (json.dumps({"microbatch_tokens": 5.5}), "trainer_config_json.microbatch_tokens"),
    # A teacher (on-policy distillation) is a model the trainer loads: inside its model_roots only.
    (json.dumps({"teacher": {"model_path": "/etc"}}), "trainer_config_json.teacher.model_path"),
    (json.dumps({"teacher": {"model_path": "/"}}), "trainer_config_json.teacher.model_path"),
])
def test_trainer_configure_with_a_hostile_config_is_invalid_argument(trainer, model_dir, config_json, fragment):
    got, details = _configure(trainer, model_path=str(model_dir), trainer_config_json=config_json)
    assert got == INVALID and fragment in details, (got, details)
    assert trainer.health().ok


def _unary(served, method: str, request, response_type):
    return served.channel.unary_unary(served.method(method), request_serializer=type(request).SerializeToString,
                                      response_deserializer=response_type.FromString)(request, timeout=120)


@pytest.mark.parametrize("corrupt", ["optimizer.pt", "model.safetensors", "lockstep_trainer_state.json"])
def test_trainer_load_checkpoint_of_corrupt_files_is_invalid_argument(trainer, model_dir, tmp_path, corrupt):
    run_id = f"ckpt-{uuid.uuid4().hex}"
    _unary(trainer, "ConfigureRun", pb.ConfigureRunRequest(run_id=run_id, model_path=str(model_dir), seed=0),
           pb.ConfigureRunResponse)
    saved = _unary(trainer, "SaveCheckpoint", pb.SaveCheckpointRequest(run_id=run_id, directory=str(tmp_path / "c")),
                   pb.SaveCheckpointResponse).directory
    target = Path(saved) / corrupt
    assert target.is_file(), sorted(p.name for p in Path(saved).iterdir())
    target.write_bytes(b"\x00 not what it should be")
    got, details = code_of(lambda: _unary(trainer, "LoadCheckpoint",
                                          pb.LoadCheckpointRequest(run_id=run_id, directory=saved),
                                          pb.LoadCheckpointResponse))
    assert got == INVALID and "directory" in details, (got, details)
    assert trainer.health().ok


def _train_step(trainer, header: pb.TrainStepHeader, trajectories: list[pb.Trajectory]) -> pb.StepMetrics:
    call = trainer.channel.stream_unary(trainer.method("TrainStep"),
                                        request_serializer=pb.TrainStepChunk.SerializeToString,
                                        response_deserializer=pb.StepMetrics.FromString)
    chunks = [pb.TrainStepChunk(header=header), *(pb.TrainStepChunk(trajectory=t) for t in trajectories)]
    return call(iter(chunks), timeout=120)


def _trainer_version(trainer) -> int:
    return _unary(trainer, "Info", pb.InfoRequest(), pb.ServiceInfo).policy_version


def test_trainer_refuses_token_versions_outside_the_bound_and_trains_nothing(trainer, model_dir):
    """A replica that reports versions the step's bound does not admit (too old, from the future, falling
    along a trajectory, or in fixed_lag another version than the step's) gets the step refused, naming
    it, before the trainer applies anything: the version stays, and the honest step trains after."""
    from services.common.tensors import ids_to_proto, logprobs_to_proto

    run_id = f"versions-{uuid.uuid4().hex}"
    # The log-probs below are made up: a gate this wide lets the honest step through to training.
    gate = {"parity_gate": {"iw_mean_tolerance": 1e9, "iw_max": 1e9, "logprob_abs_diff_mean": 1e9}}
    _unary(trainer, "ConfigureRun", pb.ConfigureRunRequest(run_id=run_id, model_path=str(model_dir), seed=0,
                                                           trainer_config_json=json.dumps(gate)),
           pb.ConfigureRunResponse)

    def traj(step: int, versions: list[int], i: int = 0) -> pb.Trajectory:
        return pb.Trajectory(run_id=run_id, step=step, policy_version=versions[0], group_id="g", sample_id=f"g/{i}",
                             prompt_token_ids=ids_to_proto([1, 2]), response_token_ids=ids_to_proto([3, 4, 5]),
                             rollout_logprobs=logprobs_to_proto([-1.0, -1.5, -2.0]), reward=1.0,
                             advantage=1.0 - 2 * i, token_policy_versions=versions)

    def header(step: int, k: int = 0, streaming: bool = False) -> pb.TrainStepHeader:
        return pb.TrainStepHeader(run_id=run_id, step=step, policy_version=max(0, step - 1 - k), num_trajectories=2,
                                  max_staleness=k, streaming=streaming)

    cases = [
        (header(1), [traj(1, [0, 0, 0]), traj(1, [0, 1, 1], 1)], PRECONDITION, r"version 1 outside \[0, 0\]"),
        (header(1, 1, True), [traj(1, [0, 0, 0]), traj(1, [0, 0, 1], 1)], PRECONDITION, r"outside \[0, 0\]"),
        (header(4, 1, True), [traj(4, [2, 3, 3]), traj(4, [3, 2, 3], 1)], INVALID, "versions decrease"),
        (header(4, 1, True), [traj(4, [2, 3, 3]), traj(4, [1, 2, 3], 1)], PRECONDITION, r"version 1 outside \[2, 3\]"),
        (header(4, 1), [traj(4, [2, 2, 2]), traj(4, [2, 2, 3], 1)], PRECONDITION,
         "fixed_lag trains step 4 on version 2"),
    ]
    for h, trajectories, code, fragment in cases:
        got, details = code_of(lambda: _train_step(trainer, h, trajectories))
        assert got == code and f"step {h.step}" in details and re.search(fragment, details), (got, details)
        assert _trainer_version(trainer) == 0, "a refused step changed the trainer's policy version"
    metrics = _train_step(trainer, header(1), [traj(1, [0, 0, 0]), traj(1, [0, 0, 0], 1)])
    assert (metrics.step, metrics.replayed, _trainer_version(trainer)) == (1, False, 1)
