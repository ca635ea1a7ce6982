"""PauseGeneration and resumed samples through the rollout servicer with the real torch engine (tiny model).

A Generate in flight is paused at a token boundary and returns its samples with finish_reason 'paused';
they continue under new weights (version 1) from their tokens, and every token reports the policy version
that sampled it. Bit-for-bit continuation under unchanged weights is tests/rollout/test_decoder_schedules.py's.
"""
from __future__ import annotations

import asyncio

import pytest
import torch
from prometheus_client import CollectorRegistry

from proto import lockstep_pb2 as pb
from services.common.auth import BearerToken, generate_token
from services.common.metric_defs import ROLLOUT_METRICS, build_collectors
from services.common.tensors import from_proto, ids_to_proto, logprobs_to_proto
from services.rollout.config import RolloutServiceConfig
from services.rollout.server import RolloutServicer
from services.rollout.torch_engine import TorchEngine, TorchEngineConfig
from tests.rollout.test_rollout_server_ordering import Context

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


def request(version: int, resumed=()) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        run_id="r", policy_version=version, samples_per_prompt=2, resumed=list(resumed),
        prompts=[pb.Prompt(group_id="g", token_ids=ids_to_proto([5, 9, 2, 13]), seed=3),
                 pb.Prompt(group_id="h", token_ids=ids_to_proto([7]), seed=8)],
        sampling=pb.SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=100))


def test_pause_then_resume_under_new_weights_reports_each_tokens_version(decoder_model_dir):
    engine = TorchEngine(TorchEngineConfig(max_batch_size=4))
    engine.load(str(decoder_model_dir), 0)

    async def scenario():
        servicer = RolloutServicer(RolloutServiceConfig(), build_collectors(ROLLOUT_METRICS, CollectorRegistry()),
                                   BearerToken(generate_token()))
        servicer.engine, servicer.engine_name, servicer.run_id = engine, "torch", "r"
        assert (await servicer.PauseGeneration(pb.PauseGenerationRequest(run_id="r"), Context())).paused is False
        gen = asyncio.create_task(servicer.Generate(request(0), Context()))
        await asyncio.to_thread(engine._generating.wait, 30)
        paused = await servicer.PauseGeneration(pb.PauseGenerationRequest(run_id="r"), Context())
        first = await gen
        assert paused.paused
        weights = {k: v + 0.01 * torch.randn_like(v) if v.is_floating_point() else v
                   for k, v in engine._require_model().state_dict().items()}
        engine.update_weights(weights, 1)
        resumed = [pb.ResumedSample(sample_id=s.sample_id, response_token_ids=s.response_token_ids,
                                    logprobs=s.logprobs, policy_versions=s.policy_versions)
                   for s in first.samples if s.finish_reason == "paused"]
        second = await servicer.Generate(request(1, resumed), Context())
        servicer.close()
        return first, second

    first, second = asyncio.run(scenario())
    assert {s.finish_reason for s in first.samples} == {"paused"}
    for a, b in zip(first.samples, second.samples):
        before = from_proto(a.response_token_ids, field="a").tolist()
        after = from_proto(b.response_token_ids, field="b").tolist()
        assert after[:len(before)] == before and len(after) == 100 and b.finish_reason == "length"
        assert list(a.policy_versions) == [0] * len(before)
        assert list(b.policy_versions) == [0] * len(before) + [1] * (100 - len(before))
        assert from_proto(b.logprobs, field="l").tolist()[:len(before)] == from_proto(a.logprobs, field="l").tolist()


def test_bad_resumed_samples_are_refused_by_field(decoder_model_dir):
    from services.rollout.convert import generation_request_from_proto

    ok = dict(response_token_ids=ids_to_proto([1, 2]), logprobs=logprobs_to_proto([-1.0, -2.0]),
              policy_versions=[0, 0])
    for resumed, field in (([pb.ResumedSample(sample_id="x/0", **ok)], "resumed\\[0\\].sample_id"),
                           ([pb.ResumedSample(sample_id="g/0", **ok)] * 2, "resumed\\[1\\].sample_id: duplicate"),
                           ([pb.ResumedSample(sample_id="g/1", **{**ok, "policy_versions": [0]})], "resumed\\[0\\]:")):
        with pytest.raises(ValueError, match=field):
            generation_request_from_proto(request(0, resumed))
