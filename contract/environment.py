"""Multi-turn environments: the interface, its limits, the reasons an episode ends, and a registry entry.

An episode alternates model turns and environment observations:

    observation_0 = env.reset(problem)
    repeat: model_turn_i = <the policy samples>; (observation_i+1, reward_i, done_i) = env.step(model_turn_i)

The environment sees the model's turn as text (decoded from the sampled tokens) and answers with text;
the rollout keeps the sampled tokens as they were sampled and appends the observation's tokens after
them, so an environment never changes a model token.

An environment is ordinary Python listed by name in services/environments/registry.py (the built-ins)
or registered there in process (`register_environment`): a run spec picks one by that name, never a
module or an executable. Environments are run by a host that can stop them
(services/rollout/episodes/environment_host.py): an exception, a hang past `EpisodeLimits.step_timeout_s`, an
observation over `max_observation_bytes`, one that is not UTF-8, or a malformed result ends that episode
with one of the `EndReason`s below and is counted; the run goes on.

This module imports pydantic and the standard library only (the coordinator imports it without torch).
"""
from __future__ import annotations

import abc
import enum
import math
from collections.abc import Callable
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field


class EndReason(str, enum.Enum):
    """Why an episode ended; each is counted per step under its value."""

    DONE = "done"
    """The environment said so (its last step returned done=True)."""
    MAX_TURNS = "max_turns"
    """The model took `max_turns` turns and the environment had not finished."""
    MAX_EPISODE_TOKENS = "max_episode_tokens"
    """The episode's tokens (prompt, model turns and observations) reached `max_episode_tokens`."""
    ENV_ERROR = "env_error"
    """reset() or step() raised."""
    ENV_TIMEOUT = "env_timeout"
    """reset() or step() ran past `step_timeout_s`; its process was killed."""
    ENV_CRASHED = "env_crashed"
    """The process running the environment died (a signal, os._exit, out of memory)."""
    OBSERVATION_TOO_LARGE = "observation_too_large"
    """An observation's UTF-8 encoding exceeded `max_observation_bytes`."""
    OBSERVATION_NOT_UTF8 = "observation_not_utf8"
    """An observation was bytes that are not UTF-8, or a str that cannot be encoded as UTF-8."""
    BAD_RESULT = "bad_result"
    """step() returned something other than (str, finite float, bool)."""


ENV_FAILURES = frozenset({EndReason.ENV_ERROR, EndReason.ENV_TIMEOUT, EndReason.ENV_CRASHED,
                          EndReason.OBSERVATION_TOO_LARGE, EndReason.OBSERVATION_NOT_UTF8, EndReason.BAD_RESULT})
"""Reasons that are the environment's fault (the episode's reward is then 0)."""


class EpisodeLimits(BaseModel):
    """Bounds on one episode (the run spec's `task.episode`)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    max_turns: int = Field(4, ge=1, le=64, description="Most model turns in one episode; an episode still going "
                           "after this many ends with reason 'max_turns'.")
    max_episode_tokens: int = Field(4096, ge=2, le=1_048_576, description="Most tokens in one episode, prompt, "
                                    "model turns and observations together; the turn that reaches it is cut there "
                                    "and the episode ends with reason 'max_episode_tokens'.")
    step_timeout_s: float = Field(5.0, gt=0.0, le=600.0, description="Wall-clock bound on one reset() or step() "
                                  "call; past it the environment's process is killed and the episode ends with "
                                  "reason 'env_timeout'.")
    max_observation_bytes: int = Field(16384, ge=1, le=16 * 1024 * 1024, description="Largest observation, in "
                                       "bytes of UTF-8; a larger one ends the episode with reason "
                                       "'observation_too_large' (and is never copied into the rollout's process).")


@dataclass(frozen=True)
class EpisodeProblem:
    """What reset() is given: the task's problem (its prompt and reference answer)."""

    problem_id: str
    prompt: str
    answer: str


