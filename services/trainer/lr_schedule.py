"""Learning-rate schedule of a run: linear warmup, then constant, linear or cosine decay to a floor.

The learning rate is a pure function of the optimizer step (`lr_at`), never
state that a scheduler object carries forward. That is what keeps resume
exact: a run restored from a checkpoint at step k, or a coordinator that
replays a step, needs nothing but the step number to apply the same rate the
uninterrupted run would have. The trainer writes `lr_at(step, ...)` into
every parameter group right before each optimizer update, so an lr restored
from an optimizer state_dict is never the one that gets used.

Steps are 1-based: step s is the update that takes policy_version s-1 to s.
"""
from __future__ import annotations

import math
from contract.trainer_settings import LRSchedule


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
