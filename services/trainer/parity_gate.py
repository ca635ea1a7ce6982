"""Step-1 parity gate: trainer and rollout must agree before the first update.

Before the first optimizer step the trainer holds the rollout's weights, so
for every response token IW = exp(logp - rollout_logp) must be 1 up to
numerics. Seed 000 is what happens otherwise: an attention that ignored packed
boundaries gave IW mean 0.41 (max 1.5e5) while rewards looked normal, and the
run trained on garbage for 50 steps. `check_parity` turns that into a verdict;
`ParityVerdict.raise_if_failed` stops the run with a diagnostic naming the IW
statistics, the worst tokens (sample, position in its sequence) and the
attention and log-prob backends in use.

The statistics are services/trainer/grpo.mismatch_stats, the same function
the trainer exports every step (`lockstep_step_iw_mean`, ...), so the gate and
the dashboards can never disagree about what "IW mean" means.

In numerics 'true_on_policy' trainer and rollout run the same batch-invariant
kernels, so the bounds are not the test: every response token's logp must
equal its rollout_logp bit for bit, and one token off by one ulp fails the
gate naming that token.

Pure functions over tensors: no model, no I/O; float64 reductions.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from contract.trainer_settings import ParityThresholds


def gate_stats(logp: torch.Tensor, rollout_logp: torch.Tensor) -> dict[str, float]:
    """The step metrics' mismatch statistics (services/trainer/grpo.mismatch_stats: one definition for the
    gate and the per-step export), plus how many tokens were compared and how many differences are non-finite."""
    from services.trainer.loss.surrogate import mismatch_stats

    delta = logp.detach().double() - rollout_logp.detach().double()
    stats = mismatch_stats(logp, rollout_logp).as_dict()
    stats["tokens"] = float(delta.numel())
    stats["nonfinite"] = float((~torch.isfinite(delta)).sum())
    return stats


@dataclass(frozen=True)
class WorstToken:
    sample: int
    """Index of the token's sample in the step (PackedMicrobatch.sample_index)."""
    sample_id: str
    position: int
    """Position of the token in its sample's sequence (prompt tokens count; the first token is 0)."""
    logp: float
    rollout_logp: float

    @property
    def iw(self) -> float:
        d = self.logp - self.rollout_logp
        return d if math.isnan(d) else math.exp(min(d, 700.0))


