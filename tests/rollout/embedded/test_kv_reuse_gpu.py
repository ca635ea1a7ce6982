"""KV reuse across an episode's turns on a CUDA GPU (run on the device machine; CI deselects `gpu`).

bf16, true_on_policy, CUDA graphs, torch's deterministic mode: 64 episodes (16 prompts x 4 samples) of
3 turns, each turn's context the last one plus its sampled tokens plus an observation, decoded with each
episode's K/V kept from turn to turn and, as the baseline, re-prefilled whole every turn: the same token
ids and log-prob bits, also in small prefill chunks in a pool small enough to evict kept prefixes and
preempt sequences; no page referenced once the episodes are forgotten.
"""
from __future__ import annotations

import pytest
import torch

from services.rollout.embedded.decoder import Decoder, DecoderOptions
from services.rollout.types import SamplingConfig
from tests.rollout.embedded.test_decoder_gpu import SMALL, cuda_deterministic, prompts, qwen3  # noqa: F401 - fixture

pytestmark = pytest.mark.gpu

GROUPS, SAMPLES, TURNS = 16, 4, 3
CFG = SamplingConfig(temperature=1.0, max_new_tokens=48, stop_token_ids=tuple(range(40)))


def episodes(model, reuse: bool, **options):
    """Every turn's (token ids, log-probs) of every episode, and the decoder's prefill counts."""
    d = Decoder(model, DecoderOptions(numerics="true_on_policy", cuda_graphs=True,
                                      **{"max_batch_size": 64, **options}))
    lengths = [(53 * i) % 180 + 20 for i in range(GROUPS)]  # across page boundaries
    contexts = [list(p) for p in prompts(lengths, SMALL["vocab"]) for _ in range(SAMPLES)]
    keys = [f"g{i // SAMPLES}/{i % SAMPLES}" for i in range(len(contexts))]
    g = torch.Generator().manual_seed(7)
    out = []
    for turn in range(TURNS):
        seeds = [1000 * turn + i for i in range(len(contexts))]
        rows = d.decode(contexts, seeds, CFG, keys=keys if reuse else None)
        out.append([(r.token_ids, r.logprobs) for r in rows])
        observation = torch.randint(40, SMALL["vocab"], (len(contexts), 12), generator=g).tolist()
        contexts = [c + r.token_ids + o for c, r, o in zip(contexts, rows, observation)]
    counts = d.take_counters()
    d.forget(keys)
    kept = d.kept_prefixes
    assert not kept.entries and kept.alloc.referenced == 0
    d.release()
    return out, counts


def test_reuse_gives_the_bits_of_re_prefill_on_the_gpu():
    model = qwen3(SMALL)
    want, full = episodes(model, reuse=False)
    got, counts = episodes(model, reuse=True)
    assert got == want
    assert counts.misses == {} and counts.reused_tokens > 0
    assert counts.prefill_tokens + counts.reused_tokens == full.prefill_tokens
    squeezed, tight = episodes(model, reuse=True, prefill_chunk_tokens=96, kv_pool_tokens=40 * 64)
    assert squeezed == want
    assert tight.misses.get("evicted", 0) > 0 and 0 < tight.reused_tokens < counts.reused_tokens
