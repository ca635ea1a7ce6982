"""Options of the embedded torch engine (LoadModelRequest.engine_config_json with engine=torch).

Apart from the engine so that the coordinator validates a run spec's
engine_options against it at submit time without importing the engine.
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from services.rollout.engine import parse_engine_config


class TorchEngineConfig(BaseModel):
    """Options of the embedded torch engine (LoadModelRequest.engine_config_json)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32",
        description="Weights and activations dtype; must equal the trainer's or step-1 importance weights drift.",
    )
    device: str = Field("cpu", min_length=1, description="torch device the model runs on ('cpu', 'cuda', 'cuda:1').")
    max_batch_size: int = Field(
        64,
        ge=1,
        le=65536,
        description="Sequences (prompts x samples) per forward; larger requests run as consecutive micro-batches.",
    )
    attn_implementation: str = Field(
        "sdpa",
        min_length=1,
        description="Hugging Face attention implementation; must match the trainer's (same model code, same kernels).",
    )
    logprob_backend: str = Field(
        "auto",
        min_length=1,
        description="kernels.logprob backend ('auto', 'reference', 'triton', 'native'); must match the trainer's.",
    )
    pad_token_id: int = Field(
        0,
        ge=0,
        description="Id placed in left padding and after a sequence finished. Those positions are masked out of "
        "attention, so any in-vocabulary id gives the same results.",
    )

    @field_validator("device")
    @classmethod
    def _device_name(cls, v: str) -> str:
        import torch

        try:
            device = torch.device(v)
        except (RuntimeError, ValueError) as exc:
            raise ValueError(f"not a torch device name ({exc})") from None
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"{v!r}: only 'cpu' and 'cuda[:N]' devices serve rollouts")
        return v

    @field_validator("logprob_backend")
    @classmethod
    def _known_backend(cls, v: str) -> str:
        from kernels.logprob.registry import BACKEND_NAMES

        if v != "auto" and v not in BACKEND_NAMES:
            raise ValueError(f"unknown backend {v!r}; known: {['auto', *BACKEND_NAMES]}")
        return v

    @classmethod
    def from_json(cls, text: str) -> "TorchEngineConfig":
        """Parse and validate; errors are ValueError naming the field (`engine_config.dtype: ...`)."""
        return parse_engine_config(cls, text)
