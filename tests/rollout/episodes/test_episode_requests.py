"""GenerateRequest.episode on the rollout: what is refused (naming the field) and what an episode looks like
on the wire."""
from __future__ import annotations

import json

import pytest
import torch

from contract.environment import EndReason
from proto import lockstep_pb2 as pb
from services.common.tensors import from_proto, ids_to_proto
from services.rollout.episodes.requests import episode_request_from_proto, episodes_to_proto
from services.rollout.episodes.runner import Episode


def _request(**over) -> pb.GenerateRequest:
    req = pb.GenerateRequest(
        run_id="r", step=1, policy_version=0, samples_per_prompt=2,
        sampling=pb.SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=4),
        prompts=[pb.Prompt(group_id="g0", seed=9, problem=pb.EpisodeProblem(problem_id="p", prompt="6*7=",
                                                                             answer="42"))],
        episode=pb.EpisodeSettings(environment="calculator", options_json="{}",
                                   limits_json=json.dumps({"max_turns": 3})))
    for key, value in over.items():
        if key == "episode":
            req.episode.CopyFrom(value)
        elif key in ("prompts", "sample_ids"):
            del getattr(req, key)[:]
            getattr(req, key).extend(value)
        else:
            setattr(req, key, value)
    return req


def test_an_episode_request_becomes_one_spec_per_sample():
    got = episode_request_from_proto(_request())
    assert got.environment == "calculator" and got.limits.max_turns == 3
    assert [(s.group_id, s.index, s.seed, s.problem.answer) for s in got.specs] == [("g0", 0, 9, "42"),
                                                                                  ("g0", 1, 10, "42")]


@pytest.mark.parametrize("over,field", [
    ({"episode": pb.EpisodeSettings(environment="os.system")}, "episode.environment: unknown environment"),
    ({"episode": pb.EpisodeSettings(environment="calculator", options_json='{"x": 1}')}, "episode.options_json"),
    ({"episode": pb.EpisodeSettings(environment="calculator", options_json="[1]")}, "episode.options_json"),
    ({"episode": pb.EpisodeSettings(environment="calculator", limits_json='{"max_turns": 0}')},
     "episode.limits_json: max_turns"),
    ({"episode": pb.EpisodeSettings(environment="calculator", limits_json="{")}, "episode.limits_json"),
    ({"prompts": [pb.Prompt(group_id="g0", seed=1)]}, r"prompts\[0\].problem: missing"),
    ({"prompts": [pb.Prompt(group_id="g0", seed=1, token_ids=ids_to_proto([5]),
                            problem=pb.EpisodeProblem(prompt="x", answer="1"))]}, r"prompts\[0\].token_ids"),
    ({"prompts": [pb.Prompt(group_id="g0", seed=1, problem=pb.EpisodeProblem(prompt="x" * 70000))]},
     r"prompts\[0\].problem.prompt"),
    ({"prompts": []}, "prompts: empty"),
    ({"samples_per_prompt": 0}, "samples_per_prompt"),
    ({"sample_ids": ["g0/1"]}, "sample_ids: an episode request generates every sample"),
])
def test_a_bad_episode_request_is_refused_naming_the_field(over, field):
    with pytest.raises(ValueError, match=field):
        episode_request_from_proto(_request(**over))


def test_an_episode_on_the_wire_carries_its_prompt_mask_reward_and_end():
    e = Episode("g0", 1, prompt_ids=[5, 6], response_ids=[7, 8, 30, 9], response_mask=[True, True, False, True],
                logprobs=[-0.5, -0.25, -1.0], turn_rewards=[0.0, 1.0], turns=2, end_reason=EndReason.DONE,
                tool_calls=1, tool_errors=1)
    failed = Episode("g0", 0, end_reason=EndReason.ENV_TIMEOUT, end_message="reset() ran past 5s")
    (s, f) = episodes_to_proto([e, failed], policy_version=3)
    assert from_proto(s.prompt_token_ids, field="p").tolist() == [5, 6]
    assert from_proto(s.response_mask, field="m", dtype=torch.bool).tolist() == [True, True, False, True]
    assert from_proto(s.logprobs, field="l").tolist() == [-0.5, -0.25, -1.0] and list(s.policy_versions) == [3, 3, 3]
    assert (s.episode_reward, s.turns, s.end_reason, s.sample_id) == (1.0, 2, "done", "g0/1")
    assert (s.tool_calls, s.tool_errors, list(s.turn_rewards)) == (1, 1, [0.0, 1.0])
    assert from_proto(f.response_token_ids, field="r").numel() == 0 and f.end_reason == "env_timeout"
    with pytest.raises(RuntimeError, match="2 log-probs, 3 model tokens"):
        episodes_to_proto([Episode("g", 0, [1], [2, 3, 4], [True] * 3, [-1.0, -1.0], end_reason=EndReason.DONE)], 0)
