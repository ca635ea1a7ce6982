"""Mixture-of-experts routing with bits that depend only on the token's own router logits.

    weights, experts = route(logits, top_k, norm_topk_prob)   # logits [T, E]
    weights, experts = route(logits, top_k, norm_topk_prob, forced=ids)   # routing replay

The softmax, the top-k and the renormalisation are written in elementwise torch ops and reductions whose
order is fixed by the code, never by a library's choice of kernel for the tensor's shape:

* the row max is exact in any order; `exp(x - max)` is elementwise (kernels/moe/rowwise.py keeps a row off
  the CPU's scalar tail); the row sum is a pairwise tree over
  the expert axis built from elementwise adds of slices (`fixed_order_sum`), so a token's probabilities
  are the same bits whichever other tokens share the call, on every device;
* top-k takes k times the largest remaining probability, and among equal ones the lowest expert index
  (an exact integer min over the tied positions): ties are broken by the rule, never by a sort kernel;
* the renormalisation sums the k chosen weights in rank order.

It is Hugging Face's `Qwen3MoeTopKRouter` (softmax in float32, top-k on the probabilities, optional
renormalisation) with a defined tie rule and summation order. Replay (`forced`) takes the experts from
the caller, validated, and the weights from this token's own probabilities at those experts.
"""
from __future__ import annotations

import torch

from kernels.moe.rowwise import rowwise


class RoutingInputError(ValueError):
    """Routing input that cannot be used (expert ids out of range, wrong count...); names the argument."""


def fixed_order_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim by a pairwise tree of elementwise adds (keepdim): the order depends on the
    width only. Zero-padding to even widths adds exact zeros."""
    while x.shape[-1] > 1:
        if x.shape[-1] % 2:
            x = torch.cat([x, torch.zeros_like(x[..., :1])], dim=-1)
        x = x[..., 0::2] + x[..., 1::2]
    return x


def router_probabilities(logits: torch.Tensor) -> torch.Tensor:
    """float32 softmax over experts, row by row in a fixed order."""
    x = logits.float()
    shifted = rowwise(torch.exp, x - x.amax(-1, keepdim=True))
    return shifted / fixed_order_sum(shifted)


def top_k_lowest_index(probs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, indices) [T, k] of the k largest entries per row, in decreasing order; equal values are
    taken lowest expert index first."""
    n_experts = probs.shape[-1]
    if not 1 <= k <= n_experts:
        raise RoutingInputError(f"top_k: must lie in [1, {n_experts}], got {k}")
    index = torch.arange(n_experts, device=probs.device)
    remaining = probs.detach().clone()
    picks = []
    for _rank in range(k):
        best = remaining.amax(-1, keepdim=True)
        chosen = torch.where(remaining == best, index, n_experts).amin(-1, keepdim=True)
        picks.append(chosen)
        remaining.scatter_(-1, chosen, float("-inf"))
    indices = torch.cat(picks, dim=-1)
    return probs.gather(-1, indices), indices


def check_forced(forced: torch.Tensor, tokens: int, n_experts: int, k: int) -> torch.Tensor:
    if forced.dtype not in (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64):
        raise RoutingInputError(f"forced: expert ids must be integers, got {forced.dtype}")
    if tuple(forced.shape) != (tokens, k):
        raise RoutingInputError(f"forced: expected [{tokens}, {k}] expert ids (tokens x top_k), got {tuple(forced.shape)}")
    ids = forced.to(torch.int64)
    if tokens and bool(((ids < 0) | (ids >= n_experts)).any()):
        raise RoutingInputError(f"forced: expert ids must lie in [0, {n_experts}), got {ids.min().item()}..{ids.max().item()}")
    if k > 1 and tokens and bool((ids.sort(-1).values.diff(dim=-1) == 0).any()):
        raise RoutingInputError("forced: a token lists one expert twice")
    return ids


def route(logits: torch.Tensor, top_k: int, norm_topk_prob: bool,
          forced: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights float32 [T, k], experts int64 [T, k]) of router logits [T, E]. Differentiable in the weights."""
    probs = router_probabilities(logits)
    if forced is None:
        values, experts = top_k_lowest_index(probs, top_k)
    else:
        experts = check_forced(forced.to(logits.device), logits.shape[0], logits.shape[-1], top_k)
        values = probs.gather(-1, experts)
    if norm_topk_prob:
        total = values[..., :1]
        for rank in range(1, values.shape[-1]):
            total = total + values[..., rank:rank + 1]
        values = values / total
    return values, experts


def routing_stats(experts: torch.Tensor, probs: torch.Tensor, n_experts: int) -> dict[str, float]:
    """Per-step statistics of one layer's routing: tokens per expert (max, mean), dropped tokens (always 0:
    there is no capacity factor) and the mean router entropy in nats."""
    load = torch.bincount(experts.reshape(-1), minlength=n_experts).float()
    entropy = -(probs.float() * torch.log(probs.float().clamp_min(1e-30))).sum(-1)
    return {"expert_load_max": float(load.max()) if load.numel() else 0.0,
            "expert_load_mean": float(load.mean()) if load.numel() else 0.0,
            "dropped_tokens": 0.0,
            "router_entropy": float(entropy.mean()) if entropy.numel() else 0.0}
