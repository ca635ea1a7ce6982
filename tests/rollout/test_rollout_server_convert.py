"""Pure request/response conversion and the engine registry (no server, no model)."""
from __future__ import annotations

import json

import grpc
import pytest

from proto import lockstep_pb2 as pb
from services.common.tensors import ids_to_proto, logprobs_to_proto
from services.rollout.config import RolloutServiceConfig
from services.rollout.embedded.torch_engine import TorchEngine
from services.rollout.engine import EngineUnavailable
from services.rollout.registry import ENGINES, engine_class
from services.rollout.server import RpcFailure, status_for
from services.rollout.types import GeneratedSample
from services.rollout.wire import (
    check_sample_order,
    generation_request_from_proto,
    samples_to_proto,
    split_engine_config,
)


def good_request(**over) -> pb.GenerateRequest:
    req = pb.GenerateRequest(
        run_id="r",
        policy_version=0,
        prompts=[pb.Prompt(group_id="g0", token_ids=ids_to_proto([1, 2]), seed=5),
                 pb.Prompt(group_id="g1", token_ids=ids_to_proto([3]), seed=9)],
        sampling=pb.SamplingParams(temperature=0.8, top_p=0.9, top_k=4, max_new_tokens=6, stop_token_ids=[2]),
        samples_per_prompt=2,
    )
    for k, v in over.items():
        if k == "sampling":
            req.sampling.CopyFrom(v)
        else:
            setattr(req, k, v)
    return req


def test_valid_request_converts():
    gen = generation_request_from_proto(good_request())
    assert [p.token_ids for p in gen.prompts] == [(1, 2), (3,)]
    assert [p.seed for p in gen.prompts] == [5, 9]
    assert gen.sampling.top_k == 4 and gen.sampling.stop_token_ids == (2,)
    assert abs(gen.sampling.temperature - 0.8) < 1e-6 and gen.samples_per_prompt == 2


def _bad(mutate):
    req = good_request()
    mutate(req)
    return req


@pytest.mark.parametrize(
    "req, message",
    [
        (_bad(lambda r: r.prompts[1].token_ids.CopyFrom(ids_to_proto([]))), r"^prompts\[1\]\.token_ids: empty"),
        (_bad(lambda r: r.prompts[0].token_ids.CopyFrom(logprobs_to_proto([1.0]))), r"^prompts\[0\]\.token_ids: expected dtype int32"),
        (_bad(lambda r: setattr(r.prompts[0].token_ids, "data", b"\x00")), r"^prompts\[0\]\.token_ids: 1 bytes"),
        (_bad(lambda r: r.prompts[1].token_ids.CopyFrom(ids_to_proto([-4]))), r"^prompts\[1\]\.token_ids: negative id -4"),
        (_bad(lambda r: setattr(r.prompts[1], "group_id", "g0")), r"^prompts\[1\]\.group_id: duplicate 'g0'"),
        (_bad(lambda r: setattr(r.prompts[0], "group_id", "")), r"^prompts\[0\]\.group_id: empty"),
        (_bad(lambda r: setattr(r.sampling, "top_p", 0.0)), r"^sampling\.top_p"),
        (_bad(lambda r: setattr(r.sampling, "temperature", 0.0)), r"^sampling\.temperature"),
        (_bad(lambda r: setattr(r.sampling, "temperature", float("nan"))), r"^sampling\.temperature"),
        (_bad(lambda r: setattr(r.sampling, "max_new_tokens", 0)), r"^sampling\.max_new_tokens"),
        (_bad(lambda r: setattr(r.sampling, "top_k", -1)), r"^sampling\.top_k"),
        (_bad(lambda r: r.sampling.stop_token_ids.append(-2)), r"^sampling\.stop_token_ids: negative"),
        (_bad(lambda r: setattr(r, "samples_per_prompt", 0)), r"^samples_per_prompt"),
        (_bad(lambda r: r.ClearField("sampling")), r"^sampling: missing"),
        (_bad(lambda r: r.ClearField("prompts")), r"^prompts: empty"),
        (_bad(lambda r: setattr(r.prompts[0], "seed", 2**64 - 1)), r"^prompts\[0\]\.seed"),
    ],
)
def test_bad_request_names_the_field(req, message):
    with pytest.raises(ValueError, match=message):
        generation_request_from_proto(req)


