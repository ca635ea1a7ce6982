"""A mixture-of-experts block's experts on one grouped GEMM per projection, combined in a fixed order.

    out = experts_forward(hidden, experts, weights, gate_up_proj, down_proj, act)
    # hidden [T, H]; experts, weights [T, k] (route()); gate_up_proj [E, 2I, H]; down_proj [E, H, I]

The token-expert pairs are sorted by expert (a stable sort: within an expert, token order then rank
order), gathered, and each projection is one `grouped_linear` over all experts; SiLU-and-mul is
elementwise (the SiLU through kernels/moe/rowwise.py, so no row falls on the CPU's scalar tail). The
outputs go back to (token, rank) order and are combined in top-k rank order:
acc = 0; acc += weight_r * out_r for r = 0..k-1, in float32, cast once. With a batch-invariant
grouped GEMM each pair's expert output is the bits it would have alone, and the combination is a fixed
sequence of elementwise ops of the token's own values, so a token's output does not depend on which
other tokens (nor how many) were routed with it. This is Hugging Face's `Qwen3MoeExperts` math (the
weights cast to the model dtype as its router returns them) with a defined summation.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from kernels.moe.grouped import GroupedImpl, grouped_linear
from kernels.moe.rowwise import rowwise


def sort_by_expert(experts: torch.Tensor, n_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(order, counts): the flat (token, rank) pairs in expert order (stable), and rows per expert."""
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    # Not bincount: on CUDA it reads the max id back to the host, which a captured decode step cannot do.
    # Integer adds are exact in any order.
    counts = torch.zeros(n_experts, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
    return order, counts


def expert_mlp(rows: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor, counts: torch.Tensor,
               act: Callable[[torch.Tensor], torch.Tensor], *, impl: GroupedImpl = "auto") -> torch.Tensor:
    """Each row (sorted by expert, counts[e] rows of expert e) through its expert's SwiGLU MLP: [M, H]."""
    gate_up = grouped_linear(rows, gate_up_proj, counts, impl=impl)
    gate, up = gate_up.chunk(2, dim=-1)
    return grouped_linear(rowwise(act, gate) * up, down_proj, counts, impl=impl)


def combine_in_rank_order(out: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[T, H] in `dtype`: out [T, k, H] (each token's expert outputs in top-k rank order) weighted by
    weights [T, k] and summed rank 0 first, in float32, cast once."""
    w = weights.to(dtype).float()
    acc = out[:, 0].float() * w[:, :1]
    for rank in range(1, out.shape[1]):
        acc = acc + out[:, rank].float() * w[:, rank:rank + 1]
    return acc.to(dtype)


def experts_forward(hidden: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, gate_up_proj: torch.Tensor,
                    down_proj: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor], *,
                    impl: GroupedImpl = "auto") -> torch.Tensor:
    """[T, H] in hidden's dtype: sum over ranks r of weights[:, r] * expert_{experts[:, r]}(hidden)."""
    tokens, k = experts.shape
    n_experts = gate_up_proj.shape[0]
    order, counts = sort_by_expert(experts, n_experts)
    rows = hidden[order // k]  # [T*k, H], sorted by expert
    out_sorted = expert_mlp(rows, gate_up_proj, down_proj, counts, act, impl=impl)
    # Back to (token, rank) order: a gather. The width is explicit: with no tokens, -1 is ambiguous.
    out = out_sorted[torch.argsort(order)].reshape(tokens, k, down_proj.shape[1])
    return combine_in_rank_order(out, weights, hidden.dtype)
