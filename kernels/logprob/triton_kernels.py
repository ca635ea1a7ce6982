"""Triton kernels of the log-prob definition: one source for CUDA and ROCm (wave64 on MI300).

Nothing here assumes a warp size; reductions are `tl.max`/`tl.sum` over a
block whose shape is fixed by the vocab, so each tile's reduction order is fixed
for a given vocab, dtype and device -- independent of how many rows are in the
batch or how the vocab is sharded (when shards fall on tile bounds).

Kept beside reference.py, which defines the same three steps in pure torch;
tests compare the two. The AOT signatures at the bottom are what
`python -m kernels.check_targets` compiles for gfx942 and sm_90.
"""
from __future__ import annotations

import triton
import triton.language as tl


LOG2E = tl.constexpr(1.4426950408889634)


# What the JIT may specialize on. Every integer that changes from call to call (the row count, the
# slot stride of the merge, the upstream gradient's row stride) is `do_not_specialize`, and every
# pointer but the logits' and the gradient's is `do_not_specialize_on_alignment` (scratch views
# and user tensors whose offsets vary; those accesses are one scalar per row anyway). Everything
# else the JIT specializes on is fixed by the shard layout and the logits' row stride, so a
# compiled kernel is a function of what triton_launch.py's key holds -- which lets it be
# re-launched without re-binding arguments on every call.
_SCRATCH_PTRS_PARTIALS = ["targets_ptr", "m_ptr", "s_ptr", "w_ptr", "tgt_ptr", "cnt_ptr", "active_ptr", "logp_ptr",
                          "lse_ptr", "ent_ptr"]


@triton.jit(do_not_specialize=["n_rows"], do_not_specialize_on_alignment=_SCRATCH_PTRS_PARTIALS)
def logprob_partials_kernel(
    x_ptr, targets_ptr, m_ptr, s_ptr, w_ptr, tgt_ptr,
    stride_x, local_vocab, real_hi, col0, vocab_start, global_vocab, n_rows, n_slots, temperature,
    cnt_ptr, active_ptr, logp_ptr, lse_ptr, ent_ptr,
    TILE_W: tl.constexpr, CHUNK: tl.constexpr, ALIGN: tl.constexpr, NUM_CHUNKS: tl.constexpr,
    SPP: tl.constexpr, WITH_ENT: tl.constexpr, SCALE: tl.constexpr,
    FUSED: tl.constexpr = False, N_SLOTS: tl.constexpr = 1, HAS_MASK: tl.constexpr = False,
):
    """Grid (T, cdiv(S, SPP)): fp32 (max, sumexp[, sum e*x]) of SPP slots of one row, stored slot-major [S, T].

    A tile (2374 columns for Qwen3) is read once, in NUM_CHUNKS chunks of CHUNK
    columns, with an online max per chunk: each chunk rescales the per-lane
    running sums by exp(old max - new max), one scalar exp per chunk, so each
    element costs one exp. Small chunks waste few lanes on a tile width that is
    not a power of two (5 x 512 lanes for 2374 columns, against 4096 for one
    block). Chunk windows start at the tile's first column rounded down to
    ALIGN elements so loads stay 16-byte vectors; columns outside the tile, the
    shard or the real vocab are -inf. The chunk order, CHUNK, SPP and the block
    shape depend on the vocab and dtype only, never on T: that is what keeps
    each tile's reduction order, and so every bit, independent of batch
    composition. The program with pid(1) == 0 also stores the row's target
    logit (-inf when another shard holds it).

    FUSED (TP 1 only: every slot of the row is in this launch): the same
    partials are stored, then the last program of the row to finish -- found
    with a per-row arrival counter (zeroed by the launcher) -- merges that
    row's N_SLOTS stored partials through `_merge_rows`, the very code of the
    merge kernel. Which program merges depends on timing; what it reads (the
    stored partials, in slot order) and how it folds them does not, so the
    output is bitwise that of partials + merge. The counter is the only atomic;
    no value is ever accumulated atomically. Saves the merge launch and its
    host-side cost, which at T=2048 is as long as the kernels.
    """
    row = tl.program_id(0)
    row_ptr = x_ptr + row.to(tl.int64) * stride_x
    slots = tl.program_id(1) * SPP + tl.arange(0, SPP)
    base = col0 + slots * TILE_W
    lo = tl.maximum(base, 0)
    hi = tl.minimum(base + TILE_W, real_hi)
    width = tl.maximum(hi - lo, 0)
    start = tl.multiple_of(lo - lo % ALIGN, ALIGN)  # lo >= 0, so % is the plain remainder
    # Load bound rounded up to ALIGN (the launcher guarantees local_vocab % ALIGN == 0, so it stays
    # inside the row) keeps the load mask constant over each vector; `keep` then trims to the tile.
    load_hi = tl.multiple_of(tl.minimum(hi + (ALIGN - hi % ALIGN) % ALIGN, local_vocab), ALIGN)
    lane = tl.arange(0, CHUNK)
    neg_inf = float("-inf")
    m_run = tl.full([SPP], neg_inf, tl.float32)
    s_acc = tl.zeros([SPP, CHUNK], tl.float32)
    w_acc = tl.zeros([SPP, CHUNK], tl.float32)
    for c in tl.static_range(NUM_CHUNKS):
        offs = start[:, None] + c * CHUNK + lane[None, :]
        x = tl.load(row_ptr + offs, mask=(offs >= start[:, None]) & (offs < load_hi[:, None]), other=neg_inf)
        x = x.to(tl.float32)
        # One unsigned compare: offs - lo in [0, width).
        keep = (offs - lo[:, None]).to(tl.uint32, bitcast=True) < width[:, None].to(tl.uint32, bitcast=True)
        x = tl.where(keep, x, neg_inf)
        if SCALE:
            x = x / temperature
        m_new = tl.maximum(m_run, tl.max(x, axis=1))
        shift = tl.where(m_new == neg_inf, 0.0, m_new)
        alpha = tl.exp(m_run - shift)  # 0 on the first live chunk (m_run = -inf)
        e = tl.math.exp2(x * LOG2E - (shift * LOG2E)[:, None])
        s_acc = s_acc * alpha[:, None] + e
        if WITH_ENT:
            w_acc = w_acc * alpha[:, None] + e * tl.where(x == neg_inf, 0.0, x)
        m_run = m_new
    s = tl.sum(s_acc, axis=1)
    out = slots.to(tl.int64) * n_rows + row
    smask = slots < n_slots
    tl.store(m_ptr + out, m_run, mask=smask)
    tl.store(s_ptr + out, s, mask=smask)
    if WITH_ENT:
        tl.store(w_ptr + out, tl.sum(w_acc, axis=1), mask=smask)
    if tl.program_id(1) == 0:
        t = tl.load(targets_ptr + row)
        local = t - vocab_start
        owned = (local >= 0) & (local < local_vocab) & (t < global_vocab)
        v = tl.load(row_ptr + tl.where(owned, local, 0), mask=owned, other=neg_inf).to(tl.float32)
        if SCALE:
            v = v / temperature
        tl.store(tgt_ptr + row, tl.where(owned, v, neg_inf))
    if FUSED:
        # Release: the barrier orders every lane's stores above before the counter increment
        # (the threadfence-reduction pattern); acq_rel at GPU scope makes them visible to the
        # program that sees the last arrival, and its acquire precedes its loads below.
        tl.debug_barrier()
        arrived = tl.atomic_add(cnt_ptr + row, 1, sem="acq_rel", scope="gpu")
        tl.debug_barrier()
        if arrived == tl.num_programs(1) - 1:
            rows = row + tl.arange(0, 1)
            _merge_rows(m_ptr, s_ptr, w_ptr, tgt_ptr, targets_ptr, active_ptr, logp_ptr, lse_ptr, ent_ptr,
                        rows, rows < n_rows, 1, n_rows, global_vocab, N_SLOTS, WITH_ENT, HAS_MASK, ".cg")


