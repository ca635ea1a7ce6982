"""Fused lm_head + log-prob: token log-probs of `hidden @ weight.T` without the [N, V] logits.

`linear_token_logprobs(hidden, weight, targets, ...)` returns what
`token_logprobs_with_entropy(hidden @ weight.T, targets, ...)` returns, with
the same autograd surface (gradients for hidden and weight), but holds at most
one [chunk_tokens, block width] piece of logits at a time:

- forward: for each token chunk, for each vocab block (vocab_blocks.py), one
  GEMM and the backend's per-tile partials; the partials of all blocks (and,
  under TP, of all ranks) are merged in global tile order. Saved for backward:
  the inputs and two fp32 numbers per token (lse, and E[x] = lse - entropy).
- backward: the same GEMMs again, the backend's elementwise d(logits) per
  block, then d(hidden) += d(logits) @ W_block (fp32 out, summed over blocks
  in a fixed pairwise tree) and d(W_block) += d(logits)^T @ hidden_chunk
  (fp32, accumulated across chunks, cast to W's dtype once at the end).

Chunking invariance: every GEMM runs at `chunk_tokens` rows (the last chunk is
zero-padded) and at one block width, and every chunk is staged into the same
buffer, so a token's logits, outputs and d(hidden) row do not depend on which
other tokens are in the call or where chunk bounds fall. `chunk_tokens` and
`vocab_block_tiles` are part of the definition: a different value may select
another GEMM kernel and change low bits.
"""
from __future__ import annotations

import dataclasses
from itertools import chain, islice, repeat
from typing import Any

import torch

from kernels.logprob.api import _gather_partials, build_contract
from kernels.logprob.registry import select, verify_group_agreement
from kernels.logprob.vocab_blocks import (
    DEFAULT_VOCAB_BLOCK_TILES,
    VocabBlockPlan,
    pairwise_tree_sum,
    plan_vocab_blocks,
)

DEFAULT_CHUNK_TOKENS = 2048
"""Rows per GEMM. Ample for the H200's tensor cores at H >= 1024 with 18992-column blocks, and
small enough that the zero-padded last chunk wastes little of a 16k-32k token microbatch."""


def mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b with an fp32 result and fp32 accumulation, whatever the (common) input dtype.

    On GPUs the bf16/fp16 tensor-core GEMM writes fp32 directly (out_dtype); CPU torch has no
    such kernel, so there the inputs are widened first (exact) and the GEMM runs in fp32.
    """
    if a.dtype == torch.float32:
        return torch.mm(a, b)
    if a.device.type == "cuda":
        return torch.mm(a, b, out_dtype=torch.float32)
    return torch.mm(a.float(), b.float())


def addmm_fp32_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b, acc fp32, in the GEMM's epilogue where the platform has one for mixed
    dtypes (on the H200 that is ~17% faster than a separate add over the [block, H] fp32 piece)."""
    if a.dtype == torch.float32:
        acc.addmm_(a, b)
    elif a.device.type == "cuda":
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    else:
        acc.addmm_(a.float(), b.float())


class _Plan:
    """Everything one call needs besides its tensors: backend, block plan, group."""

    def __init__(self, impl, blocks: VocabBlockPlan, temperature, chunk_tokens, with_entropy, tp_group):
        self.impl = impl
        self.blocks = blocks
        self.temperature = temperature
        self.chunk_tokens = chunk_tokens
        self.with_entropy = with_entropy
        self.tp_group = tp_group if blocks.shard.tp_world_size > 1 else None

    def block_weight(self, weight: torch.Tensor, block: int, cache: dict) -> torch.Tensor:
        """Rows of `weight` for `block`, zero-padded to the block width (only the last block of a
        TP-1 weight can be short), so every GEMM has the same shape."""
        lo, hi = self.blocks.local_rows(block)
        if hi - lo == self.blocks.width:
            return weight[lo:hi]
        if block not in cache:
            pad = weight.new_zeros((self.blocks.width, weight.shape[1]))
            pad[: hi - lo] = weight[lo:hi]
            cache[block] = pad
        return cache[block]

    def local_block_ids(self) -> range:
        b0 = self.blocks.first_block
        return range(b0, b0 + self.blocks.local_blocks)


def _chunks(n_tokens: int, chunk_tokens: int):
    for start in range(0, n_tokens, chunk_tokens):
        yield start, min(chunk_tokens, n_tokens - start)


