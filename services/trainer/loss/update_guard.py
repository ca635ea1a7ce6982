"""Refuse a non-finite update before it reaches the weights, naming the step and the tokens that carry it.

Every log-ratio in the losses is bounded (services/trainer/loss/policy_loss.py), so a finite batch of log-probs
gives a finite loss and gradient whatever the rollout's staleness. What is left is the model itself: a
log-prob that came out NaN or inf from the forward (an overflow in a bf16 layer, a weight already broken), or
a backward that overflowed. The trainer checks the step's loss, its gradient norm, and each response token's
log-prob, loss and d loss / d log-prob before the optimizer step; any non-finite value refuses the step with
a message naming it, and the update is never applied.

Pure functions over tensors; the trainer raises its StepFailed with the message.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch

NAMED_TOKENS = 8
"""At most this many tokens are named in a refusal (the count is always given)."""


def nonfinite_tokens(token_loss: torch.Tensor, logp: torch.Tensor, logp_grad: torch.Tensor | None) -> torch.Tensor:
    """bool [N]: tokens whose log-prob, loss, or gradient of the step loss by their log-prob is not finite."""
    bad = ~torch.isfinite(logp.detach()) | ~torch.isfinite(token_loss.detach())
    if logp_grad is not None:
        bad = bad | ~torch.isfinite(logp_grad)
    return bad


def nonfinite_update(step: int, *, loss: float, grad_norm: float,
                     tokens: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
                     sample_ids: Sequence[str]) -> str | None:
    """None when the update is finite; else the refusal, naming the step and the non-finite tokens.

    `tokens` holds, per microbatch in order, (nonfinite [N] bool, sample_index [N], positions [N]): which
    tokens are not finite (nonfinite_tokens), each token's index into `sample_ids` (the step's canonical
    order) and its position in its sequence (prompt included)."""
    bad = [(sample_ids[int(i)], int(p)) for nonfinite, index, positions in tokens
           for i, p in zip(index.cpu()[nonfinite.cpu()], positions.cpu()[nonfinite.cpu()])]
    if math.isfinite(loss) and math.isfinite(grad_norm) and not bad:
        return None
    head = f"step {step}: non-finite update refused, no weights changed (loss {loss}, gradient norm {grad_norm})"
    if not bad:
        return (f"{head}; every response token's log-prob, loss and log-prob gradient is finite, so the "
                "non-finite values arose inside the model's backward")
    named = ", ".join(f"{sample_id} at position {position}" for sample_id, position in bad[:NAMED_TOKENS])
    more = f" (the first {NAMED_TOKENS})" if len(bad) > NAMED_TOKENS else ""
    return (f"{head}; {len(bad)} response tokens have a non-finite log-prob, loss or log-prob gradient: "
            f"{named}{more}")
