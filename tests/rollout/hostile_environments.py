"""Environments that misbehave in each way an environment can, for tests/rollout/episodes/test_environment_host.py.

Module-level classes, so the environment host's child process finds them by reference."""
from __future__ import annotations

import os
import signal
import time

from pydantic import BaseModel, ConfigDict

from contract.environment import Environment, EpisodeProblem, StepResult
from services.environments.registry import register_environment


class NoOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class _Hostile(Environment):
    """reset() behaves; step() misbehaves (subclasses say how). A turn "fine" gets a plain answer, so a test
    shows the episode worked until the hostile step."""

    def __init__(self, options: NoOptions):
        self.turns = 0

    def reset(self, problem: EpisodeProblem) -> str:
        return problem.prompt

    def step(self, model_turn: str):
        self.turns += 1
        if model_turn == "fine":
            return StepResult(f"turn {self.turns} ok", 0.0, False)
        return self.misbehave()

    def misbehave(self):
        raise NotImplementedError


class Raises(_Hostile):
    def misbehave(self):
        raise RuntimeError("the tool fell over")


class Hangs(_Hostile):
    def misbehave(self):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # only SIGKILL stops it
        while True:
            time.sleep(1)


class Huge(_Hostile):
    def misbehave(self):
        return StepResult("x" * (64 * 1024 * 1024), 0.0, False)


class HugeBytes(_Hostile):
    def misbehave(self):
        return (b"y" * (1024 * 1024), 0.0, False)


class NotUtf8(_Hostile):
    def misbehave(self):
        return (b"caf\xe9 \xff\xfe", 0.0, False)


class LoneSurrogate(_Hostile):
    def misbehave(self):
        return ("half a pair: \ud800", 0.0, False)


class Dies(_Hostile):
    def misbehave(self):
        os._exit(3)


class NanReward(_Hostile):
    def misbehave(self):
        return ("fine", float("nan"), False)


class WrongShape(_Hostile):
    def misbehave(self):
        return {"observation": "a dict is not a result"}


class HangsInReset(_Hostile):
    def reset(self, problem: EpisodeProblem) -> str:
        while True:
            time.sleep(1)


class NeverDone(_Hostile):
    def misbehave(self):
        return StepResult("again", 0.0, False)


HOSTILE = {"test-raises": Raises, "test-hangs": Hangs, "test-huge": Huge, "test-huge-bytes": HugeBytes,
           "test-not-utf8": NotUtf8, "test-lone-surrogate": LoneSurrogate, "test-dies": Dies,
           "test-nan-reward": NanReward, "test-wrong-shape": WrongShape, "test-hangs-in-reset": HangsInReset,
           "test-never-done": NeverDone}


def register_hostile() -> None:
    from services.environments.registry import known_environments

    known = known_environments()
    for name, cls in HOSTILE.items():
        if name not in known:
            register_environment(name, NoOptions, cls)


class Feedback(Environment):
    """Well behaved: answers every turn with feedback naming the turn, never done (the episode ends at
    max_turns), reward 0.25 a turn."""

    def __init__(self, options: NoOptions):
        self.turns = 0

    def reset(self, problem: EpisodeProblem) -> str:
        return problem.prompt

    def step(self, model_turn: str) -> StepResult:
        self.turns += 1
        return StepResult(f" try {self.turns}: ", 0.25, False)


def register_feedback() -> None:
    from services.environments.registry import known_environments

    if "test-feedback" not in known_environments():
        register_environment("test-feedback", NoOptions, Feedback)


class PickleBomb(Environment):
    """Writes a crafted pickle to the host's pipe itself, bypassing the reply _serve would send: unpickled, its
    `__reduce__` creates the file named by the problem's prompt (a marker the test looks for). The environment
    finds the pipe as any code in its process could, in the process's own objects."""

    def __init__(self, options: NoOptions):
        self.marker = ""

    def reset(self, problem: EpisodeProblem) -> str:
        self.marker = problem.prompt
        return "ready"

    def step(self, model_turn: str):
        import gc
        import pickle
        from multiprocessing.connection import Connection

        marker = self.marker

        class Payload:
            def __reduce__(self):
                return (open, (marker, "w"))

        for obj in gc.get_objects():
            if isinstance(obj, Connection) and not obj.closed:
                obj.send_bytes(pickle.dumps(("ok", Payload())))
        time.sleep(30)  # the parent has read the crafted reply by now; never send the real one


def register_pickle_bomb() -> None:
    from services.environments.registry import known_environments

    if "test-pickle-bomb" not in known_environments():
        register_environment("test-pickle-bomb", NoOptions, PickleBomb)
