"""Runs one episode's environment in its own process, where a timeout can stop it.

An environment is Python the rollout did not write for this episode's safety: it may raise, loop
forever, return a gigabyte, or return bytes that are not text. A thread cannot be stopped, so each
episode's environment lives in a child process forked from a forkserver (a clean process that imported
only `contract.environment`; forking the rollout itself would copy its torch and gRPC threads). The
parent sends each call over a pipe and waits at most `step_timeout_s`:

- the child checks the observation (UTF-8, `max_observation_bytes`) before sending it, and the parent
  reads at most that many bytes (plus framing) anyway, so an oversized answer never reaches its memory;
- a timeout kills the child (SIGKILL; a hung step may be ignoring signals);
- a dead child (a signal, os._exit) is noticed as a closed pipe.

Each failure raises `EpisodeEnded` with its `EndReason`; the caller ends that episode and counts it.
"""
from __future__ import annotations

import multiprocessing
import pickle
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection

from pydantic import BaseModel

from contract.environment import (
    EndReason, Environment, EpisodeLimits, EpisodeProblem, ObservationRefused, StepResult, check_observation,
    check_step_result,
)
from services.environments.registry import environment_entry, environment_options

_FRAMING_BYTES = 4096
"""Room for the pickled reply's own structure around the observation text."""

_CONTEXT_LOCK = threading.Lock()
_CONTEXT: multiprocessing.context.BaseContext | None = None


def _context() -> multiprocessing.context.BaseContext:
    global _CONTEXT
    with _CONTEXT_LOCK:
        if _CONTEXT is None:
            ctx = multiprocessing.get_context("forkserver")
            ctx.set_forkserver_preload(["contract.environment", "services.environments.calculator",
                                        "services.environments.number_guess"])
            _CONTEXT = ctx
        return _CONTEXT


class EpisodeEnded(Exception):
    """The environment ended the episode abnormally; `reason` names how."""

    def __init__(self, reason: EndReason, message: str):
        super().__init__(f"{reason.value}: {message}")
        self.reason = reason
        self.message = message


def _serve(conn: Connection, factory: Callable[[BaseModel], Environment], options: BaseModel,
           max_bytes: int) -> None:
    """The child: build the environment, answer reset/step calls until the parent closes the pipe."""
    try:
        env = factory(options)
    except Exception as exc:  # noqa: BLE001 - any failure is reported, not raised into nothing
        conn.send(("refused", EndReason.ENV_ERROR.value, f"building it raised {type(exc).__name__}: {exc}"))
        return
    while True:
        try:
            kind, payload = conn.recv()
        except EOFError:
            return
        try:
            if kind == "reset":
                reply: object = check_observation(env.reset(payload), max_bytes)
            else:
                reply = check_step_result(env.step(payload), max_bytes)
        except ObservationRefused as exc:
            conn.send(("refused", exc.reason.value, str(exc)))
            return
        except Exception as exc:  # noqa: BLE001 - the environment's own error ends its episode, nothing else
            conn.send(("refused", EndReason.ENV_ERROR.value, f"{kind}() raised {type(exc).__name__}: {exc}"))
            return
        conn.send(("ok", reply))


class EpisodeEnvironment:
    """One episode's environment, in a process of its own. Use as a context manager (close kills it)."""

    def __init__(self, name: str, options: dict, limits: EpisodeLimits):
        """ValueError naming the environment or option when `name` is unknown or `options` invalid; the
        registry is read here, in the caller's process, and the child receives the factory by reference."""
        self.limits = limits
        entry = environment_entry(name)
        validated = environment_options(name, options)
        ctx = _context()
        self._conn, child = ctx.Pipe(duplex=True)
        self._process = ctx.Process(target=_serve, args=(child, entry.factory, validated, limits.max_observation_bytes),
                                    daemon=True, name=f"environment-{name}")
        self._process.start()
        child.close()
        self._ended: EpisodeEnded | None = None

    def __enter__(self) -> "EpisodeEnvironment":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def reset(self, problem: EpisodeProblem) -> str:
        reply = self._call("reset", problem)
        assert isinstance(reply, str)
        return reply

    def step(self, model_turn: str) -> StepResult:
        reply = self._call("step", model_turn)
        assert isinstance(reply, StepResult)
        return reply

    def _call(self, kind: str, payload: object) -> object:
        if self._ended is not None:
            raise self._ended
        try:
            self._conn.send((kind, payload))
        except (BrokenPipeError, ConnectionResetError, EOFError):
            self._end(EndReason.ENV_CRASHED, f"the environment's process exited before {kind}()")
        if not self._conn.poll(self.limits.step_timeout_s):
            self._end(EndReason.ENV_TIMEOUT, f"{kind}() ran past step_timeout_s={self.limits.step_timeout_s}")
        try:
            raw = self._conn.recv_bytes(self.limits.max_observation_bytes + _FRAMING_BYTES)
        except EOFError:
            self._end(EndReason.ENV_CRASHED, f"the environment's process exited during {kind}()")
        except OSError:  # the message is longer than maxlength: the pipe is now unusable anyway
            self._end(EndReason.OBSERVATION_TOO_LARGE,
                      f"{kind}() answered more than max_observation_bytes={self.limits.max_observation_bytes}")
        # The child sends only builtins and contract dataclasses (its reply is built by _serve, not by the
        # environment), so unpickling it imports nothing new.
        status, *rest = pickle.loads(raw)
        if status == "ok":
            return rest[0]
        reason, message = rest
        self._end(EndReason(reason), message)

    def _end(self, reason: EndReason, message: str) -> None:
        self._ended = EpisodeEnded(reason, message)
        self.close()
        raise self._ended

    def close(self) -> None:
        """Stop the child now (SIGKILL: a hung environment may ignore anything gentler) and reap it."""
        if self._process.is_alive():
            self._process.kill()
        self._process.join()
        self._conn.close()
