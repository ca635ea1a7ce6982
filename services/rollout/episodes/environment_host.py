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

The child's replies come back as JSON, never pickle: the environment's own code runs in the child and can
write anything to the pipe (it finds the connection in its own memory), and unpickling bytes it chose would
run its code in the rollout process, undoing the isolation the child exists for. The parent decodes each
reply with `decode_reply`, field by field (a status, then a str observation, or a finite float reward and
bools, or a failure reason the child may name); anything else ends the episode with `bad_result`.

Each failure raises `EpisodeEnded` with its `EndReason`; the caller ends that episode and counts it.
"""
from __future__ import annotations

import json
import math
import multiprocessing
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
"""Room for the JSON reply's own structure around the observation text."""
_ESCAPE_FACTOR = 6
"""JSON writes a control character of the observation as \\u00XX: 6 bytes for 1 of UTF-8, the most any
character grows (others are sent as UTF-8, ensure_ascii=False)."""
_REPORTABLE = frozenset({EndReason.ENV_ERROR, EndReason.OBSERVATION_TOO_LARGE, EndReason.OBSERVATION_NOT_UTF8,
                         EndReason.BAD_RESULT})
"""The reasons a child may name for itself (a timeout or a crash is only ever the parent's finding)."""

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


def _send(conn: Connection, reply: dict) -> None:
    conn.send_bytes(json.dumps(reply, ensure_ascii=False, allow_nan=False).encode("utf-8"))


def _refused(reason: EndReason, message: str) -> dict:
    return {"status": "refused", "reason": reason.value, "message": message[:1000]}


def _serve(conn: Connection, factory: Callable[[BaseModel], Environment], options: BaseModel,
           max_bytes: int) -> None:
    """The child: build the environment, answer reset/step calls until the parent closes the pipe."""
    try:
        env = factory(options)
    except Exception as exc:  # noqa: BLE001 - any failure is reported, not raised into nothing
        _send(conn, _refused(EndReason.ENV_ERROR, f"building it raised {type(exc).__name__}: {exc}"))
        return
    while True:
        try:
            kind, payload = conn.recv()
        except EOFError:
            return
        try:
            if kind == "reset":
                reply: dict = {"status": "ok", "observation": check_observation(env.reset(payload), max_bytes)}
            else:
                r = check_step_result(env.step(payload), max_bytes)
                reply = {"status": "ok", "observation": r.observation, "reward": r.reward, "done": r.done,
                         "tool_call": r.tool_call, "tool_error": r.tool_error}
        except ObservationRefused as exc:
            _send(conn, _refused(exc.reason, str(exc)))
            return
        except Exception as exc:  # noqa: BLE001 - the environment's own error ends its episode, nothing else
            _send(conn, _refused(EndReason.ENV_ERROR, f"{kind}() raised {type(exc).__name__}: {exc}"))
            return
        _send(conn, reply)


class BadReply(ValueError):
    """The child's bytes are not a reply of the host's format."""


def _no_constant(name: str) -> object:
    raise BadReply(f"{name} is no JSON number")


def decode_reply(raw: bytes, kind: str, max_bytes: int) -> str | StepResult | tuple[EndReason, str]:
    """A child's reply to `kind` ('reset' or 'step'): the observation, the StepResult, or (reason, message) of a
    failure the child reported. BadReply for anything else: nothing in `raw` is ever run or imported."""
    try:
        reply = json.loads(raw.decode("utf-8", errors="strict"), parse_constant=_no_constant)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise BadReply(f"the reply is not UTF-8 JSON ({type(exc).__name__})") from None
    if not isinstance(reply, dict):
        raise BadReply(f"the reply is a JSON {type(reply).__name__}, not an object")
    status = reply.get("status")
    if status == "refused":
        if set(reply) != {"status", "reason", "message"} or not isinstance(reply["message"], str):
            raise BadReply("a refusal must be exactly {status, reason, message: str}")
        try:
            reason = EndReason(reply["reason"])
        except ValueError:
            raise BadReply(f"reason {str(reply['reason'])[:40]!r} is not one a child may report") from None
        if reason not in _REPORTABLE:
            raise BadReply(f"reason {reason.value!r} is not one a child may report")
        return reason, reply["message"][:1000]
    if status != "ok":
        raise BadReply(f"status {str(status)[:40]!r} is neither 'ok' nor 'refused'")
    want = {"status", "observation"} if kind == "reset" else {"status", "observation", "reward", "done",
                                                               "tool_call", "tool_error"}
    if set(reply) != want:
        raise BadReply(f"a {kind}() reply must have exactly the keys {sorted(want)}")
    observation = reply["observation"]
    if not isinstance(observation, str):
        raise BadReply("the observation is not a str")
    try:
        size = len(observation.encode("utf-8", errors="strict"))  # a lone surrogate (\\ud800) is refused here
    except UnicodeEncodeError:
        raise BadReply("the observation is not UTF-8 text") from None
    if size > max_bytes:
        raise BadReply(f"the observation is larger than max_observation_bytes={max_bytes}")
    if kind == "reset":
        return observation
    reward = reply["reward"]
    if type(reward) not in (int, float) or not math.isfinite(reward):
        raise BadReply(f"reward {str(reward)[:40]!r} is not a finite number")
    for key in ("done", "tool_call", "tool_error"):
        if type(reply[key]) is not bool:
            raise BadReply(f"{key} is not a bool")
    return StepResult(observation, float(reward), reply["done"], reply["tool_call"], reply["tool_error"])


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
        max_bytes = self.limits.max_observation_bytes
        try:
            raw = self._conn.recv_bytes(_ESCAPE_FACTOR * max_bytes + _FRAMING_BYTES)
        except EOFError:
            self._end(EndReason.ENV_CRASHED, f"the environment's process exited during {kind}()")
        except OSError:  # the message is longer than maxlength: the pipe is now unusable anyway
            self._end(EndReason.OBSERVATION_TOO_LARGE,
                      f"{kind}() answered more than max_observation_bytes={max_bytes}")
        try:
            reply = decode_reply(raw, kind, max_bytes)
        except BadReply as exc:
            self._end(EndReason.BAD_RESULT, f"the environment's process sent no valid {kind}() reply: {exc}")
        if isinstance(reply, tuple):
            self._end(*reply)
        return reply

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
