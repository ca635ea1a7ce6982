"""Batch-invariant Triton kernels: matmul, RMSNorm, and one attention kernel for packed prefill and decode.

What makes a row's bits independent of the batch is that nothing about a row's arithmetic is a
function of the number of rows: tile sizes, warps and stages are fixed per dtype (launchers in
triton_launch.py, no autotune), a row is never reduced with another row, and the row count is
`do_not_specialize` (Triton would otherwise compile M == 1 or M % 16 == 0 as its own variant).

Matmul: K is reduced in fixed splits of reference.SPLIT_K elements, each split's partial folded into
the total in split order. One program may run every split of its tile (`_split_k_loop`, the trainer's
and large batches' schedule), or the split-K schedule runs one program per (tile, split), each writing
its fp32 partial, and `bi_matmul_combine_kernel` folds them from zero in split order: the same fp32 adds
in the same order, so a row's bits do not depend on the schedule (nor, as before, on the batch).

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


@triton.jit
def _fold_split(total, part, kb, n_k, SPLIT_STEPS: tl.constexpr):
    """After K step kb: at the last step of a split (or of K) the split's partial joins the total (an fp32
    add, as the split-K combine does it) and restarts from zero. Selected, not branched: the loop stays one
    software-pipelined loop over all of K."""
    done = ((kb + 1) % SPLIT_STEPS == 0) | (kb + 1 == n_k)
    return tl.where(done, total + part, total), tl.where(done, 0.0, part)


@triton.jit
def _k_range(n_k, SPLIT_STEPS: tl.constexpr, PARTIAL: tl.constexpr):
    """The K steps [lo, hi) a program reduces: its split's (PARTIAL: split = program_id(2)), else all of K."""
    if PARTIAL:
        lo = tl.program_id(2) * SPLIT_STEPS
        return lo, tl.minimum(lo + SPLIT_STEPS, n_k)
    else:
        return n_k * 0, n_k


@triton.jit
def _split_k_loop(x_ptr, w_ptr, offs_m, offs_n, m_ok, n_ok, K, stride_xm, stride_xk, stride_wn, stride_wk,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_STEPS: tl.constexpr,
                  PARTIAL: tl.constexpr, DOT_PRECISION: tl.constexpr, INTERPRETED: tl.constexpr):
    """One [BLOCK_M, BLOCK_N] tile's reduction over K in BLOCK_K steps (reference.split_k_sum's order).

    SPLIT_STEPS > 0: steps are grouped in splits of SPLIT_STEPS (= SPLIT_K / BLOCK_K); each split accumulates
    from zero through one MMA chain and is folded into the total in split order (`_fold_split`).
    PARTIAL: only split program_id(2), returned unfolded (the split-K schedule's first pass; its combine
    folds the partials from zero in split order: the same adds). SPLIT_STEPS = 0: one chain over all of K,
    the order before split-K (kept as the benchmark's baseline, bench/decode_step_profile.py --matmul legacy)."""
    offs_k = tl.arange(0, BLOCK_K)
    n_k = (K + BLOCK_K - 1) // BLOCK_K
    lo, hi = _k_range(n_k, SPLIT_STEPS, PARTIAL)
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + (lo * BLOCK_K + offs_k)[None, :] * stride_xk
    w_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + (lo * BLOCK_K + offs_k)[:, None] * stride_wk
    total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if INTERPRETED:
        kb = lo
        while kb < hi:
            part = _matmul_step(part, x_ptrs + (kb - lo) * BLOCK_K * stride_xk,
                                w_ptrs + (kb - lo) * BLOCK_K * stride_wk, kb, K, m_ok, n_ok, offs_k, BLOCK_K,
                                DOT_PRECISION, INTERPRETED)
            if SPLIT_STEPS > 0 and not PARTIAL:
                total, part = _fold_split(total, part, kb, n_k, SPLIT_STEPS)
            kb += 1
    else:
        for kb in range(lo, hi):
            part = _matmul_step(part, x_ptrs, w_ptrs, kb, K, m_ok, n_ok, offs_k, BLOCK_K, DOT_PRECISION, INTERPRETED)
            if SPLIT_STEPS > 0 and not PARTIAL:
                total, part = _fold_split(total, part, kb, n_k, SPLIT_STEPS)
            x_ptrs += BLOCK_K * stride_xk
            w_ptrs += BLOCK_K * stride_wk
    if SPLIT_STEPS > 0 and not PARTIAL:
        return total
    else:
        return part


