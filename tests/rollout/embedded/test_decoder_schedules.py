"""The paged, continuously batched decoder on CPU: in true_on_policy a sequence's tokens and log-probs are the
same bits under every schedule, and equal to the trainer's packed recompute.

Schedules compared against each sequence decoded alone: everything at once; the reverse arrival order; two
rows at a time; prefill in 7-token chunks; prompt sharing off; a pool of three pages, which forces
preemption and recomputation. fp32 and bf16 (the batch-invariant reference kernels). The prompts cross a
page (KEY_BLOCK = 64 tokens), groups of samples share a prompt, and stop tokens end rows at different steps.
"""
from __future__ import annotations

import pytest

from kernels.batch_invariant import KEY_BLOCK
from services.rollout.embedded.decoder import Decoder, DecoderOptions
from tests.rollout.decoder_support import batch_invariant_scorer, loaded, packed_recompute, sampling

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

LONG = tuple((7 * i) % 97 + 1 for i in range(KEY_BLOCK + 6))  # 70 tokens: its last page is partly filled
GROUPS = [(LONG, 3), ((5, 9, 2, 13), 3), ((7,), 2)]  # (prompt, samples)
PROMPTS = [p for p, n in GROUPS for _ in range(n)]
SEEDS = [100 + i for i in range(len(PROMPTS))]
CFG = sampling(temperature=0.9, max_new_tokens=30, stop_token_ids=(3, 17))


def decoder(model_dir, dtype, **options) -> Decoder:
    return Decoder(loaded(model_dir, dtype), DecoderOptions(numerics="true_on_policy", **options))


def bits(rows):
    return [(r.token_ids, r.logprobs, r.finish_reason) for r in rows]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_every_schedule_gives_the_same_bits_and_the_trainers_recompute(decoder_model_dir, dtype):
    d = decoder(decoder_model_dir, dtype, max_batch_size=16)
    together = d.decode(PROMPTS, SEEDS, CFG)
    assert d.stats.preemptions == 0
    assert {r.finish_reason for r in together} == {"stop", "length"}  # rows end at different steps
    alone = [d.decode([p], [s], CFG)[0] for p, s in zip(PROMPTS, SEEDS)]
    assert bits(alone) == bits(together)
    assert bits(d.decode(PROMPTS[::-1], SEEDS[::-1], CFG)[::-1]) == bits(together)
    # A chunk of len(LONG) - 1 ends one token short of the shared prompt's end: its samples decode only
    # once the prompt's prefill completes (each from the prompt's last logits), never from a half prefill.
    for options in (dict(max_batch_size=2), dict(max_batch_size=16, prefill_chunk_tokens=7),
                    dict(max_batch_size=16, prefill_chunk_tokens=len(LONG) - 1),
                    dict(max_batch_size=16, share_prompts=False)):
        assert bits(decoder(decoder_model_dir, dtype, **options).decode(PROMPTS, SEEDS, CFG)) == bits(together), options
    tight = decoder(decoder_model_dir, dtype, max_batch_size=16, kv_pool_tokens=3 * KEY_BLOCK)
    assert bits(tight.decode(PROMPTS, SEEDS, CFG)) == bits(together)
    assert tight.stats.preemptions > 0 and tight.stats.pool_pages == 4  # three pages and the scratch page
    recomputed = packed_recompute(batch_invariant_scorer(loaded(decoder_model_dir, dtype)), PROMPTS,
                                  [r.token_ids for r in together], CFG.temperature)
    assert [r.logprobs for r in together] == recomputed


def test_one_prefill_per_group_and_pages_stored_once(decoder_model_dir):
    """With sharing a group's prompt runs through prefill once and its pages are held once (refcounted)."""
    cfg = sampling(max_new_tokens=4)
    shared = decoder(decoder_model_dir, "float32", max_batch_size=16)
    shared.decode(PROMPTS, SEEDS, cfg)
    private = decoder(decoder_model_dir, "float32", max_batch_size=16, share_prompts=False)
    private.decode(PROMPTS, SEEDS, cfg)
    assert shared.stats.prefill_tokens == sum(len(p) for p, _ in GROUPS)
    assert private.stats.prefill_tokens == sum(len(p) * n for p, n in GROUPS)
    # Pages: a shared group holds its full prompt pages once; each sample copies only the partly filled last one.
    assert shared.stats.peak_pages < private.stats.peak_pages
    assert shared.stats.page_copies == sum(n for _, n in GROUPS) - len(GROUPS)


