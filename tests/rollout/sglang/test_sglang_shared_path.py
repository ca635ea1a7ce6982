"""The SGLang engine loads a trainer-written weight directory (shared-path source) in place.

Against a real SGLang server on loopback (CPU, float32), as tests/rollout/sglang/test_sglang_engine.py: the
directory write_weight_dir produced is served as written (the engine writes no copy of its own) and
generation follows the new weights.
"""
from __future__ import annotations

import pytest
import torch

from services.common.weights.files import read_weight_dir, write_weight_dir
from services.rollout.sglang.weights import load_checkpoint_tensors
from tests.rollout.sglang.test_sglang_engine import TOL, engine, gaps, make_request, model_dir  # noqa: F401 - fixtures

pytestmark = pytest.mark.slow


def test_a_trainer_weight_directory_is_served_in_place(engine, model_dir, tmp_path):  # noqa: F811
    old_dir, v = engine.weights_path, engine.policy_version
    old = load_checkpoint_tensors(old_dir)
    g = torch.Generator().manual_seed(11)
    new = [(k, t + 0.05 * torch.randn(t.shape, generator=g)) for k, t in old.items()]
    directory = tmp_path / "weights" / "v000001-test"
    written = write_weight_dir(directory, new, v + 1, base_dir=model_dir)
    tensors, _ = read_weight_dir(directory, policy_version=v + 1, expected_sha256=written.total_sha256)
    own = engine._dir / "weights"
    before = sorted(own.rglob("*")) if own.exists() else []

    engine.update_weights_from_dir(str(directory), tensors, v + 1)
    assert engine.policy_version == v + 1 and engine.weights_path == str(directory)
    assert (sorted(own.rglob("*")) if own.exists() else []) == before  # no copy of the weights written
    engine.update_weights_from_dir(str(directory), tensors, v + 1)  # the loaded version again: a no-op
    with pytest.raises(ValueError, match="different weights"):
        engine.update_weights_from_dir(str(directory), old, v + 1)

    req = make_request(n=4)
    samples = engine.generate(req)
    assert gaps(str(directory), req, samples, 0.7).mean().item() <= TOL
    assert gaps(old_dir, req, samples, 0.7).mean().item() > 100 * TOL
