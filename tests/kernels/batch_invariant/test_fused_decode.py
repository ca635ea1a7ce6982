"""The fused decode-step kernels (kernels/batch_invariant/fused_kernels.py) against the unfused ops they replace.

Interpreted on CPU (compiled where CUDA is present), tiny shapes that still cross every tail: each fused op
must give the bits of its unfused composition run through the same Triton kernels (bi_linear, bi_rms_norm)
and torch's elementwise ops, must be row-invariant, and must match the pure-torch reference within the dtype
tolerance. The same checks at the Qwen3-0.6B shape on a GPU, bit for bit including SiLU over every bf16
input, are in test_fused_decode_gpu.py.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kernels.batch_invariant import BatchInvariantInputError, bi_linear, bi_rms_norm
from kernels.batch_invariant.fused import add_rms_norm, gate_up, grouped_linear, qk_norm_rope_store, rotate_half
from tests.kernels.batch_invariant.batch_invariant_support import assert_bitwise
from tests.kernels.interpreted_dot import row_position_dependent_matmul

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")
TOL = {torch.float32: dict(rtol=2e-5, atol=2e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


@pytest.fixture(autouse=True)
def numpy_matmul_that_orders_each_row_by_its_index(monkeypatch):
    if DEVICE == "cpu":
        monkeypatch.setattr(np, "matmul", row_position_dependent_matmul)


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _randn(*shape, g, dtype, scale=1.0):
    return (torch.randn(*shape, generator=g) * scale).to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_is_the_add_then_the_norm(dtype):
    g = _gen(0)
    x, r = _randn(40, 96, g=g, dtype=dtype, scale=2), _randn(40, 96, g=g, dtype=dtype, scale=2)
    w = (1 + torch.randn(96, generator=g) / 10).to(DEVICE, dtype)
    s, out = add_rms_norm(x, r, w, 1e-6, impl="triton")
    assert_bitwise(s, r + x, "sum")
    assert_bitwise(out, bi_rms_norm(r + x, w, 1e-6, impl="triton"), "norm of the sum")
    ref_s, ref_out = add_rms_norm(x, r, w, 1e-6, impl="reference")
    assert_bitwise(s, ref_s, "sum vs reference")
    torch.testing.assert_close(out.float(), ref_out.float(), **TOL[dtype])
    alone, normed = add_rms_norm(x, None, w, 1e-6, impl="triton")
    assert alone is x or torch.equal(alone, x)
    assert_bitwise(normed, bi_rms_norm(x, w, 1e-6, impl="triton"), "no residual")
    for idx in ([3], [0, 17, 39]):
        assert_bitwise(add_rms_norm(x[idx], r[idx], w, 1e-6, impl="triton")[1], out[idx], f"rows {idx}")


def _hf_attention_inputs(qkv, n_heads, n_kv, q_norm, k_norm, cos, sin):
    """What Hugging Face's Qwen3 attention block computes from the projections (before the cache write)."""
    b, d = qkv.shape[0], cos.shape[-1]
    q = qkv[:, :n_heads * d].view(b, 1, n_heads, d)
    k = qkv[:, n_heads * d:(n_heads + n_kv) * d].view(b, 1, n_kv, d)
    v = qkv[:, (n_heads + n_kv) * d:].view(b, 1, n_kv, d).transpose(1, 2)
    if q_norm is not None:
        q, k = bi_rms_norm(q, q_norm, 1e-6, impl="triton"), bi_rms_norm(k, k_norm, 1e-6, impl="triton")
    q, k = q.transpose(1, 2), k.transpose(1, 2)  # [B, heads, 1, D]
    c, s = cos[:, None, None], sin[:, None, None]
    return (q * c) + (rotate_half(q) * s), (k * c) + (rotate_half(k) * s), v


