"""One program and its tests, run once in a fresh sandbox; the outcome named from what the kernel and harness say.

Outcomes (`Outcome`):
- passed: the harness's verdict says every test passed (and there was at least one);
- failed: a verdict with a failing test, or the program raised (a syntax error, MemoryError past memory_mb,
  SystemExit, a missing entry point);
- timeout: the wall bound (the parent kills the sandbox) or the CPU bound (SIGXCPU, then SIGKILL);
- crashed: the interpreter ended without a verdict (a signal such as SIGSEGV from ctypes, os._exit);
- output_limit: stdout and stderr passed `output_bytes` (the parent kills the sandbox);
- refused: not run at all (the program is too large or not text).

Whatever the program does, the parent's reads are bounded (output by `output_bytes`, the verdict by a few KiB)
and its waits are bounded by `wall_s`.
"""
from __future__ import annotations

import enum
import json
import os
import secrets
import selectors
import signal
import subprocess
import time
from dataclasses import dataclass

from services.common.sandbox.bwrap import bwrap_command, drops_to_uid
from services.common.sandbox.settings import SandboxLimits, SandboxSettings

VERDICT_BYTES = 4096
OUTPUT_TAIL_BYTES = 2048
"""How much of a program's output a result keeps (for a person reading why it failed)."""


class Outcome(str, enum.Enum):
    PASSED = "passed"
    FAILED = "failed"
    TIMEOUT = "timeout"
    CRASHED = "crashed"
    OUTPUT_LIMIT = "output_limit"
    REFUSED = "refused"


@dataclass(frozen=True)
class Execution:
    """What to run: `program` defines `entry_point`; `test` defines check(candidate) (HumanEval's format)."""

    program: str
    test: str
    entry_point: str


@dataclass(frozen=True)
class ExecutionResult:
    outcome: Outcome
    passed: int
    total: int
    seconds: float
    detail: str = ""
    """Why, in a few words: the first failing test's exception, the signal, the limit."""
    output_tail: str = ""

    @property
    def passed_fraction(self) -> float:
        return self.passed / self.total if self.total else 0.0


def rlimits(limits: SandboxLimits) -> dict[str, tuple[int, int]]:
    """(soft, hard) of each limit. The CPU bound's hard limit is a second later: SIGXCPU first (Python dies of
    it), SIGKILL for a program that ignores it."""
    same = {"RLIMIT_AS": limits.memory_mb << 20, "RLIMIT_NPROC": limits.processes,
            "RLIMIT_NOFILE": limits.open_files, "RLIMIT_FSIZE": limits.file_mb << 20, "RLIMIT_CORE": 0}
    return {**{name: (value, value) for name, value in same.items()}, "RLIMIT_CPU": (limits.cpu_s, limits.cpu_s + 1)}


def _refusal(execution: Execution, limits: SandboxLimits) -> str:
    size = sum(len(s.encode("utf-8", "surrogatepass")) for s in (execution.program, execution.test))
    if size > limits.program_bytes:
        return f"program and tests are {size} bytes, more than program_bytes={limits.program_bytes}"
    for name in ("program", "test", "entry_point"):
        text = getattr(execution, name)
        if not isinstance(text, str) or "\x00" in text:
            return f"{name} is not text without NUL characters"
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            return f"{name} is not valid UTF-8 text"
    if not execution.entry_point.isidentifier():
        return f"entry_point {execution.entry_point[:40]!r} is not a Python name"
    return ""


