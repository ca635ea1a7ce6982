"""Fused Triton kernels of one decode step, each giving the bits of the unfused batch-invariant ops it replaces.

A decode step of a Qwen3-shaped model at a few hundred rows is a chain of small kernels whose time is
mostly launch and tail, not bytes; these kernels cut the chain without touching any reduction:

- `add_rms_norm_kernel`: the residual add, then bi_rms_norm_kernel's row, in one program. The add is
  elementwise ((a + b) rounded to the dtype, as torch's add), the normalisation is bi_rms_norm_kernel's
  code line for line (same one-row program, same BLOCK_H and warps, so the same sum tree).
- `head_rms_norm_kernel` + `rope_store_kernel`: the per-head q/k RMSNorms of every head of a row in one
  launch (bi_rms_norm_kernel's code at BLOCK_H = head_dim, the weight chosen by head), then the rotary
  embedding in the model dtype as Hugging Face's eager `q * cos + rotate_half(q) * sin` rounds it (each
  product and the sum rounded to the dtype) and the K/V write into the paged pool, in a second launch.
  Two launches because they need different compiler settings: the norm's must be bi_rms_norm_kernel's
  (FP contraction on, as its sum of squares was compiled), the rotary's must keep every rounding
  (contraction off: the compiler narrows each fp32 op on 16-bit operands to a 16-bit op, which is exact,
  and would then fuse a product into the sum, which is not).
- `grouped_matmul_kernel`: up to three weights that share x (q, k and v) in one launch: a program's
  N tile belongs to one weight and runs bi_matmul_kernel's K loop unchanged (`_split_k_loop`, both
  schedules: one program per tile, or one per tile and split with bi_matmul_combine_kernel after).
- `gate_up_kernel`: gate and up projections of the MLP in one launch (two accumulators over the same
  x tiles, each bi_matmul_kernel's K loop), optionally with torch's `silu(gate) * up` in the epilogue:
  silu as torch computes it for a 16-bit tensor (x / (1 + expf(-x)) in fp32, IEEE division, libdevice's
  expf, rounded to the dtype), then the product rounded. The epilogue's bits are checked against torch
  for every 16-bit input on the GPU (tests/kernels/batch_invariant/test_fused_decode_gpu.py). Its
  split-K schedule writes both partials and `gate_up_combine_kernel` folds them and runs the epilogue.

fp32 models do not take these kernels on GPUs (see fused.py): fp32 sums of products could be contracted
into FMAs by the compiler where torch's separate kernels round each product.
"""
from __future__ import annotations

import triton
import triton.language as tl

from kernels.batch_invariant.triton_kernels import (
    _fold_split,
    _k_range,
    _split_k_loop,
    _store_partial,
    _sum_partials,
)

try:  # libdevice's expf: torch's silu calls expf; the interpreter has no extern functions (it uses tl.exp)
    from triton.language.extra import libdevice as _libdevice
except ImportError:  # pragma: no cover - every Triton this project supports has it
    _libdevice = None


@triton.jit
def _rne(x, out_ty: tl.constexpr, INTERPRETED: tl.constexpr):
    """fp32 x rounded to out_ty to nearest even, as torch rounds an elementwise op's result.

    Compiled, that is the cast. The interpreter truncates fp32 to bf16, so there the rounding is spelled out
    on the bits (finite values), letting the CPU tests compare these kernels with torch's ops bit for bit.
    Roundings inside code copied from the batch-invariant kernels keep their plain cast, so that
    interpreted they match those kernels instead."""
    if INTERPRETED:
        if out_ty == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = bits + 0x7FFF + ((bits >> 16) & 1)
            return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        else:
            return x.to(out_ty)
    else:
        return x.to(out_ty)