@triton.jit
def _store_partial(ws_ptr, acc, offs_m, cols, m_ok, n_ok, stride_ws_split, stride_ws_m):
    """A split's fp32 partial of a tile into the workspace [splits, M, columns] at split program_id(2)."""
    split = tl.program_id(2).to(tl.int64)
    ptrs = ws_ptr + split * stride_ws_split + offs_m[:, None].to(tl.int64) * stride_ws_m + cols[None, :]
    tl.store(ptrs, acc, mask=m_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["M"])
def bi_matmul_kernel(x_ptr, w_ptr, b_ptr, out_ptr, M, N, K,
                     stride_xm, stride_xk, stride_wn, stride_wk, stride_om, stride_on, stride_ws_split,
                     HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     SPLIT_STEPS: tl.constexpr, PARTIAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
                     INTERPRETED: tl.constexpr):
    """out[M, N] = x[M, K] @ w[N, K].T (+ b): fp32 accumulation over K split by split (`_split_k_loop`), bias
    added after. Grid (N tiles, M tiles), or PARTIAL: (N tiles, M tiles, splits) writing split partials into
    out_ptr as an fp32 workspace [splits, M, N] (rows stride_om, splits stride_ws_split) for
    bi_matmul_combine_kernel, which adds the bias."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    acc = _split_k_loop(x_ptr, w_ptr, offs_m, offs_n, m_ok, n_ok, K, stride_xm, stride_xk, stride_wn, stride_wk,
                        BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_STEPS, PARTIAL, DOT_PRECISION, INTERPRETED)
    if PARTIAL:
        _store_partial(out_ptr, acc, offs_m, offs_n, m_ok, n_ok, stride_ws_split, stride_om)
    else:
        if HAS_BIAS:
            acc = acc + tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :] * stride_on
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _sum_partials(ws_ptr, offs, ok, n_splits, stride_ws_split, BLOCK_C: tl.constexpr):
    """A row's fp32 total from the split partials at offsets `offs` of each split: zero, then + each in order."""
    total = tl.zeros((BLOCK_C,), dtype=tl.float32)
    split = 0
    while split < n_splits:
        total = total + tl.load(ws_ptr + split * stride_ws_split + offs, mask=ok, other=0.0)
        split += 1
    return total


