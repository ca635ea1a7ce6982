"""The paged, continuously batched decoder with a tiny Qwen3-MoE (8 experts, top-2, 2 layers) and a Qwen2-MoE
(shared expert) in true_on_policy on CPU: a sequence's tokens and log-probs are the same bits alone, among
others, in reverse arrival order, two rows at a time, in 7-token prefill chunks and under forced preemption;
equal to the trainer's packed recompute; and the fused decode step (which runs the patched MoE blocks
themselves) gives the stock step's bits."""
from __future__ import annotations

import pytest
import torch

from kernels.batch_invariant import KEY_BLOCK
from recipes.tiny_moe import TinyMoeConfig, build_moe_model_dir
from services.rollout.embedded.decoder import Decoder, DecoderOptions
from tests.rollout.decoder_support import batch_invariant_scorer, loaded, packed_recompute, sampling

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

LONG = tuple((7 * i) % 97 + 1 for i in range(KEY_BLOCK + 6))
GROUPS = [(LONG, 2), ((5, 9, 2, 13), 2), ((7,), 1)]
PROMPTS = [p for p, n in GROUPS for _ in range(n)]
SEEDS = [300 + i for i in range(len(PROMPTS))]
CFG = sampling(temperature=0.9, max_new_tokens=16, stop_token_ids=(3, 17))


@pytest.fixture(scope="module", params=["qwen3_moe", "qwen2_moe"])
def moe_dir(request, tmp_path_factory):
    cfg = TinyMoeConfig(family=request.param, hidden_size=32, head_dim=8, moe_intermediate_size=16,
                        shared_expert_intermediate_size=32, initializer_range=0.3)
    return build_moe_model_dir(tmp_path_factory.mktemp(request.param), cfg, seed=3)


def decoder(model_dir, dtype, **options) -> Decoder:
    return Decoder(loaded(model_dir, dtype), DecoderOptions(numerics="true_on_policy", **options))


def bits(rows):
    return [(r.token_ids, r.logprobs, r.finish_reason) for r in rows]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_moe_sequences_have_the_same_bits_under_every_schedule(moe_dir, dtype):
    d = decoder(moe_dir, dtype, max_batch_size=16)
    assert d.decode_forward == "fused"
    together = d.decode(PROMPTS, SEEDS, CFG)
    assert d.stats.preemptions == 0
    alone = [d.decode([p], [s], CFG)[0] for p, s in zip(PROMPTS, SEEDS)]
    assert bits(alone) == bits(together)
    assert bits(d.decode(PROMPTS[::-1], SEEDS[::-1], CFG)[::-1]) == bits(together)
    for options in (dict(max_batch_size=2), dict(max_batch_size=16, prefill_chunk_tokens=7),
                    dict(max_batch_size=16, fused_step=False)):
        other = decoder(moe_dir, dtype, **options)
        assert bits(other.decode(PROMPTS, SEEDS, CFG)) == bits(together), options
    tight = decoder(moe_dir, dtype, max_batch_size=16, kv_pool_tokens=2 * KEY_BLOCK)
    assert bits(tight.decode(PROMPTS, SEEDS, CFG)) == bits(together)
    assert tight.stats.preemptions > 0
    recomputed = packed_recompute(batch_invariant_scorer(loaded(moe_dir, dtype)), PROMPTS,
                                  [r.token_ids for r in together], CFG.temperature)
    assert [r.logprobs for r in together] == recomputed
    assert sum(len(r.token_ids) for r in together) > 2 * len(PROMPTS)


def test_stock_step_is_reported_when_fused_is_off(moe_dir):
    assert decoder(moe_dir, "float32", fused_step=False).decode_forward == "hf"


@pytest.mark.parametrize("numerics", ["true_on_policy", "fast"])
def test_each_token_comes_back_with_the_experts_the_trainer_routes_it_to(moe_dir, numerics):
    """The decoder's routing table of a sequence equals, position by position, what a packed forward of the
    whole sequence routes (true_on_policy: the trainer's own forward, bitwise; fast: the same model in one
    forward); the last token, never read, is padding. Preemption recomputes and overwrites it."""
    from kernels.moe.hf_blocks import observe_routing, router_states

    cfg = sampling(temperature=0.9, max_new_tokens=16)
    d = Decoder(loaded(moe_dir, "float32"), DecoderOptions(numerics=numerics, max_batch_size=16,
                                                           kv_pool_tokens=2 * KEY_BLOCK))
    rows = d.decode(PROMPTS, SEEDS, cfg)
    assert d.stats.preemptions > 0
    scorer = batch_invariant_scorer(loaded(moe_dir, "float32")) if numerics == "true_on_policy" else None
    plain = loaded(moe_dir, "float32")
    observe_routing(plain)
    for prompt, row in zip(PROMPTS, rows):
        table = row.routed_experts
        tokens = list(prompt) + row.token_ids
        assert table.dtype == torch.uint8 and tuple(table.shape) == (len(tokens), 2, 2)
        assert (table[-1] == 255).all() and (table[:-1] < 8).all()
        model = scorer if scorer is not None else plain
        packed_recompute(model, [prompt], [row.token_ids], cfg.temperature) if scorer is not None else \
            plain(input_ids=torch.tensor([tokens]), use_cache=False)
        want = torch.stack([s.experts for s in router_states(model)], dim=1)[:len(tokens) - 1]
        if numerics == "true_on_policy":
            assert torch.equal(table[:-1].long(), want)
        else:  # fast promises no bits: the same experts as a set for nearly every token
            same = (table[:-1].long().sort(-1).values == want.sort(-1).values).all(-1).all(-1)
            assert same.float().mean() > 0.9
