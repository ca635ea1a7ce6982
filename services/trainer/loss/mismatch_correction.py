"""Importance-sampling correction of the train/inference mismatch: pure functions.

Their settings, `trainer.mismatch_correction`, are MismatchCorrection in
contract/trainer_settings.py.

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
The weights carry no gradient. log w is clamped to +-policy_loss.log_ratio_bound
before exp, as verl clamps it (the run spec keeps [lower, upper] inside
e^+-bound, so the clamp never changes a truncation or mask decision).
"""
from __future__ import annotations

from dataclasses import dataclass
import torch

from contract.trainer_settings import MismatchCorrection


@dataclass(frozen=True)
class CorrectionWeights:
    weights: torch.Tensor   # float32 [N], no grad: multiplies each token's loss
    affected: torch.Tensor  # bool [N]: truncated or masked
    clamped: torch.Tensor   # bool [N]: log w was beyond the bound and clamped before exp


def correction_weights(log_ratio: torch.Tensor, sample_index: torch.Tensor, config: MismatchCorrection, *,
                       log_ratio_bound: float) -> CorrectionWeights:
    """Per-token weights from log(pi_train / pi_rollout) of each response token.

    `sample_index[i]` is the sequence token i belongs to (any ids; tokens of a
    sequence need not be adjacent). Sequence sums run in float64 in token order.
    """
    if log_ratio.shape != sample_index.shape or log_ratio.dim() != 1:
        raise ValueError(f"correction_weights: want equal 1-d shapes, got {tuple(log_ratio.shape)} and "
                         f"{tuple(sample_index.shape)}")
    if config.mode == "none":
        nothing = torch.zeros_like(log_ratio, dtype=torch.bool)
        return CorrectionWeights(torch.ones_like(log_ratio, dtype=torch.float32), nothing, nothing)
    d = log_ratio.detach().double()
    if config.level == "token":
        log_w = d
    else:
        seqs, inverse = torch.unique(sample_index, return_inverse=True)
        sums = torch.zeros(len(seqs), dtype=torch.float64, device=d.device).index_add_(0, inverse, d)
        if config.level == "geometric":
            counts = torch.zeros(len(seqs), dtype=torch.float64, device=d.device).index_add_(
                0, inverse, torch.ones_like(d))
            sums = sums / counts
        log_w = sums[inverse]
    clamped = log_w.abs() > log_ratio_bound
    w = torch.exp(torch.clamp(log_w, -log_ratio_bound, log_ratio_bound))
    if config.mode == "truncate":
        affected = w > config.upper
        weights = torch.clamp(w, max=config.upper)
    else:  # mask
        affected = (w < config.mask_lower) | (w > config.upper)
        weights = torch.where(affected, torch.zeros_like(w), w)
    return CorrectionWeights(weights.float(), affected, clamped)