@triton.jit(do_not_specialize=["M", "n_splits"])
def bi_matmul_combine_kernel(ws_ptr, b_ptr, out_ptr, M, N, n_splits, stride_ws_split, stride_ws_m, stride_om,
                             HAS_BIAS: tl.constexpr, BLOCK_C: tl.constexpr):
    """Split-K second pass, grid (cdiv(N, BLOCK_C), M): out[m, n] = sum of the partials in split order from
    zero (`_sum_partials`, the adds `_fold_split` does inline) (+ b[n]), rounded to out's dtype."""
    row = tl.program_id(1).to(tl.int64)
    offs = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    ok = offs < N
    acc = _sum_partials(ws_ptr + row * stride_ws_m, offs, ok, n_splits, stride_ws_split, BLOCK_C)
    if HAS_BIAS:
        acc = acc + tl.load(b_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_om + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


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
def _fold(m_t, l_t, acc_t, m_c, l_c, acc_c, active):
    """Fold one split's partial into a row's total (reference._fold); inactive rows keep their total.

    Explicit FMAs: the fold runs inline in the attention kernel and in the split-KV combine kernel,
    and a multiply-add the compiler may or may not contract could round differently in the two."""
    m_new = tl.maximum(m_t, m_c)
    a = tl.exp2(m_t - m_new)
    b = tl.exp2(m_c - m_new)
    l_new = tl.fma(l_t, a, l_c * b)
    acc_new = tl.fma(acc_t, a[:, None], acc_c * b[:, None])
    return (tl.where(active, m_new, m_t), tl.where(active, l_new, l_t), tl.where(active[:, None], acc_new, acc_t))


@triton.jit
def _split_keys(q, k_base, v_base, table_row, stride_page, stride_kn, n_valid, key_limit, blk_lo, blk_hi, qk_scale,
                HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                PAGED: tl.constexpr, DOT_PRECISION: tl.constexpr, INTERPRETED: tl.constexpr):
    """One split: a fresh online softmax over key blocks [blk_lo, blk_hi). Returns its partial (m, l, acc)."""
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    if INTERPRETED:
        blk = blk_lo
        while blk < blk_hi:
            kb, vb = _block_bases(k_base, v_base, table_row, stride_page, stride_kn, blk, BLOCK_N, PAGED)
            m_i, l_i, acc = _key_block(m_i, l_i, acc, q, kb, vb, stride_kn, n_valid, key_limit, blk,
                                       qk_scale, HEAD_DIM, BLOCK_D, BLOCK_N, DOT_PRECISION, INTERPRETED)
            blk += 1
    else:
        for blk in range(blk_lo, blk_hi):
            kb, vb = _block_bases(k_base, v_base, table_row, stride_page, stride_kn, blk, BLOCK_N, PAGED)
            m_i, l_i, acc = _key_block(m_i, l_i, acc, q, kb, vb, stride_kn, n_valid, key_limit, blk,
                                       qk_scale, HEAD_DIM, BLOCK_D, BLOCK_N, DOT_PRECISION, INTERPRETED)
    return m_i, l_i, acc


@triton.jit
def _attend_keys(q, k_base, v_base, table_row, stride_page, stride_kn, n_valid, key_limit, n_blocks, qk_scale,
                 HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 SPLIT_BLOCKS: tl.constexpr, PAGED: tl.constexpr, DOT_PRECISION: tl.constexpr,
                 INTERPRETED: tl.constexpr):
    """Online softmax of BLOCK_M query rows over keys [0, n_blocks * BLOCK_N) of one kv head, split by split.

    q [BLOCK_M, BLOCK_D] in the input dtype (head dims >= HEAD_DIM zero); row r sees keys j < n_valid[r];
    keys j >= key_limit are not loaded (0). PAGED: key block `blk` lives in page table_row[blk] of the
    pool (k_base/v_base point at page 0 of the kv head): only the addresses differ, never the arithmetic.
    Every SPLIT_BLOCKS blocks the softmax restarts and the split's partial is folded into the total, as
    the split-KV decode's combine folds the partials its programs wrote. Returns (acc, l), both fp32.
    """
    m_t = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_t = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc_t = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    if INTERPRETED:
        lo = 0
        while lo < n_blocks:
            m_i, l_i, acc = _split_keys(q, k_base, v_base, table_row, stride_page, stride_kn, n_valid, key_limit,
                                        lo, tl.minimum(lo + SPLIT_BLOCKS, n_blocks), qk_scale, HEAD_DIM, BLOCK_D,
                                        BLOCK_M, BLOCK_N, PAGED, DOT_PRECISION, INTERPRETED)
            m_t, l_t, acc_t = _fold(m_t, l_t, acc_t, m_i, l_i, acc, n_valid > lo * BLOCK_N)
            lo += SPLIT_BLOCKS
    else:
        for lo in range(0, n_blocks, SPLIT_BLOCKS):
            m_i, l_i, acc = _split_keys(q, k_base, v_base, table_row, stride_page, stride_kn, n_valid, key_limit,
                                        lo, tl.minimum(lo + SPLIT_BLOCKS, n_blocks), qk_scale, HEAD_DIM, BLOCK_D,
                                        BLOCK_M, BLOCK_N, PAGED, DOT_PRECISION, INTERPRETED)
            m_t, l_t, acc_t = _fold(m_t, l_t, acc_t, m_i, l_i, acc, n_valid > lo * BLOCK_N)
    return acc_t, l_t


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
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_BLOCKS: tl.constexpr,
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
                            n_blocks, qk_scale, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, SPLIT_BLOCKS, PAGED,
                            DOT_PRECISION, INTERPRETED)
    out = acc / tl.where(row_ok, l_i, 1.0)[:, None]
    tl.store(o_rows + offs_d[None, :], out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _decode_rows(pid_s, kv_head, tile, seq_ptr, cap, GROUP: tl.constexpr, BLOCK_M: tl.constexpr):
    """A decode program's query rows: the query heads [tile * BLOCK_M, ...) of one kv head of batch row pid_s."""
    length = tl.minimum(tl.load(seq_ptr + pid_s), cap)
    offs_r = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_r < GROUP
    return length, offs_r, row_ok, tl.where(row_ok, length, 0)


@triton.jit(do_not_specialize=["cap"])
def bi_decode_split_kernel(q_ptr, k_ptr, v_ptr, seq_ptr, table_ptr, m_ptr, l_ptr, acc_ptr,
                           stride_qt, stride_qh, stride_kb, stride_kh, stride_kn, stride_tb, cap, qk_scale,
                           N_KV: tl.constexpr, SLOTS: tl.constexpr, TILES: tl.constexpr,
                           GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_BLOCKS: tl.constexpr,
                           PAGED: tl.constexpr, DOT_PRECISION: tl.constexpr, INTERPRETED: tl.constexpr):
    """Split-KV decode, first pass: one program per (split, row tile) x batch row x kv head.

    Grid (SLOTS * TILES, B, N_KV). Each program runs `_split_keys` over its split's key blocks exactly as
    `_attend_keys` does inline, and writes the partial (m, l, acc) of its query heads to the workspace
    [B, N_KV, SLOTS, GROUP] (m, l) and [B, N_KV, SLOTS, GROUP, HEAD_DIM] (acc). Splits past a row's
    length write nothing; the combine never reads them. Caches as bi_attention_kernel's decode.
    """
    split = tl.program_id(0) // TILES
    tile = tl.program_id(0) % TILES
    pid_s = tl.program_id(1)
    kv_head = tl.program_id(2)
    length, offs_r, row_ok, n_valid = _decode_rows(pid_s, kv_head, tile, seq_ptr, cap, GROUP, BLOCK_M)
    n_blocks = (length + BLOCK_N - 1) // BLOCK_N
    lo = split * SPLIT_BLOCKS
    if lo >= n_blocks:
        return
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_r
    q = tl.load(q_ptr + pid_s.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if PAGED:
        kv_off = kv_head.to(tl.int64) * stride_kh
    else:
        kv_off = pid_s.to(tl.int64) * stride_kb + kv_head * stride_kh
    table_row = table_ptr + pid_s.to(tl.int64) * stride_tb
    m_i, l_i, acc = _split_keys(q, k_ptr + kv_off, v_ptr + kv_off, table_row, stride_kb, stride_kn, n_valid, length,
                                lo, tl.minimum(lo + SPLIT_BLOCKS, n_blocks), qk_scale, HEAD_DIM, BLOCK_D, BLOCK_M,
                                BLOCK_N, PAGED, DOT_PRECISION, INTERPRETED)
    slot = ((pid_s.to(tl.int64) * N_KV + kv_head) * SLOTS + split) * GROUP
    tl.store(m_ptr + slot + offs_r, m_i, mask=row_ok)
    tl.store(l_ptr + slot + offs_r, l_i, mask=row_ok)
    tl.store(acc_ptr + (slot + offs_r[:, None]) * HEAD_DIM + offs_d[None, :], acc, mask=row_ok[:, None] & d_ok[None, :])


@triton.jit(do_not_specialize=["cap"])
def bi_decode_combine_kernel(seq_ptr, m_ptr, l_ptr, acc_ptr, o_ptr, stride_ot, stride_oh, cap,
                             N_KV: tl.constexpr, SLOTS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                             BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                             SPLIT_BLOCKS: tl.constexpr):
    """Split-KV decode, second pass: grid (TILES, B, N_KV); folds a row's partials from split 0 upward with
    `_fold`, the arithmetic `_attend_keys` applies inline, then normalises as bi_attention_kernel does."""
    tile = tl.program_id(0)
    pid_s = tl.program_id(1)
    kv_head = tl.program_id(2)
    length, offs_r, row_ok, n_valid = _decode_rows(pid_s, kv_head, tile, seq_ptr, cap, GROUP, BLOCK_M)
    n_splits = (length + SPLIT_BLOCKS * BLOCK_N - 1) // (SPLIT_BLOCKS * BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    ok = row_ok[:, None] & d_ok[None, :]
    m_t = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_t = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc_t = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    split = 0
    while split < n_splits:
        slot = ((pid_s.to(tl.int64) * N_KV + kv_head) * SLOTS + split) * GROUP
        m_c = tl.load(m_ptr + slot + offs_r, mask=row_ok, other=float("-inf"))
        l_c = tl.load(l_ptr + slot + offs_r, mask=row_ok, other=0.0)
        acc_c = tl.load(acc_ptr + (slot + offs_r[:, None]) * HEAD_DIM + offs_d[None, :], mask=ok, other=0.0)
        m_t, l_t, acc_t = _fold(m_t, l_t, acc_t, m_c, l_c, acc_c, n_valid > split * SPLIT_BLOCKS * BLOCK_N)
        split += 1
    out = acc_t / tl.where(row_ok, l_t, 1.0)[:, None]
    heads = kv_head * GROUP + offs_r
    tl.store(o_ptr + pid_s.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=ok)