def _stage(buf: torch.Tensor, hidden: torch.Tensor, start: int, n: int) -> torch.Tensor:
    """Copy rows [start, start+n) into the fixed [chunk_tokens, H] buffer, zeros after them."""
    buf[:n].copy_(hidden[start : start + n])
    if n < buf.shape[0]:
        buf[n:].zero_()
    return buf


def _identity_partials(n: int, slots: int, with_entropy: bool, like: torch.Tensor):
    """(-inf, 0[, 0]) for blocks with no real column: the merge adds exact zeros for them."""
    m = torch.full((n, slots), float("-inf"), device=like.device, dtype=torch.float32)
    z = torch.zeros((n, slots), device=like.device, dtype=torch.float32)
    return m, z, (z if with_entropy else None)


def _forward(plan: _Plan, hidden, weight, targets, active):
    """(logp, lse, ent|None) for all N tokens, logits one [chunk_tokens, width] block at a time."""
    N, H = hidden.shape
    C, blocks, impl = plan.chunk_tokens, plan.blocks, plan.impl
    stage = hidden.new_empty((C, H))
    padded_w: dict = {}
    ms, ss, ws, tgts = [], [], [], []
    for start, n in _chunks(N, C):
        x = _stage(stage, hidden, start, n)
        tgt_chunk = targets[start : start + n]
        m_parts, s_parts, w_parts, t_best = [], [], [], None
        for b in plan.local_block_ids():
            if not blocks.is_real(b):
                m, s, w = _identity_partials(n, blocks.tiles_per_block, plan.with_entropy, hidden)
            else:
                logits = torch.mm(x, plan.block_weight(weight, b, padded_w).t())[:n]
                m, s, w, t = impl.partials(logits, tgt_chunk, blocks.block_layout(b), plan.temperature,
                                           plan.with_entropy)
                t_best = t if t_best is None else torch.maximum(t_best, t)  # -inf except at the owner
            m_parts.append(m)
            s_parts.append(s)
            w_parts.append(w)
        if t_best is None:  # a shard of padding only
            t_best = torch.full((n,), float("-inf"), device=hidden.device, dtype=torch.float32)
        ms.append(torch.cat(m_parts, dim=1))
        ss.append(torch.cat(s_parts, dim=1))
        ws.append(torch.cat(w_parts, dim=1) if plan.with_entropy else None)
        tgts.append(t_best)
    if N == 0:
        S = blocks.local_blocks * blocks.tiles_per_block
        m, s, w = _identity_partials(0, S, plan.with_entropy, hidden)
        tgt = torch.empty((0,), device=hidden.device, dtype=torch.float32)
    else:
        m, s, tgt = torch.cat(ms), torch.cat(ss), torch.cat(tgts)
        w = torch.cat(ws) if plan.with_entropy else None
    if plan.tp_group is not None:
        m, s, w, tgt = _gather_partials(m, s, w, tgt, plan.tp_group)
    return impl.merge(m, s, w, tgt, targets, blocks.shard.global_vocab_size, active)


def _grad_inputs(impl, lse, g_logp, g_lse, g_ent, with_entropy):
    """Backend-ready fp32 gradients: None where no gradient flows, if the backend accepts that."""
    def prep(g):
        return None if g is None else g.float().contiguous()

    g_logp, g_lse = prep(g_logp), prep(g_lse)
    g_ent = prep(g_ent) if with_entropy else None
    if not getattr(impl, "accepts_none_grads", False):
        zeros = torch.zeros_like(lse)
        g_logp = zeros if g_logp is None else g_logp
        g_lse = zeros if g_lse is None else g_lse
        if with_entropy and g_ent is None:
            g_ent = zeros
    return g_logp, g_lse, g_ent


def _slice(t: torch.Tensor | None, start: int, n: int) -> torch.Tensor | None:
    return None if t is None else t[start : start + n]


