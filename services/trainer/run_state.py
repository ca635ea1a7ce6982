"""A configured run's state in the trainer, and the weights snapshot it hands to whoever sends them.

`RunState` is what `Trainer.configure` builds and every call after it reads: the policy and optimizer,
the policy version that makes TrainStep exactly-once, and each applied step's metrics and digest, which a
checkpoint keeps (services/trainer/checkpoint.py, `TrainerState.of_run`). `WeightSnapshot` names one
weights state by `weights_epoch`, which every change of the weights bumps, so a sender can tell that the
tensors it streams are still current.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from contract.trainer_run import TrainerRunConfig
from services.common.models.loading import resolve_dtype
from services.common.weights.stream import LoraAdapterMeta
from services.trainer.model.policy import PolicyModule


@dataclass
class RunState:
    run_id: str
    model_path: str          # the run's initial model: reference policy and tokenizer come from here
    seed: int
    config: TrainerRunConfig
    policy: PolicyModule     # FSDP-sharded float32 masters; forward and backward in config.dtype
    ref_model: PolicyModule | None  # frozen initial policy in config.dtype, whole on every rank
    optimizer: torch.optim.Optimizer
    policy_version: int
    vocab_size: int
    step_metrics: dict[int, dict[str, float]] = field(default_factory=dict)
    step_digests: dict[int, str] = field(default_factory=dict)  # step -> trajectories_digest, beside its metrics
    weights_epoch: int = 0   # bumped by every change of the weights (step, checkpoint load)
    teacher: PolicyModule | None = None  # on-policy distillation's frozen teacher, whole on every rank (teacher.py)

    @property
    def model(self) -> PolicyModule:
        """The policy; called with Hugging Face arguments it returns the HF model's output (`.logits`)."""
        return self.policy

    @property
    def compute_dtype(self) -> torch.dtype:
        return resolve_dtype(self.config.dtype)


@dataclass(frozen=True)
class WeightSnapshot:
    """The live tensors of one weights state, and what identifies that state."""

    run: RunState
    weights_epoch: int
    policy_version: int
    tensors: list[tuple[str, torch.Tensor]]
    lora: LoraAdapterMeta | None = None  # set when `tensors` are a LoRA adapter's (peft's saved keys)
    cast_to: torch.dtype | None = None  # set when `tensors` are the masters: what a reader casts them to
