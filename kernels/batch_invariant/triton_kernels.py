"""Batch-invariant Triton kernels: matmul, RMSNorm, and one attention kernel for packed prefill and decode.

What makes a row's bits independent of the batch is that nothing about a row's arithmetic is a
function of the number of rows: tile sizes, warps and stages are fixed per dtype (launchers in
triton_launch.py, no autotune), there is no split-K, a row is never reduced with another row,
and the row count is `do_not_specialize` (Triton would otherwise compile M == 1 or M % 16 == 0
as its own variant).

Attention: `bi_attention_kernel` serves both entry points; the DECODE constexpr only changes how
a program finds its query rows and its keys. Every program holds BLOCK_M query rows (packed:
consecutive positions of one head; decode: the query heads of one kv head, rows beyond the
group masked) and calls the same `_attend_keys` loop: keys in BLOCK_N (= KEY_BLOCK) blocks from
the sequence's first key, the same two tl.dot shapes, an online softmax in fp32. A row whose
valid keys all lie before a block (its n_valid <= the block's first key) keeps its state
through that block by selection (tl.where), not by arithmetic that happens to be exact, so the
packed program, which walks to the block of its last row, and the decode program, which stops
at its own last block, produce the same bits for a token. Keys at or beyond a sequence's end
are loaded as 0 (never read), so NaN in a cache tail cannot reach a result.

INTERPRETED (Triton's interpreter, the CPU tests) changes three things. Dot operands go to fp32
first: the interpreter keeps bf16 as raw uint16 and cannot multiply it (the cast is exact;
products and fp32 sums then model the MMA). The cast is written inline under `if INTERPRETED:`
(no code when compiled) because every call of a jit helper costs the interpreter a re-patch of
triton.language, about as much as the rest of a key block. Loops are `while` loops: the
interpreter cannot run `range` over a runtime bound, and the compiled kernels keep the `for`
loops Triton software-pipelines. And tl.dot is numpy's matmul there, whose BLAS may order a row's
K sum by the row's position in the tile (OpenBLAS does on AVX2-only CPUs), so interpreted rows
are batch-invariant only with a dot that reduces every output alike: the CPU tests install one
(tests/kernels/interpreted_dot.py; docs/testing.md, "Interpreted Triton kernels on CPU").
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _matmul_step(acc, x_ptrs, w_ptrs, kb, K, m_ok, n_ok, offs_k, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
                 INTERPRETED: tl.constexpr):
    k_ok = offs_k < K - kb * BLOCK_K
    a = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
    b = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
    if INTERPRETED:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision=DOT_PRECISION)


@triton.jit(do_not_specialize=["M"])
def bi_matmul_kernel(x_ptr, w_ptr, b_ptr, out_ptr, M, N, K,
                     stride_xm, stride_xk, stride_wn, stride_wk, stride_om, stride_on,
                     HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     DOT_PRECISION: tl.constexpr, INTERPRETED: tl.constexpr):
    """out[M, N] = x[M, K] @ w[N, K].T (+ b), fp32 accumulation over K in BLOCK_K steps, bias added after."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :] * stride_xk
    w_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None] * stride_wk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    n_k = (K + BLOCK_K - 1) // BLOCK_K
    if INTERPRETED:
        kb = 0
        while kb < n_k:
            acc = _matmul_step(acc, x_ptrs + kb * BLOCK_K * stride_xk, w_ptrs + kb * BLOCK_K * stride_wk, kb, K,
                               m_ok, n_ok, offs_k, BLOCK_K, DOT_PRECISION, INTERPRETED)
            kb += 1
    else:
        for kb in range(0, n_k):
            acc = _matmul_step(acc, x_ptrs, w_ptrs, kb, K, m_ok, n_ok, offs_k, BLOCK_K, DOT_PRECISION, INTERPRETED)
            x_ptrs += BLOCK_K * stride_xk
            w_ptrs += BLOCK_K * stride_wk
    if HAS_BIAS:
        acc = acc + tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :] * stride_on
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def bi_rms_norm_kernel(x_ptr, w_ptr, out_ptr, stride_x, stride_o, H, eps, BLOCK_H: tl.constexpr):
    """One row per program: out = w * (x.float() * rsqrt(mean(x^2) + eps)).to(x.dtype), in out's dtype."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_H)
    ok = offs < H
    x = tl.load(x_ptr + row * stride_x + offs, mask=ok, other=0.0).to(tl.float32)
    variance = tl.sum(x * x, axis=0) / H
    normed = (x * tl.math.rsqrt(variance + eps)).to(x_ptr.dtype.element_ty)
    out_ty = out_ptr.dtype.element_ty
    w = tl.load(w_ptr + offs, mask=ok, other=0.0)
    # The product of two 16-bit floats is exact in fp32, so this is the 16-bit multiply, rounded once.
    y = w.to(tl.float32) * normed.to(out_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, y.to(out_ty), mask=ok)


@triton.jit
def _key_block(m_i, l_i, acc, q, k_base, v_base, stride_kn, n_valid, key_limit, blk, qk_scale,
               HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
               INTERPRETED: tl.constexpr):
    """One KEY_BLOCK block of the online softmax; rows with no valid key in it keep their state."""
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    lo = blk * BLOCK_N
    offs_n = lo + tl.arange(0, BLOCK_N)
    load_ok = offs_n < key_limit
    k = tl.load(k_base + offs_n[None, :].to(tl.int64) * stride_kn + offs_d[:, None],
                mask=load_ok[None, :] & d_ok[:, None], other=0.0)  # [BLOCK_D, BLOCK_N]
    if INTERPRETED:
        q = q.to(tl.float32)
        k = k.to(tl.float32)
    s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale
    s = tl.where(offs_n[None, :] < n_valid[:, None], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_new = l_i * alpha + tl.sum(p, axis=1)
    v = tl.load(v_base + offs_n[:, None].to(tl.int64) * stride_kn + offs_d[None, :],
                mask=load_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
    p_v = p.to(v.dtype)  # the probabilities in v's dtype, as the MMA takes them
    if INTERPRETED:
        p_v = p_v.to(tl.float32)
        v = v.to(tl.float32)
    pv = tl.dot(p_v, v, input_precision=DOT_PRECISION)
    acc_new = acc * alpha[:, None] + pv
    active = n_valid > lo
    return (tl.where(active, m_new, m_i), tl.where(active, l_new, l_i), tl.where(active[:, None], acc_new, acc))


@triton.jit
def _attend_keys(q, k_base, v_base, table_row, stride_page, stride_kn, n_valid, key_limit, n_blocks, qk_scale,
                 HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 PAGED: tl.constexpr, DOT_PRECISION: tl.constexpr, INTERPRETED: tl.constexpr):
    """Online softmax of BLOCK_M query rows over keys [0, n_blocks * BLOCK_N) of one kv head.

    q [BLOCK_M, BLOCK_D] in the input dtype (head dims >= HEAD_DIM zero); row r sees keys j < n_valid[r];
    keys j >= key_limit are not loaded (0). PAGED: key block `blk` lives in page table_row[blk] of the
    pool (k_base/v_base point at page 0 of the kv head): only the addresses differ, never the arithmetic.
    Returns (acc [BLOCK_M, BLOCK_D] fp32, l [BLOCK_M] fp32).
    """
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    if INTERPRETED:
        blk = 0
        while blk < n_blocks:
            kb, vb = _block_bases(k_base, v_base, table_row, stride_page, stride_kn, blk, BLOCK_N, PAGED)
            m_i, l_i, acc = _key_block(m_i, l_i, acc, q, kb, vb, stride_kn, n_valid, key_limit, blk,
                                       qk_scale, HEAD_DIM, BLOCK_D, BLOCK_N, DOT_PRECISION, INTERPRETED)
            blk += 1
    else:
        for blk in range(0, n_blocks):
            kb, vb = _block_bases(k_base, v_base, table_row, stride_page, stride_kn, blk, BLOCK_N, PAGED)
            m_i, l_i, acc = _key_block(m_i, l_i, acc, q, kb, vb, stride_kn, n_valid, key_limit, blk,
                                       qk_scale, HEAD_DIM, BLOCK_D, BLOCK_N, DOT_PRECISION, INTERPRETED)
    return acc, l_i


@triton.jit
def _block_bases(k_base, v_base, table_row, stride_page, stride_kn, blk, BLOCK_N: tl.constexpr,
                 PAGED: tl.constexpr):
    """Where key block `blk` starts, shifted back by blk * BLOCK_N slots so `_key_block`'s own offsets
    (blk * BLOCK_N + j) land on slot j of the block's page."""
    if PAGED:
        page = tl.load(table_row + blk).to(tl.int64)
        shift = page * stride_page - (blk * BLOCK_N).to(tl.int64) * stride_kn
        return k_base + shift, v_base + shift
    else:
        return k_base, v_base


