"""`python -m services.rollout` as a real subprocess on loopback, driven over real gRPC.

Tests run in file order against one process (startup dominates the cost):
first the unloaded server, then LoadModel / Generate / bad requests, then
weight streams (which bump the policy version), then SIGTERM.
"""
from __future__ import annotations

import json
import math
import os
import re
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

from grpc_health.v1 import health_pb2, health_pb2_grpc

from kernels.logprob import token_logprobs

from proto import lockstep_pb2 as pb
from proto import lockstep_pb2_grpc as pb_grpc
from services.common.auth import TOKEN_ENV, BearerToken, generate_token
from services.common.grpc.options import sync_channel
from services.common.models.loading import load_causal_lm
from services.common.tensors import from_proto, ids_to_proto
from services.common.weights.stream import iter_weight_chunks
from tests.support.rounding_bounds import response_logprob_bounds

REPO_ROOT = Path(__file__).resolve().parents[2]
RUN = "run-test"
PROMPTS = [[3], [1, 2, 3, 4, 5, 6, 7], [9, 30, 2]]
TEMPERATURE = 0.8
TOKEN = BearerToken(generate_token())


def build_tiny_qwen3(path: Path) -> Path:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
        initializer_range=0.3, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    Qwen3ForCausalLM(cfg).save_pretrained(str(path))
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, tmp: Path, repo_root: Path, model_roots: Path) -> None:
        self.grpc_port, self.metrics_port = free_port(), free_port()
        self.log_path = tmp / "rollout.log"
        env = {**os.environ, "PYTHONPATH": str(repo_root), "LOCKSTEP_ROLLOUT_LOG_LEVEL": "info",
               "LOCKSTEP_ROLLOUT_MODEL_ROOTS": str(model_roots), TOKEN_ENV: TOKEN.secret}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "services.rollout", "--host", "127.0.0.1",
             "--grpc-port", str(self.grpc_port), "--metrics-port", str(self.metrics_port)],
            cwd=repo_root, env=env, stdout=self.log_path.open("w"), stderr=subprocess.STDOUT,
        )
        self.channel = sync_channel(f"127.0.0.1:{self.grpc_port}", TOKEN)
        self.stub = pb_grpc.RolloutStub(self.channel)

    def wait_ready(self, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"rollout exited with {self.proc.returncode}:\n{self.log()}")
            try:
                self.stub.Health(pb.HealthRequest(), timeout=2)
                return
            except grpc.RpcError:
                time.sleep(0.2)
        raise TimeoutError(f"rollout not ready after {timeout}s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text()

    def stop(self) -> None:
        self.channel.close()
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return build_tiny_qwen3(tmp_path_factory.mktemp("tiny_qwen3"))


@pytest.fixture(scope="module")
def server(tmp_path_factory, request):
    s = Server(tmp_path_factory.mktemp("rollout"), REPO_ROOT, tmp_path_factory.getbasetemp())
    try:
        request.getfixturevalue("model_dir")  # built while the server process imports torch
        s.wait_ready()
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def loaded(server, model_dir):
    resp = server.stub.LoadModel(pb.LoadModelRequest(
        run_id=RUN, model_path=str(model_dir), policy_version=0,
        engine_config_json='{"engine": "torch", "dtype": "float32", "max_batch_size": 16}'), timeout=60)
    assert resp.info.policy_version == 0 and resp.info.details["engine"] == "torch"
    return server


def generate_request(version: int, **over) -> pb.GenerateRequest:
    sampling = pb.SamplingParams(temperature=TEMPERATURE, top_p=1.0, top_k=0, max_new_tokens=8)
    req = pb.GenerateRequest(
        run_id=RUN, step=1, policy_version=version, sampling=sampling, samples_per_prompt=2,
        prompts=[pb.Prompt(group_id=f"g{i}", token_ids=ids_to_proto(p), seed=100 * i) for i, p in enumerate(PROMPTS)],
    )
    for k, v in over.items():
        setattr(req, k, v)
    return req


def code_of(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code(), info.value.details()


def decoded(resp: pb.GenerateResponse) -> list[tuple[str, list[int], torch.Tensor, str]]:
    return [
        (s.sample_id,
         from_proto(s.response_token_ids, field="ids", dtype=torch.int32, ndim=1).tolist(),
         from_proto(s.logprobs, field="logprobs", dtype=torch.float32, ndim=1),
         s.finish_reason)
        for s in resp.samples
    ]


def rounding_excess(model: torch.nn.Module, resp: pb.GenerateResponse) -> float:
    """Max over tokens of |engine logp - one teacher-forced forward in this process| minus the most float32
    rounding may move it (tests/support/rounding_bounds.py): <= 0 when the engine computes this model."""
    excess = -math.inf
    for sample_id, ids, logp, _ in decoded(resp):
        prompt = PROMPTS[int(sample_id.split("/")[0][1:])]
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1]
        ref, _ = token_logprobs(logits, torch.tensor(ids), temperature=TEMPERATURE)
        bound = response_logprob_bounds(model, [(prompt, ids)], temperature=TEMPERATURE)
        excess = max(excess, ((ref - logp).abs().double() - bound).max().item())
    return excess


# --------------------------------------------------------------------- tests --


def test_unloaded_server_refuses_and_keeps_serving(server, model_dir):
    health = server.stub.Health(pb.HealthRequest(), timeout=5)
    assert health.ok and health.status == "not_loaded"
    assert server.stub.Info(pb.InfoRequest(), timeout=5).policy_version == -1
    code, msg = code_of(lambda: server.stub.Generate(generate_request(0), timeout=10))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "no model loaded" in msg
    load = lambda cfg, path=str(model_dir): server.stub.LoadModel(  # noqa: E731
        pb.LoadModelRequest(run_id=RUN, model_path=path, engine_config_json=cfg), timeout=30)
    code, msg = code_of(lambda: load('{"engine": "vllm"}'))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "known engines: [" in msg and "'torch'" in msg
    code, msg = code_of(lambda: load('{"dtyp": "float32"}'))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "engine_config.dtyp" in msg
    code, msg = code_of(lambda: load("{}", path=str(model_dir / "nope")))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "model_path" in msg
    # Outside the service's model_roots: refused before the path is looked at, existing or not.
    for outside in ("/usr", "/nonexistent/model", str(model_dir) + "/.." * 40 + "/usr"):
        code, msg = code_of(lambda: load("{}", path=outside))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and msg.startswith("model_path: ") and "outside the allowed roots" in msg
    # What SGLang executes and where it writes are the service's configuration, not a request's.
    for option, value in (("python", "/bin/sh"), ("weights_dir", "/etc/lockstep"), ("url", "http://attacker:1")):
        code, msg = code_of(lambda: load(json.dumps({"engine": "sglang", option: value})))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and f"{option}: set by the rollout service" in msg, msg
    assert server.stub.Health(pb.HealthRequest(), timeout=5).status == "not_loaded"


def test_standard_grpc_health_check_is_served(server):
    check = health_pb2_grpc.HealthStub(server.channel).Check
    for service in ("", "lockstep.v1.Rollout"):
        reply = check(health_pb2.HealthCheckRequest(service=service), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING, service
    code, _ = code_of(lambda: check(health_pb2.HealthCheckRequest(service="lockstep.v1.Trainer"), timeout=10))
    assert code == grpc.StatusCode.NOT_FOUND  # a probe aimed at the wrong service fails


def test_generate_returns_finite_aligned_logprobs_matching_recompute(loaded, model_dir):
    resp = loaded.stub.Generate(generate_request(0), timeout=60)
    assert resp.engine == "torch" and resp.policy_version == 0
    samples = decoded(resp)
    assert [s[0] for s in samples] == [f"g{i}/{j}" for i in range(3) for j in range(2)]
    for _, ids, logp, reason in samples:
        assert len(ids) == logp.numel() == 8 and reason == "length"
        assert torch.isfinite(logp).all() and (logp <= 0).all()
    model = load_causal_lm(model_dir)
    assert rounding_excess(model, resp) <= 0
    again = loaded.stub.Generate(generate_request(0), timeout=60)
    assert again.SerializeToString() == resp.SerializeToString()  # same request -> same bits


def _with(mutate) -> pb.GenerateRequest:
    req = generate_request(0)
    mutate(req)
    return req


@pytest.mark.parametrize(
    "req, code, fragment",
    [
        (_with(lambda r: r.prompts[2].token_ids.CopyFrom(ids_to_proto([]))), "INVALID_ARGUMENT", "prompts[2].token_ids: empty"),
        (_with(lambda r: r.prompts[1].token_ids.CopyFrom(ids_to_proto([1, 500]))), "INVALID_ARGUMENT", "prompts[1].token_ids: id 500"),
        (_with(lambda r: setattr(r.sampling, "top_p", 1.5)), "INVALID_ARGUMENT", "sampling.top_p"),
        (_with(lambda r: setattr(r, "samples_per_prompt", 0)), "INVALID_ARGUMENT", "samples_per_prompt"),
        (_with(lambda r: setattr(r.sampling, "max_new_tokens", 1000)), "INVALID_ARGUMENT", "sampling.max_new_tokens"),
        (_with(lambda r: setattr(r, "policy_version", 7)), "FAILED_PRECONDITION", "policy_version"),
        (_with(lambda r: setattr(r, "run_id", "other-run")), "FAILED_PRECONDITION", "run_id"),
    ],
)
def test_bad_request_is_refused_and_server_keeps_serving(loaded, req, code, fragment):
    got, msg = code_of(lambda: loaded.stub.Generate(req, timeout=30))
    assert got.name == code and fragment in msg, (got, msg)
    ok = loaded.stub.Generate(generate_request(0, samples_per_prompt=1), timeout=60)
    assert len(ok.samples) == len(PROMPTS)


def test_metrics_endpoint_counts_outcomes(loaded):
    with urllib.request.urlopen(f"http://127.0.0.1:{loaded.metrics_port}/metrics", timeout=10) as r:
        text = r.read().decode()
    assert 'lockstep_rollout_requests_total{outcome="invalid_argument",service="rollout"}' in text
    assert 'lockstep_rollout_requests_total{outcome="ok",service="rollout"}' in text
    assert 'lockstep_rollout_policy_version{service="rollout"} 0.0' in text
    assert "lockstep_rollout_generated_tokens_total" in text
    # The OK generates ran their prompts through prefill; none was a multi-turn episode's later turn.
    prefill = re.search(r'^lockstep_rollout_prefill_tokens_total\{service="rollout"\} (\S+)$', text, re.M)
    assert prefill is not None and float(prefill.group(1)) > 0
    assert 'lockstep_rollout_reused_prefix_tokens_total{service="rollout"} 0.0' in text


def test_update_weights_stream(loaded, model_dir):
    stub = loaded.stub
    baseline = stub.Generate(generate_request(0), timeout=60)
    model = load_causal_lm(model_dir)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    chunks = list(iter_weight_chunks(model.state_dict().items(), run_id=RUN, policy_version=1, chunk_bytes=2048))
    assert len(chunks) > 10

    # A flipped byte: the chunk checksum fails; nothing is applied.
    bad = [pb.WeightChunk.FromString(c.SerializeToString()) for c in chunks]
    bad[5].data = bytes([bad[5].data[0] ^ 1]) + bad[5].data[1:]
    code, msg = code_of(lambda: stub.UpdateWeights(iter(bad), timeout=60))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "chunk_sha256 mismatch" in msg
    # A stream cut short: refused too.
    code, msg = code_of(lambda: stub.UpdateWeights(iter(chunks[:-1]), timeout=60))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "before its last chunk" in msg
    # A tensor the model does not have (checksums fine): refused by the engine's verification.
    renamed = list(iter_weight_chunks([("model.bogus.weight", torch.ones(3))], run_id=RUN, policy_version=1))
    code, msg = code_of(lambda: stub.UpdateWeights(iter(renamed), timeout=60))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "model.bogus.weight" in msg
    # A NaN (checksums fine): refused as the chunks arrive, naming the tensor.
    poisoned = {k: v.clone() for k, v in model.state_dict().items()}
    name = "model.layers.1.mlp.up_proj.weight"
    poisoned[name].view(-1)[7] = float("nan")
    nan_chunks = list(iter_weight_chunks(poisoned.items(), run_id=RUN, policy_version=1, chunk_bytes=2048))
    code, msg = code_of(lambda: stub.UpdateWeights(iter(nan_chunks), timeout=60))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and f"{name}: non-finite values" in msg
    assert stub.Info(pb.InfoRequest(), timeout=5).policy_version == 0
    unchanged = stub.Generate(generate_request(0), timeout=60)
    assert unchanged.SerializeToString() == baseline.SerializeToString()

    resp = stub.UpdateWeights(iter(chunks), timeout=60)
    assert (resp.policy_version, resp.tensors) == (1, len(model.state_dict()))
    assert resp.bytes == sum(len(c.data) for c in chunks)
    code, _ = code_of(lambda: stub.Generate(generate_request(0), timeout=30))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    after = stub.Generate(generate_request(1), timeout=60)
    assert after.policy_version == 1
    before_lp = torch.cat([s[2] for s in decoded(baseline)])
    after_lp = torch.cat([s[2] for s in decoded(after)])
    assert before_lp.shape != after_lp.shape or not torch.equal(before_lp, after_lp)
    assert rounding_excess(model, after) <= 0  # the new weights, exactly as sent

    again = stub.UpdateWeights(iter(chunks), timeout=60)  # same version re-sent: idempotent
    assert again.policy_version == 1
    assert stub.Generate(generate_request(1), timeout=60).SerializeToString() == after.SerializeToString()


def test_sigterm_shuts_down_gracefully(server):
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(timeout=30) == 0, server.log()
    assert '"msg": "rollout stopped"' in server.log()