@pytest.mark.parametrize("norm", [True, False], ids=["qk_norm", "no_norm"])
def test_qk_norm_rope_store_gives_the_attention_blocks_bits(norm):
    dtype, n_heads, n_kv, d, b = torch.bfloat16, 4, 2, 16, 6
    g = _gen(1)
    qkv = _randn(b, (n_heads + 2 * n_kv) * d, g=g, dtype=dtype, scale=3)
    q_norm, k_norm = ((1 + torch.randn(d, generator=g) / 10).to(DEVICE, dtype) for _ in range(2))
    if not norm:
        q_norm = k_norm = None
    angles = torch.rand(b, d // 2, generator=g) * 50
    emb = torch.cat([angles, angles], -1)
    cos, sin = emb.cos().to(DEVICE, dtype), emb.sin().to(DEVICE, dtype)
    pages = torch.tensor([3, 1, 4, 2, 5, 6], device=DEVICE)
    slots = torch.tensor([0, 7, 3, 7, 1, 2], device=DEVICE)
    pools = [torch.full((8, n_kv, 8, d), float("nan"), dtype=dtype, device=DEVICE) for _ in range(2)]
    q = qk_norm_rope_store(qkv, n_heads, n_kv, q_norm, k_norm, 1e-6, cos, sin, *pools, pages, slots, impl="triton")
    want_q, want_k, want_v = _hf_attention_inputs(qkv, n_heads, n_kv, q_norm, k_norm, cos, sin)
    assert_bitwise(q, want_q[:, :, 0].contiguous(), "q")
    assert_bitwise(pools[0][pages, :, slots], want_k[:, :, 0].contiguous(), "k in the pool")
    assert_bitwise(pools[1][pages, :, slots], want_v[:, :, 0].contiguous(), "v in the pool")
    written = torch.zeros(8, 8, dtype=torch.bool)
    written[pages.cpu(), slots.cpu()] = True
    assert pools[0].isnan().cpu().permute(0, 2, 1, 3).all(-1).all(-1)[~written].all(), "nothing else written"
    ref_pools = [torch.zeros_like(p) for p in pools]
    ref_q = qk_norm_rope_store(qkv, n_heads, n_kv, q_norm, k_norm, 1e-6, cos, sin, *ref_pools, pages, slots,
                               impl="reference")
    torch.testing.assert_close(q.float(), ref_q.float(), **TOL[dtype])
    sub = [4, 1]
    sub_pools = [torch.zeros_like(p) for p in pools]
    assert_bitwise(qk_norm_rope_store(qkv[sub], n_heads, n_kv, q_norm, k_norm, 1e-6, cos[sub], sin[sub], *sub_pools,
                                      pages[sub], slots[sub], impl="triton"), q[sub], "rows alone")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
def test_grouped_linear_is_the_separate_projections(dtype, bias):
    g = _gen(2)
    x = _randn(70, 80, g=g, dtype=dtype)  # M tail, K tail inside a BLOCK_K step
    ws = [_randn(n, 80, g=g, dtype=dtype, scale=1 / 9) for n in (72, 40, 40)]  # N tails
    bs = [_randn(w.shape[0], g=g, dtype=dtype) for w in ws] if bias else None
    full = grouped_linear(x, ws, bs, impl="triton")
    want = torch.cat([bi_linear(x, w, None if bs is None else bs[i], impl="triton") for i, w in enumerate(ws)], -1)
    assert_bitwise(full, want, "q|k|v")
    torch.testing.assert_close(full.float(), grouped_linear(x, ws, bs, impl="reference").float(), **TOL[dtype])
    assert_bitwise(grouped_linear(x[5:8], ws[:2], None if bs is None else bs[:2], impl="triton"),
                   full[5:8, :112], "two weights, three rows")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gate_up_is_the_two_projections_and_silu_times_up(dtype):
    g = _gen(3)
    x = _randn(70, 80, g=g, dtype=dtype)
    wg, wu = (_randn(72, 80, g=g, dtype=dtype, scale=1 / 3) for _ in range(2))
    gate, up = bi_linear(x, wg, impl="triton"), bi_linear(x, wu, impl="triton")
    assert_bitwise(gate_up(x, wg, wu, silu_mul=False, impl="triton"), torch.cat([gate, up], -1), "gate | up")
    fused = gate_up(x, wg, wu, impl="triton")
    unfused = F.silu(gate) * up
    if dtype == torch.float32 or DEVICE == "cpu":
        # fp32 takes the unfused ops; interpreted, exp is numpy's, not torch's (the GPU test checks bits).
        torch.testing.assert_close(fused.float(), unfused.float(), rtol=8e-3, atol=1e-6)
    else:
        assert_bitwise(fused, unfused, "silu(gate) * up")
    if dtype != torch.float32:  # fp32 runs torch's silu, whose CPU kernel rounds a vector tail its own way
        for idx in ([0], [69, 3, 40]):
            assert_bitwise(gate_up(x[idx], wg, wu, impl="triton"), fused[idx], f"rows {idx}")
    torch.testing.assert_close(fused.float(), gate_up(x, wg, wu, impl="reference").float(), **TOL[dtype])


def test_fused_ops_refuse_bad_inputs_by_name():
    x = torch.zeros(2, 8)
    with pytest.raises(BatchInvariantInputError, match="residual"):
        add_rms_norm(x, torch.zeros(2, 4), torch.ones(8), 1e-6)
    with pytest.raises(BatchInvariantInputError, match="1 to 3 weights"):
        grouped_linear(x, [torch.zeros(4, 8)] * 4)
    with pytest.raises(BatchInvariantInputError, match="gate and up"):
        gate_up(x, torch.zeros(4, 8), torch.zeros(5, 8))
    pool = torch.zeros(2, 1, 4, 4)
    with pytest.raises(BatchInvariantInputError, match="cos/sin"):
        qk_norm_rope_store(torch.zeros(2, 12), 1, 1, None, None, 1e-6, torch.zeros(2, 3), torch.zeros(2, 3), pool,
                           pool.clone(), torch.zeros(2, dtype=torch.long), torch.zeros(2, dtype=torch.long))
