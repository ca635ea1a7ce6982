"""Pure-torch batch-invariant forwards: the CPU implementation and the oracle the Triton kernels are tested against.

Each function gives a row the same bits whatever other rows are in the call, because every
floating-point reduction runs at a shape that does not depend on the number of rows:

* Nothing calls a BLAS GEMM: MKL picks kernels, K-splits and thread partitions from the shape and
  the thread count (a fixed-shape GEMM still changes bits between 1 and 2 threads). Instead an
  output element is an elementwise product reduced over a contiguous inner dim of fixed length
  (a SPLIT_K slice of K for linear, head_dim for a score, KEY_BLOCK for a block's P.V, H for
  RMSNorm's mean square).
* a linear's K is reduced split by split: SPLIT_K elements at a time, each split's sum added to the
  output's running total from zero, in split order (`split_k_sum`). The Triton matmul folds its
  per-split partials in that order, inline or in a combine pass after one program per split
  (split-K decode), so the split is where the kernels may parallelise K without moving a bit.
  torch computes such a reduction per output element with one vectorised loop whatever the outer
  shape, and splits threads over outputs, never over the reduced dim (it only does that for a
  single output, which a staging buffer of `ROW_CHUNK` rows rules out for RMSNorm).
* attention visits keys in KEY_BLOCK blocks aligned to the
  sequence's first key, with an online softmax. A block in which a row has no valid key leaves
  that row's state untouched (selected, not computed), so packed prefill (which walks every row
  of a chunk to the chunk's last block) and decode (which stops at its own last block) take
  the same arithmetic for a row.
* the online softmax restarts every SPLIT_BLOCKS key blocks (a split), and the splits' partial
  results (max, sum, unnormalised output) are folded into the row's total left to right. The
  split is a fixed number of keys, so a decoder may compute a row's splits in parallel programs
  (split-KV decode) and fold them afterwards in the same order with the same arithmetic: a
  token's bits stay those of the packed prefill, whatever the schedule.

Forward only; autograd lives in ops.py.
"""
from __future__ import annotations

import torch

KEY_BLOCK = 64
"""Keys are reduced in blocks of this many, aligned to each sequence's first key (both attention entry points)."""

ROW_CHUNK = 16
"""Rows per linear step and per RMSNorm staging buffer."""

PRODUCT_BUDGET = 1 << 22
"""Elements of one linear step's [rows, columns, K] fp32 product (16 MiB)."""

SPLIT_BLOCKS = 4
"""Key blocks per split of the online softmax (256 keys): fixed, never a function of the batch."""

SPLIT_K = 256
"""K elements per split of a linear's reduction: a constant of the numerics, never a function of the rows.

A multiple of every BLOCK_K the Triton matmul uses (64 for 16-bit, 32 for fp32), so a split is whole K
steps. 256 rather than 512: at decode sizes the split-K schedule needs programs (K = 1024 gives 4 splits,
the hidden size of Qwen3-0.6B), while a split still holds 4 (16-bit) or 8 (fp32) K steps of a pipelined
loop; its fp32 partials cost rows / 64 of the weight bytes (written and read once), which bounds the rows
the split schedule is worth taking at (triton_launch.use_split_k)."""

ATTN_ROW_CHUNK = 256
"""Query rows per attention step (memory: rows x KEY_BLOCK x head_dim fp32 products)."""

DECODE_BATCH_CHUNK = 32
"""Decode rows per attention step."""