@triton.jit
def add_rms_norm_kernel(x_ptr, r_ptr, w_ptr, sum_ptr, out_ptr, stride_x, stride_r, stride_s, stride_o, H, eps,
                        BLOCK_H: tl.constexpr, HAS_RESIDUAL: tl.constexpr, INTERPRETED: tl.constexpr):
    """One row per program: s = x + r (rounded to x's dtype, stored), out = RMSNorm(s) as bi_rms_norm_kernel."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_H)
    ok = offs < H
    x = tl.load(x_ptr + row * stride_x + offs, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + row * stride_r + offs, mask=ok, other=0.0)
        x = _rne(x.to(tl.float32) + r.to(tl.float32), x_ptr.dtype.element_ty, INTERPRETED)
        tl.store(sum_ptr + row * stride_s + offs, x, mask=ok)
    out_ty = out_ptr.dtype.element_ty
    xf = x.to(tl.float32)
    variance = tl.sum(xf * xf, axis=0) / H
    normed = (xf * tl.math.rsqrt(variance + eps)).to(x_ptr.dtype.element_ty)
    w = tl.load(w_ptr + offs, mask=ok, other=0.0)
    y = w.to(tl.float32) * normed.to(out_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, y.to(out_ty), mask=ok)


@triton.jit
def head_rms_norm_kernel(x_ptr, qw_ptr, kw_ptr, out_ptr, stride_x, stride_o, n_heads, D, eps, BLOCK_D: tl.constexpr):
    """Grid (B, n_heads + n_kv): head h of row b of x ([q heads | k heads | ...] of D each) normalised with q's
    weight (h < n_heads) or k's into out[b, h]. bi_rms_norm_kernel's row program line for line (one head per
    program, the same warps for BLOCK_D), so the same sum tree and the same bits."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs = tl.arange(0, BLOCK_D)
    ok = offs < D
    x = tl.load(x_ptr + b * stride_x + h * D + offs, mask=ok, other=0.0).to(tl.float32)
    variance = tl.sum(x * x, axis=0) / D
    normed = (x * tl.math.rsqrt(variance + eps)).to(x_ptr.dtype.element_ty)
    out_ty = out_ptr.dtype.element_ty
    if h < n_heads:
        w = tl.load(qw_ptr + offs, mask=ok, other=0.0)
    else:
        w = tl.load(kw_ptr + offs, mask=ok, other=0.0)
    y = w.to(tl.float32) * normed.to(out_ty).to(tl.float32)
    tl.store(out_ptr + b * stride_o + h * D + offs, y.to(out_ty), mask=ok)


@triton.jit
def _rope(src, cos, sin, offs, partner, ok, HALF, out_ty: tl.constexpr, INTERPRETED: tl.constexpr):
    """src * cos + rotate_half(src) * sin, each product and the sum rounded to out_ty (Hugging Face's eager
    apply_rotary_pos_emb). Launched without FP contraction: the compiler narrows each fp32 op on 16-bit
    operands to a 16-bit op (exact), and would then fuse the products into the sum."""
    y = tl.load(src + offs, mask=ok, other=0.0).to(tl.float32)
    yp = tl.load(src + partner, mask=ok, other=0.0).to(tl.float32)
    # rotate_half: element d < HALF takes -y[d + HALF], element d >= HALF takes y[d - HALF] (negation is exact).
    rot = tl.where(offs < HALF, -yp, yp)
    a = _rne(y * cos.to(tl.float32), out_ty, INTERPRETED)
    b = _rne(rot * sin.to(tl.float32), out_ty, INTERPRETED)
    return _rne(a.to(tl.float32) + b.to(tl.float32), out_ty, INTERPRETED)


