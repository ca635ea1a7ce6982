"""The paged, continuously batched decoder on a CUDA GPU (run on the device machine; CI deselects `gpu`).

bf16, true_on_policy, CUDA graphs, torch's deterministic mode: 256 sequences (32 prompts x 8 samples) with
long-tailed lengths; a sequence's tokens and log-prob bits are the same alone and among the 255 others, in
reverse arrival order, in a pool small enough to force preemption, with prompt sharing off and in small
prefill chunks, and equal the trainer's packed batch-invariant recompute.
"""
from __future__ import annotations

import pytest
import torch

from services.rollout.embedded.decoder import Decoder, DecoderOptions
from services.rollout.types import SamplingConfig
from tests.rollout.decoder_support import batch_invariant_scorer, packed_recompute
from tests.rollout.embedded.test_decoder_gpu import SMALL, cuda_deterministic, prompts, qwen3  # noqa: F401 - fixture

pytestmark = pytest.mark.gpu

GROUPS, SAMPLES = 32, 8
CFG = SamplingConfig(temperature=1.0, max_new_tokens=160, stop_token_ids=tuple(range(40)))  # ~1% stop a step


def batch():
    lengths = [(37 * i) % 150 + 1 for i in range(GROUPS)]  # across page boundaries
    ps = [p for p in prompts(lengths, SMALL["vocab"]) for _ in range(SAMPLES)]
    return ps, [100 + i for i in range(len(ps))]


def bits(rows):
    return [(r.token_ids, r.logprobs) for r in rows]


def test_256_sequences_same_bits_under_every_schedule_and_the_recompute():
    model = qwen3(SMALL)
    ps, seeds = batch()

    def run(**options):
        d = Decoder(model, DecoderOptions(numerics="true_on_policy", cuda_graphs=True,
                                          **{"max_batch_size": 256, **options}))
        out = d.decode(ps, seeds, CFG)
        d.release()
        return out, d.stats

    together, stats = run()
    assert stats.preemptions == 0 and max(n for n, _, _ in stats.steps) > 200  # all admitted at once
    assert len({len(r.token_ids) for r in together}) > 20  # long-tailed: rows end at many different steps
    want = bits(together)
    picks = [0, 7, 100, 255]
    small = Decoder(model, DecoderOptions(numerics="true_on_policy", cuda_graphs=True, max_batch_size=8))
    assert bits(small.decode([ps[i] for i in picks], [seeds[i] for i in picks], CFG)) == [want[i] for i in picks]
    for i in picks:
        assert bits(small.decode([ps[i]], [seeds[i]], CFG)) == [want[i]]
    small.release()
    reverse = Decoder(model, DecoderOptions(numerics="true_on_policy", cuda_graphs=True, max_batch_size=256))
    assert bits(reverse.decode(ps[::-1], seeds[::-1], CFG))[::-1] == want
    reverse.release()
    tight, tight_stats = run(kv_pool_tokens=40 * 64)
    assert tight_stats.preemptions > 0
    assert bits(tight) == want
    assert bits(run(share_prompts=False, prefill_chunk_tokens=100)[0]) == want
    scorer = batch_invariant_scorer(qwen3(SMALL))
    assert [r.logprobs for r in together] == packed_recompute(scorer, ps, [r.token_ids for r in together], 1.0)


def test_paged_kernels_at_the_qwen3_shape_equal_packed_bitwise():
    """Qwen3-0.6B attention shape (16 heads over 8 kv heads of 128), bf16: paged decode and chunked paged
    prefill over scattered pages give packed attention's bits."""
    from kernels.batch_invariant import packed_attention, paged_decode_attention, paged_prefill_attention
    from tests.kernels.batch_invariant.batch_invariant_support import assert_bitwise, make_qkv, pack_lengths
    from tests.kernels.batch_invariant.test_batch_invariant_paged import scatter_into_pool

    lengths = [1, 63, 64, 65, 700, 2051]
    q, k, v = make_qkv(sum(lengths), 16, 8, 128, torch.bfloat16, seed=3, device="cuda")
    cu = pack_lengths(lengths, "cuda")
    packed = packed_attention(q, k, v, cu, max(lengths), 128**-0.5)
    k_pool, v_pool, tables = scatter_into_pool(k, v, lengths)
    seq_of = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)).cuda()
    lens = torch.cat([torch.arange(1, n + 1) for n in lengths]).cuda().int()
    assert_bitwise(paged_decode_attention(q, k_pool, v_pool, tables[seq_of], lens, 128**-0.5), packed, "decode")
    cuts = [n // 3 for n in lengths]
    out = torch.empty_like(q)
    offsets = [0] + torch.tensor(lengths).cumsum(0).tolist()
    for part in (0, 1):
        spans = [(c, n) if part else (0, c) for c, n in zip(cuts, lengths)]
        live = [s for s, (a, b) in enumerate(spans) if b > a]
        rows = torch.cat([torch.arange(offsets[s] + spans[s][0], offsets[s] + spans[s][1]) for s in live]).cuda()
        out[rows] = paged_prefill_attention(q[rows], k_pool, v_pool, tables[live],
                                            pack_lengths([spans[s][1] - spans[s][0] for s in live], "cuda"),
                                            torch.tensor([spans[s][0] for s in live], dtype=torch.int32).cuda(),
                                            max(spans[s][1] - spans[s][0] for s in live), 128**-0.5)
    assert_bitwise(out, packed, "chunked paged prefill")
