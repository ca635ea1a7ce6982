"""The whole Lockstep stack as real processes on loopback (demo, tests, laptops).

Starts one trainer, N rollout replicas and a coordinator (which starts its
embedded Redis) with `python -m services.<name>`, each on a free port, logs in
`<run_dir>/logs/`. Used by `make demo` and by the integration tests, so both
exercise exactly what a user runs.

Secure like any deployment: a bearer token is generated into
`<run_dir>/auth_token` (mode 0600; kept across restarts on the same run_dir)
and handed to every service as $LOCKSTEP_AUTH_TOKEN_FILE; `client()` sends it.
Models, datasets and checkpoints must lie under run_dir or one of
`path_roots` (each service's *_roots settings).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from services.cli.client import CoordinatorClient
from services.common.auth import TOKEN_FILE_ENV, BearerToken, read_token_file, write_token_file
from services.common.process.ports import SLICE_ENV, child_port_slice, free_port


REPO_ROOT = Path(__file__).resolve().parent.parent


def service_env(base: Mapping[str, str]) -> dict[str, str]:
    """The environment a service process gets (here, and from a Ray actor): `base` (with any device
    visibility it sets), this checkout importable, unbuffered output for its log file."""
    env = dict(base)
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    return env


@dataclass
class ServiceProcess:
    name: str
    args: list[str]
    env: dict[str, str]
    log_path: Path
    proc: subprocess.Popen | None = None
    _terminated: bool = field(default=False, init=False, repr=False)

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.args, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self._terminated = False
        log.close()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def terminate(self) -> None:
        """Ask it to stop (SIGTERM) without waiting; stop() then waits for it."""
        if self.proc is not None and self.proc.poll() is None and not self._terminated:
            self.proc.send_signal(signal.SIGTERM)
            self._terminated = True

    def stop(self, timeout_s: float = 20.0) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.terminate()
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


@dataclass
class LocalStack:
    run_dir: Path
    rollout_replicas: int = 1
    num_threads: int = 1
    extra_env: dict[str, str] = field(default_factory=dict)
    python: str = sys.executable
    redis_url: str = ""  # empty: the coordinator starts (and supervises) its embedded Redis
    redis_password: str = ""
    """The requirepass of the Redis at redis_url (handed to the coordinator in a 0600 file)."""
    path_roots: Sequence[str | Path] = ()
    """Directories besides run_dir that models and datasets may come from (the services' *_roots)."""
    scorers: Sequence[Sequence[str]] = ()
    """Scorer replicas (rollout services of role scorer, docs/rewards.md), each as the `python -m` module and
    its leading arguments (("services.rollout",) for the real one); the coordinator's scorer_addresses."""

    def __post_init__(self) -> None:
        self.run_dir = Path(self.run_dir).resolve()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.token_file = self.run_dir / "auth_token"
        if not self.token_file.exists():
            write_token_file(self.token_file)
        self.token: BearerToken = read_token_file(self.token_file)
        roots = ",".join(str(Path(r).resolve()) for r in (self.run_dir, *self.path_roots))
        redis_args = ["--redis-url", self.redis_url] if self.redis_url else []
        if self.redis_password:
            password_file = self.run_dir / "redis_password"
            password_file.touch(mode=0o600)
            password_file.write_text(self.redis_password)
            redis_args += ["--redis-password-file", str(password_file)]
        self.api_port = free_port()
        self.trainer_port = free_port()
        self.broadcast_port = free_port()  # the trainer's rendezvous for the broadcast weight source
        self.rollout_ports = [free_port() for _ in range(self.rollout_replicas)]
        self.metrics_ports = {"trainer": free_port(), **{f"rollout{i}": free_port() for i in range(self.rollout_replicas)}}
        env = service_env({**os.environ, SLICE_ENV: child_port_slice(), **self.extra_env,
                           TOKEN_FILE_ENV: str(self.token_file)})
        logs = self.run_dir / "logs"
        threads = str(self.num_threads)
        self.trainer = ServiceProcess("trainer", [
            self.python, "-m", "services.trainer", "--grpc-port", str(self.trainer_port),
            "--metrics-port", str(self.metrics_ports["trainer"]), "--num-threads", threads,
            "--model-roots", roots, "--checkpoint-roots", roots,
            "--weight-broadcast-address", f"127.0.0.1:{self.broadcast_port}",
        ], env, logs / "trainer.log")
        self.rollouts = [ServiceProcess(f"rollout{i}", [
            self.python, "-m", "services.rollout", "--grpc-port", str(port),
            "--metrics-port", str(self.metrics_ports[f"rollout{i}"]), "--num-threads", threads,
            "--model-roots", roots, "--sglang-weights-dir", str(self.run_dir / "sglang-weights"),
            "--weight-sources", f"127.0.0.1:{self.trainer_port}",
            "--broadcast-sources", f"127.0.0.1:{self.broadcast_port}",
        ], env, logs / f"rollout{i}.log") for i, port in enumerate(self.rollout_ports)]
        self.scorer_ports = [free_port() for _ in self.scorers]
        self.scorer_replicas = [ServiceProcess(f"scorer{i}", [
            self.python, "-m", *module, "--grpc-port", str(port), "--metrics-port", "0", "--num-threads", threads,
            "--model-roots", roots, "--role", "scorer", "--sglang-weights-dir", str(self.run_dir / "sglang-weights"),
        ], env, logs / f"scorer{i}.log") for i, (module, port) in enumerate(zip(self.scorers, self.scorer_ports))]
        scorer_args = (["--scorer-addresses", ",".join(self.scorer_addresses)] if self.scorers else [])
        self.coordinator = ServiceProcess("coordinator", [
            self.python, "-m", "services.coordinator", "--port", str(self.api_port),
            "--data-dir", str(self.run_dir / "coordinator"),
            "--trainer-address", f"127.0.0.1:{self.trainer_port}",
            "--rollout-addresses", ",".join(f"127.0.0.1:{p}" for p in self.rollout_ports),
            *redis_args, *scorer_args,
            "--model-roots", roots, "--data-roots", roots,
        ], env, logs / "coordinator.log")

    @property
    def scorer_addresses(self) -> list[str]:
        return [f"127.0.0.1:{p}" for p in self.scorer_ports]

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.api_port}"

    def client(self, timeout_s: float = 30.0) -> CoordinatorClient:
        """A REST client of this stack's coordinator that sends the stack's token."""
        return CoordinatorClient(self.api_url, token=self.token, timeout_s=timeout_s)

    @property
    def processes(self) -> list[ServiceProcess]:
        return [self.trainer, *self.rollouts, *self.scorer_replicas, self.coordinator]

    def start(self, timeout_s: float = 120.0) -> "LocalStack":
        try:
            for p in self.processes:
                p.start()
            self.wait_ready(timeout_s)
        except BaseException:
            self.stop()  # `with` never reaches __exit__ when __enter__ raises: nothing may outlive it
            raise
        return self

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        last = ""
        while time.monotonic() < deadline:
            for p in self.processes:
                if not p.alive():
                    raise RuntimeError(f"{p.name} exited with {p.proc.returncode if p.proc else '?'}:\n{p.tail()}")
            try:
                r = httpx.get(f"{self.api_url}/readyz", timeout=2.0)
                if r.status_code == 200:
                    return
                last = r.text
            except httpx.HTTPError as exc:
                last = str(exc)
            time.sleep(0.3)
        raise RuntimeError(f"stack not ready within {timeout_s}s: {last}\n{self.coordinator.tail()}")

    def restart_coordinator(self, timeout_s: float = 60.0) -> None:
        self.coordinator.start()
        self.wait_ready(timeout_s)

    def stop(self) -> None:
        """The coordinator first, so that it sees none of the services it drives go away; then those
        services all at once: each takes seconds to wind down, and none waits for another."""
        self.coordinator.stop()
        workers = [*reversed(self.scorer_replicas), *reversed(self.rollouts), self.trainer]
        for p in workers:
            p.terminate()
        for p in workers:
            p.stop()

    def __enter__(self) -> "LocalStack":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
