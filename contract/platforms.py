"""Platform names and the platform-dependent SGLang server options a run may set: pydantic only, no torch.

Which platform a process runs on, and what follows from it (server flags, the
child's environment), is decided in services/common/platform.py; these are the
names and options both the coordinator (at submit time) and the rollout
service (at LoadModel) validate against.
"""
from __future__ import annotations

import enum
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class Platform(str, enum.Enum):
    """The platforms Lockstep runs on (kernels declare capabilities per platform under these names)."""

    CPU = "cpu"
    CUDA = "cuda"
    ROCM = "rocm"


class SGLangPlatformConfig(BaseModel):
    """Platform-dependent SGLang server options (the rest of the command is the supervisor's)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    cuda_attention_backend: str = Field(
        "fa3",
        min_length=1,
        description="Attention backend on NVIDIA GPUs. fa3 (Hopper) is one SGLang accepts in deterministic "
        "mode and the one miles' true on-policy work uses; set flashinfer/triton for other GPUs.",
    )
    lora_backend: Literal["triton", "csgmv", "torch_native", "triton_v2"] | None = Field(
        None,
        description="SGLang's LoRA kernel backend (--lora-backend). On NVIDIA GPUs None keeps SGLang's default "
        "(csgmv); on ROCm it is always triton (the others are CUDA-only), so anything else is refused there.",
    )
    max_lora_rank: int | None = Field(
        None, ge=1, le=1024,
        description="Serve LoRA adapters up to this rank (--enable-lora --max-lora-rank): needed by a run with "
        "trainer.lora, whose rank must not exceed it. None: no LoRA. Not available on CPU (services/common/platform.py says why).",
    )
    lora_target_modules: tuple[str, ...] = Field(
        ("all",), min_length=1,
        description="Modules the server prepares LoRA buffers for (--lora-target-modules): 'all' or SGLang's module "
        "names (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, ...). Used with max_lora_rank.",
    )
    deterministic: bool = Field(
        False,
        description="Pass --enable-deterministic-inference (batch-invariant kernels, per-request sampling seeds). "
        "GPU only: SGLang refuses it with the CPU torch_native backend, so CPU + deterministic is an error.",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="Weights/activations dtype (--dtype). Must equal the trainer's. On CPU only float32 "
        "(or auto, meaning float32) is accepted: that is the configuration whose log-probs were measured.",
    )
    cpu_max_total_tokens: int = Field(
        8192,
        ge=256,
        description="KV-cache size in tokens on CPU (--max-total-tokens). Without it SGLang sizes the pool from "
        "the free RAM of a machine shared with other processes.",
    )
    mem_fraction_static: float | None = Field(
        None,
        gt=0,
        lt=1,
        description="GPU memory fraction for weights + KV cache (--mem-fraction-static); None = SGLang's default. "
        "Set it when the trainer shares the GPU (colocated).",
    )
    chunked_prefill_size: int | None = Field(
        None,
        ge=-1,
        le=1 << 20,
        description="Most prompt tokens one prefill step computes (--chunked-prefill-size); longer prompts are "
        "prefilled in chunks of this size, which bounds the activation memory a long prompt takes next to the KV "
        "cache. -1 turns chunking off; None = SGLang's default.",
    )

    @field_validator("chunked_prefill_size")
    @classmethod
    def _chunk_is_a_size_or_off(cls, v: int | None) -> int | None:
        if v == 0:
            raise ValueError("0 tokens per prefill chunk cannot make progress; give a size >= 1, or -1 for no chunking")
        return v
