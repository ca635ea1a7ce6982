"""The fused decode-step kernels on a GPU at the Qwen3-0.6B shape, bf16, bit for bit against the unfused ops
(CI deselects `gpu`; the interpreted checks at tiny shapes are in test_fused_decode.py).

Each fused op must give exactly what the stock Hugging Face layer patched by make_batch_invariant computes
from the same inputs: the residual add then bi_rms_norm; the projections through bi_linear; the per-head
bi_rms_norm, HF's rotary arithmetic and the pool write; torch's silu(gate) * up, for every bf16 gate value.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.batch_invariant import bi_linear, bi_rms_norm
from kernels.batch_invariant.fused import add_rms_norm, gate_up, grouped_linear, qk_norm_rope_store, rotate_half
from tests.conftest import require
from tests.kernels.batch_invariant.batch_invariant_support import ROW_COUNTS, assert_bitwise

pytestmark = pytest.mark.gpu

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE = 1024, 16, 8, 128, 3072


@pytest.fixture(autouse=True)
def _cuda():
    require(torch.cuda.is_available(), "no CUDA device")


def _gen(seed):
    return torch.Generator(device="cuda").manual_seed(seed)


def _randn(*shape, g, scale=1.0):
    return (torch.randn(*shape, device="cuda", generator=g) * scale).bfloat16()


@pytest.mark.parametrize("hidden", [HIDDEN, 2560])
def test_add_rms_norm_is_the_add_then_bi_rms_norm(hidden):
    g = _gen(0)
    x, r = _randn(4096, hidden, g=g, scale=3), _randn(4096, hidden, g=g, scale=3)
    w = (1 + torch.randn(hidden, device="cuda", generator=g) / 10).bfloat16()
    s, out = add_rms_norm(x, r, w, 1e-6)
    assert_bitwise(s, r + x, "sum")
    assert_bitwise(out, bi_rms_norm(r + x, w, 1e-6), "normed sum")
    assert_bitwise(add_rms_norm(x, None, w, 1e-6)[1], bi_rms_norm(x, w, 1e-6), "no residual")
    for m in ROW_COUNTS:
        idx = torch.randperm(4096, device="cuda", generator=g)[:m]
        assert_bitwise(add_rms_norm(x[idx], r[idx], w, 1e-6)[1], out[idx], f"M={m}")


@pytest.mark.parametrize("norm", [True, False], ids=["qk_norm", "no_norm"])
def test_qk_norm_rope_store_is_the_hf_attention_block(norm):
    b, pages = 300, 400
    g = _gen(1)
    qkv = _randn(b, (HEADS + 2 * KV_HEADS) * HEAD_DIM, g=g, scale=3)
    q_norm, k_norm = ((1 + torch.randn(HEAD_DIM, device="cuda", generator=g) / 10).bfloat16() for _ in range(2))
    if not norm:
        q_norm = k_norm = None
    positions = torch.randint(0, 40000, (b,), device="cuda", generator=g)
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, HEAD_DIM, 2, device="cuda").float() / HEAD_DIM))
    freqs = positions[:, None].float() * inv_freq
    emb = torch.cat([freqs, freqs], -1)
    cos, sin = emb.cos().bfloat16(), emb.sin().bfloat16()
    page_of = torch.randperm(pages, device="cuda", generator=g)[:b]
    slot_of = torch.randint(0, 64, (b,), device="cuda", generator=g)
    pools = [torch.full((pages, KV_HEADS, 64, HEAD_DIM), float("nan"), device="cuda").bfloat16() for _ in range(2)]
    q = qk_norm_rope_store(qkv, HEADS, KV_HEADS, q_norm, k_norm, 1e-6, cos, sin, *pools, page_of, slot_of)
    # Hugging Face's Qwen3Attention from the projections, with the patched (batch-invariant) norms.
    qh = qkv[:, :HEADS * HEAD_DIM].view(b, 1, HEADS, HEAD_DIM)
    kh = qkv[:, HEADS * HEAD_DIM:(HEADS + KV_HEADS) * HEAD_DIM].view(b, 1, KV_HEADS, HEAD_DIM)
    vh = qkv[:, (HEADS + KV_HEADS) * HEAD_DIM:].view(b, KV_HEADS, HEAD_DIM)
    if norm:
        qh, kh = bi_rms_norm(qh, q_norm, 1e-6), bi_rms_norm(kh, k_norm, 1e-6)
    qh, kh = qh.transpose(1, 2), kh.transpose(1, 2)
    c, s = cos[:, None, None], sin[:, None, None]
    want_q, want_k = (qh * c) + (rotate_half(qh) * s), (kh * c) + (rotate_half(kh) * s)
    assert_bitwise(q, want_q[:, :, 0].contiguous(), "q")
    assert_bitwise(pools[0][page_of, :, slot_of], want_k[:, :, 0].contiguous(), "k in the pool")
    assert_bitwise(pools[1][page_of, :, slot_of], vh.contiguous(), "v in the pool")
    assert int(pools[0].isnan().all(-1).sum()) == (pages * 64 - b) * KV_HEADS, "only the rows' slots written"


# (K, weight rows) of the decode step's grouped projections (q|k|v, o_proj, down_proj) in Qwen3-0.6B and -4B.
GROUPED = {"0.6b_qkv": (1024, [2048, 1024, 1024]), "0.6b_o": (2048, [1024]), "0.6b_down": (3072, [1024]),
           "4b_qkv": (2560, [4096, 1024, 1024]), "4b_o": (4096, [2560]), "4b_down": (9728, [2560])}


@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("group", sorted(GROUPED))
def test_grouped_linear_on_decode_tiles_is_bi_linear(group, bias):
    """One launch on the decode tiles (64 x 32) gives what bi_linear's own tiles (64 x 64) give, per weight."""
    k, ns = GROUPED[group]
    g = _gen(2)
    x = _randn(2048, k, g=g)
    ws = [_randn(n, k, g=g, scale=k ** -0.5) for n in ns]
    bs = [_randn(w.shape[0], g=g) for w in ws] if bias else [None] * len(ws)
    full = grouped_linear(x, ws, bs if bias else None)
    assert_bitwise(full, torch.cat([bi_linear(x, w, b_) for w, b_ in zip(ws, bs)], -1), group)
    for m in ROW_COUNTS:
        idx = torch.randperm(2048, device="cuda", generator=g)[:m]
        assert_bitwise(grouped_linear(x[idx], ws, bs if bias else None), full[idx], f"{group} M={m}")