def test_greedy_needs_no_temperature():
    req = _bad(lambda r: (setattr(r.sampling, "temperature", 0.0), setattr(r.sampling, "greedy", True)))
    assert generation_request_from_proto(req).sampling.logprob_temperature == 1.0


def test_split_engine_config():
    assert split_engine_config("", "torch") == ("torch", "{}")
    name, opts = split_engine_config('{"engine": "sglang", "dtype": "bfloat16"}', "torch")
    assert name == "sglang" and json.loads(opts) == {"dtype": "bfloat16"}
    assert split_engine_config('{"max_batch_size": 4}', "torch")[0] == "torch"
    for text, message in [("[]", "JSON object"), ("{x", "not valid JSON"), ('{"engine": 3}', "engine_config_json.engine")]:
        with pytest.raises(ValueError, match=message):
            split_engine_config(text, "torch")


def test_registry_is_by_name_and_refuses_unknown():
    assert engine_class("torch") is TorchEngine
    assert ENGINES["torch"] == "services.rollout.embedded.torch_engine:TorchEngine"
    with pytest.raises(ValueError, match=r"unknown engine 'vllm'; known engines: \[.*'torch'") as info:
        engine_class("vllm")
    assert str(sorted(ENGINES)) in str(info.value)


def test_samples_to_proto_refuses_engine_bugs():
    ok = GeneratedSample("g", 0, [1, 2], [-0.5, -1.0], "stop")
    (msg,) = samples_to_proto([ok], 7)
    assert msg.sample_id == "g/0" and msg.logprobs.dtype == "float32" and list(msg.logprobs.shape) == [2]
    assert list(msg.policy_versions) == [7, 7]  # every token under the engine's version unless it says otherwise
    (paused,) = samples_to_proto([GeneratedSample("g", 1, [3], [-0.1], "paused", [5])], 7)
    assert (paused.finish_reason, list(paused.policy_versions)) == ("paused", [5])
    for bad in (GeneratedSample("g", 0, [1, 2], [-0.5], "stop"),
                GeneratedSample("g", 0, [1], [float("nan")], "stop"),
                GeneratedSample("g", 0, [1], [float("-inf")], "length"),
                GeneratedSample("g", 0, [1], [-1.0], "eos"),
                GeneratedSample("g", 0, [1], [-1.0], "stop", [1, 2])):
        with pytest.raises(RuntimeError):
            samples_to_proto([bad], 0)


def test_sample_order_is_checked():
    gen = generation_request_from_proto(good_request())
    samples = [GeneratedSample(g, i, [1], [-1.0], "length") for g in ("g0", "g1") for i in range(2)]
    check_sample_order(gen, samples)
    with pytest.raises(RuntimeError):
        check_sample_order(gen, samples[::-1])


def test_status_mapping():
    assert status_for(ValueError("x")) == grpc.StatusCode.INVALID_ARGUMENT
    assert status_for(EngineUnavailable("x")) == grpc.StatusCode.UNAVAILABLE
    assert status_for(RpcFailure(grpc.StatusCode.FAILED_PRECONDITION, "x")) == grpc.StatusCode.FAILED_PRECONDITION
    assert status_for(ImportError("no sglang")) == grpc.StatusCode.FAILED_PRECONDITION
    assert status_for(RuntimeError("bug")) == grpc.StatusCode.INTERNAL


def test_service_config_is_documented():
    assert all(f.description for f in RolloutServiceConfig.model_fields.values())
    c = RolloutServiceConfig()
    assert (c.grpc_port, c.metrics_port, c.engine) == (50051, 9101, "torch")
