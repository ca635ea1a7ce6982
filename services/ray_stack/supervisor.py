"""Run one Lockstep service process and restart it when it exits on its own.

This is what a compose `restart: unless-stopped` policy does on one machine,
inside the Ray actor that owns the service. The process is started by the one
watcher thread that lives as long as the supervisor, with PR_SET_PDEATHSIG:
if the actor process dies (killed, OOM), the kernel kills the service with it,
so a restarted actor finds its port free instead of held by an orphan.
"""
from __future__ import annotations

import logging
import signal
import subprocess
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from services.common.process.parent_death import with_parent_death

log = logging.getLogger("lockstep.ray_stack.supervisor")


@dataclass(frozen=True)
class SupervisorStatus:
    pid: int | None
    alive: bool
    restarts: int
    exit_codes: tuple[int, ...]  # of every exit so far, oldest first
    gave_up: bool                # exited more often than the restart budget allows


class ServiceSupervisor:
    def __init__(self, argv: Sequence[str], *, env: Mapping[str, str], log_path: Path,
                 max_restarts: int, restart_delay_s: float) -> None:
        self.argv, self.env, self.log_path = list(argv), dict(env), log_path
        self.max_restarts, self.restart_delay_s = max_restarts, restart_delay_s
        self._proc: subprocess.Popen | None = None
        self._restarts = 0
        self._exit_codes: list[int] = []
        self._gave_up = False
        self._stopping = threading.Event()
        self._started = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._watch, name=f"supervise-{Path(log_path).stem}", daemon=True)

    def start(self) -> None:
        self._thread.start()
        self._started.wait()

    def _spawn(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as out:
            proc = subprocess.Popen(with_parent_death(self.argv, signal.SIGKILL), env=self.env,
                                    stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
        with self._lock:
            self._proc = proc

    def _watch(self) -> None:
        self._spawn()
        self._started.set()
        while True:
            code = self._proc.wait()
            if self._stopping.is_set():
                return
            with self._lock:
                self._exit_codes.append(code)
                if self._restarts >= self.max_restarts:
                    self._gave_up = True
                    log.error("service %s exited with %s; restart budget (%d) spent", self.argv, code,
                              self.max_restarts)
                    return
                self._restarts += 1
            log.warning("service %s exited with %s; restart %d/%d in %.1f s", self.argv, code,
                        self._restarts, self.max_restarts, self.restart_delay_s)
            if self._stopping.wait(self.restart_delay_s):
                return
            self._spawn()

    def status(self) -> SupervisorStatus:
        with self._lock:
            proc = self._proc
            return SupervisorStatus(
                pid=proc.pid if proc else None, alive=proc is not None and proc.poll() is None,
                restarts=self._restarts, exit_codes=tuple(self._exit_codes), gave_up=self._gave_up,
            )

    def hold(self) -> None:
        """Restart the service no more: when it exits from now on, it stays down (stop() still ends it)."""
        self._stopping.set()

    def stop(self, grace_s: float = 20.0) -> int | None:
        """SIGTERM the service (its own graceful shutdown), SIGKILL after `grace_s`; no restart after."""
        self._stopping.set()
        with self._lock:
            proc = self._proc
        if proc is None:
            return None
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._thread.join(timeout=5.0)
        return proc.returncode

