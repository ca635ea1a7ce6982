"""Hostile environments end their own episode with a named reason; the host and other episodes go on."""
from __future__ import annotations

import pytest

from contract.environment import EndReason, EpisodeLimits, EpisodeProblem, StepResult
from services.rollout.episodes.environment_host import BadReply, EpisodeEnded, EpisodeEnvironment, decode_reply
from tests.rollout.hostile_environments import register_hostile, register_pickle_bomb

register_hostile()

PROBLEM = EpisodeProblem("p0", "What is 6*7?", "42")
# A short timeout keeps the hang cases fast; only they wait on it. Every other case gets room for a loaded host:
# the environment's process starts within reset's deadline, and once took more than 0.5 s in CI.
HANG_LIMITS = EpisodeLimits(step_timeout_s=0.5, max_observation_bytes=4096)
LIMITS = EpisodeLimits(step_timeout_s=30.0, max_observation_bytes=4096)


@pytest.mark.parametrize("name,reason", [
    ("test-raises", EndReason.ENV_ERROR),
    ("test-hangs", EndReason.ENV_TIMEOUT),
    ("test-huge", EndReason.OBSERVATION_TOO_LARGE),
    ("test-huge-bytes", EndReason.OBSERVATION_TOO_LARGE),
    ("test-not-utf8", EndReason.OBSERVATION_NOT_UTF8),
    ("test-lone-surrogate", EndReason.OBSERVATION_NOT_UTF8),
    ("test-dies", EndReason.ENV_CRASHED),
    ("test-nan-reward", EndReason.BAD_RESULT),
    ("test-wrong-shape", EndReason.BAD_RESULT),
])
def test_a_hostile_step_ends_the_episode_with_its_reason(name, reason):
    with EpisodeEnvironment(name, {}, HANG_LIMITS if reason is EndReason.ENV_TIMEOUT else LIMITS) as env:
        assert env.reset(PROBLEM) == "What is 6*7?"
        assert env.step("fine").observation == "turn 1 ok"
        with pytest.raises(EpisodeEnded) as ended:
            env.step("now misbehave")
        assert ended.value.reason is reason
        # The episode stays ended: a further call answers the same reason and runs nothing.
        with pytest.raises(EpisodeEnded) as again:
            env.step("fine")
        assert again.value.reason is reason
        assert not env._process.is_alive()
    # The host is not harmed: a well-behaved episode runs right after.
    with EpisodeEnvironment("calculator", {}, LIMITS) as env:
        assert env.reset(PROBLEM) == "What is 6*7?"
        assert env.step("<calc>6*7</calc>").observation == "<result>42</result>"
        result = env.step("42")
        assert (result.reward, result.done) == (1.0, True)


def test_a_hang_in_reset_is_stopped_too():
    with EpisodeEnvironment("test-hangs-in-reset", {}, HANG_LIMITS) as env:
        with pytest.raises(EpisodeEnded) as ended:
            env.reset(PROBLEM)
        assert ended.value.reason is EndReason.ENV_TIMEOUT


def test_an_unknown_environment_or_bad_option_is_refused_before_any_process_starts():
    with pytest.raises(ValueError, match="unknown environment 'nope'"):
        EpisodeEnvironment("nope", {}, LIMITS)
    with pytest.raises(ValueError, match="correct_reward"):
        EpisodeEnvironment("calculator", {"correct_reward": 2.0}, LIMITS)


def test_a_crafted_pickle_on_the_return_pipe_runs_nothing_in_the_host(tmp_path):
    register_pickle_bomb()
    marker = tmp_path / "reduce-ran"
    with EpisodeEnvironment("test-pickle-bomb", {}, LIMITS) as env:
        assert env.reset(EpisodeProblem("p0", str(marker), "")) == "ready"
        with pytest.raises(EpisodeEnded) as ended:
            env.step("go")
        assert ended.value.reason is EndReason.BAD_RESULT
        assert "not UTF-8 JSON" in ended.value.message
    assert not marker.exists()
    # The host goes on: a well-behaved episode runs right after.
    with EpisodeEnvironment("calculator", {}, LIMITS) as env:
        assert env.reset(PROBLEM) == "What is 6*7?"


@pytest.mark.parametrize("raw,match", [
    (b'{"status": "ok", "observation": "x", "reward": NaN, "done": false, "tool_call": false, '
     b'"tool_error": false}', "no JSON number"),
    (b'{"status": "ok", "observation": "x", "reward": 1, "done": 1, "tool_call": false, "tool_error": false}',
     "done is not a bool"),
    (b'{"status": "ok", "observation": "x", "reward": 1.0, "done": false}', "exactly the keys"),
    (b'{"status": "ok", "observation": "\\ud800", "reward": 1.0, "done": false, "tool_call": false, '
     b'"tool_error": false}', "not UTF-8 text"),
    (b'{"status": "refused", "reason": "env_timeout", "message": "x"}', "not one a child may report"),
    (b'{"status": "refused", "reason": "anything", "message": "x"}', "not one a child may report"),
    (b'["ok", "x"]', "not an object"),
    (b'{"status": "maybe"}', "neither"),
])
def test_a_reply_not_in_the_hosts_format_is_refused_by_field(raw, match):
    with pytest.raises(BadReply, match=match):
        decode_reply(raw, "step", 4096)


def test_replies_in_the_hosts_format_decode():
    assert decode_reply(b'{"status": "ok", "observation": "caf\xc3\xa9"}', "reset", 64) == "caf\u00e9"
    step = decode_reply(b'{"status": "ok", "observation": "o", "reward": 1, "done": true, "tool_call": true, '
                        b'"tool_error": false}', "step", 64)
    assert step == StepResult("o", 1.0, True, True, False) and type(step.reward) is float
    assert decode_reply(b'{"status": "refused", "reason": "env_error", "message": "boom"}', "step", 64) == (
        EndReason.ENV_ERROR, "boom")
    with pytest.raises(BadReply, match="larger than max_observation_bytes=4"):
        decode_reply(b'{"status": "ok", "observation": "caf\xc3\xa9"}', "reset", 4)
