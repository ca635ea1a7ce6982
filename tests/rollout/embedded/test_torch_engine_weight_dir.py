"""The torch engine applies a trainer-written weight directory (shared-path source).

The reader checks floating values finite as it reads and says so by the type it returns (FiniteTensors);
the engine then does not check them again, and checks anything else as update_weights does: non-finite
weights are refused whichever way they came, and nothing is applied.
"""
from __future__ import annotations

import pytest
import torch

from services.common.weights.files import read_weight_dir, write_weight_dir
from services.common.weights.finite_check import FiniteTensors
from services.rollout.embedded import torch_engine
from services.rollout.embedded.torch_engine import TorchEngine, TorchEngineConfig
from tests.rollout.embedded.test_torch_engine import build_tiny_qwen3, perturbed, snapshot

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_qwen3(tmp_path_factory.mktemp("tiny_qwen3_dir"))


@pytest.fixture
def engine(model_dir) -> TorchEngine:
    e = TorchEngine(TorchEngineConfig())
    e.load(str(model_dir), 0)
    return e


def _written(tmp_path, model_dir, weights: dict[str, torch.Tensor], version: int):
    written = write_weight_dir(tmp_path / f"v{version}", list(weights.items()), version, base_dir=model_dir)
    return read_weight_dir(written.directory, policy_version=version, expected_sha256=written.total_sha256)[0]


def test_a_read_directory_is_applied_without_a_second_finite_pass(engine, model_dir, tmp_path, monkeypatch):
    new = perturbed(engine)
    tensors = _written(tmp_path, model_dir, new, 1)
    assert isinstance(tensors, FiniteTensors)
    checked: list[int] = []
    real = torch_engine.non_finite
    monkeypatch.setattr(torch_engine, "non_finite", lambda named: checked.extend(named) or real(named))
    engine.update_weights_from_dir(str(tmp_path / "v1"), tensors, 1)
    assert checked == [] and engine.policy_version == 1
    assert all(torch.equal(engine._model.state_dict()[n], t) for n, t in new.items())
    # Any other mapping is checked here, as update_weights checks it.
    engine.update_weights_from_dir(str(tmp_path / "v1"), dict(tensors), 1)  # the loaded version again: a no-op
    assert len(checked) == len(new)


@pytest.mark.parametrize("how", ["read", "plain"])
def test_non_finite_weights_are_refused_and_nothing_is_applied(engine, model_dir, tmp_path, how):
    before = snapshot(engine)
    new = perturbed(engine)
    new["model.layers.1.mlp.up_proj.weight"].view(-1)[5] = float("nan")
    tensors = _written(tmp_path, model_dir, new, 1) if how == "read" else new
    assert not isinstance(tensors, FiniteTensors)
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight: non-finite values"):
        engine.update_weights_from_dir(str(tmp_path / "v1"), tensors, 1)
    assert engine.policy_version == 0
    assert all(torch.equal(engine._model.state_dict()[n], t) for n, t in before.items())