@triton.jit
def rope_store_kernel(qk_ptr, v_ptr, cos_ptr, sin_ptr, q_out_ptr, k_pool_ptr, v_pool_ptr, page_ptr, slot_ptr,
                      stride_qk, stride_v, stride_cos, stride_qo_b, stride_qo_h, stride_pool_page, stride_pool_head,
                      stride_pool_slot, n_heads, D, BLOCK_D: tl.constexpr, INTERPRETED: tl.constexpr):
    """Grid (B, n_heads + n_kv). qk row b holds [q heads | k heads] (normalised, or the raw projections), v row b
    the v heads, D each. Program (b, h < n_heads): q head h rotated into q_out[b, h]. Program (b, n_heads + j):
    k head j rotated, and v head j as is, into slot slot_ptr[b] of page page_ptr[b] of the pools."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs = tl.arange(0, BLOCK_D)
    ok = offs < D
    half = D // 2
    partner = tl.where(offs < half, offs + half, offs - half)
    cos = tl.load(cos_ptr + b * stride_cos + offs, mask=ok, other=0.0)
    sin = tl.load(sin_ptr + b * stride_cos + offs, mask=ok, other=0.0)
    out_ty = q_out_ptr.dtype.element_ty
    y = _rope(qk_ptr + b * stride_qk + h * D, cos, sin, offs, partner, ok, half, out_ty, INTERPRETED)
    if h < n_heads:
        tl.store(q_out_ptr + b * stride_qo_b + h * stride_qo_h + offs, y, mask=ok)
    else:
        j = h - n_heads
        page = tl.load(page_ptr + b).to(tl.int64)
        slot = tl.load(slot_ptr + b).to(tl.int64)
        dst = page * stride_pool_page + j * stride_pool_head + slot * stride_pool_slot + offs
        tl.store(k_pool_ptr + dst, y, mask=ok)
        tl.store(v_pool_ptr + dst, tl.load(v_ptr + b * stride_v + j * D + offs, mask=ok, other=0.0), mask=ok)


@triton.jit(do_not_specialize=["M", "N0", "N1", "N2"])
def grouped_matmul_kernel(x_ptr, w0_ptr, w1_ptr, w2_ptr, b0_ptr, b1_ptr, b2_ptr, out_ptr, M, N0, N1, N2, K,
                          stride_xm, stride_xk, stride_w0, stride_w1, stride_w2, stride_wk, stride_om, stride_on,
                          stride_ws_split, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, SPLIT_STEPS: tl.constexpr, PARTIAL: tl.constexpr,
                          DOT_PRECISION: tl.constexpr, INTERPRETED: tl.constexpr):
    """out[:, N0 + N1 + N2] = x @ [w0; w1; w2].T (+ [b0; b1; b2]) without concatenating the weights.

    Program (pid_n, pid_m): pid_n's N tile lies in one weight (tiles never straddle two), whose columns
    land at that weight's offset in out. Each tile is bi_matmul_kernel's (`_split_k_loop`, same K steps and
    splits, same dot). PARTIAL: grid (tiles, M tiles, splits), out_ptr is the fp32 workspace [splits, M,
    N0 + N1 + N2] (no bias: the combine adds it)."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    t0 = (N0 + BLOCK_N - 1) // BLOCK_N
    t1 = (N1 + BLOCK_N - 1) // BLOCK_N
    if pid_n < t0:
        w_ptr, b_ptr, stride_wn, n, tile, col0 = w0_ptr, b0_ptr, stride_w0, N0, pid_n, N0 * 0
    elif pid_n < t0 + t1:
        w_ptr, b_ptr, stride_wn, n, tile, col0 = w1_ptr, b1_ptr, stride_w1, N1, pid_n - t0, N0
    else:
        w_ptr, b_ptr, stride_wn, n, tile, col0 = w2_ptr, b2_ptr, stride_w2, N2, pid_n - t0 - t1, N0 + N1
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < n
    acc = _split_k_loop(x_ptr, w_ptr, offs_m, offs_n, m_ok, n_ok, K, stride_xm, stride_xk, stride_wn, stride_wk,
                        BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_STEPS, PARTIAL, DOT_PRECISION, INTERPRETED)
    if PARTIAL:
        _store_partial(out_ptr, acc, offs_m, col0 + offs_n, m_ok, n_ok, stride_ws_split, stride_om)
    else:
        if HAS_BIAS:
            acc = acc + tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + (col0 + offs_n)[None, :] * stride_on
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _silu_times(g, u, out_ty: tl.constexpr, INTERPRETED: tl.constexpr):
    """torch's `silu(g) * u` for g, u in out_ty: silu in fp32 (x / (1 + expf(-x)), IEEE division) rounded to
    out_ty, then the product rounded to out_ty."""
    gf = g.to(tl.float32)
    if INTERPRETED:
        e = tl.exp(-gf)
    else:
        e = _libdevice.exp(-gf)
    s = _rne(tl.math.div_rn(gf, 1.0 + e), out_ty, INTERPRETED)
    return _rne(s.to(tl.float32) * u.to(tl.float32), out_ty, INTERPRETED)


