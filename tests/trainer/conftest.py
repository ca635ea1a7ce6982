"""Fixtures of the trainer tests (helpers live in trainer_support.py)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from trainer_support import build_tiny_model_dir


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return build_tiny_model_dir(tmp_path_factory.mktemp("tiny_qwen3"))


@pytest.fixture
def restore_torch_globals():
    """configure_determinism changes process-wide torch settings; put them back for other tests."""
    det = torch.are_deterministic_algorithms_enabled()
    threads = torch.get_num_threads()
    yield
    torch.use_deterministic_algorithms(det)
    torch.set_num_threads(threads)