@dataclass(frozen=True)
class ParityVerdict:
    passed: bool
    failures: tuple[str, ...]
    stats: dict[str, float]
    worst: tuple[WorstToken, ...]
    attention_backend: str
    logprob_backend: str
    thresholds: ParityThresholds
    numerics: str = "fast"

    def message(self) -> str:
        head = "step-1 parity gate " + ("PASSED" if self.passed else "FAILED: " + "; ".join(self.failures))
        s = self.stats
        demand = ("bitwise equality of logp and rollout_logp" if self.numerics == "true_on_policy"
                  else "the thresholds below")
        lines = [
            head,
            f"  numerics: {self.numerics} (demands {demand})",
            f"  attention backend: {self.attention_backend}; logprob backend: {self.logprob_backend}",
            "  " + ", ".join(f"{k}={v:.6g}" for k, v in s.items()),
        ]
        if self.worst:
            lines.append("  worst tokens (|logp - rollout_logp|):")
            lines += [f"    sample {w.sample} ({w.sample_id}) position {w.position}: logp={w.logp:.6g} "
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
    *,
    sample_index: torch.Tensor,
    positions: torch.Tensor,
    attention_backend: str,
    logprob_backend: str,
    loss_mask: torch.Tensor | None = None,
    sample_ids: Sequence[str] | None = None,
    thresholds: ParityThresholds = ParityThresholds(),
    numerics: str = "fast",
) -> ParityVerdict:
    """Compare trainer and rollout log-probs of one step's response tokens.

    All tensors are 1-D and aligned token by token: logp is the trainer's, rollout_logp the
    rollout's, sample_index/positions say which sample each token belongs to and where it sits in
    that sample's sequence. loss_mask, when given, selects the tokens to compare (None: all are
    response tokens, as with PackedMicrobatch.response_* concatenated over a step's microbatches).
    sample_ids[i], when given, names sample i in the diagnostic.
    attention_backend and logprob_backend name what produced logp (e.g. ",".join(REGISTRY.usage())
    and the log-prob backend); they appear in the verdict so a failure names its suspects.
    numerics 'true_on_policy' (TrainerRunConfig.numerics) adds the demand that every logp equal its
    rollout_logp exactly; 'fast' applies the thresholds alone.
    """
    if numerics not in ("fast", "true_on_policy"):
        raise ValueError(f"numerics: {numerics!r} is not 'fast' or 'true_on_policy'")
    n = logp.shape[0]
    for name, t in (("rollout_logp", rollout_logp), ("sample_index", sample_index), ("positions", positions)) + (
            (("loss_mask", loss_mask),) if loss_mask is not None else ()):
        if t.dim() != 1 or t.shape[0] != n:
            raise ValueError(f"{name} must be 1-D with {n} entries like logp, got {tuple(t.shape)}")
    if loss_mask is not None:
        keep = loss_mask.to(torch.bool)
        logp, rollout_logp, sample_index, positions = (x[keep] for x in (logp, rollout_logp, sample_index, positions))
    if logp.numel() == 0:
        raise ValueError("parity gate: no response tokens to compare")
    stats = gate_stats(logp, rollout_logp)
    failures: list[str] = []
    if numerics == "true_on_policy":
        failures += _bitwise_failure(logp, rollout_logp, sample_index, positions, sample_ids)
    if stats["nonfinite"]:
        failures.append(f"{int(stats['nonfinite'])} response tokens have a non-finite logp - rollout_logp")
    # `not x <= bound` so that NaN statistics fail too.
    dev = abs(stats["iw_mean"] - 1.0)
    if not dev <= thresholds.iw_mean_tolerance:
        failures.append(f"|IW mean - 1| = {dev:.4g} > {thresholds.iw_mean_tolerance:g}")
    if not stats["iw_max"] <= thresholds.iw_max:
        failures.append(f"IW max = {stats['iw_max']:.4g} > {thresholds.iw_max:g}")
    if not stats["logprob_abs_diff_mean"] <= thresholds.logprob_abs_diff_mean:
        failures.append(f"mean |logp - rollout_logp| = {stats['logprob_abs_diff_mean']:.4g} > "
                        f"{thresholds.logprob_abs_diff_mean:g}")
    worst = _worst_tokens(logp, rollout_logp, sample_index, positions, sample_ids, thresholds.worst_tokens)
    return ParityVerdict(passed=not failures, failures=tuple(failures), stats=stats, worst=worst,
                         attention_backend=attention_backend, logprob_backend=logprob_backend,
                         thresholds=thresholds, numerics=numerics)


def _bitwise_failure(logp, rollout_logp, sample_index, positions, sample_ids) -> list[str]:
    """The true_on_policy demand: no token may differ at all (NaN differs from everything)."""
    # float64 holds every float32 exactly, so this compares the reported bits whatever the inputs' dtypes.
    lp, rl = logp.detach().double().cpu(), rollout_logp.detach().double().cpu()
    differ = ~(lp == rl)
    count = int(differ.sum())
    if count == 0:
        return []
    (w,) = _worst_tokens(lp, rl, sample_index, positions, sample_ids, 1)
    return [f"numerics 'true_on_policy' demands bitwise equality of logp and rollout_logp, but {count} of "
            f"{lp.numel()} response tokens differ; worst: sample {w.sample} ({w.sample_id}) position {w.position}: "
            f"logp={w.logp!r} rollout_logp={w.rollout_logp!r} (difference {w.logp - w.rollout_logp:.3g})"]


def _worst_tokens(logp, rollout_logp, sample_index, positions, sample_ids, k) -> tuple[WorstToken, ...]:
    if k == 0:
        return ()
    lp, rl = logp.detach().double().cpu(), rollout_logp.detach().double().cpu()
    # NaN ranks first; stable sort keeps ties in token order, so the report is deterministic.
    score = torch.nan_to_num((lp - rl).abs(), nan=float("inf"))
    top = torch.sort(score, descending=True, stable=True).indices[:k]
    si, pos = sample_index.cpu(), positions.cpu()
    return tuple(
        WorstToken(sample=int(si[j]), sample_id=sample_ids[int(si[j])] if sample_ids else str(int(si[j])),
                   position=int(pos[j]), logp=float(lp[j]), rollout_logp=float(rl[j]))
        for j in top.tolist())
