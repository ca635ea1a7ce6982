"""Learning-rate schedule of a run: linear warmup, then constant, linear or cosine decay to a floor.

The learning rate is a pure function of the optimizer step (`lr_at`), never
state that a scheduler object carries forward. That is what keeps resume
exact: a run restored from a checkpoint at step k, or a coordinator that
replays a step, needs nothing but the step number to apply the same rate the
uninterrupted run would have. The trainer writes `lr_at(step, ...)` into
every parameter group right before each optimizer update, so an lr restored
from an optimizer state_dict is never the one that gets used.

Steps are 1-based: step s is the update that takes policy_version s-1 to s.

With `staleness_scaling: inverse` the rate also depends on how stale the
step's tokens are (`staleness_factor`), which is a pure function of the
step's trajectories: a replayed or recomputed step sees the same versions and
gets the same rate.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

from contract.trainer_settings import LRSchedule
from services.trainer.data.batching import TrainSample


def lr_at(step: int, base_lr: float, schedule: LRSchedule) -> float:
    """The learning rate of optimizer step `step` (1-based) under `schedule`."""
    if step < 1:
        raise ValueError(f"step: {step}, optimizer steps are 1-based")
    if schedule.warmup_steps and step <= schedule.warmup_steps:
        # step / warmup_steps first: at step == warmup_steps it is exactly 1.0,
        # so warmup ends on base_lr to the bit.
        return base_lr * (step / schedule.warmup_steps)
    if schedule.decay == "constant":
        return base_lr
    assert schedule.decay_steps is not None  # the validator guarantees it
    span = schedule.decay_steps - schedule.warmup_steps
    progress = min(1.0, (step - schedule.warmup_steps) / span)
    if schedule.decay == "linear":
        shape = 1.0 - progress
    elif schedule.decay == "cosine":
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        raise ValueError(f"decay: {schedule.decay!r} is not implemented")
    # floor + (1 - floor) * shape rather than 1 - (1 - floor) * progress: at
    # the end shape is exactly 0, so the floor is lr * min_lr_ratio to the bit.
    floor = schedule.min_lr_ratio
    return base_lr * (floor + (1.0 - floor) * shape)


def mean_token_staleness(samples: Sequence[TrainSample]) -> float:
    """How many policy versions behind the trainer the step's model tokens were sampled, on average over
    the tokens (0.0 for a synchronous step)."""
    tokens = sum(s.num_model_tokens for s in samples)
    return sum(s.staleness_sum for s in samples) / tokens if tokens else 0.0


def staleness_factor(mean_staleness: float, scaling: str) -> float:
    """What `scaling` multiplies the step's rate by. 'inverse' is staleness-aware SGD's lr / tau with tau
    floored at 1, so a step at most one version behind on average (the synchronous loop, fixed_lag K = 1)
    keeps the rate and fixed_lag K = 2 halves it."""
    if mean_staleness < 0:
        raise ValueError(f"mean_staleness: {mean_staleness} < 0; a token cannot come from a newer policy")
    if scaling == "none":
        return 1.0
    if scaling == "inverse":
        return 1.0 / max(1.0, mean_staleness)
    raise ValueError(f"staleness_scaling: {scaling!r} is not implemented")
