"""Fixtures the rollout tests share."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.common.tiny_model import build_model_dir
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