def _kill(proc: subprocess.Popen) -> None:
    """SIGKILL bubblewrap's process group (reaped by _reap). The interpreter, in a session of its own, dies of
    --die-with-parent, and with it, the PID namespace's init, every process of the sandbox."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _signal_name(returncode: int) -> str:
    sig = returncode - 128 if returncode > 128 else -returncode
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


def run_execution(bwrap: str, settings: SandboxSettings, limits: SandboxLimits,
                  execution: Execution) -> ExecutionResult:
    """Run `execution` in a new sandbox and wait at most `limits.wall_s` (plus the kill). A sandbox bubblewrap
    could not build (it said so and exited before the interpreter ran: a namespace limit reached for a moment
    on a busy host) is built again, up to SETUP_ATTEMPTS times, so a correct program is not scored 0 for it;
    the result's detail keeps bubblewrap's words if every attempt failed."""
    refusal = _refusal(execution, limits)
    if refusal:
        return ExecutionResult(Outcome.REFUSED, 0, 0, 0.0, refusal)
    for attempt in range(1, SETUP_ATTEMPTS + 1):
        result = _run_once(bwrap, settings, limits, execution)
        if not result.detail.startswith(SETUP_FAILED) or attempt == SETUP_ATTEMPTS:
            return result
        time.sleep(0.05 * attempt)
    raise AssertionError("unreachable")


SETUP_ATTEMPTS = 3
SETUP_FAILED = "sandbox setup failed"


def _run_once(bwrap: str, settings: SandboxSettings, limits: SandboxLimits, execution: Execution) -> ExecutionResult:
    start = time.monotonic()
    nonce = secrets.token_hex(16)
    request = json.dumps({"nonce": nonce, "rlimits": rlimits(limits), "program": execution.program,
                          "test": execution.test, "entry_point": execution.entry_point}).encode("utf-8")
    uid = drops_to_uid(settings)
    proc = subprocess.Popen(bwrap_command(bwrap, settings, limits), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env={}, close_fds=True, start_new_session=True,
                            user=uid, group=uid, extra_groups=[] if uid is not None else None)
    output, verdict = bytearray(), bytearray()
    ended = ""  # why the parent killed it: "timeout" or "output_limit"
    deadline = start + limits.wall_s
    with selectors.DefaultSelector() as sel:
        try:
            proc.stdin.write(request)
            proc.stdin.close()
        except BrokenPipeError:  # it died before reading (the interpreter is gone): told by the exit status below
            pass
        sel.register(proc.stdout, selectors.EVENT_READ, output)
        sel.register(proc.stderr, selectors.EVENT_READ, verdict)
        while sel.get_map():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                ended = "timeout"
                break
            for key, _ in sel.select(remaining):
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    sel.unregister(key.fileobj)
                    continue
                key.data.extend(chunk)
                if len(output) > limits.output_bytes:
                    ended = "output_limit"
                elif len(verdict) > VERDICT_BYTES:
                    ended = "crashed"  # only the harness writes there; anything this long is not its verdict
            if ended:
                break
    if ended:
        _kill(proc)
    cpu_seconds = _reap(proc, deadline + 1.0)
    if cpu_seconds is None:  # pipes closed but bubblewrap lingers: never wait past the bound
        ended = ended or "timeout"
        _kill(proc)
        cpu_seconds = _reap(proc, None)
    proc.stdout.close()
    proc.stderr.close()
    seconds = time.monotonic() - start
    tail = bytes(output[-OUTPUT_TAIL_BYTES:]).decode("utf-8", "replace")
    if ended == "timeout":
        return ExecutionResult(Outcome.TIMEOUT, 0, 0, seconds, f"ran past wall_s={limits.wall_s}", tail)
    if ended == "output_limit":
        return ExecutionResult(Outcome.OUTPUT_LIMIT, 0, 0, seconds,
                               f"wrote more than output_bytes={limits.output_bytes}", tail)
    return _judge(proc.returncode, cpu_seconds or 0.0, bytes(verdict), nonce, limits, seconds, tail)


def _reap(proc: subprocess.Popen, until: float | None) -> float | None:
    """Wait for bubblewrap (until the monotonic time `until`; None: however long) and set its returncode; the
    CPU seconds of it and every process it reaped (the sandboxed interpreter), or None when still running."""
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG if until is not None else 0)
        if pid:
            proc.returncode = os.waitstatus_to_exitcode(status)
            return usage.ru_utime + usage.ru_stime
        if time.monotonic() >= until:
            return None
        time.sleep(0.005)


def _judge(returncode: int, cpu_seconds: float, raw: bytes, nonce: str, limits: SandboxLimits, seconds: float,
           tail: str) -> ExecutionResult:
    try:
        verdict = json.loads(raw.decode("utf-8")) if raw else None
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        verdict = None
    valid = (isinstance(verdict, dict) and verdict.get("nonce") == nonce
             and all(type(verdict.get(k)) is int for k in ("passed", "total"))
             and isinstance(verdict.get("error"), str) and 0 <= verdict["passed"] <= verdict["total"])
    if valid and returncode == 0:
        passed, total = verdict["passed"], verdict["total"]
        outcome = Outcome.PASSED if total and passed == total else Outcome.FAILED
        return ExecutionResult(outcome, passed, total, seconds, verdict["error"][:300], tail)
    # SIGXCPU is only ever the CPU bound; SIGKILL is the bound's hard limit when the CPU time reached it (a
    # program that killed itself has not).
    cpu_killed = returncode in (128 + signal.SIGKILL, -signal.SIGKILL) and cpu_seconds >= limits.cpu_s
    if returncode in (128 + signal.SIGXCPU, -signal.SIGXCPU) or cpu_killed:
        return ExecutionResult(Outcome.TIMEOUT, 0, 0, seconds, f"{_signal_name(returncode)}: past "
                               f"cpu_s={limits.cpu_s}", tail)
    if returncode > 128 or returncode < 0:
        return ExecutionResult(Outcome.CRASHED, 0, 0, seconds, f"killed by {_signal_name(returncode)}", tail)
    said = raw.decode("utf-8", "replace").strip()[-200:] if not valid else ""  # bubblewrap's or Python's own words
    if returncode == 1 and said.startswith("bwrap:"):
        return ExecutionResult(Outcome.CRASHED, 0, 0, seconds, f"{SETUP_FAILED}: {said}", tail)
    return ExecutionResult(Outcome.CRASHED, 0, 0, seconds, f"exited with status {returncode} without a verdict"
                           + (f": {said}" if said else ""), tail)
