"""GRPO advantages from rewards and groups: plain Python, no torch.

The coordinator computes every trajectory's advantage before it ships the
step to the trainer, so this lives in the contract both sides import; the
trainer's GRPO math (services/trainer/loss/surrogate.py) imports it from here.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

DEFAULT_ADVANTAGE_EPS = 1e-6


class SupportsToList(Protocol):
    """A tensor or array of rewards (torch.Tensor, numpy.ndarray): anything with `tolist()`."""

    def tolist(self) -> list[float]: ...


def group_advantages(
    rewards: Sequence[float] | SupportsToList,
    group_ids: Sequence[str],
    *,
    eps: float = DEFAULT_ADVANTAGE_EPS,
    std_normalization: bool = True,
) -> list[float]:
    """GRPO advantages: (reward - group mean) / (group std + eps), per sample.

    `group_ids[i]` names the group (one prompt) of `rewards[i]`; samples of a
    group need not be adjacent. The std is the population std (ddof=0): a
    group whose rewards are all equal (including a group of one) gets
    advantage 0 everywhere — it carries no learning signal — instead of the
    NaN a sample std would give for a single sample.

    `std_normalization=False` is Dr. GRPO's advantage, reward - group mean:
    dividing by the std weights the groups whose rewards barely differ most.

    Computed in float64 with Python sums in input order, so the coordinator
    (plain lists) and tests get the same bits on every machine.
    """
    values = rewards.tolist() if hasattr(rewards, "tolist") else list(rewards)
    if len(values) != len(group_ids):
        raise ValueError(f"rewards: {len(values)} values for {len(group_ids)} group ids")
    if not eps >= 0:
        raise ValueError(f"eps: must be >= 0, got {eps}")
    members: dict[str, list[int]] = {}
    for i, (r, g) in enumerate(zip(values, group_ids)):
        if not math.isfinite(float(r)):
            raise ValueError(f"rewards[{i}]: not finite ({r})")
        members.setdefault(g, []).append(i)
    out = [0.0] * len(values)
    for idx in members.values():
        group = [float(values[i]) for i in idx]
        if max(group) == min(group):
            # Exactly 0, not a rounding residue of (r - mean) nor 0/0 at eps=0.
            continue
        mean = sum(group) / len(group)
        if not std_normalization:
            for i, r in zip(idx, group):
                out[i] = r - mean
            continue
        std = math.sqrt(sum((r - mean) ** 2 for r in group) / len(group))
        for i, r in zip(idx, group):
            out[i] = (r - mean) / (std + eps)
    return out