def _reduce_over_ranks(plan: _Plan, local: list[torch.Tensor | None] | torch.Tensor | None, like: torch.Tensor):
    """Finish the d(hidden) tree over the TP group (identical result on every rank).

    `local` is this rank's subtree sum when its blocks form an aligned subtree, else the list of
    its per-block leaves; either way every rank gathers the same shapes and builds the same tree.
    """
    import torch.distributed as dist

    blocks, group = plan.blocks, plan.tp_group
    world = dist.get_world_size(group)

    def gather(t):
        out = [torch.empty_like(like) for _ in range(world)]
        dist.all_gather(out, torch.zeros_like(like) if t is None else t.contiguous(), group=group)
        return out

    if blocks.subtree_aligned:
        sums = gather(local)
        nodes = blocks.tree_leaves // blocks.local_blocks
        return pairwise_tree_sum((sums[r] if r < world else None for r in range(nodes)), nodes)
    per_block = [gather(leaf) for leaf in local]  # [local block][rank]
    L = blocks.local_blocks
    leaves = [per_block[b % L][b // L] if b // L < world else None for b in range(blocks.tree_leaves)]
    return pairwise_tree_sum(iter(leaves), blocks.tree_leaves)


def _backward(plan: _Plan, hidden, weight, targets, lse, mean_x, active, g_logp, g_lse, g_ent, need_h, need_w):
    N, H = hidden.shape
    C, blocks, impl = plan.chunk_tokens, plan.blocks, plan.impl
    stage = hidden.new_empty((C, H))
    padded_w: dict = {}
    d_hidden = torch.empty_like(hidden) if need_h else None
    # fp32 across chunks: a bf16 accumulator would round every chunk's contribution to 8 bits.
    # Whole blocks of rows (a TP-1 weight's last block padded), so every d(W) GEMM has one shape.
    d_weight = torch.zeros((blocks.local_blocks * blocks.width, H), device=weight.device,
                           dtype=torch.float32) if need_w else None
    dl_pad = None
    for start, n in _chunks(N, C):
        x = _stage(stage, hidden, start, n)
        sl = dict(targets=targets[start : start + n], lse=lse[start : start + n], mean_x=_slice(mean_x, start, n),
                  g_logp=_slice(g_logp, start, n), g_lse=_slice(g_lse, start, n), g_ent=_slice(g_ent, start, n),
                  active=_slice(active, start, n))

        def leaves():
            nonlocal dl_pad
            for b in plan.local_block_ids():
                if not blocks.is_real(b):
                    yield None
                    continue
                w_b = plan.block_weight(weight, b, padded_w)
                logits = torch.mm(x, w_b.t())[:n]
                dl = impl.backward(logits, sl["targets"], sl["lse"], sl["mean_x"], sl["g_logp"], sl["g_lse"],
                                   sl["g_ent"], sl["active"], blocks.block_layout(b), plan.temperature)
                if n < C:  # the GEMMs keep C rows; padded rows carry exact zeros
                    if dl_pad is None:
                        dl_pad = dl.new_zeros((C, blocks.width))
                    dl_pad[:n] = dl
                    dl = dl_pad
                if need_w:
                    lo = blocks.local_rows(b)[0]
                    addmm_fp32_(d_weight[lo : lo + blocks.width], dl.t(), x)
                yield mm_fp32(dl, w_b) if need_h else None

        if plan.tp_group is None:
            # TP 1: the whole tree here. Leaves past the weight's last block are +0.0; blocks past
            # the tree's leaves hold padding rows only (zero gradient) and are never computed.
            T = blocks.tree_leaves
            total = pairwise_tree_sum(islice(chain(leaves(), repeat(None)), T), T)
        elif blocks.subtree_aligned:
            local = pairwise_tree_sum(leaves(), blocks.local_blocks)
            total = _reduce_over_ranks(plan, local, stage.new_empty((C, H), dtype=torch.float32))
        else:
            total = _reduce_over_ranks(plan, list(leaves()), stage.new_empty((C, H), dtype=torch.float32))
        if need_h:
            d_hidden[start : start + n] = (torch.zeros_like(stage) if total is None else total[:n]).to(hidden.dtype)
    return d_hidden, (d_weight[: weight.shape[0]].to(weight.dtype) if need_w else None)


class _LinearLogprobFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, active, plan):
        logp, lse, ent = _forward(plan, hidden, weight, targets, active)
        mean_x = (lse - ent) if ent is not None else None
        ctx.save_for_backward(hidden, weight, targets, lse, mean_x, active)
        ctx.plan = plan
        ctx.set_materialize_grads(False)
        return logp, lse, ent

    @staticmethod
    def backward(ctx, g_logp, g_lse, g_ent):
        hidden, weight, targets, lse, mean_x, active = ctx.saved_tensors
        plan = ctx.plan
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        g_logp, g_lse, g_ent = _grad_inputs(plan.impl, lse, g_logp, g_lse, g_ent, plan.with_entropy)
        if g_logp is None and g_lse is None and g_ent is None and plan.tp_group is None:
            return None, None, None, None, None
        # Under TP every rank runs the collectives of the backward, whatever gradients reached it.
        dh, dw = _backward(plan, hidden, weight, targets, lse, mean_x, active, g_logp, g_lse, g_ent, need_h, need_w)
        return dh, dw, None, None, None


def _validate(hidden, weight, targets, mask, chunk_tokens) -> None:
    if hidden.dim() != 2:
        raise ValueError(f"hidden: expected [N, H], got shape {tuple(hidden.shape)}")
    if weight.dim() != 2:
        raise ValueError(f"weight: expected [V_local, H], got shape {tuple(weight.shape)}")
    if hidden.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"hidden: dtype must be bf16, fp16 or fp32, got {hidden.dtype}")
    if weight.dtype != hidden.dtype:
        raise ValueError(f"weight: dtype {weight.dtype} differs from hidden's {hidden.dtype} (cast one first)")
    if weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"weight: hidden size {weight.shape[1]} differs from hidden's {hidden.shape[1]}")
    if weight.device != hidden.device:
        raise ValueError(f"weight on {weight.device} but hidden on {hidden.device}")
    N = hidden.shape[0]
    if targets.shape != (N,) or targets.dtype != torch.int64 or targets.device != hidden.device:
        raise ValueError(
            f"targets: expected int64 [{N}] on {hidden.device}, got {targets.dtype} {tuple(targets.shape)} "
            f"on {targets.device}"
        )
    if mask is not None and (mask.shape != (N,) or mask.dtype != torch.bool or mask.device != hidden.device):
        raise ValueError(f"mask: expected bool [{N}] on {hidden.device}, got {mask.dtype} {tuple(mask.shape)}")
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ValueError(f"chunk_tokens: must be an int >= 1, got {chunk_tokens!r}")


