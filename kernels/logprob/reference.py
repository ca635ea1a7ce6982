"""Pure-torch reference backend: the oracle every optimized backend is tested against.

It follows the same definition as the kernels (fixed global tiling, fp32
per-tile (max, sumexp), merge in global tile order) using only elementwise torch
ops and exact reductions (max). Sums are done as explicit pairwise trees of
elementwise adds rather than `torch.sum`, because torch's reduction order may
depend on the tensor's size and thread count, and this backend promises
bitwise batch and TP invariance like the others. Memory is O(T x V) fp32: it is
the oracle, not the fast path.
"""
from __future__ import annotations

import torch

from kernels.logprob.tiling import ShardLayout

NEG_INF = float("-inf")


def tree_sum_lastdim(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim by pairwise halving; the order depends only on its length."""
    n = x.shape[-1]
    p = 1 << max(n - 1, 0).bit_length()
    if p != n:
        x = torch.nn.functional.pad(x, (0, p - n))  # + 0.0 is exact
    while x.shape[-1] > 1:
        h = x.shape[-1] // 2
        x = x[..., :h] + x[..., h:]
    return x[..., 0]


def scaled_logits(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """fp32 logits / temperature: the definition's x (division, as the kernels do)."""
    x = logits.float()
    return x / temperature if temperature != 1.0 else x


def _slot_view(x: torch.Tensor, layout: ShardLayout) -> torch.Tensor:
    """[T, V_local] -> [T, slots_per_rank, w] in global tile coordinates, -inf where no real column."""
    T = x.shape[0]
    w, S = layout.tile_width, layout.slots_per_rank
    buf = x.new_full((T, S * w), NEG_INF)
    lo = layout.slot_col_offset  # local column at slot position 0
    # Columns of this shard that are real vocab and fall inside the slot window.
    real_hi = min(layout.local_vocab_size, layout.global_vocab_size - layout.vocab_start)
    c0, c1 = max(0, lo), min(real_hi, lo + S * w)
    if c1 > c0:
        buf[:, c0 - lo : c1 - lo] = x[:, c0:c1]
    return buf.view(T, S, w)


def local_target_logit(x: torch.Tensor, targets: torch.Tensor, layout: ShardLayout) -> torch.Tensor:
    """x[t, target] for targets this shard holds (real vocab only), -inf elsewhere."""
    local = targets - layout.vocab_start
    owned = (local >= 0) & (local < layout.local_vocab_size) & (targets < layout.global_vocab_size)
    idx = torch.where(owned, local, torch.zeros_like(local)).unsqueeze(1)
    val = torch.gather(x, 1, idx).squeeze(1)
    return torch.where(owned, val, torch.full_like(val, NEG_INF))


def partials(
    logits: torch.Tensor, targets: torch.Tensor, layout: ShardLayout, temperature: float, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Per-slot fp32 (max, sumexp[, sum exp*x]) [T, S] and the local target logit [T]."""
    x = scaled_logits(logits, temperature)
    tiles = _slot_view(x, layout)
    m = tiles.amax(dim=-1)
    # A slot of only -inf has m=-inf; shift by 0 there so exp gives 0, not NaN.
    shift = torch.where(m == NEG_INF, torch.zeros_like(m), m)
    e = torch.exp(tiles - shift.unsqueeze(-1))
    s = tree_sum_lastdim(e)
    w = None
    if with_entropy:
        ex = torch.where(tiles == NEG_INF, torch.zeros_like(e), e * tiles)  # 0 * -inf would be NaN
        w = tree_sum_lastdim(ex)
    return m, s, w, local_target_logit(x, targets, layout)


def merge(
    m: torch.Tensor,
    s: torch.Tensor,
    w: torch.Tensor | None,
    tgt: torch.Tensor,
    targets: torch.Tensor,
    global_vocab_size: int,
    active: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Merge gathered partials [T, N] in slot order -> (logp, lse, entropy|None), 0 where inactive.

    Sequential left fold over slots: identity partials (-inf, 0) add an exact
    0.0, so padding slots change no bit wherever they sit.
    """
    M = m.amax(dim=-1)
    shift = torch.where(M == NEG_INF, torch.zeros_like(M), M)
    S = torch.zeros_like(M)
    W = torch.zeros_like(M) if w is not None else None
    for k in range(m.shape[1]):
        scale = torch.exp(m[:, k] - shift)
        S = S + s[:, k] * scale
        if W is not None:
            W = W + w[:, k] * scale
    lse = M + torch.log(S)
    valid = (targets >= 0) & (targets < global_vocab_size)
    logp = torch.where(valid, tgt - lse, torch.full_like(lse, float("nan")))
    ent = lse - W / S if W is not None else None
    if active is not None:
        zero = torch.zeros_like(lse)
        logp, lse = torch.where(active, logp, zero), torch.where(active, lse, zero)
        ent = torch.where(active, ent, zero) if ent is not None else None
    return logp, lse, ent


def backward(
    logits: torch.Tensor,
    targets: torch.Tensor,
    lse: torch.Tensor,
    mean_x: torch.Tensor | None,
    g_logp: torch.Tensor,
    g_lse: torch.Tensor,
    g_ent: torch.Tensor | None,
    active: torch.Tensor | None,
    layout: ShardLayout,
    temperature: float,
) -> torch.Tensor:
    """d/dlogits of g_logp*logp + g_lse*lse (+ g_ent*entropy), elementwise per (t, v): no reductions.

    With p = softmax(x): dlogp/dx = onehot - p, dlse/dx = p, dH/dx = p*(E[x] - x);
    then / temperature for x = logits / temperature.
    """
    x = scaled_logits(logits, temperature)
    V_local = x.shape[1]
    col = torch.arange(V_local, device=x.device) + layout.vocab_start
    real = (col < layout.global_vocab_size).unsqueeze(0) & (x != NEG_INF)
    p = torch.where(real, torch.exp(x - lse.unsqueeze(1)), torch.zeros_like(x))
    grad = (g_lse - g_logp).unsqueeze(1) * p
    if g_ent is not None:
        dx = torch.where(real, mean_x.unsqueeze(1) - x, torch.zeros_like(x))
        grad = grad + g_ent.unsqueeze(1) * (p * dx)
    local = targets - layout.vocab_start
    owned = (local >= 0) & (local < V_local) & (targets < layout.global_vocab_size)
    hit = (torch.arange(V_local, device=x.device).unsqueeze(0) == local.unsqueeze(1)) & owned.unsqueeze(1)
    grad = grad + torch.where(hit, g_logp.unsqueeze(1), torch.zeros_like(grad))
    if temperature != 1.0:
        grad = grad / temperature
    if active is not None:
        grad = torch.where(active.unsqueeze(1), grad, torch.zeros_like(grad))
    return grad.to(logits.dtype)


class ReferenceBackend:
    name = "reference"
    partials = staticmethod(partials)
    merge = staticmethod(merge)
    backward = staticmethod(backward)