@triton.jit(do_not_specialize=["cap"])
def bi_attention_kernel(q_ptr, k_ptr, v_ptr, o_ptr, seq_ptr, start_ptr, table_ptr,
                        stride_qt, stride_qh, stride_ot, stride_oh,
                        stride_kb, stride_kh, stride_kn, stride_tb, cap, qk_scale,
                        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        DECODE: tl.constexpr, PAGED: tl.constexpr, DOT_PRECISION: tl.constexpr,
                        INTERPRETED: tl.constexpr):
    """Causal attention; k and v share strides (the launcher checks).

    Packed (DECODE=False, PAGED=False): grid (cdiv(max_seqlen, BLOCK_M), S, H); seq_ptr is cu_seqlens;
    q/o rows are tokens (stride_qt), k/v are [T, Hkv, D] (stride_kn per token, stride_kb unused).
    Decode (DECODE=True, PAGED=False): grid (cdiv(GROUP, BLOCK_M), B, Hkv); seq_ptr is lengths; q/o rows
    are batch rows, k/v caches are [B, Hkv, cap, D] (stride_kb per batch row, stride_kn per slot).
    Paged (PAGED=True): k/v are a pool [pages, Hkv, BLOCK_N, D] (stride_kb per page); table_ptr holds
    each sequence's pages in key-block order (stride_tb per sequence). Paged decode as decode, at most
    `cap` keys. Paged prefill (DECODE=False): as packed, but query token i of sequence s sits at position
    start_ptr[s] + i - cu_seqlens[s] and attends the pool's keys [0, position].
    """
    pid_m = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_h = tl.program_id(2)
    offs_r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    table_row = table_ptr + pid_s.to(tl.int64) * stride_tb
    if DECODE:
        length = tl.minimum(tl.load(seq_ptr + pid_s), cap)
        kv_head = pid_h
        row_ok = offs_r < GROUP
        heads = kv_head * GROUP + offs_r
        q_rows = q_ptr + pid_s.to(tl.int64) * stride_qt + heads[:, None] * stride_qh
        o_rows = o_ptr + pid_s.to(tl.int64) * stride_ot + heads[:, None] * stride_oh
        n_valid = tl.where(row_ok, length, 0)
        if PAGED:
            kv_off = kv_head.to(tl.int64) * stride_kh
        else:
            kv_off = pid_s.to(tl.int64) * stride_kb + kv_head * stride_kh
        key_limit = length
        n_blocks = (length + BLOCK_N - 1) // BLOCK_N
    else:
        start = tl.load(seq_ptr + pid_s)
        length = tl.load(seq_ptr + pid_s + 1) - start
        if pid_m * BLOCK_M >= length:
            return
        kv_head = pid_h // GROUP
        row_ok = offs_r < length
        tokens = (start + offs_r).to(tl.int64)
        q_rows = q_ptr + tokens[:, None] * stride_qt + pid_h * stride_qh
        o_rows = o_ptr + tokens[:, None] * stride_ot + pid_h * stride_oh
        if PAGED:
            first = tl.load(start_ptr + pid_s)  # position of the sequence's first query token
            kv_off = kv_head.to(tl.int64) * stride_kh
        else:
            first = 0
            kv_off = start.to(tl.int64) * stride_kn + kv_head * stride_kh
        n_valid = tl.where(row_ok, first + offs_r + 1, 0)
        key_limit = first + length
        n_blocks = (first + tl.minimum(length, (pid_m + 1) * BLOCK_M) + BLOCK_N - 1) // BLOCK_N
    q = tl.load(q_rows + offs_d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    acc, l_i = _attend_keys(q, k_ptr + kv_off, v_ptr + kv_off, table_row, stride_kb, stride_kn, n_valid, key_limit,
                            n_blocks, qk_scale, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, PAGED, DOT_PRECISION,
                            INTERPRETED)
    out = acc / tl.where(row_ok, l_i, 1.0)[:, None]
    tl.store(o_rows + offs_d[None, :], out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
