"""A coordinator alone as a real process (real uvicorn, real embedded redis-server).

Its trainer and rollout addresses are ports nothing listens on: the REST edge
(validation, ids, status codes) is what these tests exercise, and a run that
gets past it fails at once (trainer_recovery_timeout_s 0) instead of waiting.
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import httpx
import pytest

from recipes.tiny_model import build_model_dir
from services.common.auth import TOKEN_FILE_ENV, read_token_file, write_token_file
from services.common.process.ports import free_port
from services.local_stack import ServiceProcess, service_env


class LoneCoordinator:
    """`roots`: where run specs' models and datasets may come from (the tests' temporary directories)."""

    def __init__(self, root: Path, roots: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.token = read_token_file(write_token_file(root / "auth_token"))
        self.headers = {"Authorization": self.token.header}
        self.process = ServiceProcess("coordinator", [
            sys.executable, "-m", "services.coordinator", "--port", str(self.port), "--data-dir", str(root / "data"),
            "--trainer-address", f"127.0.0.1:{free_port()}", "--rollout-addresses", f"127.0.0.1:{free_port()}",
            "--trainer-recovery-timeout-s", "0", "--rpc-timeout-s", "5",
            "--model-roots", str(roots), "--data-roots", str(roots),
        ], service_env({**os.environ, TOKEN_FILE_ENV: str(root / "auth_token")}), root / "coordinator.log")

    def start(self, timeout_s: float = 60.0) -> "LoneCoordinator":
        self.process.start()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.process.alive():
                raise RuntimeError(f"coordinator exited:\n{self.process.tail()}")
            try:
                if httpx.get(f"{self.url}/healthz", timeout=2.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.process.stop()
        raise RuntimeError(f"coordinator not answering within {timeout_s}s:\n{self.process.tail()}")


@pytest.fixture(scope="session")
def lone_coordinator(tmp_path_factory):
    """One coordinator for every module here: a process start is most of what a module of REST-edge tests
    costs, and they leave nothing behind that another reads (each counts runs before and after itself)."""
    c = LoneCoordinator(tmp_path_factory.mktemp("coordinator"), tmp_path_factory.getbasetemp()).start()
    try:
        yield c
    finally:
        c.process.stop()


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory) -> Path:
    return build_model_dir(tmp_path_factory.mktemp("model") / "tiny", seed=0)
