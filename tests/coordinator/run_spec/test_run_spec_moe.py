"""Submit-time architecture checks: the covered MoE families pass in both numerics modes; any other MoE
architecture, and true_on_policy on a family without batch-invariant kernels, are refused naming
model_path and the architecture. The coordinator reads config.json only (it never imports torch)."""
from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from contract.models.model_families import BATCH_INVARIANT_FAMILIES, MOE_FAMILIES
from services.coordinator.run_spec import RunSpec


def _model_dir(tmp_path, config: dict):
    d = tmp_path / config["model_type"]
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    return d


def _spec(model_dir, numerics):
    return {"name": "n", "model_path": str(model_dir), "steps": 1, "task": {"name": "arithmetic"},
            "numerics": numerics}


@pytest.mark.parametrize("numerics", ["fast", "true_on_policy"])
@pytest.mark.parametrize("family,arch", [("qwen3_moe", "Qwen3MoeForCausalLM"), ("qwen2_moe", "Qwen2MoeForCausalLM")])
def test_covered_moe_families_are_accepted(tmp_path, numerics, family, arch):
    d = _model_dir(tmp_path, {"model_type": family, "architectures": [arch], "num_experts": 8})
    assert RunSpec.model_validate(_spec(d, numerics)).trainer.numerics == numerics


@pytest.mark.parametrize("numerics", ["fast", "true_on_policy"])
@pytest.mark.parametrize("config", [
    {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "num_local_experts": 8},
    {"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "n_routed_experts": 256},
])
def test_other_moe_architectures_are_refused_naming_model_path_and_architecture(tmp_path, numerics, config):
    d = _model_dir(tmp_path, config)
    with pytest.raises(ValidationError) as exc:
        RunSpec.model_validate(_spec(d, numerics))
    message = str(exc.value)
    assert "model_path" in message and config["model_type"] in message and config["architectures"][0] in message


def test_true_on_policy_refuses_a_family_without_batch_invariant_kernels(tmp_path):
    d = _model_dir(tmp_path, {"model_type": "gemma3", "architectures": ["Gemma3ForCausalLM"]})
    assert RunSpec.model_validate(_spec(d, "fast")).numerics == "fast"
    with pytest.raises(ValidationError, match=r"model_path[\s\S]*gemma3[\s\S]*true_on_policy"):
        RunSpec.model_validate(_spec(d, "true_on_policy"))


def test_the_contract_lists_the_families_the_kernels_patch():
    from kernels.batch_invariant import hf

    assert set(BATCH_INVARIANT_FAMILIES) == set(hf._FAMILIES)
    assert set(MOE_FAMILIES) == set(hf.MOE_FAMILIES)


def test_routing_replay_is_refused_where_it_cannot_work(tmp_path):
    d = _model_dir(tmp_path, {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "num_experts": 8})
    ok = {**_spec(d, "fast"), "trainer": {"moe": {"routing_replay": True}}}
    assert RunSpec.model_validate(ok).trainer.moe.routing_replay
    for change, field in (({"numerics": "true_on_policy"}, "moe.routing_replay"),
                          ({"trainer": {"moe": {"routing_replay": True}, "batching": "padded"}}, "moe.routing_replay"),
                          ({"rollout": {"engine": "sglang"}}, "trainer.moe.routing_replay")):
        with pytest.raises(ValidationError, match=field.replace(".", r"\.")):
            RunSpec.model_validate({**ok, **change})
    # SGLang returns them when its server runs with --enable-return-routed-experts.
    sglang = {**ok, "rollout": {"engine": "sglang", "engine_options": {"return_routed_experts": True}}}
    assert RunSpec.model_validate(sglang).rollout.engine_options["return_routed_experts"] is True
