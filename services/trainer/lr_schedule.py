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
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class LRSchedule(BaseModel):
    """How the learning rate moves with the step; the default keeps it at `lr` exactly."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    warmup_steps: int = Field(
        0, ge=0,
        description="Linear warmup length: step s <= warmup_steps uses lr * s / warmup_steps, so step 1 "
        "uses lr / warmup_steps and step warmup_steps uses lr (0 = no warmup).")
    decay: Literal["constant", "linear", "cosine"] = Field(
        "constant",
        description="Shape after warmup: 'constant' stays at lr; 'linear' and 'cosine' go from lr at "
        "step warmup_steps down to lr * min_lr_ratio at step decay_steps and stay there.")
    decay_steps: int | None = Field(
        None, ge=1,
        description="The step at which 'linear' or 'cosine' decay reaches its floor (required by them, "
        "refused with 'constant'); must be greater than warmup_steps.")
    min_lr_ratio: float = Field(
        0.0, ge=0, le=1,
        description="Floor of the decay as a fraction of lr (only with 'linear' or 'cosine').")

    @model_validator(mode="after")
    def _consistent(self) -> LRSchedule:
        # A field that the chosen shape would ignore is refused rather than
        # silently dropped: a user who set it expected it to do something.
        if self.decay == "constant":
            if self.decay_steps is not None:
                raise ValueError(f"decay_steps: {self.decay_steps} is set but decay is 'constant' "
                                 "(set decay to 'linear' or 'cosine', or drop decay_steps)")
            if self.min_lr_ratio != 0.0:
                raise ValueError(f"min_lr_ratio: {self.min_lr_ratio} is set but decay is 'constant' "
                                 "(set decay to 'linear' or 'cosine', or drop min_lr_ratio)")
            return self
        if self.decay_steps is None:
            raise ValueError(f"decay_steps: required when decay is {self.decay!r}")
        if self.warmup_steps >= self.decay_steps:
            raise ValueError(f"warmup_steps: {self.warmup_steps} must be less than decay_steps "
                             f"({self.decay_steps})")
        return self


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
