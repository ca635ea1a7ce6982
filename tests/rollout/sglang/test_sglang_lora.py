"""The SGLang engine's LoRA path without a LoRA-serving server: SGLang 0.5.23 cannot build its LoRA layers
on CPU (they pin host memory: "RuntimeError: Found no NVIDIA driver on your system"), so here the engine's
refusals are checked, and every request body of the path is built into SGLang's own request types
(sglang/srt/managers/io_struct.py) in the SGLang virtualenv, so a renamed or removed field fails."""
from __future__ import annotations

import json

import pytest
import torch

from contract.engine_options import SGLangEngineConfig
from services.common.weights.stream import LoraAdapterMeta
from services.rollout.sglang.client import generate_body, load_lora_adapter_body, update_weight_version_body
from services.rollout.sglang.engine import SGLangEngine
from services.rollout.types import GenerationRequest, PromptSpec, SamplingConfig

REQ = GenerationRequest(prompts=(PromptSpec("a", (1, 5, 6), seed=10), PromptSpec("b", (1, 7), seed=99)),
                        sampling=SamplingConfig(temperature=0.7, max_new_tokens=4, stop_token_ids=(2,)),
                        samples_per_prompt=2)
META = LoraAdapterMeta(rank=8, alpha=16.0, target_modules=("q_proj", "v_proj"))


def test_generate_body_names_the_adapter_for_every_sample():
    body = generate_body(REQ, "policy-v3")
    assert body["lora_path"] == ["policy-v3"] * 4 and len(body["input_ids"]) == 4
    assert "lora_path" not in generate_body(REQ)
    assert update_weight_version_body("3") == {"new_version": "3", "abort_all_requests": False}
    with pytest.raises(ValueError, match="new_version"):
        update_weight_version_body("")


def test_lora_request_bodies_fit_sglangs_request_types(sglang_request_types):
    bodies = {
        "GenerateReqInput": generate_body(REQ, "policy-v3"),
        "LoadLoRAAdapterReqInput": load_lora_adapter_body("policy-v3", "/w/adapters/v000000003"),
        "UnloadLoRAAdapterReqInput": {"lora_name": "policy-v2"},
        "UpdateWeightVersionReqInput": update_weight_version_body("3"),
    }
    # Each body becomes the type SGLang's HTTP handler decodes it into: an unknown field is a TypeError.
    for name, body in bodies.items():
        assert sglang_request_types.changed_fields(name, body) == [], name  # every field kept its value


def test_lora_serving_on_cpu_is_refused_when_the_engine_is_built():
    with pytest.raises(ValueError, match=r"max_lora_rank: SGLang cannot serve LoRA adapters on CPU .*"
                                         r"Found no NVIDIA driver on your system.*use engine=torch"):
        SGLangEngine.from_config_json(json.dumps({"platform": "cpu", "server": {"max_lora_rank": 8}}))


def _adapter(rank: int = 8) -> dict[str, torch.Tensor]:
    return {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(rank, 32),
            "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(32, rank)}


@pytest.mark.parametrize(("server", "meta", "reason"), [
    ({}, META, "launched without LoRA serving; set engine_config.server.max_lora_rank"),
    ({"max_lora_rank": 4}, META, "weights.lora.rank: 8 exceeds engine_config.server.max_lora_rank 4"),
    ({"max_lora_rank": 8, "lora_target_modules": ["q_proj"]}, META,
     r"weights.lora.target_modules: \['v_proj'\] are not in engine_config.server.lora_target_modules"),
])
def test_an_adapter_the_server_was_not_launched_for_is_refused(server, meta, reason):
    # platform cuda: the launch plan is decided (pure) but nothing is started on this CPU host.
    engine = SGLangEngine(SGLangEngineConfig(platform="cuda", server=server))
    with pytest.raises(ValueError, match=reason):
        engine.update_lora_adapter(meta, _adapter(), 1)
