"""Episodic tasks on the coordinator: their splits, the settings they send, their step metrics, and what a
run spec may not combine with them."""
from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from contract.environment import EndReason, EpisodeLimits
from contract.wire_tensors import ids_to_proto
from proto import lockstep_pb2 as pb
from recipes.tiny_model import build_model_dir
from services.coordinator.run_spec import RunSpec
from services.coordinator.tasks import build_task
from services.coordinator.tasks.episodic import episode_metrics


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model_dir(tmp_path_factory.mktemp("m") / "tiny", seed=0)


@pytest.mark.parametrize("name,options", [("calculator", {"digits": 2, "heldout_size": 50, "train_size": 300}),
                                          ("number_guess", {"max_value": 999, "heldout_size": 50})])
def test_splits_are_disjoint_and_a_pure_function_of_the_options(name, options):
    task, again = build_task(name, options), build_task(name, options)
    held, train = task.split("heldout"), task.split("train")
    assert held == again.split("heldout") and train == again.split("train") and len(held) == 50
    if name == "calculator":
        key = lambda p: frozenset(p.prompt.removesuffix("=").split("*"))  # noqa: E731
        for p in held + train:
            a, b = p.prompt.removesuffix("=").split("*")
            assert int(a) * int(b) == int(p.answer) and 10 <= int(a) <= 99
    else:
        key = lambda p: p.answer  # noqa: E731
    assert not {key(p) for p in held} & {key(p) for p in train}
    assert build_task(name, {**options, "seed": 1}).split("heldout") != held


def test_the_episode_settings_carry_the_environment_and_the_limits():
    task = build_task("number_guess", {"episode": {"max_turns": 5, "step_timeout_s": 2.0}})
    settings = task.episode_settings()
    assert settings.environment == "number_guess" and json.loads(settings.options_json) == {}
    assert EpisodeLimits.model_validate_json(settings.limits_json) == EpisodeLimits(max_turns=5, step_timeout_s=2.0)


@pytest.mark.parametrize("options,field", [({"episode": {"max_turns": 0}}, "options.episode.max_turns"),
                                           ({"episode": {"step_timeout_s": 0}}, "options.episode.step_timeout_s"),
                                           ({"episode": {"nope": 1}}, "options.episode.nope"),
                                           ({"digits": 9}, "options.digits")])
def test_bad_options_are_refused_naming_the_option(options, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        build_task("calculator", options)


@pytest.mark.parametrize("engine", ["torch", "sglang"])
def test_an_episodic_task_runs_on_either_engine(model_dir, engine):
    spec = {"name": "n", "model_path": str(model_dir), "steps": 1,
            "task": {"name": "calculator", "options": {"episode": {"max_episode_tokens": 128}}},
            "rollout": {"engine": engine}}
    assert RunSpec.model_validate(spec).task.name == "calculator"


def test_an_episode_longer_than_the_model_is_refused_naming_the_field(model_dir):
    # The tiny model's max_position_embeddings is 128; the default budget (4096) does not fit.
    for options in ({}, {"episode": {"max_episode_tokens": 129}}):
        spec = {"name": "n", "model_path": str(model_dir), "steps": 1, "task": {"name": "number_guess",
                                                                                 "options": options}}
        with pytest.raises(ValidationError) as exc:
            RunSpec.model_validate(spec)
        assert "task.options.episode.max_episode_tokens" in str(exc.value) and "128" in str(exc.value)


def test_an_episodic_task_reads_no_eval_sets(model_dir, tmp_path):
    (tmp_path / "set.jsonl").write_text('{"a": 1, "b": 2}\n')
    spec = {"name": "n", "model_path": str(model_dir), "steps": 1,
            "task": {"name": "number_guess", "options": {"episode": {"max_episode_tokens": 64}}},
            "eval": {"sets": [{"name": "x", "path": str(tmp_path / "set.jsonl")}]}}
    with pytest.raises(ValidationError, match="reads no eval sets"):
        RunSpec.model_validate(spec)


def _sample(prompt: int, mask: list[bool], turns: int, reason: EndReason, tools: tuple[int, int] = (0, 0)
            ) -> pb.Sample:
    import numpy as np

    s = pb.Sample(turns=turns, end_reason=reason.value, policy_versions=[0] * sum(mask),
                  tool_calls=tools[0], tool_errors=tools[1],
                  prompt_token_ids=ids_to_proto([5] * prompt), response_token_ids=ids_to_proto([6] * len(mask)))
    s.response_mask.CopyFrom(pb.Tensor(dtype="bool", shape=[len(mask)], data=np.array(mask, dtype=bool).tobytes()))
    return s


def test_episode_metrics_count_turns_tokens_and_end_reasons():
    m = episode_metrics([_sample(3, [True, True, False, True], 2, EndReason.DONE, (1, 0)),
                         _sample(2, [True, False, False, True, True, True], 3, EndReason.MAX_TURNS, (2, 1)),
                         _sample(4, [], 0, EndReason.ENV_TIMEOUT)])
    assert m["episodes"] == 3 and m["episode_turns_mean"] == pytest.approx(5 / 3) and m["episode_turns_max"] == 3
    assert m["episode_tokens_mean"] == pytest.approx((7 + 8 + 4) / 3)
    assert m["episode_model_token_fraction"] == pytest.approx(7 / 10)
    assert (m["episodes_end_done"], m["episodes_end_max_turns"], m["episodes_end_env_timeout"]) == (1, 1, 1)
    assert m["episodes_end_env_error"] == 0
    assert m["episode_tool_calls_mean"] == pytest.approx(1.0) and m["episode_tool_errors"] == 1


def test_episode_views_summarise_the_episodes_of_a_record():
    from services.coordinator.http.episode_views import episode_views

    import numpy as np

    t = pb.Trajectory(sample_id="s1-g0/1", reward=1.0, advantage=0.5, prompt_token_ids=ids_to_proto([5, 6, 7]),
                      response_token_ids=ids_to_proto([1, 2, 3, 4, 5]))
    t.response_mask.CopyFrom(pb.Tensor(dtype="bool", shape=[5], data=np.array([1, 1, 0, 0, 1], dtype=bool).tobytes()))
    t.episode.CopyFrom(pb.EpisodeRecord(turns=2, turn_rewards=[0.0, 1.0], tool_calls=1, tool_errors=0,
                                        end_reason="done"))
    single_turn = pb.Trajectory(sample_id="s1-g1/0", reward=1.0)
    assert episode_views([t, single_turn]) == [{
        "sample_id": "s1-g0/1", "reward": 1.0, "advantage": 0.5, "turns": 2, "turn_rewards": [0.0, 1.0],
        "tool_calls": 1, "tool_errors": 0, "end_reason": "done", "prompt_tokens": 3, "model_tokens": 3,
        "environment_tokens": 2}]