def linear_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    vocab_block_tiles: int = DEFAULT_VOCAB_BLOCK_TILES,
    vocab_start: int = 0,
    global_vocab_size: int | None = None,
    tp_group: Any = None,
    backend: str = "auto",
    mask: torch.Tensor | None = None,
    determinism: str = "cross_tp_bitwise",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(logp, lse, entropy|None), fp32 [N], of log_softmax(hidden @ weight.T / temperature) at `targets`.

    hidden: [N, H]; weight: this rank's lm_head rows [V_local, H] (global rows from `vocab_start`),
    same dtype (bf16, fp16 or fp32). Other arguments as `token_logprobs_with_entropy`.
    Differentiable w.r.t. hidden and weight. Under TP (`tp_group`), outputs and d(hidden) come back
    complete and identical on every rank (d(hidden) is reduced over the group inside, in a fixed
    order: do not all-reduce it again); d(weight) is this rank's shard.

    chunk_tokens: rows per GEMM. vocab_block_tiles: log-prob tiles per vocab block (every shard
    must hold whole blocks). Bits: for one chunk_tokens, vocab_block_tiles, backend and device, a
    token's outputs and d(hidden) row are independent of the rest of the call and of the TP degree.
    Memory: one [chunk_tokens, block] logits block at a time, an fp32 d(weight) accumulator
    [V_local, H], and two fp32 numbers per token saved for backward.
    """
    _validate(hidden, weight, targets, mask, chunk_tokens)
    V_local = weight.shape[0]
    contract = build_contract(
        weight.new_empty((0, V_local)), temperature=temperature, vocab_start=vocab_start,
        global_vocab_size=global_vocab_size, tp_group=tp_group, masked=mask is not None,
        with_entropy=with_entropy, determinism=determinism,
    )
    impl = select(backend, contract)
    blocks = plan_vocab_blocks(contract.sharding, vocab_block_tiles)
    # The backend runs each block as a vocab shard: it must serve that contract too (select raises).
    select(impl.name, dataclasses.replace(contract, sharding=blocks.block_layout(0)))
    if contract.sharding.tp_world_size > 1:
        verify_group_agreement(
            tp_group, contract,
            f"{impl.name}+linear_head(chunk_tokens={chunk_tokens}, block={blocks.width}, hidden={hidden.shape[1]})",
        )
    plan = _Plan(impl, blocks, float(temperature), chunk_tokens, with_entropy, tp_group)
    # hidden is copied chunk by chunk into one staging buffer, so any layout will do; the weight's
    # blocks feed the GEMMs directly and must have one layout.
    weight_c = weight if weight.is_contiguous() else weight.contiguous()
    targets = targets.contiguous()
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        return _LinearLogprobFunction.apply(hidden, weight_c, targets, mask, plan)
    with torch.no_grad():
        return _forward(plan, hidden, weight_c, targets, mask)