@triton.jit
def _matmul_step2(acc_g, acc_u, x_ptrs, wg_ptrs, wu_ptrs, kb, K, m_ok, n_ok, offs_k, BLOCK_K: tl.constexpr,
                  DOT_PRECISION: tl.constexpr, INTERPRETED: tl.constexpr):
    """_matmul_step for two weights sharing one x tile: each accumulator gets the same dot as alone."""
    k_ok = offs_k < K - kb * BLOCK_K
    a = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
    bg = tl.load(wg_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
    bu = tl.load(wu_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
    if INTERPRETED:
        a = a.to(tl.float32)
        bg = bg.to(tl.float32)
        bu = bu.to(tl.float32)
    return tl.dot(a, bg, acc_g, input_precision=DOT_PRECISION), tl.dot(a, bu, acc_u, input_precision=DOT_PRECISION)


@triton.jit(do_not_specialize=["M"])
def gate_up_kernel(x_ptr, wg_ptr, wu_ptr, out_ptr, M, N, K, stride_xm, stride_xk, stride_wgn, stride_wun, stride_wk,
                   stride_om, stride_on, stride_ws_split, SILU_MUL: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_STEPS: tl.constexpr, PARTIAL: tl.constexpr,
                   DOT_PRECISION: tl.constexpr, INTERPRETED: tl.constexpr):
    """SILU_MUL: out[M, N] = silu(x @ wg.T) * (x @ wu.T), each product rounded to the dtype first (torch's
    eager MLP). Otherwise out[M, 2N] = [x @ wg.T | x @ wu.T]. Each accumulator is bi_matmul_kernel's: the
    same K steps, splits and dots (`_split_k_loop`'s order), the x tile of a step loaded once for both.
    PARTIAL: grid (N tiles, M tiles, splits), out_ptr is the fp32 workspace [splits, M, 2N] (gate's partials,
    then up's) for gate_up_combine_kernel."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    n_k = (K + BLOCK_K - 1) // BLOCK_K
    lo, hi = _k_range(n_k, SPLIT_STEPS, PARTIAL)
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + (lo * BLOCK_K + offs_k)[None, :] * stride_xk
    wg_ptrs = wg_ptr + offs_n[None, :].to(tl.int64) * stride_wgn + (lo * BLOCK_K + offs_k)[:, None] * stride_wk
    wu_ptrs = wu_ptr + offs_n[None, :].to(tl.int64) * stride_wun + (lo * BLOCK_K + offs_k)[:, None] * stride_wk
    tot_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    tot_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if INTERPRETED:
        kb = lo
        while kb < hi:
            acc_g, acc_u = _matmul_step2(acc_g, acc_u, x_ptrs + (kb - lo) * BLOCK_K * stride_xk,
                                         wg_ptrs + (kb - lo) * BLOCK_K * stride_wk,
                                         wu_ptrs + (kb - lo) * BLOCK_K * stride_wk,
                                         kb, K, m_ok, n_ok, offs_k, BLOCK_K, DOT_PRECISION, INTERPRETED)
            if SPLIT_STEPS > 0 and not PARTIAL:
                tot_g, acc_g = _fold_split(tot_g, acc_g, kb, n_k, SPLIT_STEPS)
                tot_u, acc_u = _fold_split(tot_u, acc_u, kb, n_k, SPLIT_STEPS)
            kb += 1
    else:
        for kb in range(lo, hi):
            acc_g, acc_u = _matmul_step2(acc_g, acc_u, x_ptrs, wg_ptrs, wu_ptrs, kb, K, m_ok, n_ok, offs_k, BLOCK_K,
                                         DOT_PRECISION, INTERPRETED)
            if SPLIT_STEPS > 0 and not PARTIAL:
                tot_g, acc_g = _fold_split(tot_g, acc_g, kb, n_k, SPLIT_STEPS)
                tot_u, acc_u = _fold_split(tot_u, acc_u, kb, n_k, SPLIT_STEPS)
            x_ptrs += BLOCK_K * stride_xk
            wg_ptrs += BLOCK_K * stride_wk
            wu_ptrs += BLOCK_K * stride_wk
    if PARTIAL:
        _store_partial(out_ptr, acc_g, offs_m, offs_n, m_ok, n_ok, stride_ws_split, stride_om)
        _store_partial(out_ptr, acc_u, offs_m, N + offs_n, m_ok, n_ok, stride_ws_split, stride_om)
    else:
        if SPLIT_STEPS > 0:
            acc_g = tot_g
            acc_u = tot_u
        _gate_up_epilogue(out_ptr, acc_g, acc_u, offs_m[:, None].to(tl.int64) * stride_om, offs_n, N, stride_on,
                          m_ok[:, None] & n_ok[None, :], SILU_MUL, INTERPRETED)


@triton.jit
def _gate_up_epilogue(out_ptr, acc_g, acc_u, row_offs, offs_n, N, stride_on, mask, SILU_MUL: tl.constexpr,
                      INTERPRETED: tl.constexpr):
    """The fp32 gate and up sums rounded to out's dtype, then silu(g) * u or both stored side by side."""
    out_ty = out_ptr.dtype.element_ty
    g = acc_g.to(out_ty)
    u = acc_u.to(out_ty)
    rows = out_ptr + row_offs
    if SILU_MUL:
        tl.store(rows + offs_n[None, :] * stride_on, _silu_times(g, u, out_ty, INTERPRETED), mask=mask)
    else:
        tl.store(rows + offs_n[None, :] * stride_on, g, mask=mask)
        tl.store(rows + (N + offs_n)[None, :] * stride_on, u, mask=mask)


@triton.jit(do_not_specialize=["M", "n_splits"])
def gate_up_combine_kernel(ws_ptr, out_ptr, M, N, n_splits, stride_ws_split, stride_ws_m, stride_om,
                           SILU_MUL: tl.constexpr, BLOCK_C: tl.constexpr, INTERPRETED: tl.constexpr):
    """Split-K second pass of gate_up_kernel, grid (cdiv(N, BLOCK_C), M): gate's and up's partials summed from
    zero in split order (bi_matmul_combine_kernel's adds), then gate_up_kernel's epilogue."""
    row = tl.program_id(1).to(tl.int64)
    offs = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    ok = offs < N
    base = ws_ptr + row * stride_ws_m
    g = _sum_partials(base, offs, ok, n_splits, stride_ws_split, BLOCK_C)
    u = _sum_partials(base + N, offs, ok, n_splits, stride_ws_split, BLOCK_C)
    _gate_up_epilogue(out_ptr, g[None, :], u[None, :], row * stride_om, offs, N, 1, ok[None, :], SILU_MUL,
                      INTERPRETED)
