"""Fixtures the rollout tests share."""
from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from contract.engine_options import SGLangEngineConfig
from services.common.tiny_model import TinyQwen3Config, build_model_dir
from services.rollout.sglang_config import SGLangHostConfig, default_python
from tests.conftest import require
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


@pytest.fixture(scope="session")
def sglang_model_dir(tmp_path_factory) -> Path:
    # initializer_range 0.2: far from uniform distributions, so a wrong
    # temperature or position moves log-probs by much more than the SGLang tests' TOL.
    return build_model_dir(tmp_path_factory.mktemp("tiny_qwen3"), TinyQwen3Config(initializer_range=0.2), seed=0)


@pytest.fixture(scope="session")
def sglang_engine(sglang_model_dir, tmp_path_factory):
    """One real SGLang server (CPU, float32) for every module that drives the engine directly
    (test_sglang_engine.py and the modules importing its fixtures): a server start is most of what
    such a module costs. Its tests read the weights and version they find and leave it serving."""
    python = default_python()
    require(Path(python).is_file(), f"SGLang virtualenv not built ({python} missing): run `make sglang-venv`")
    from services.rollout.sglang_engine import SGLangEngine

    eng = SGLangEngine(SGLangEngineConfig(platform="cpu"),
                       SGLangHostConfig(weights_dir=str(tmp_path_factory.mktemp("sglang"))))
    started = time.monotonic()
    eng.load(str(sglang_model_dir), policy_version=0)
    print(f"\nsglang server healthy after {time.monotonic() - started:.1f}s (pid {eng.server_pid})")
    yield eng
    pid = eng.server_pid
    eng.close()
    if pid is not None:
        with pytest.raises(ProcessLookupError):  # close() returns once the server is gone and reaped
            os.kill(pid, 0)