@pytest.mark.parametrize("k,n", [(HIDDEN, INTERMEDIATE), (2560, 9728)], ids=["0.6b", "4b"])
def test_gate_up_is_silu_of_gate_times_up(k, n):
    g = _gen(3)
    x = _randn(2048, k, g=g)
    wg, wu = (_randn(n, k, g=g, scale=2 * k ** -0.5) for _ in range(2))
    gate, up = bi_linear(x, wg), bi_linear(x, wu)
    fused = gate_up(x, wg, wu)
    assert_bitwise(fused, F.silu(gate) * up, "silu(gate) * up")
    assert_bitwise(gate_up(x, wg, wu, silu_mul=False), torch.cat([gate, up], -1), "gate | up")
    for m in ROW_COUNTS:
        idx = torch.randperm(2048, device="cuda", generator=g)[:m]
        assert_bitwise(gate_up(x[idx], wg, wu), fused[idx], f"M={m}")


def test_gate_up_epilogue_is_torchs_silu_for_every_bf16_gate():
    """x = I makes the gate projection the gate weight itself (one nonzero product per output, exact), so the
    epilogue sees every finite bf16 value once; the up projection is random."""
    n = 256
    every = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).cuda()
    every = torch.where(every.isfinite(), every, torch.zeros_like(every))
    wg = every.view(n, n).t().contiguous()  # gate[m, j] = wg[j, m]
    wu = _randn(n, n, g=_gen(4), scale=4)
    x = torch.eye(n, device="cuda").bfloat16()
    gate, up = bi_linear(x, wg), bi_linear(x, wu)
    # Signed zeros and subnormals may come out of the MMA as +0; every other value passes through exactly.
    assert (gate.view(torch.int16) == every.view(n, n).view(torch.int16)).float().mean() > 0.99
    assert_bitwise(gate_up(x, wg, wu), F.silu(gate) * up, "silu over every bf16 value")


# (K, N) of every decode projection bi_linear serves at the 0.6B and 4B shapes, and the lm_head (wide tiles).
LINEAR = {"0.6b_q": (1024, 2048), "0.6b_o": (2048, 1024), "0.6b_down": (3072, 1024), "4b_down": (9728, 2560),
          "lm_head": (1024, 151936)}


@pytest.mark.parametrize("shape", sorted(LINEAR))
def test_split_k_schedule_gives_bi_linears_one_program_bits(shape):
    """bi_linear forced onto split-K (one program per tile and split, then the combine) equals the one-program
    schedule bit for bit, for every row alone and in batches; the launcher takes split-K at one row."""
    from kernels.batch_invariant import triton_launch

    k, n = LINEAR[shape]
    g = _gen(5)
    x = _randn(256, k, g=g)
    w, b = _randn(n, k, g=g, scale=k ** -0.5), _randn(n, g=g)
    one = triton_launch.linear(x, w, b, split_k=False)
    assert_bitwise(triton_launch.linear(x, w, b, split_k=True), one, f"{shape} split-K, 256 rows")
    for m in ROW_COUNTS[:-1]:
        idx = torch.randperm(256, device="cuda", generator=g)[:m]
        assert_bitwise(triton_launch.linear(x[idx], w, b, split_k=True), one[idx], f"{shape} split-K M={m}")
        assert_bitwise(bi_linear(x[idx], w, b), one[idx], f"{shape} auto M={m}")
    if n < triton_launch.WIDE_N:
        cfg = triton_launch.matmul_config(torch.bfloat16, n, "cuda")
        assert triton_launch.split_k_plan(cfg, k, 1, triton_launch.triton_cdiv(n, cfg.block_n), x.device,
                                          None).partial, "one row of a decode projection runs split-K"


@pytest.mark.parametrize("group", sorted(GROUPED))
def test_split_k_schedule_gives_the_fused_projections_one_program_bits(group):
    k, ns = GROUPED[group]
    g = _gen(6)
    x = _randn(256, k, g=g)
    ws = [_randn(n, k, g=g, scale=k ** -0.5) for n in ns]
    one = grouped_linear(x, ws, split_k=False)
    assert_bitwise(grouped_linear(x, ws, split_k=True), one, f"{group} split-K, 256 rows")
    wg, wu = (_randn(INTERMEDIATE, k, g=g, scale=2 * k ** -0.5) for _ in range(2))
    mlp = gate_up(x, wg, wu, split_k=False)
    assert_bitwise(gate_up(x, wg, wu, split_k=True), mlp, f"gate_up K={k} split-K, 256 rows")
    for m in ROW_COUNTS[:-1]:
        idx = torch.randperm(256, device="cuda", generator=g)[:m]
        assert_bitwise(grouped_linear(x[idx], ws, split_k=True), one[idx], f"{group} split-K M={m}")
        assert_bitwise(gate_up(x[idx], wg, wu, split_k=True), mlp[idx], f"gate_up K={k} split-K M={m}")
