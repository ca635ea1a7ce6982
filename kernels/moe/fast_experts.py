"""`fast` mode's experts: torch's grouped matmul, with the token movement in as few memory passes as
deterministic code allows.

    out = fast_experts_forward(hidden, experts, weights, gate_up_proj, down_proj, act)
    # hidden [T, H]; experts, weights [T, k]; gate_up_proj [E, 2I, H]; down_proj [E, H, I]

The same function as experts.py's `experts_forward` (and Hugging Face's `Qwen3MoeExperts`), computed for
speed, not for batch invariance (torch's grouped matmul picks its tiles from the group sizes):

* the (token, rank) pairs are sorted by expert and each token's row is repeated into the sorted order once.
  Indexing's own backward scatters with `index_put_(accumulate=True)`, which under deterministic
  algorithms sorts the indices first; here the backward gathers each token's k row gradients back to
  (token, rank) order and sums them in float32: no atomics, no scatter, one rounding;
* the expert outputs go back to (token, rank) order through a permutation whose backward is the inverse
  permutation (a gather, not a scatter);
* the top-k weighting and the sum over ranks are one batched matmul ([1, k] x [k, H] per token, float32
  accumulation, one rounding) instead of a weighted copy of every row followed by a reduction.

Every step is deterministic on CUDA: same inputs, same bits. kernels/moe/hf_blocks.py binds it to the
experts modules in `fast` mode; `bench/moe_train.py --block-probe` times it against Hugging Face's
forward and experts.py's structure on the same inputs.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch

from kernels.moe.experts import expert_mlp, sort_by_expert


class _RepeatRows(torch.autograd.Function):
    """rows[j] = hidden[order[j] // k]: each token's row once per rank, in expert order."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, order: torch.Tensor, inverse: torch.Tensor, k: int) -> torch.Tensor:
        ctx.save_for_backward(inverse)
        ctx.k = k
        return hidden.index_select(0, order // k)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (inverse,) = ctx.saved_tensors
        # inverse[t * k + r] is the sorted row of token t's rank r: its k gradients, summed in float32.
        per_rank = grad.index_select(0, inverse).view(-1, ctx.k, grad.shape[-1])
        return per_rank.sum(1, dtype=torch.float32).to(grad.dtype), None, None, None


class _PermuteRows(torch.autograd.Function):
    """x[index] for a permutation `index` whose inverse is `inverse`; the backward is the inverse gather."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(inverse)
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


def inverse_permutation(order: torch.Tensor) -> torch.Tensor:
    """inverse[order[j]] = j, as a sort of `order`: the op experts.py's forward already runs under deterministic
    algorithms and inside the engine's captured decode step (a scatter's deterministic path is not that)."""
    return torch.argsort(order)


Combine = Literal["bmm", "elementwise"]


def fast_experts_forward(hidden: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
                         gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                         act: Callable[[torch.Tensor], torch.Tensor], *, combine: Combine = "bmm") -> torch.Tensor:
    """[T, H] in hidden's dtype: sum over ranks r of weights[:, r] * expert_{experts[:, r]}(hidden).
    `combine`: the weighting and rank sum as one batched matmul (the binding's), or as Hugging Face's
    elementwise product then sum (float32 accumulation of the rounded products; kept for the bench)."""
    tokens, k = experts.shape
    width = down_proj.shape[1]
    order, counts = sort_by_expert(experts, gate_up_proj.shape[0])
    inverse = inverse_permutation(order)
    rows = _RepeatRows.apply(hidden, order, inverse, k)
    out_sorted = expert_mlp(rows, gate_up_proj, down_proj, counts, act, impl="grouped_mm")
    out = _PermuteRows.apply(out_sorted, inverse, order).view(tokens, k, width)
    w = weights.to(hidden.dtype)
    if combine == "elementwise":
        return (out * w.unsqueeze(-1)).sum(1, dtype=torch.float32).to(hidden.dtype)
    if combine != "bmm":
        raise ValueError(f"combine: {combine!r}, not one of ['bmm', 'elementwise']")
    return torch.bmm(w.unsqueeze(1), out).view(tokens, width)