def split_k_sum(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """sum(a * b, -1) of fp32 tensors (broadcast), in the matmul's order: total = 0; per SPLIT_K slice of the last
    dim, in order, total = total + (the slice's products summed by torch's per-output loop)."""
    k = a.shape[-1]
    total = torch.zeros(torch.broadcast_shapes(a.shape, b.shape)[:-1], dtype=torch.float32, device=a.device)
    for k0 in range(0, k, SPLIT_K):
        total = total + (a[..., k0:k0 + SPLIT_K] * b[..., k0:k0 + SPLIT_K]).sum(-1)
    return total


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] @ weight[N, K].T (+ bias) with fp32 accumulation split by split (split_k_sum); x.dtype out.

    Slow (no GEMM, see the module docstring): meant for tests and tiny CPU models.
    """
    k = x.shape[-1]
    n = weight.shape[0]
    rows = x.reshape(-1, k)
    m = rows.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out.reshape(*x.shape[:-1], n)
    bias32 = None if bias is None else bias.float()
    cols = max(1, PRODUCT_BUDGET // (ROW_CHUNK * max(k, 1)))
    for c0 in range(0, n, cols):
        c1 = min(c0 + cols, n)
        w32 = weight[c0:c1].float().unsqueeze(0)  # [1, C, K]
        for r0 in range(0, m, ROW_CHUNK):
            r1 = min(r0 + ROW_CHUNK, m)
            acc = split_k_sum(rows[r0:r1].float().unsqueeze(1), w32)
            if bias32 is not None:
                acc = acc + bias32[c0:c1]
            out[r0:r1, c0:c1] = acc
    return out.reshape(*x.shape[:-1], n)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF RMSNorm: weight * (x.float() * rsqrt(mean(x.float()^2) + eps)).to(x.dtype)."""
    h = x.shape[-1]
    rows = x.reshape(-1, h)
    m = rows.shape[0]
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty(m, h, dtype=out_dtype, device=x.device)
    for r0 in range(0, m, ROW_CHUNK):
        r1 = min(r0 + ROW_CHUNK, m)
        stage = torch.zeros(ROW_CHUNK, h, dtype=torch.float32, device=x.device)
        stage[: r1 - r0] = rows[r0:r1]
        variance = stage.pow(2).mean(-1, keepdim=True)
        normed = stage * torch.rsqrt(variance + eps)
        out[r0:r1] = (weight * normed.to(x.dtype))[: r1 - r0]
    return out.reshape(x.shape)


