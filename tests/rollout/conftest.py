"""Fixtures the rollout tests share."""
from __future__ import annotations

import os
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch

from contract.engine_options import SGLangEngineConfig
from recipes.tiny_model import TinyQwen3Config, build_model_dir
from services.rollout.sglang.config import SGLangHostConfig, default_python
from tests.conftest import require_sglang_python
from tests.rollout.decoder_support import TINY


@pytest.fixture(scope="module")
def one_intra_op_thread():
    """Tiny matrices: extra intra-op threads only add contention on the shared CI cores. Modules opt in
    with `pytestmark = pytest.mark.usefixtures("one_intra_op_thread")`."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def decoder_model_dir(tmp_path_factory) -> Path:
    """The decoder tests' tiny Qwen3 (tests/rollout/decoder_support.py TINY, seed 3)."""
    return build_model_dir(tmp_path_factory.mktemp("tiny"), TINY, seed=3)


class SessionSGLang:
    """The session's SGLang server, started in a thread of its own: a start is tens of seconds of work
    in the server's own processes, so the suite starts it as soon as collection ends (when a selected
    test uses it) and goes on with other tests meanwhile; the first test that needs it waits for it."""

    def __init__(self) -> None:
        from services.rollout.sglang.engine import SGLangEngine

        self._root = tempfile.TemporaryDirectory(prefix="sglang-session-")
        root = Path(self._root.name)
        # initializer_range 0.2: far from uniform distributions, so a wrong
        # temperature or position moves log-probs by much more than the SGLang tests' TOL.
        self.model_dir = build_model_dir(root / "tiny_qwen3", TinyQwen3Config(initializer_range=0.2), seed=0)
        self.engine = SGLangEngine(SGLangEngineConfig(platform="cpu"), SGLangHostConfig(weights_dir=str(root / "sglang")))
        self._error: BaseException | None = None
        # The name is in tests/conftest.py's SESSION_START_THREADS: the stack guard leaves this start alone.
        self._thread = threading.Thread(target=self._load, name="session-sglang-start", daemon=True)
        self._thread.start()

    def _load(self) -> None:
        started = time.monotonic()
        try:
            self.engine.load(str(self.model_dir), policy_version=0)
        except BaseException as exc:  # re-raised in the test that asks for the engine
            self._error = exc
        self.seconds = time.monotonic() - started

    def ready(self):
        """The loaded engine, once its server is healthy; the start's error otherwise."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self.engine

    def close(self) -> None:
        self._thread.join()
        pid = self.engine.server_pid
        self.engine.close()
        self._root.cleanup()
        if pid is not None:
            with pytest.raises(ProcessLookupError):  # close() returns once the server is gone and reaped
                os.kill(pid, 0)


SESSION_SGLANG = pytest.StashKey[SessionSGLang]()


def _session_sglang(session: pytest.Session) -> SessionSGLang:
    require_sglang_python()
    if SESSION_SGLANG not in session.stash:
        session.stash[SESSION_SGLANG] = SessionSGLang()
    return session.stash[SESSION_SGLANG]


def pytest_collection_finish(session: pytest.Session) -> None:
    if session.config.option.collectonly or not Path(default_python()).is_file():
        return
    if any("sglang_engine" in getattr(item, "fixturenames", ()) for item in session.items):
        _session_sglang(session)


def pytest_sessionfinish(session: pytest.Session) -> None:
    started = session.stash.get(SESSION_SGLANG, None)
    if started is not None:
        started.close()


@pytest.fixture(scope="session")
def sglang_model_dir(request) -> Path:
    return _session_sglang(request.session).model_dir


@pytest.fixture(scope="session")
def sglang_engine(request):
    """One real SGLang server (CPU, float32) for every module that drives the engine directly
    (test_sglang_engine.py and the modules importing its fixtures): a server start is most of what
    such a module costs. Its tests read the weights and version they find and leave it serving."""
    started = _session_sglang(request.session)
    eng = started.ready()
    print(f"\nsglang server healthy after {started.seconds:.1f}s of its start (pid {eng.server_pid})")
    return eng


@pytest.fixture(scope="session")
def sglang_request_types():
    """SGLang's own request types in one Python of its virtualenv, shared by the tests that check the bodies
    Lockstep sends (tests/support/sglang_request_types.py)."""
    from tests.support.sglang_request_types import SGLangRequestTypes

    types = SGLangRequestTypes.start(require_sglang_python())
    yield types
    types.close()
