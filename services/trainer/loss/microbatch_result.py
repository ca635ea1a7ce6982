"""What one microbatch's forward and backward leave for the rest of the step, and the step's metrics from them.

A step's microbatches may run on several ranks (services/trainer/distributed/data_parallel.py): each
rank's results travel to every rank (pickled over the control group, their tensors on the CPU) and come
back in global microbatch order, so the metrics and the update guard see the same results in the same
order whatever the number of ranks.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from services.common.metric_defs import STEP_METRIC_HELP
from services.trainer.data.batching import TrainSample
from services.trainer.loss.surrogate import sample_iw_range, step_metrics

# The keys TrainStep returns: the shared step-metric definitions minus what the
# coordinator measures itself (eval accuracy).
TRAIN_STEP_METRIC_KEYS: tuple[str, ...] = tuple(k for k in STEP_METRIC_HELP if k != "eval_accuracy")


def _moved(result, device: torch.device | str):
    """A copy of the frozen dataclass `result` with every tensor field on `device`."""
    return dataclasses.replace(result, **{
        f.name: value.to(device) for f in dataclasses.fields(result)
        if isinstance(value := getattr(result, f.name), torch.Tensor)})


@dataclass(frozen=True)
class MicrobatchResult:
    """One microbatch's share of a step, taken before the optimizer step: every tensor is flat [N] over
    its N response tokens (in the microbatch's token order) and carries no gradient."""

    loss: float
    """Its share of the step loss (policy_loss.MicrobatchLoss.loss); the shares sum to the step loss."""
    logp: torch.Tensor
    """float32: the trainer's pre-update log-prob of each token (the train/inference mismatch measure)."""
    rollout_logp: torch.Tensor
    """float32: the rollout's log-prob of each token."""
    clipped: torch.Tensor
    """bool: the token's ratio was clipped (no gradient from it)."""
    clamped: torch.Tensor
    """bool: a log-ratio of the token (policy ratio, IS weight, KL) was beyond its bound."""
    sample_index: torch.Tensor
    """int64: each token's sequence, an index in the step's canonical sample order."""
    positions: torch.Tensor
    """int64: each token's position in its sequence (prompt included)."""
    nonfinite: torch.Tensor
    """bool: the token's log-prob, loss or d loss / d log-prob is not finite (update_guard)."""
    is_weight: torch.Tensor
    """float32: the mismatch-correction weight of each token (1 with mode 'none')."""
    is_affected: torch.Tensor
    """bool: the token's weight was truncated or masked."""
    entropy: torch.Tensor
    """float32: the entropy of the temperature-scaled distribution each token was sampled from."""
    kl: torch.Tensor | None = None
    """float32: the k3 KL to the reference of each token; None when the run has no reference model."""
    moe_stats: torch.Tensor | None = None
    """float64 [layers, E + 4]: the microbatch's routing statistics (services/trainer/model/moe.py); None
    for a dense model."""
    teacher_logp: torch.Tensor | None = None
    """float32: the teacher's log-prob of each token (on-policy distillation); None without a teacher."""
    teacher_argmax: torch.Tensor | None = None
    """int64: the teacher's most likely token at each response position; None without a teacher."""
    student_argmax: torch.Tensor | None = None
    """int64: the trainer's (pre-update) most likely token at each response position; None without a teacher."""

    def to(self, device: torch.device | str) -> MicrobatchResult:
        return _moved(self, device)


@dataclass(frozen=True)
class TokenDeltas:
    """M2PO's input from one microbatch: each token's pre-update log-prob minus the rollout's (float32,
    `delta`) at its index in the step's canonical token order (int64, `keys`)."""

    keys: torch.Tensor
    delta: torch.Tensor

    def to(self, device: torch.device | str) -> TokenDeltas:
        return _moved(self, device)


def step_loss(results: Sequence[MicrobatchResult]) -> float:
    """The step loss: the microbatches' shares summed in microbatch order (one rank or many: the same sum)."""
    loss_value = 0.0
    for r in results:
        loss_value += r.loss
    return loss_value


def results_step_metrics(results: Sequence[MicrobatchResult], samples: list[TrainSample],
                         ordered: list[TrainSample], keep: torch.Tensor | None, *, loss_value: float,
                         grad_norm: float, lr: float) -> dict[str, float]:
    """The step's metrics (surrogate.step_metrics) from the microbatches' pre-update tensors, in
    microbatch order, keyed and ordered as TRAIN_STEP_METRIC_KEYS."""
    def cat(name: str) -> torch.Tensor:
        return torch.cat([getattr(r, name) for r in results])

    metrics = step_metrics(
        loss=loss_value, logp=cat("logp"), rollout_logp=cat("rollout_logp"), clipped=cat("clipped"),
        clamped=cat("clamped"), sample_index=cat("sample_index"), m2po_keep=keep, is_weight=cat("is_weight"),
        is_affected=cat("is_affected"), entropy=cat("entropy"),
        kl=cat("kl") if results[0].kl is not None else None,
        rewards=[s.reward for s in ordered], num_tokens_total=sum(s.num_tokens for s in samples),
        grad_norm=grad_norm, lr=lr)
    if set(metrics) != set(TRAIN_STEP_METRIC_KEYS):
        drifted = sorted(set(metrics) ^ set(TRAIN_STEP_METRIC_KEYS))
        raise AssertionError(f"step metric keys drifted from STEP_METRIC_HELP: {drifted}")
    out = {k: metrics[k] for k in TRAIN_STEP_METRIC_KEYS}
    if results and results[0].moe_stats is not None:  # MoE policies add metric_defs.MOE_STEP_METRIC_HELP's keys
        from services.trainer.model.moe import moe_step_metrics

        out.update(moe_step_metrics([r.moe_stats for r in results]))
    return out


def results_sample_weights(results: Sequence[MicrobatchResult],
                           ordered: list[TrainSample]) -> tuple[tuple[str, float, float], ...]:
    """(sample id, smallest IW, largest IW) of every sample of the step, in canonical order, from the same
    pre-update tensors as the step's iw_min / iw_max."""
    low, high = sample_iw_range(torch.cat([r.logp for r in results]), torch.cat([r.rollout_logp for r in results]),
                                torch.cat([r.sample_index for r in results]), len(ordered))
    return tuple((s.sample_id, lo, hi) for s, lo, hi in zip(ordered, low.tolist(), high.tolist(), strict=True))
