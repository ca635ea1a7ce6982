"""Step-1 parity gate: trainer and rollout must agree before the first update.

Before the first optimizer step the trainer holds the rollout's weights, so
for every response token IW = exp(logp - rollout_logp) must be 1 up to
numerics. Seed 000 is what happens otherwise: an attention that ignored packed
boundaries gave IW mean 0.41 (max 1.5e5) while rewards looked normal, and the
run trained on garbage for 50 steps. `check_parity` turns that into a verdict;
`ParityVerdict.raise_if_failed` stops the run with a diagnostic naming the IW
statistics, the worst tokens (sample, position in its sequence) and the
attention and log-prob backends in use.

`mismatch_stats` is the same statistics without thresholds: the trainer
exports it every step (keys are the `lockstep_step_<key>` metric names in
services/common/metric_defs.py).

Pure functions over tensors: no model, no I/O. Statistics in float64 so that
the verdict does not depend on summation order of fp32 partial sums.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch
from pydantic import BaseModel, ConfigDict, Field


class ParityThresholds(BaseModel):
    """Bounds on trainer/rollout disagreement at step 1 (part of the run spec)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    iw_mean_tolerance: float = Field(
        1e-3, ge=0,
        description="Largest allowed |mean(IW) - 1| over response tokens, IW = exp(logp - rollout_logp). "
        "Seed 000: 0.9996 with varlen attention (passes), 0.41 with boundary-blind SDPA (fails).")
    iw_max: float = Field(
        3.0, gt=1,
        description="Largest allowed single-token IW. One token far above it means the trainer assigns much "
        "more probability than the sampler did: a numerics or masking bug concentrated somewhere.")
    logprob_abs_diff_mean: float = Field(
        0.03, ge=0,
        description="Largest allowed mean |logp - rollout_logp| over response tokens (the 0.03 gate of seed 003).")
    worst_tokens: int = Field(
        8, ge=0, le=1000,
        description="How many tokens with the largest |logp - rollout_logp| the diagnostic lists.")


def mismatch_stats(logp: torch.Tensor, rollout_logp: torch.Tensor, loss_mask: torch.Tensor) -> dict[str, float]:
    """Train/inference mismatch statistics over the tokens where loss_mask is True.

    iw_*: IW = exp(logp - rollout_logp); logprob_abs_diff_*: |logp - rollout_logp|;
    approx_kl_k3: mean((IW - 1) - log IW), the k3 estimator of KL(rollout || trainer) on rollout samples;
    m2po_m2: mean(0.5 * (logp - rollout_logp)^2); tokens: how many tokens were compared.
    """
    if not (logp.shape == rollout_logp.shape == loss_mask.shape) or logp.dim() != 1:
        raise ValueError(f"logp, rollout_logp and loss_mask must be equal-length 1-D tensors; got "
                         f"{tuple(logp.shape)}, {tuple(rollout_logp.shape)}, {tuple(loss_mask.shape)}")
    mask = loss_mask.to(torch.bool)
    if not bool(mask.any()):
        raise ValueError("no response tokens to compare (loss_mask is all False)")
    delta = (logp.detach().double() - rollout_logp.detach().double())[mask]
    if not bool(torch.isfinite(delta).all()):
        # inf - inf or NaN anywhere means the statistics below would be meaningless; say so.
        return {"tokens": float(delta.numel()), "nonfinite": float((~torch.isfinite(delta)).sum())}
    iw = delta.exp()
    return {
        "iw_mean": float(iw.mean()),
        "iw_min": float(iw.min()),
        "iw_max": float(iw.max()),
        "logprob_abs_diff_mean": float(delta.abs().mean()),
        "logprob_abs_diff_max": float(delta.abs().max()),
        "approx_kl_k3": float(((iw - 1) - delta).mean()),
        "m2po_m2": float((0.5 * delta.square()).mean()),
        "tokens": float(delta.numel()),
        "nonfinite": 0.0,
    }


@dataclass(frozen=True)
class WorstToken:
    sample: int
    """Index of the token's sample in the step (PackedMicrobatch.sample_index)."""
    sample_id: str
    position: int
    """position_ids of the compared logit row: its position in its sequence (its target token is at position + 1)."""
    logp: float
    rollout_logp: float

    @property
    def iw(self) -> float:
        return math.exp(self.logp - self.rollout_logp) if self.logp - self.rollout_logp < 700 else float("inf")


