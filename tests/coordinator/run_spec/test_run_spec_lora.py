"""A LoRA run on SGLang must launch its server to serve adapters of the run's rank: refused at submit."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from recipes.tiny_model import build_model_dir
from services.coordinator.run_spec import RunSpec


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model_dir(tmp_path_factory.mktemp("m") / "tiny", seed=0)


def _spec(model_dir, server: dict, rank: int = 16) -> dict:
    return {"name": "l", "model_path": str(model_dir), "steps": 1, "task": {"name": "arithmetic"},
            "rollout": {"engine": "sglang", "engine_options": {"server": server}},
            "trainer": {"lora": {"rank": rank, "alpha": 32.0, "target_modules": "all-linear"}}}


@pytest.mark.parametrize("server", [{}, {"max_lora_rank": 8}])
def test_sglang_lora_run_without_a_large_enough_max_lora_rank_is_refused(model_dir, server):
    with pytest.raises(ValidationError, match=r"rollout.engine_options.server.max_lora_rank .* trainer.lora.rank \(16\)"):
        RunSpec.model_validate(_spec(model_dir, server))


def test_sglang_lora_run_with_max_lora_rank_is_accepted(model_dir):
    spec = RunSpec.model_validate(_spec(model_dir, {"max_lora_rank": 16}))
    assert spec.trainer.lora.rank == 16
    # The embedded engine merges adapters itself: nothing to launch.
    torch_spec = _spec(model_dir, {})
    torch_spec["rollout"] = {"engine": "torch"}
    assert RunSpec.model_validate(torch_spec).trainer.lora.rank == 16
