"""Batch-invariant attention over a paged KV pool: decode (one query per sequence) and prefill (a packed chunk of
each sequence's next tokens, after its earlier tokens' keys are already in the pool).

A pool is [pages, Hkv, KEY_BLOCK, D] per layer; a sequence's keys at positions [KEY_BLOCK * i, KEY_BLOCK * (i + 1))
live in page block_tables[s, i]. A page is exactly one key block of the online softmax, so a query's keys are
reduced in the same blocks, in the same order, with the same arithmetic as packed_attention over the whole
sequence and decode_attention over a dense cache: only the addresses differ. That is what makes a token's bits
independent of where its keys live, of how its sequence was split into prefill chunks, and of whether its KV was
written by decode steps or recomputed by a prefill.

`impl="reference"` (CPU's path) gathers the pages into the dense layout and runs reference.py's arithmetic;
`impl="triton"` runs bi_attention_kernel with PAGED=True. Inference only.
"""
from __future__ import annotations

import torch

from kernels.batch_invariant import reference
from kernels.batch_invariant.ops import (
    BatchInvariantInputError,
    Impl,
    _check_float,
    _check_heads,
    _check_same,
    _check_scale,
    _checked_layouts,
    _resolve,
)
from kernels.batch_invariant.reference import ATTN_ROW_CHUNK, KEY_BLOCK, _online_softmax


def _check_pool(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor,
                rows: int, rows_name: str) -> None:
    for name, t in (("q", q), ("k_pool", k_pool), ("v_pool", v_pool)):
        _check_float(name, t)
    if q.dim() != 3:
        raise BatchInvariantInputError(f"q must be [{rows_name}, H, D], got shape {tuple(q.shape)}")
    for name, t in (("k_pool", k_pool), ("v_pool", v_pool)):
        if t.dim() != 4 or t.shape[2] != KEY_BLOCK:
            raise BatchInvariantInputError(f"{name} must be [pages, Hkv, KEY_BLOCK={KEY_BLOCK}, D], got "
                                           f"{tuple(t.shape)}")
    if k_pool.shape != v_pool.shape:
        raise BatchInvariantInputError(
            f"k_pool and v_pool must have one shape; got {tuple(k_pool.shape)} and {tuple(v_pool.shape)}")
    _check_heads("q", q, "k_pool", k_pool, 1)
    _check_same("dtype", ("q", "k_pool", "v_pool"), (q.dtype, k_pool.dtype, v_pool.dtype))
    _check_same("device", ("q", "k_pool", "v_pool", "block_tables"),
                (q.device, k_pool.device, v_pool.device, block_tables.device))
    if block_tables.dim() != 2 or block_tables.shape[0] != rows or block_tables.dtype != torch.int32:
        raise BatchInvariantInputError(f"block_tables must be int32 [{rows_name}={rows}, max_pages], got "
                                       f"{block_tables.dtype} {tuple(block_tables.shape)}")
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k_pool, v_pool)):
        raise BatchInvariantInputError("paged attention is inference-only: q/k_pool/v_pool must not require grad")


def _check_pages_on_host(block_tables: torch.Tensor, used: torch.Tensor, pages: int) -> None:
    """CPU only (GPU calls run under graph capture): every page a sequence reads is inside the pool."""
    for s, n in enumerate(used.tolist()):
        row = block_tables[s, :n]
        if n > block_tables.shape[1]:
            raise BatchInvariantInputError(f"block_tables[{s}] holds {block_tables.shape[1]} pages, the sequence "
                                           f"needs {n}")
        if bool(((row < 0) | (row >= pages)).any()):
            raise BatchInvariantInputError(f"block_tables[{s}] names a page outside [0, {pages})")