@dataclass(frozen=True)
class ParityVerdict:
    passed: bool
    failures: tuple[str, ...]
    stats: dict[str, float]
    worst: tuple[WorstToken, ...]
    attention_backend: str
    logprob_backend: str
    thresholds: ParityThresholds

    def message(self) -> str:
        head = "step-1 parity gate " + ("PASSED" if self.passed else "FAILED: " + "; ".join(self.failures))
        s = self.stats
        lines = [
            head,
            f"  attention backend: {self.attention_backend}; logprob backend: {self.logprob_backend}",
            "  " + ", ".join(f"{k}={v:.6g}" for k, v in s.items()),
        ]
        if self.worst:
            lines.append("  worst tokens (|logp - rollout_logp|):")
            lines += [f"    sample {w.sample} ({w.sample_id}) row position {w.position} (target at {w.position + 1}): "
                      f"logp={w.logp:.6g} "
                      f"rollout_logp={w.rollout_logp:.6g} iw={w.iw:.6g}" for w in self.worst]
        return "\n".join(lines)

    def raise_if_failed(self) -> None:
        if not self.passed:
            raise ParityGateError(self)


class ParityGateError(RuntimeError):
    """The run must stop: trainer and rollout disagree before any update. str() is the full diagnostic."""

    def __init__(self, verdict: ParityVerdict) -> None:
        super().__init__(verdict.message())
        self.verdict = verdict


def check_parity(
    logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    sample_index: torch.Tensor,
    position_ids: torch.Tensor,
    attention_backend: str,
    logprob_backend: str,
    sample_ids: Sequence[str] | None = None,
    thresholds: ParityThresholds = ParityThresholds(),
) -> ParityVerdict:
    """Compare trainer and rollout log-probs of one step's response tokens.

    All tensors are 1-D and aligned per logit row (as in PackedMicrobatch; concatenate a step's
    microbatches): logp is the trainer's, rollout_logp the rollout's, loss_mask marks response
    tokens, sample_index/position_ids locate each row in its sample. attention_backend and
    logprob_backend name what produced logp (e.g. ",".join(REGISTRY.usage()) and the logprob
    kernel's backend); they appear in the verdict so a failure names its suspects.
    """
    n = logp.shape[0]
    for name, t in (("sample_index", sample_index), ("position_ids", position_ids)):
        if t.shape != (n,):
            raise ValueError(f"{name} must be 1-D with {n} entries, got {tuple(t.shape)}")
    stats = mismatch_stats(logp, rollout_logp, loss_mask)
    failures: list[str] = []
    if stats["nonfinite"]:
        failures.append(f"{int(stats['nonfinite'])} response tokens have non-finite logp - rollout_logp")
    else:
        dev = abs(stats["iw_mean"] - 1.0)
        if not dev <= thresholds.iw_mean_tolerance:
            failures.append(f"|IW mean - 1| = {dev:.4g} > {thresholds.iw_mean_tolerance:g}")
        if not stats["iw_max"] <= thresholds.iw_max:
            failures.append(f"IW max = {stats['iw_max']:.4g} > {thresholds.iw_max:g}")
        if not stats["logprob_abs_diff_mean"] <= thresholds.logprob_abs_diff_mean:
            failures.append(f"mean |logp - rollout_logp| = {stats['logprob_abs_diff_mean']:.4g} > "
                            f"{thresholds.logprob_abs_diff_mean:g}")
    worst = _worst_tokens(logp, rollout_logp, loss_mask, sample_index, position_ids, sample_ids,
                          thresholds.worst_tokens)
    return ParityVerdict(passed=not failures, failures=tuple(failures), stats=stats, worst=worst,
                         attention_backend=attention_backend, logprob_backend=logprob_backend,
                         thresholds=thresholds)


def _worst_tokens(logp, rollout_logp, loss_mask, sample_index, position_ids, sample_ids, k) -> tuple[WorstToken, ...]:
    rows = loss_mask.to(torch.bool).nonzero().flatten().cpu()
    if k == 0 or rows.numel() == 0:
        return ()
    lp, rl = logp.detach().double().cpu()[rows], rollout_logp.detach().double().cpu()[rows]
    # Non-finite differences rank first (nan_to_num maps NaN/inf to the largest double).
    score = torch.nan_to_num((lp - rl).abs(), nan=float("inf"))
    # Stable sort: ties keep row order, so the report is deterministic.
    top = torch.sort(score, descending=True, stable=True).indices[:k]
    si, pos = sample_index.cpu()[rows], position_ids.cpu()[rows]
    return tuple(
        WorstToken(sample=int(si[j]), sample_id=sample_ids[int(si[j])] if sample_ids else str(int(si[j])),
                   position=int(pos[j]), logp=float(lp[j]), rollout_logp=float(rl[j]))
        for j in top.tolist())