@dataclass(frozen=True)
class StepResult:
    """What step() returns. `observation` is ignored when `done` is true."""

    observation: str
    reward: float
    done: bool
    tool_call: bool = False
    """The turn called a tool (counted per step: episode_tool_calls_mean)."""
    tool_error: bool = False
    """That call failed (a refused expression, an unknown tool; counted: episode_tool_errors)."""


class Environment(abc.ABC):
    """One episode's environment. A fresh instance serves each episode (state lives on `self`)."""

    @abc.abstractmethod
    def reset(self, problem: EpisodeProblem) -> str:
        """The first observation: the text the policy is prompted with."""

    @abc.abstractmethod
    def step(self, model_turn: str) -> StepResult | tuple[str, float, bool]:
        """React to the model's turn (its sampled tokens decoded as text)."""


class ObservationRefused(ValueError):
    """An observation broke a limit; `reason` says which."""

    def __init__(self, reason: EndReason, message: str):
        super().__init__(message)
        self.reason = reason


def check_observation(value: object, max_bytes: int) -> str:
    """The observation as text, or ObservationRefused naming the reason (bytes must be UTF-8; a str must
    encode as UTF-8, no lone surrogates; at most `max_bytes` bytes encoded)."""
    if isinstance(value, (bytes, bytearray)):
        if len(value) > max_bytes:
            raise ObservationRefused(EndReason.OBSERVATION_TOO_LARGE,
                                     f"observation of {len(value)} bytes > max_observation_bytes={max_bytes}")
        try:
            return bytes(value).decode("utf-8", errors="strict")
        except UnicodeDecodeError as exc:
            raise ObservationRefused(EndReason.OBSERVATION_NOT_UTF8,
                                     f"observation is not UTF-8 ({exc.reason} at byte {exc.start})") from None
    if not isinstance(value, str):
        raise ObservationRefused(EndReason.BAD_RESULT, f"observation is {type(value).__name__}, not str")
    # A str holds at most 4 bytes of UTF-8 per character: check the cheap bound before encoding a huge one.
    if len(value) > max_bytes:
        raise ObservationRefused(EndReason.OBSERVATION_TOO_LARGE,
                                 f"observation of {len(value)} characters > max_observation_bytes={max_bytes}")
    try:
        encoded = value.encode("utf-8", errors="strict")
    except UnicodeEncodeError as exc:
        raise ObservationRefused(EndReason.OBSERVATION_NOT_UTF8,
                                 f"observation is not UTF-8 ({exc.reason} at character {exc.start})") from None
    if len(encoded) > max_bytes:
        raise ObservationRefused(EndReason.OBSERVATION_TOO_LARGE,
                                 f"observation of {len(encoded)} bytes > max_observation_bytes={max_bytes}")
    return value


def check_step_result(result: object, max_bytes: int) -> StepResult:
    """step()'s return value validated: (observation text, finite float reward, bool done)."""
    tool_call = tool_error = False
    if isinstance(result, StepResult):
        observation, reward, done = result.observation, result.reward, result.done
        tool_call, tool_error = result.tool_call, result.tool_error
        if not isinstance(tool_call, bool) or not isinstance(tool_error, bool):
            raise ObservationRefused(EndReason.BAD_RESULT, "tool_call and tool_error must be bool")
    elif isinstance(result, tuple) and len(result) == 3:
        observation, reward, done = result
    else:
        raise ObservationRefused(EndReason.BAD_RESULT, f"step() returned {type(result).__name__}, "
                                 "not StepResult or (observation, reward, done)")
    if not isinstance(done, bool):
        raise ObservationRefused(EndReason.BAD_RESULT, f"done is {type(done).__name__}, not bool")
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
        raise ObservationRefused(EndReason.BAD_RESULT, f"reward {reward!r} is not a finite number")
    text = "" if done else check_observation(observation, max_bytes)
    return StepResult(text, float(reward), done, tool_call, tool_error)


# ---------------------------------------------------------------- registry entry

@dataclass(frozen=True)
class EnvironmentEntry:
    name: str
    options_model: type[BaseModel]
    factory: Callable[[BaseModel], Environment]
    """Builds one episode's environment from validated options."""
