"""Launch, watch and stop one SGLang server child process.

The server runs in its own virtualenv (`python` of the engine config), never in
the rollout service's: sglang pins its own torch/transformers. It is started in
a new session so that its process group holds the server and the scheduler /
detokenizer processes it forks; stopping signals that group by the server's
pid, so nothing is left behind even after the server itself was SIGKILLed.

Its command line and environment are built by contract/sglang_command.py,
which `lockstep recipe show` prints from as well.
"""
from __future__ import annotations

import atexit
import logging
import os
import signal
import subprocess
import time
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path

import httpx

from contract.command_line import SpecOption
from contract.sglang_command import server_command
from contract.sglang_command import server_env as launch_env
from services.common.auth import TOKEN_ENV, TOKEN_FILE_ENV
from services.common.platform import SGLangLaunchPlan
from services.common.process.ports import free_port

log = logging.getLogger(__name__)


class SGLangStartError(RuntimeError):
    """The server exited or did not become healthy in time; the message carries its log tail."""


def server_env(plan: SGLangLaunchPlan, base: Mapping[str, str], api_key: str) -> dict[str, str]:
    """The server's environment (contract.sglang_command.server_env) from `base` without Lockstep's own
    token, which the server has no use for."""
    credentials = (TOKEN_ENV, TOKEN_FILE_ENV)
    return launch_env(plan, {k: v for k, v in base.items() if k not in credentials}, api_key)


_LIVE: "weakref.WeakSet[SGLangServer]" = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:  # a rollout service that exits takes its servers with it
    for server in list(_LIVE):
        server.stop(grace_s=2.0)


class SGLangServer:
    """One child server. start() blocks until /health answers; stop() is idempotent."""

    def __init__(self, python: str, plan: SGLangLaunchPlan, *, host: str, port: int,
                 run_options: Sequence[SpecOption], extra_args: Sequence[str], log_dir: Path, api_key: str,
                 switches: Sequence[str] = ()):
        if not Path(python).is_file():
            raise FileNotFoundError(
                f"python: SGLang interpreter {python} does not exist; build the virtualenv with "
                "`make sglang-venv` (deploy/sglang/setup_cpu_venv.sh) or set the rollout service's sglang_python"
            )
        if not api_key:
            raise ValueError("api_key: an SGLang server is never started without one")
        self.python, self.plan, self.host = python, plan, host
        self.requested_port, self.run_options, self.extra_args = port, tuple(run_options), list(extra_args)
        self.switches = tuple(switches)
        self.log_dir = log_dir
        self._api_key = api_key
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0
        self.log_path: Path | None = None
        self.model_path = ""

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def exit_code(self) -> int | None:
        return self.proc.poll() if self.proc is not None else None

    def log_tail(self, n_chars: int = 4000) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        data = self.log_path.read_bytes()[-n_chars * 4:].decode("utf-8", "replace")
        # tqdm bars pad lines with spaces; keep the tail readable.
        lines = [ln.strip() for ln in data.replace("\r", "\n").splitlines() if ln.strip()]
        return "\n".join(lines)[-n_chars:]

    def start(self, model_path: str, weight_version: str, timeout_s: float) -> None:
        if self.alive():
            raise RuntimeError(f"sglang server pid {self.pid} is already running")
        self.port = self.requested_port or free_port(self.host)
        cmd = server_command(
            self.python, self.plan, model_path=model_path, host=self.host, port=self.port,
            weight_version=weight_version, run_options=self.run_options, switches=self.switches,
            extra_args=self.extra_args,
            parent_pid=os.getpid(),
        )
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"sglang-{self.port}-{int(time.time() * 1000)}.log"
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                env=server_env(self.plan, os.environ, self._api_key), start_new_session=True,
            )
        self.log_path, self.model_path = log_path, model_path
        _LIVE.add(self)
        try:
            self._wait_healthy(timeout_s)
        except BaseException:
            self.stop()
            raise

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        with httpx.Client(base_url=self.url, timeout=5.0, trust_env=False) as http:
            while True:
                code = self.exit_code()
                if code is not None:
                    raise SGLangStartError(
                        f"sglang server exited with code {code} during start-up "
                        f"(command log {self.log_path}):\n{self.log_tail()}"
                    )
                try:
                    if http.get("/health").status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    raise SGLangStartError(
                        f"sglang server pid {self.pid} not healthy after {timeout_s:.0f}s "
                        f"(log {self.log_path}):\n{self.log_tail()}"
                    )
                time.sleep(0.5)

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM the server's process group, SIGKILL what is left after `grace_s`."""
        proc = self.proc
        if proc is None:
            return
        pgid = proc.pid  # start_new_session: the group id is the server's pid
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                break  # nothing left in the group
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline and _group_alive(pgid):
                if proc.poll() is None:
                    try:
                        proc.wait(timeout=0.2)
                    except subprocess.TimeoutExpired:
                        pass
                else:
                    time.sleep(0.1)
            if not _group_alive(pgid):
                break
        # Reap the server itself. /proc shows a multi-threaded process whose
        # main thread has exited as a zombie while its other threads are still
        # tearing down, so the group can look gone before waitpid() can collect
        # it; a bare poll() then misses it and leaves a zombie behind for good.
        try:
            proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            log.warning("sglang server pid %d still not reaped 5 s after SIGKILL", proc.pid)
        _LIVE.discard(self)


def _group_alive(pgid: int) -> bool:
    """Whether any process of the group still runs (zombies don't count).

    Zombies matter: an orphaned scheduler that was killed may wait to be
    reaped by an init that never does, and signal 0 would report it forever.
    """
    proc_dir = Path("/proc")
    if not proc_dir.is_dir():  # not Linux: signal 0 is the best available answer
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        return True
    for entry in proc_dir.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # "pid (comm) state ppid pgrp ...": comm may contain spaces, so split after ')'.
        fields = stat[stat.rindex(")") + 2:].split()
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False