@triton.jit
def _merge_rows(
    m_ptr, s_ptr, w_ptr, tgt_ptr, targets_ptr, active_ptr, logp_ptr, lse_ptr, ent_ptr,
    rows, rmask, stride_row, stride_slot, global_vocab,
    N_SLOTS: tl.constexpr, WITH_ENT: tl.constexpr, HAS_MASK: tl.constexpr, CACHE: tl.constexpr,
):
    """Merge the N_SLOTS partials of `rows` in slot order (sequential fold) and store logp/lse[/ent].

    Shared by the merge kernel and the fused partials kernel so both run the same
    arithmetic in the same order. The slot loops are unrolled (static_range): the
    loads do not depend on each other and are all issued up front, instead of one
    memory round trip per slot; the fold order is unchanged. CACHE ".cg" (fused
    path) reads partials other multiprocessors just wrote past this one's L1.
    """
    neg_inf = float("-inf")
    base = rows.to(tl.int64) * stride_row
    M = tl.full(rows.shape, neg_inf, tl.float32)
    for k in tl.static_range(N_SLOTS):
        M = tl.maximum(M, tl.load(m_ptr + base + k * stride_slot, mask=rmask, other=neg_inf, cache_modifier=CACHE))
    shift = tl.where(M == neg_inf, 0.0, M)
    S = tl.zeros(rows.shape, tl.float32)
    W = tl.zeros(rows.shape, tl.float32)
    for k in tl.static_range(N_SLOTS):
        scale = tl.exp(tl.load(m_ptr + base + k * stride_slot, mask=rmask, other=neg_inf, cache_modifier=CACHE) - shift)
        S += tl.load(s_ptr + base + k * stride_slot, mask=rmask, other=0.0, cache_modifier=CACHE) * scale
        if WITH_ENT:
            W += tl.load(w_ptr + base + k * stride_slot, mask=rmask, other=0.0, cache_modifier=CACHE) * scale
    lse = M + tl.log(S)
    t = tl.load(targets_ptr + rows, mask=rmask, other=0)
    tgt = tl.load(tgt_ptr + rows, mask=rmask, other=neg_inf, cache_modifier=CACHE)
    logp = tl.where((t >= 0) & (t < global_vocab), tgt - lse, float("nan"))
    ent = lse - W / S
    if HAS_MASK:
        a = tl.load(active_ptr + rows, mask=rmask, other=0) != 0
        logp = tl.where(a, logp, 0.0)
        lse = tl.where(a, lse, 0.0)
        ent = tl.where(a, ent, 0.0)
    tl.store(logp_ptr + rows, logp, mask=rmask)
    tl.store(lse_ptr + rows, lse, mask=rmask)
    if WITH_ENT:
        tl.store(ent_ptr + rows, ent, mask=rmask)