def _gather(pool: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
    """[..., Hkv, len(pages) * KEY_BLOCK, D] fp32: the pages' slots in key order."""
    g = pool[pages.long()]  # [..., P, Hkv, KB, D]
    g = g.transpose(-4, -3)  # [..., Hkv, P, KB, D]
    return g.reshape(*g.shape[:-3], g.shape[-3] * KEY_BLOCK, g.shape[-1])


def reference_paged_decode(q, k_pool, v_pool, block_tables, lengths, scale) -> torch.Tensor:
    """reference.decode_attention over the pages gathered into a dense cache: the same arithmetic, bit for bit."""
    pages = -(-int(lengths.max()) // KEY_BLOCK)
    k = _gather(k_pool, block_tables[:, :pages])
    v = _gather(v_pool, block_tables[:, :pages])
    return reference.decode_attention(q, k, v, lengths, scale)


def reference_paged_prefill(q, k_pool, v_pool, block_tables, cu_seqlens, starts, scale) -> torch.Tensor:
    """reference.packed_attention's arithmetic per sequence, its keys read from the pool (positions [0, end))."""
    n_heads, d = q.shape[1:]
    n_kv = k_pool.shape[1]
    group = n_heads // n_kv
    out = torch.empty_like(q)
    bounds, firsts = cu_seqlens.tolist(), starts.tolist()
    for s, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
        length, first = hi - lo, firsts[s]
        end = first + length
        padded = -(-end // KEY_BLOCK) * KEY_BLOCK
        seen = (torch.arange(padded, device=q.device) < end)[None, :, None]
        # Slots at or beyond the sequence's end are replaced (not multiplied) by 0, as packed pads them.
        ks = torch.where(seen, _gather(k_pool, block_tables[s, :padded // KEY_BLOCK]).float(), 0.0)
        vs = torch.where(seen, _gather(v_pool, block_tables[s, :padded // KEY_BLOCK]).float(), 0.0)
        qs = q[lo:hi].float().reshape(length, n_kv, group, d).permute(1, 0, 2, 3).reshape(n_kv, length * group, d)
        n_valid_all = (torch.arange(first, end, device=q.device) + 1).repeat_interleave(group)
        chunk = max(group, (ATTN_ROW_CHUNK // group) * group)
        pieces = []
        for r0 in range(0, length * group, chunk):
            r1 = min(r0 + chunk, length * group)
            n_valid = n_valid_all[r0:r1].expand(n_kv, r1 - r0)
            reach = -(-int(n_valid_all[r1 - 1]) // KEY_BLOCK) * KEY_BLOCK
            pieces.append(_online_softmax(qs[:, r0:r1], ks[:, :reach], vs[:, :reach], n_valid, scale, q.dtype))
        o = torch.cat(pieces, dim=1).reshape(n_kv, length, group, d).permute(1, 0, 2, 3).reshape(length, n_heads, d)
        out[lo:hi] = o.to(q.dtype)
    return out


def paged_decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor,
                           lengths: torch.Tensor, scale: float, *, impl: Impl = "auto") -> torch.Tensor:
    """Row b's query (position lengths[b]-1) attends its keys [0, lengths[b]) through block_tables[b].

    q [B, H, D]; pools [pages, Hkv, KEY_BLOCK, D]; block_tables int32 [B, max_pages]; lengths int32 [B] in
    [1, max_pages * KEY_BLOCK]. Bits equal decode_attention over the same keys in a dense cache. Slots at or
    beyond a row's length are never read into the result. Lengths and pages are checked on the host on CPU only.
    """
    _check_pool(q, k_pool, v_pool, block_tables, q.shape[0], "B")
    if lengths.dim() != 1 or lengths.shape[0] != q.shape[0] or lengths.dtype != torch.int32:
        raise BatchInvariantInputError(
            f"lengths must be int32 [B={q.shape[0]}], got {lengths.dtype} {tuple(lengths.shape)}")
    _check_same("device", ("q", "lengths"), (q.device, lengths.device))
    scale = _check_scale(scale)
    chosen = _resolve(impl, q.device, "paged_decode_attention")
    if q.shape[0] == 0:
        return torch.empty_like(q)
    if q.device.type == "cpu":
        lens = lengths.to(torch.int64)
        cap = block_tables.shape[1] * KEY_BLOCK
        if bool(((lens < 1) | (lens > cap)).any()):
            raise BatchInvariantInputError(f"lengths must lie in [1, {cap}], got {lengths.tolist()[:16]}")
        _check_pages_on_host(block_tables, -(-lens // KEY_BLOCK), k_pool.shape[0])
    if chosen == "reference":
        return reference_paged_decode(q, k_pool, v_pool, block_tables, lengths, scale)
    from kernels.batch_invariant import triton_launch

    return triton_launch.paged_decode_attention(q, k_pool, v_pool, block_tables, lengths, scale)


def paged_prefill_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor,
                            cu_seqlens: torch.Tensor, starts: torch.Tensor, max_seqlen: int, scale: float, *,
                            impl: Impl = "auto") -> torch.Tensor:
    """Causal attention of packed query chunks over the pool: query token i of sequence s (rows
    cu_seqlens[s]..cu_seqlens[s+1]-1) sits at position starts[s] + i - cu_seqlens[s] and attends that sequence's
    keys [0, position] through block_tables[s]; those keys (this chunk's too) must already be in the pool.

    q [T, H, D]; cu_seqlens int32 [S+1]; starts int32 [S]; max_seqlen >= the longest chunk. A row's bits equal
    packed_attention over its whole sequence and decode_attention at its position.
    """
    _check_pool(q, k_pool, v_pool, block_tables, cu_seqlens.numel() - 1, "S")
    _checked_layouts.check(cu_seqlens, q.shape[0], max_seqlen)
    if starts.dim() != 1 or starts.shape[0] != cu_seqlens.numel() - 1 or starts.dtype != torch.int32:
        raise BatchInvariantInputError(f"starts must be int32 [S={cu_seqlens.numel() - 1}], got {starts.dtype} "
                                       f"{tuple(starts.shape)}")
    _check_same("device", ("q", "cu_seqlens", "starts"), (q.device, cu_seqlens.device, starts.device))
    scale = _check_scale(scale)
    chosen = _resolve(impl, q.device, "paged_prefill_attention")
    if q.device.type == "cpu":
        if bool((starts < 0).any()):
            raise BatchInvariantInputError(f"starts must be >= 0, got {starts.tolist()[:16]}")
        ends = starts.to(torch.int64) + (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.int64)
        _check_pages_on_host(block_tables, -(-ends // KEY_BLOCK), k_pool.shape[0])
    if chosen == "reference":
        return reference_paged_prefill(q, k_pool, v_pool, block_tables, cu_seqlens, starts, scale)
    from kernels.batch_invariant import triton_launch

    return triton_launch.paged_prefill_attention(q, k_pool, v_pool, block_tables, cu_seqlens, starts, max_seqlen,
                                                 scale)
