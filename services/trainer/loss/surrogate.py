"""GRPO math as pure functions: no model, no state, no device assumptions.

Entropy is not computed here: the trainer takes it from the shared log-prob
kernel (kernels.logprob.token_logprobs_with_entropy), so it is the entropy of
exactly the temperature-scaled distribution the log-probs come from.

Every function takes flat per-token tensors of *response* tokens only (the
caller has already applied the loss mask), so the same code serves padded and
packed microbatches. Tests check each one against hand-computed numbers.

Conventions
- `logp`: the trainer's log-prob of each sampled token (fp32, differentiable).
- `rollout_logp`: the log-prob the rollout engine reported when it sampled the
  token. It is the behaviour ("old") policy of the PPO ratio: the ratio is
  exp(logp - rollout_logp). Before the first update both sides hold the same
  weights, so that ratio is the train/inference mismatch (docs/DESIGN.md).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from contract.advantages import DEFAULT_ADVANTAGE_EPS, group_advantages  # noqa: F401 - part of the GRPO math API
from contract.trainer_settings import DEFAULT_LOG_RATIO_BOUND


# ------------------------------------------------------------ PPO-clip pieces --


def bounded_exp(log_ratio: torch.Tensor, bound: float) -> tuple[torch.Tensor, torch.Tensor]:
    """exp(clamp(log_ratio, -bound, bound)) and the mask of the entries the clamp changed.

    Without the bound a log-ratio of 90 overflows float32's exp to inf, whose product with A = 0 is NaN (and
    whose gradient times a zero upstream gradient is NaN too). Entries inside the bound keep the bits of
    exp(log_ratio) and its gradient; a clamped entry is a constant, as torch.clamp makes it (verl's clamp)."""
    clamped = log_ratio.detach().abs() > bound
    return torch.exp(torch.clamp(log_ratio, -bound, bound)), clamped


def clipped_surrogate(ratio: torch.Tensor, advantages: torch.Tensor, *, clip_low: float,
                      clip_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """-min(ratio * A, clip(ratio, 1 - low, 1 + high) * A) and the mask where the clipped branch won.

    A token is "clipped" when the clipped branch is the smaller one, i.e. the clip changed the objective
    and the token contributes no gradient (ratio > 1 + high with A > 0, or ratio < 1 - low with A < 0).
    policy_loss.ppo_clip_token_loss is the token-level PPO-clip loss made of these."""
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * advantages
    loss = -torch.minimum(unclipped, clipped)
    return loss, (clipped < unclipped).detach()


def k3(log_ratio: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 KL estimator exp(d) - d - 1 of a log-ratio d = log(p/q), x ~ q.

    Unbiased for KL(q || p), always >= 0, and exactly 0 where p == q.
    """
    return torch.exp(log_ratio) - log_ratio - 1.0


def kl_to_reference(logp: torch.Tensor, ref_logp: torch.Tensor, *,
                    log_ratio_bound: float = DEFAULT_LOG_RATIO_BOUND) -> torch.Tensor:
    """Per-token k3 estimate of KL(policy || reference) (GRPO's KL term).

    Tokens are samples of the policy, so the log-ratio is log(ref / policy), clamped to +-log_ratio_bound
    before exp as verl clamps it. Differentiable in `logp` (not where clamped).
    """
    return k3(torch.clamp(ref_logp - logp, -log_ratio_bound, log_ratio_bound))


# ------------------------------------------------------------ mismatch health --


@dataclass(frozen=True)
class MismatchStats:
    """How far the trainer's log-probs are from the rollout's, over response tokens."""

    iw_mean: float
    iw_min: float
    iw_max: float
    logprob_abs_diff_mean: float
    logprob_abs_diff_max: float
    approx_kl_k3: float
    m2po_m2: float

    def as_dict(self) -> dict[str, float]:
        return dict(self.__dict__)


def mismatch_stats(logp: torch.Tensor, rollout_logp: torch.Tensor) -> MismatchStats:
    """IW = exp(logp - rollout_logp) mean/min/max, |Δlogp| mean/max, k3 KL, M2PO m2.

    approx_kl_k3 estimates KL(rollout || trainer) from tokens the rollout
    sampled: k3 of log(trainer / rollout). m2po_m2 = mean(Δlogp^2), the second
    moment M2PO constrains (as M2PO and AReaL define it, no 1/2). Reductions run
    in float64 so the numbers do not depend on how many tokens a step holds.
    """
    if logp.shape != rollout_logp.shape or logp.dim() != 1:
        raise ValueError(f"mismatch_stats: want equal 1-d shapes, got {tuple(logp.shape)} and {tuple(rollout_logp.shape)}")
    if logp.numel() == 0:
        raise ValueError("mismatch_stats: no response tokens")
    d = logp.detach().double() - rollout_logp.detach().double()
    iw = torch.exp(d)
    absd = d.abs()
    # sum / n, not .mean(): CUDA's mean multiplies by 1/n, which makes the mean of n exact ones 1 - 1 ulp
    # for some n, and true on-policy runs report (and test) an IW mean of exactly 1.
    return MismatchStats(
        iw_mean=iw.sum().item() / iw.numel(),
        iw_min=iw.min().item(),
        iw_max=iw.max().item(),
        logprob_abs_diff_mean=absd.mean().item(),
        logprob_abs_diff_max=absd.max().item(),
        approx_kl_k3=k3(d).mean().item(),
        m2po_m2=(d * d).mean().item(),
    )


def sample_iw_range(logp: torch.Tensor, rollout_logp: torch.Tensor, sample_index: torch.Tensor,
                    num_samples: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sample's smallest and largest importance weight exp(logp - rollout_logp) over its response tokens
    (float64 [num_samples] each, as mismatch_stats computes them, so the step's iw_min/iw_max are their
    min/max exactly); NaN for a sample without a token."""
    iw = torch.exp(logp.detach().double() - rollout_logp.detach().double())
    index = sample_index.to(iw.device).long()
    low = torch.full((num_samples,), float("nan"), dtype=torch.float64, device=iw.device)
    high = low.clone()
    low = low.scatter_reduce(0, index, iw, reduce="amin", include_self=False)
    high = high.scatter_reduce(0, index, iw, reduce="amax", include_self=False)
    return low, high


def reward_stats(rewards: Sequence[float]) -> tuple[float, float]:
    """(mean, population std) of the step's rewards, float64."""
    if not rewards:
        raise ValueError("reward_stats: no rewards")
    mean = sum(rewards) / len(rewards)
    return mean, math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))


# ------------------------------------------------------------ step metrics --


def step_metrics(*, loss: float, logp: torch.Tensor, rollout_logp: torch.Tensor, clipped: torch.Tensor,
                 clamped: torch.Tensor, sample_index: torch.Tensor, m2po_keep: torch.Tensor | None, is_weight: torch.Tensor,
                 is_affected: torch.Tensor, entropy: torch.Tensor, kl: torch.Tensor | None,
                 rewards: Sequence[float], num_tokens_total: int, grad_norm: float, lr: float) -> dict[str, float]:
    """The step's metrics from its response tokens (every microbatch, in microbatch order) and rewards.

    Token tensors are flat [N] over the whole step; `sample_index` names each token's sequence.
    Means run in float64. seq_clip_fraction counts a sequence as clipped when any of its tokens is
    (under GSPO a sequence's tokens are clipped together). `clamped` marks the tokens with a log-ratio beyond
    its bound (policy_loss.MicrobatchLoss.clamped)."""
    n_tokens = logp.numel()
    seqs, inverse = torch.unique(sample_index, return_inverse=True)
    seq_clipped = torch.zeros(len(seqs), dtype=torch.bool, device=clipped.device).index_put_(
        (inverse,), clipped, accumulate=True)
    reward_mean, reward_std = reward_stats(list(rewards))
    return {
        "loss": loss,
        **mismatch_stats(logp, rollout_logp).as_dict(),
        "clip_fraction": clipped.double().mean().item(),
        "seq_clip_fraction": seq_clipped.double().mean().item(),
        "m2po_masked_fraction": 0.0 if m2po_keep is None else (~m2po_keep).double().mean().item(),
        "log_ratio_clamped_tokens": float(clamped.sum()),
        "grad_norm": grad_norm,
        "lr": lr,
        "is_weight_mean": is_weight.double().mean().item(),
        "is_affected_fraction": is_affected.double().mean().item(),
        "entropy": entropy.double().mean().item(),
        "kl_ref": kl.double().mean().item() if kl is not None else 0.0,
        "reward_mean": reward_mean,
        "reward_std": reward_std,
        "response_length_mean": n_tokens / len(rewards),
        "tokens_response": float(n_tokens),
        "tokens_total": float(num_tokens_total),
    }
