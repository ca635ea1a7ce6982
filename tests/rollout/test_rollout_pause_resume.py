"""PauseGeneration and resumed samples through the rollout servicer with the real torch engine (tiny model).

A Generate in flight is paused at a token boundary and returns its samples with finish_reason 'paused';
they continue under new weights (version 1) from their tokens, and every token reports the policy version
that sampled it. Bit-for-bit continuation under unchanged weights is tests/rollout/embedded/test_decoder_schedules.py's.
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
from services.rollout.embedded.torch_engine import TorchEngine, TorchEngineConfig
from services.rollout.server import RolloutServicer
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
    from services.rollout.wire import generation_request_from_proto

    ok = dict(response_token_ids=ids_to_proto([1, 2]), logprobs=logprobs_to_proto([-1.0, -2.0]),
              policy_versions=[0, 0])
    for resumed, field in (([pb.ResumedSample(sample_id="x/0", **ok)], "resumed\\[0\\].sample_id"),
                           ([pb.ResumedSample(sample_id="g/0", **ok)] * 2, "resumed\\[1\\].sample_id: duplicate"),
                           ([pb.ResumedSample(sample_id="g/1", **{**ok, "policy_versions": [0]})], "resumed\\[0\\]:")):
        with pytest.raises(ValueError, match=field):
            generation_request_from_proto(request(0, resumed))


def test_sample_ids_generate_only_those_samples_as_the_whole_request_does(decoder_model_dir):
    """A later round of a streamed rollout asks only for the samples it lacks; each is the sample the whole
    request makes (its own seed's stream; true_on_policy numerics do not depend on the batch), and a paused
    one named with its tokens is continued."""
    engine = TorchEngine(TorchEngineConfig(max_batch_size=4, numerics="true_on_policy"))
    engine.load(str(decoder_model_dir), 0)

    async def scenario():
        servicer = RolloutServicer(RolloutServiceConfig(), build_collectors(ROLLOUT_METRICS, CollectorRegistry()),
                                   BearerToken(generate_token()))
        servicer.engine, servicer.engine_name, servicer.run_id = engine, "torch", "r"
        whole = await servicer.Generate(request(0), Context())
        some = request(0)
        some.sample_ids.extend(["g/1", "h/0"])
        part = await servicer.Generate(some, Context())
        cut = next(s for s in whole.samples if s.sample_id == "g/1")
        head = from_proto(cut.response_token_ids, field="t").tolist()[:30]
        go_on = request(0, [pb.ResumedSample(sample_id="g/1", response_token_ids=ids_to_proto(head),
                                             logprobs=logprobs_to_proto(from_proto(cut.logprobs, field="l")
                                                                        .tolist()[:30]),
                                             policy_versions=[0] * 30)])
        del go_on.prompts[1]  # a later round sends only the prompts with samples missing
        go_on.sample_ids.append("g/1")
        continued = await servicer.Generate(go_on, Context())
        servicer.close()
        return whole, part, continued

    whole, part, continued = asyncio.run(scenario())
    by_id = {s.sample_id: s for s in whole.samples}
    assert [s.sample_id for s in part.samples] == ["g/1", "h/0"]
    for s in part.samples:
        assert s.response_token_ids == by_id[s.sample_id].response_token_ids
        assert s.logprobs == by_id[s.sample_id].logprobs
    assert [s.sample_id for s in continued.samples] == ["g/1"]
    assert continued.samples[0].response_token_ids == by_id["g/1"].response_token_ids


@pytest.mark.parametrize("ids, resumed, field", [
    (["g/0", "g/0", "h/0"], [], r"sample_ids\[1\]: duplicate 'g/0'"),
    (["g/2", "h/0"], [], r"sample_ids\[0\]: 'g/2' is not a sample"),
    (["g/0"], [], r"prompts\[1\]: none of its samples is in sample_ids"),
    (["g/0", "h/0"], ["g/1"], r"resumed\[0\]\.sample_id: 'g/1' is continued but not in sample_ids"),
])
def test_bad_sample_ids_are_refused_by_field(ids, resumed, field):
    from services.rollout.wire import generation_request_from_proto

    ok = dict(response_token_ids=ids_to_proto([1, 2]), logprobs=logprobs_to_proto([-1.0, -2.0]),
              policy_versions=[0, 0])
    req = request(0, [pb.ResumedSample(sample_id=s, **ok) for s in resumed])
    req.sample_ids.extend(ids)
    with pytest.raises(ValueError, match=field):
        generation_request_from_proto(req)