def _fold(m: torch.Tensor, l: torch.Tensor, acc: torch.Tensor, m_c: torch.Tensor, l_c: torch.Tensor,
          acc_c: torch.Tensor, active: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fold one split's partial (m_c, l_c, acc_c) into a row's running total; inactive rows keep theirs.

    On a row's first split the total is (-inf, 0, 0), so the fold returns the partial exactly
    (exp(-inf) = 0 and l_c * exp(0) = l_c)."""
    m_new = torch.maximum(m, m_c)
    a = torch.exp(m - m_new)
    b = torch.exp(m_c - m_new)
    l_new = l * a + l_c * b
    acc_new = acc * a.unsqueeze(-1) + acc_c * b.unsqueeze(-1)
    return (torch.where(active, m_new, m), torch.where(active, l_new, l),
            torch.where(active.unsqueeze(-1), acc_new, acc))


def _online_softmax(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n_valid: torch.Tensor, scale: float,
                    p_dtype: torch.dtype) -> torch.Tensor:
    """Rows of q attend to the first n_valid[..., r] keys of k/v (batched over leading dims).

    q [..., R, D] fp32; k, v [..., Lk, D] fp32 with Lk a multiple of KEY_BLOCK covering max(n_valid),
    entries a row may not see already replaced by finite values; n_valid [..., R] int64 >= 1.
    Returns fp32 [..., R, D].
    """
    lead = q.shape[:-2]
    rows, d = q.shape[-2:]

    def fresh() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return (torch.full((*lead, rows), float("-inf"), dtype=torch.float32, device=q.device),
                torch.zeros((*lead, rows), dtype=torch.float32, device=q.device),
                torch.zeros((*lead, rows, d), dtype=torch.float32, device=q.device))

    m_t, l_t, acc_t = fresh()
    n_blocks = -(-int(n_valid.max()) // KEY_BLOCK)
    q_b = q.unsqueeze(-2)  # [..., R, 1, D]
    for split_lo in range(0, n_blocks, SPLIT_BLOCKS):
        m_i, l_i, acc = fresh()
        for blk in range(split_lo, min(split_lo + SPLIT_BLOCKS, n_blocks)):
            lo = blk * KEY_BLOCK
            kb = k[..., lo:lo + KEY_BLOCK, :].unsqueeze(-3)  # [..., 1, KB, D]
            vb_t = v[..., lo:lo + KEY_BLOCK, :].transpose(-1, -2).contiguous().unsqueeze(-3)  # [..., 1, D, KB]
            s = (q_b * kb).sum(-1) * scale  # [..., R, KB]
            key_idx = torch.arange(lo, lo + KEY_BLOCK, device=q.device)
            valid = key_idx < n_valid.unsqueeze(-1)
            s = torch.where(valid, s, float("-inf"))
            m_new = torch.maximum(m_i, s.amax(-1))
            alpha = torch.exp(m_i - m_new)
            p = torch.exp(s - m_new.unsqueeze(-1))
            l_new = l_i * alpha + p.sum(-1)
            # P enters P.V in the input dtype, as the Triton kernel feeds it to its second dot.
            pv = (p.to(p_dtype).float().unsqueeze(-2) * vb_t).sum(-1)  # [..., R, D]
            acc_new = acc * alpha.unsqueeze(-1) + pv
            # A row with no valid key in this block keeps its state bit for bit.
            active = n_valid > lo
            m_i = torch.where(active, m_new, m_i)
            l_i = torch.where(active, l_new, l_i)
            acc = torch.where(active.unsqueeze(-1), acc_new, acc)
        m_t, l_t, acc_t = _fold(m_t, l_t, acc_t, m_i, l_i, acc, n_valid > split_lo * KEY_BLOCK)
    return acc_t / l_t.unsqueeze(-1)


def _pad_keys(x: torch.Tensor, length: int) -> torch.Tensor:
    """Zero-pad dim -2 of x to `length` (a multiple of KEY_BLOCK)."""
    if x.shape[-2] >= length:
        return x[..., :length, :]
    pad = torch.zeros((*x.shape[:-2], length - x.shape[-2], x.shape[-1]), dtype=x.dtype, device=x.device)
    return torch.cat([x, pad], dim=-2)


def packed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """Causal attention within each sequence of a packed buffer; q [T, H, D], k/v [T, Hkv, D]."""
    t_total, n_heads, d = q.shape
    n_kv = k.shape[1]
    group = n_heads // n_kv
    out = torch.empty_like(q)
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        length = end - start
        padded = -(-length // KEY_BLOCK) * KEY_BLOCK
        # [Hkv, Lpad, D]: the sequence's own keys only, zero beyond its end.
        ks = _pad_keys(k[start:end].transpose(0, 1).float(), padded)
        vs = _pad_keys(v[start:end].transpose(0, 1).float(), padded)
        # Query rows of kv head g: (position t, head of the group), ordered t-major.
        qs = q[start:end].float().reshape(length, n_kv, group, d).permute(1, 0, 2, 3).reshape(n_kv, length * group, d)
        n_valid_all = (torch.arange(length, device=q.device) + 1).repeat_interleave(group)
        chunk = max(group, (ATTN_ROW_CHUNK // group) * group)
        pieces = []
        for r0 in range(0, length * group, chunk):
            r1 = min(r0 + chunk, length * group)
            n_valid = n_valid_all[r0:r1].expand(n_kv, r1 - r0)
            reach = -(-int(n_valid_all[r1 - 1]) // KEY_BLOCK) * KEY_BLOCK
            pieces.append(_online_softmax(qs[:, r0:r1], ks[:, :reach], vs[:, :reach], n_valid, scale, q.dtype))
        o = torch.cat(pieces, dim=1).reshape(n_kv, length, group, d).permute(1, 0, 2, 3).reshape(length, n_heads, d)
        out[start:end] = o.to(q.dtype)
    return out


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, lengths: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """Row b's query (position lengths[b]-1) attends keys [0, lengths[b]) of cache row b; q [B, H, D]."""
    b_total, n_heads, d = q.shape
    n_kv = k_cache.shape[1]
    group = n_heads // n_kv
    out = torch.empty_like(q)
    lens = lengths.to(torch.int64)
    for b0 in range(0, b_total, DECODE_BATCH_CHUNK):
        b1 = min(b0 + DECODE_BATCH_CHUNK, b_total)
        chunk_lens = lens[b0:b1]
        padded = -(-int(chunk_lens.max()) // KEY_BLOCK) * KEY_BLOCK
        key_idx = torch.arange(padded, device=q.device)
        # Entries at or beyond a row's length are replaced (not multiplied) by 0: they may hold NaN.
        seen = (key_idx < chunk_lens[:, None])[:, None, :, None]
        ks = torch.where(seen, _pad_keys(k_cache[b0:b1].float(), padded), 0.0)
        vs = torch.where(seen, _pad_keys(v_cache[b0:b1].float(), padded), 0.0)
        qs = q[b0:b1].float().reshape(b1 - b0, n_kv, group, d)
        n_valid = chunk_lens[:, None, None].expand(b1 - b0, n_kv, group)
        o = _online_softmax(qs, ks, vs, n_valid, scale, q.dtype)
        out[b0:b1] = o.reshape(b1 - b0, n_heads, d).to(q.dtype)
    return out