def test_pause_and_resume_continue_the_same_bits(decoder_model_dir):
    """Paused at a token boundary, each sequence returns what it has; resumed (its K/V recomputed) it ends as
    the uninterrupted decode did, bit for bit."""
    d = decoder(decoder_model_dir, "bfloat16", max_batch_size=4)
    full = d.decode(PROMPTS, SEEDS, CFG)
    asked = []
    paused = d.decode(PROMPTS, SEEDS, CFG, should_pause=lambda: asked.append(1) or len(asked) > 6)
    assert "paused" in {r.finish_reason for r in paused}
    for p, f in zip(paused, full):
        assert (p.token_ids, p.logprobs) == (f.token_ids[:len(p.token_ids)], f.logprobs[:len(p.token_ids)])
    resumed = d.decode(PROMPTS, SEEDS, CFG, prefixes=[(p.token_ids, p.logprobs) for p in paused])
    assert bits(resumed) == bits(full)


def test_a_pool_smaller_than_one_sequence_is_refused_by_name(decoder_model_dir):
    d = decoder(decoder_model_dir, "float32", kv_pool_tokens=KEY_BLOCK)
    with pytest.raises(ValueError, match="kv_pool_tokens: .*less than one sequence"):
        d.decode([LONG], [1], CFG)


def test_fast_mode_runs_the_same_scheduler_through_preemption(decoder_model_dir):
    """fast numerics promise no bits across schedules, but use the same scheduler: preempted, recomputed rows
    still finish within their bounds."""
    d = Decoder(loaded(decoder_model_dir, "float32"),
                DecoderOptions(max_batch_size=16, kv_pool_tokens=3 * KEY_BLOCK, prefill_chunk_tokens=16))
    rows = d.decode(PROMPTS, SEEDS, CFG)
    assert d.stats.preemptions > 0
    for r in rows:
        assert len(r.token_ids) == len(r.logprobs) and 1 <= len(r.token_ids) <= 30
        assert (r.finish_reason == "stop") == (r.token_ids[-1] in (3, 17))
        assert not set(r.token_ids[:-1]) & {3, 17}


def test_the_engine_sizes_its_pool_from_its_options(decoder_model_dir):
    from services.rollout.types import GenerationRequest, PromptSpec
    from services.rollout.embedded.torch_engine import TorchEngine, TorchEngineConfig

    with pytest.raises(ValueError, match="engine_config.kv_cache_memory_fraction: .*CUDA"):
        TorchEngineConfig.from_json('{"kv_cache_memory_fraction": 0.5}')
    with pytest.raises(ValueError, match="engine_config.kv_cache_tokens"):
        TorchEngineConfig.from_json('{"kv_cache_tokens": 8}')
    engine = TorchEngine(TorchEngineConfig(kv_cache_tokens=KEY_BLOCK, prefill_chunk_tokens=5, max_batch_size=4))
    engine.load(str(decoder_model_dir), 0)
    with pytest.raises(ValueError, match="sampling.max_new_tokens: .*kv_cache_tokens=64"):
        engine.generate(GenerationRequest(prompts=(PromptSpec("g", LONG, 0),), sampling=sampling(max_new_tokens=9)))
    out = engine.generate(GenerationRequest(prompts=(PromptSpec("g", (5, 9, 2), 0), PromptSpec("h", (7,), 1)),
                                            sampling=sampling(max_new_tokens=40), samples_per_prompt=3))
    assert [len(s.token_ids) for s in out] == [40] * 6
    assert engine._decoder.stats.pool_pages == 2 and engine._decoder.stats.preemptions > 0  # one page + scratch
