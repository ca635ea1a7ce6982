"""The decoder with a random-init Qwen3-MoE on a CUDA GPU, bf16, true_on_policy (`gpu` marker; the lead runs it).

CUDA graph replay of the fused decode step (with its MoE blocks and their routing, captured without a host
sync) gives the eager bits; every sequence's tokens, log-probs and routed experts are the same alone, together
and reversed; and the log-probs equal the trainer's packed batch-invariant recompute bit for bit."""
from __future__ import annotations

import pytest
import torch

from services.rollout.embedded.decoder import Decoder, DecoderOptions
from services.rollout.types import SamplingConfig
from tests.conftest import require
from tests.rollout.decoder_support import batch_invariant_scorer, packed_recompute

pytestmark = pytest.mark.gpu

PROMPT_LENGTHS = [5, 17, 33, 64, 1, 100, 7, 48]


@pytest.fixture(autouse=True)
def cuda_deterministic():
    require(torch.cuda.is_available(), "no CUDA device")
    from services.common.determinism import configure_determinism

    before = torch.are_deterministic_algorithms_enabled()
    configure_determinism(0)
    yield
    torch.use_deterministic_algorithms(before)


def qwen3_moe(seed: int = 0) -> torch.nn.Module:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(vocab_size=4096, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                         num_experts=16, num_experts_per_tok=4, norm_topk_prob=True, max_position_embeddings=4096,
                         tie_word_embeddings=False, initializer_range=0.05)
    torch.manual_seed(seed)
    with torch.device("cuda"):
        model = Qwen3MoeForCausalLM(cfg)
    model.set_attn_implementation("sdpa")
    return model.to(torch.bfloat16).eval().requires_grad_(False)


def _prompts():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, 4096, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def _bits(rows):
    return [(r.token_ids, r.logprobs, r.finish_reason, r.routed_experts.tolist()) for r in rows]


def test_moe_decode_is_schedule_invariant_graph_safe_and_the_trainers_bits():
    prompts, seeds = _prompts(), list(range(100, 100 + len(PROMPT_LENGTHS)))
    cfg = SamplingConfig(temperature=1.0, max_new_tokens=40)
    graphs = Decoder(qwen3_moe(), DecoderOptions(numerics="true_on_policy", max_batch_size=8, cuda_graphs=True))
    eager = Decoder(qwen3_moe(), DecoderOptions(numerics="true_on_policy", max_batch_size=8, cuda_graphs=False))
    assert graphs.decode_forward == "fused"
    together = graphs.decode(prompts, seeds, cfg)
    assert _bits(eager.decode(prompts, seeds, cfg)) == _bits(together)
    assert _bits(graphs.decode(prompts[::-1], seeds[::-1], cfg)[::-1]) == _bits(together)
    assert _bits([graphs.decode([p], [s], cfg)[0] for p, s in zip(prompts[:3], seeds[:3])]) == _bits(together[:3])
    stock = Decoder(qwen3_moe(), DecoderOptions(numerics="true_on_policy", max_batch_size=8, cuda_graphs=True,
                                                fused_step=False))
    assert _bits(stock.decode(prompts, seeds, cfg)) == _bits(together)
    recomputed = packed_recompute(batch_invariant_scorer(qwen3_moe()), prompts, [r.token_ids for r in together],
                                  cfg.temperature)
    assert [r.logprobs for r in together] == recomputed
