"""SGLang serving mixture-of-experts policies: the MoE options on the server's command line, and each token's
routed experts (routing replay) asked for, read back and checked. No server. SGLang's own argument parser
reads these flags in test_sglang_command_line.py, and its request type takes the body asking for routed
experts in test_sglang_requests.py (one SGLang import each, for all the command lines and bodies).

A server run: SGLang's CPU build serves the tiny Qwen3-MoE (recipes/tiny_moe.py), but its routed-experts
capture buffer is registered CUDA host memory, so a CPU server cannot start with
--enable-return-routed-experts (docs/moe.md); the replay path's live check needs a GPU.
"""
from __future__ import annotations

import base64
import json

import numpy as np
import pytest
import torch

from contract.engine_options import SGLangEngineConfig
from contract.sglang_command import engine_run_options, engine_switches, server_command
from services.common.platform import Platform, SGLangPlatformConfig, sglang_launch_plan
from services.rollout.sglang.client import MoeShape, SGLangRequestError, generate_body, parse_generate_response
from services.rollout.sglang.engine import moe_shape
from services.rollout.types import GenerationRequest, PromptSpec, ResumedSample, SamplingConfig

MOE = SGLangEngineConfig(tp_size=4, ep_size=2, moe_runner_backend="triton", moe_a2a_backend="deepep",
                         return_routed_experts=True)
SHAPE = MoeShape(layers=2, top_k=2, n_experts=8)
REQ = GenerationRequest(prompts=(PromptSpec("a", (1, 5, 6), seed=10),),
                        sampling=SamplingConfig(max_new_tokens=4), samples_per_prompt=2)


def _command(config: SGLangEngineConfig, platform: Platform = Platform.CUDA) -> list[str]:
    return server_command("/py", sglang_launch_plan(platform, SGLangPlatformConfig(), {}), model_path="/m",
                          host="127.0.0.1", port=1, weight_version="0", run_options=engine_run_options(config),
                          switches=engine_switches(config), parent_pid=1)


def test_moe_options_become_their_flags_and_are_absent_unless_chosen():
    cmd = _command(MOE)
    assert {"--tp-size=4", "--ep-size=2", "--moe-runner-backend=triton", "--moe-a2a-backend=deepep",
            "--enable-return-routed-experts"} <= set(cmd)
    plain = _command(SGLangEngineConfig())
    assert not [a for a in plain if a.startswith(("--ep-size", "--moe-", "--enable-return-routed"))]


@pytest.mark.parametrize("options, field", [
    ({"tp_size": 2, "ep_size": 3}, "ep_size"),
    ({"moe_a2a_backend": "deepep"}, "moe_a2a_backend"),
    ({"moe_runner_backend": "--trust-remote-code"}, "moe_runner_backend"),
    ({"ep_size": 0}, "ep_size"),
    ({"return_routed_experts": "maybe"}, "return_routed_experts"),
])
def test_bad_moe_options_are_refused_naming_the_field(options, field):
    with pytest.raises(ValueError, match=field):
        SGLangEngineConfig.from_json(json.dumps(options))


def test_the_builder_refuses_a_switch_that_is_not_a_flag_name():
    with pytest.raises(ValueError, match="not a flag name"):
        server_command("/py", sglang_launch_plan(Platform.CPU, SGLangPlatformConfig(), {}), model_path="/m",
                       host="h", port=1, weight_version="0", switches=("--x --trust-remote-code",), parent_pid=1)


def _encoded(ids: np.ndarray) -> str:
    return base64.b64encode(ids.astype(np.int32).tobytes()).decode()


def _out(ids, routed: str | None, version="3"):
    meta = {"weight_version": version, "finish_reason": {"type": "length"},
            "output_token_logprobs": [[-1.0, t, None] for t in ids]}
    if routed is not None:
        meta["routed_experts"] = routed
    return {"output_ids": ids, "meta_info": meta}


def test_routed_experts_are_asked_for_and_read_back_in_wire_form():
    assert generate_body(REQ, routed_experts=True)["return_routed_experts"] is True
    assert "return_routed_experts" not in generate_body(REQ)
    rng = np.random.default_rng(0)
    # 3 prompt + 2 new tokens: 4 read positions x 2 layers x top-2.
    tables = [np.stack([rng.permutation(8)[:2] for _ in range(8)]).reshape(4, 2, 2) for _ in range(2)]
    outs = [_out([4, 9], _encoded(t)) for t in tables]
    samples = parse_generate_response(REQ, outs, "3", routing=SHAPE)
    for s, t in zip(samples, tables, strict=True):
        assert s.routed_experts.dtype == torch.uint8 and tuple(s.routed_experts.shape) == (5, 2, 2)
        assert torch.equal(s.routed_experts[:4].long(), torch.from_numpy(t).long())
        assert bool((s.routed_experts[4] == 255).all())  # the last token is never read: padding
    assert all(s.routed_experts is None for s in parse_generate_response(REQ, outs, "3"))


def test_a_resumed_samples_table_covers_its_whole_sequence():
    req = GenerationRequest(prompts=REQ.prompts, sampling=REQ.sampling, samples_per_prompt=2,
                            resumed=(ResumedSample("a/1", (7, 8), (-0.5, -0.5), (1, 1)),))
    # SGLang read the prompt, both earlier tokens and the first new one: 3 + 2 + 1 positions.
    outs = [_out([4, 9], _encoded(np.zeros((4, 2, 2)) + [0, 1])), _out([4], _encoded(np.zeros((5, 2, 2)) + [2, 3]))]
    s = parse_generate_response(req, outs, "3", routing=SHAPE)[1]
    assert s.token_ids == [7, 8, 4] and tuple(s.routed_experts.shape) == (6, 2, 2)


@pytest.mark.parametrize("routed, why", [
    (None, "no routed experts"),
    ("not base64!", "not base64"),
    (_encoded(np.zeros((3, 2, 2))), "read positions"),
    (_encoded(np.full((4, 2, 2), 8)), "expert id 8 outside"),
    (_encoded(np.full((4, 2, 2), -1)), "expert id -1 outside"),
])
def test_missing_or_malformed_routed_experts_fail_the_call_naming_the_sample(routed, why):
    good = _encoded(np.zeros((4, 2, 2)) + [0, 1])
    with pytest.raises(SGLangRequestError, match=f"sample a/1: .*{why}"):
        parse_generate_response(REQ, [_out([4, 9], good), _out([4, 9], routed)], "3", routing=SHAPE)


def test_return_routed_experts_needs_a_model_whose_every_layer_routes():
    assert moe_shape({"model_type": "qwen3_moe", "num_experts": 128, "num_experts_per_tok": 8,
                      "num_hidden_layers": 48, "mlp_only_layers": [], "decoder_sparse_step": 1}) == MoeShape(48, 8, 128)
    with pytest.raises(ValueError, match=r"engine_config\.return_routed_experts: .*no mixture-of-experts"):
        moe_shape({"model_type": "qwen3", "num_hidden_layers": 2})
    with pytest.raises(ValueError, match=r"engine_config\.return_routed_experts: .*dense layers"):
        moe_shape({"model_type": "qwen3_moe", "num_experts": 8, "num_experts_per_tok": 2, "num_hidden_layers": 4,
                   "mlp_only_layers": [1]})
