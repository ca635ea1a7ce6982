"""Importance-sampling correction of the train/inference mismatch (pure functions + config).

The rollout engine samples from pi_rollout; the trainer's policy at the same
weights is pi_train, and kernels, dtypes and batch shapes make the two differ
(docs/DESIGN.md). With `mode: none` the PPO ratio is taken against the rollout's
log-probs, exactly as before: clipping then acts on that mismatch.

The other modes decouple the two (decoupled PPO, as in AReaL; truncated IS as
in "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training",
Yao et al. 2025; masked IS as in verl's rollout correction): the PPO ratio is
taken against the trainer's own pre-update log-probs (one update per step, so
it is 1 and its gradient is the policy gradient), and each token's loss is
weighted by w = pi_train / pi_rollout, computed at the token, the whole
sequence (product over its tokens) or the sequence's geometric mean, then
- truncate: w -> min(w, upper) (TIS), bounding the variance;
- mask: w -> 0 outside [lower, upper] (MIS), dropping tokens or sequences the
  rollout sampled from a distribution too far from the trainer's.
The weights carry no gradient.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator


class MismatchCorrection(BaseModel):
    """How token losses are reweighted for the rollout/trainer mismatch; the default changes nothing."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    mode: Literal["none", "truncate", "mask"] = Field(
        "none",
        description="'none': PPO ratio against the rollout's log-probs (no correction). 'truncate': decoupled "
        "ratio, loss weighted by min(w, upper). 'mask': decoupled ratio, loss weighted by w inside "
        "[lower, upper] and 0 outside.")
    level: Literal["token", "sequence", "geometric"] = Field(
        "token",
        description="Where w = pi_train / pi_rollout is measured: per token, per sequence (product over its "
        "response tokens), or per sequence as the geometric mean (length-normalised).")
    upper: float = Field(2.0, gt=1, description="Upper bound of w (truncation cap, or mask upper edge).")
    lower: float | None = Field(
        None, gt=0, lt=1, description="Lower edge of the mask (mode 'mask' only; default 1 / upper).")

    @model_validator(mode="after")
    def _consistent(self) -> MismatchCorrection:
        if self.lower is not None and self.mode != "mask":
            raise ValueError(f"lower: only used by mode 'mask', but mode is {self.mode!r}")
        if self.mode == "none" and (self.level != "token" or self.upper != 2.0):
            raise ValueError("mode: 'none' ignores level and upper; set mode to 'truncate' or 'mask', or drop them")
        return self

    @property
    def mask_lower(self) -> float:
        return self.lower if self.lower is not None else 1.0 / self.upper


@dataclass(frozen=True)
class CorrectionWeights:
    weights: torch.Tensor   # float32 [N], no grad: multiplies each token's loss
    affected: torch.Tensor  # bool [N]: truncated or masked


def correction_weights(log_ratio: torch.Tensor, sample_index: torch.Tensor,
                       config: MismatchCorrection) -> CorrectionWeights:
    """Per-token weights from log(pi_train / pi_rollout) of each response token.

    `sample_index[i]` is the sequence token i belongs to (any ids; tokens of a
    sequence need not be adjacent). Sequence sums run in float64 in token order.
    """
    if log_ratio.shape != sample_index.shape or log_ratio.dim() != 1:
        raise ValueError(f"correction_weights: want equal 1-d shapes, got {tuple(log_ratio.shape)} and "
                         f"{tuple(sample_index.shape)}")
    if config.mode == "none":
        return CorrectionWeights(torch.ones_like(log_ratio, dtype=torch.float32),
                                 torch.zeros_like(log_ratio, dtype=torch.bool))
    d = log_ratio.detach().double()
    if config.level == "token":
        log_w = d
    else:
        seqs, inverse = torch.unique(sample_index, return_inverse=True)
        sums = torch.zeros(len(seqs), dtype=torch.float64).index_add_(0, inverse, d)
        if config.level == "geometric":
            counts = torch.zeros(len(seqs), dtype=torch.float64).index_add_(0, inverse, torch.ones_like(d))
            sums = sums / counts
        log_w = sums[inverse]
    w = torch.exp(log_w)
    if config.mode == "truncate":
        affected = w > config.upper
        weights = torch.clamp(w, max=config.upper)
    else:  # mask
        affected = (w < config.mask_lower) | (w > config.upper)
        weights = torch.where(affected, torch.zeros_like(w), w)
    return CorrectionWeights(weights.float(), affected)