@triton.jit(do_not_specialize=["n_rows", "stride_row", "stride_slot", "global_vocab"],
            do_not_specialize_on_alignment=["m_ptr", "s_ptr", "w_ptr", "tgt_ptr", "targets_ptr", "active_ptr",
                                            "logp_ptr", "lse_ptr", "ent_ptr"])
def logprob_merge_kernel(
    m_ptr, s_ptr, w_ptr, tgt_ptr, targets_ptr, active_ptr, logp_ptr, lse_ptr, ent_ptr,
    n_rows, stride_row, stride_slot, global_vocab,
    N_SLOTS: tl.constexpr, BLOCK_T: tl.constexpr, WITH_ENT: tl.constexpr, HAS_MASK: tl.constexpr,
):
    """Grid (cdiv(T, BLOCK_T)): merge each row's N partials in slot order (sequential fold).

    N_SLOTS is a compile-time constant (one specialization per vocab and TP
    degree) rather than a runtime loop bound: the interpreter cannot loop over
    a runtime scalar under numpy 2, and the unrolled loads overlap.
    """
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    _merge_rows(m_ptr, s_ptr, w_ptr, tgt_ptr, targets_ptr, active_ptr, logp_ptr, lse_ptr, ent_ptr,
                rows, rows < n_rows, stride_row, stride_slot, global_vocab, N_SLOTS, WITH_ENT, HAS_MASK, "")


@triton.jit(do_not_specialize=["stride_glogp"],
            do_not_specialize_on_alignment=["targets_ptr", "lse_ptr", "mean_ptr", "glogp_ptr", "glse_ptr", "gent_ptr",
                                            "active_ptr"])
def logprob_backward_kernel(
    x_ptr, g_ptr, targets_ptr, lse_ptr, mean_ptr, glogp_ptr, glse_ptr, gent_ptr, active_ptr,
    stride_x, stride_g, local_vocab, vocab_start, global_vocab, temperature, stride_glogp,
    BLOCK: tl.constexpr, WITH_ENT: tl.constexpr, HAS_MASK: tl.constexpr, SCALE: tl.constexpr,
    HAS_GLSE: tl.constexpr = True,
):
    """Grid (T, cdiv(V_local, BLOCK)): elementwise gradient; every output element written once, no atomics.

    The upstream logp gradient is read with a row stride (0 when it comes from `.sum()`,
    an expanded scalar), and an absent lse gradient (HAS_GLSE=False) is the constant 0.0:
    the launcher then needs no copy or zeros kernel, and (0.0 - gl) * p has the bits of
    (0 - gl) * p with a zeros tensor. Likewise WITH_ENT=False when no entropy gradient flows.
    """
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    cmask = offs < local_vocab
    x = tl.load(x_ptr + row.to(tl.int64) * stride_x + offs, mask=cmask, other=0.0).to(tl.float32)
    if SCALE:
        x = x / temperature
    real = cmask & (vocab_start + offs < global_vocab) & (x != float("-inf"))
    lse = tl.load(lse_ptr + row)
    gl = tl.load(glogp_ptr + row.to(tl.int64) * stride_glogp)
    p = tl.where(real, tl.exp(x - lse), 0.0)
    if HAS_GLSE:
        grad = (tl.load(glse_ptr + row) - gl) * p
    else:
        grad = (0.0 - gl) * p
    if WITH_ENT:
        d = tl.where(real, tl.load(mean_ptr + row) - x, 0.0)
        grad += tl.load(gent_ptr + row) * (p * d)
    t = tl.load(targets_ptr + row)
    hit = (offs == t - vocab_start) & (t >= 0) & (t < global_vocab)
    grad += tl.where(hit, gl, 0.0)
    if SCALE:
        grad = grad / temperature
    if HAS_MASK:
        grad = tl.where(tl.load(active_ptr + row) != 0, grad, 0.0)
    tl.store(g_ptr + row.to(tl.int64) * stride_g + offs, grad.to(g_ptr.dtype.element_ty), mask=cmask)
