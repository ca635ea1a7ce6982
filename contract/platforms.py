"""Platform names and the platform-dependent SGLang server options a run may set: pydantic only, no torch.

Which platform a process runs on, and what follows from it (server flags, the
child's environment), is decided in services/common/platform.py; these are the
names and options both the coordinator (at submit time) and the rollout
service (at LoadModel) validate against.
"""
from __future__ import annotations

import enum
from typing import Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, field_validator

from contract.command_line import server_flag


class Platform(str, enum.Enum):
    """The platforms Lockstep runs on (kernels declare capabilities per platform under these names)."""

    CPU = "cpu"
    CUDA = "cuda"
    ROCM = "rocm"


# SGLang 0.5.23's own choices for --attention-backend (those for NVIDIA GPUs and the portable ones;
# sglang/srt/arg_groups/choices.py) and --lora-target-modules (sglang/srt/utils/common.py,
# SUPPORTED_LORA_TARGET_MODULES and 'all'). tests/rollout/sglang/test_sglang_command_line.py checks both
# against the installed SGLang. Enumerations, so no value a run chooses reads as an option.
CudaAttentionBackend = Literal[
    "fa3", "fa4", "flashinfer", "triton", "torch_native", "flex_attention", "flashmla", "trtllm_mha",
    "trtllm_mla", "cutedsl_mla", "hpc_ops", "dsa", "qsa", "dsv4",
]
LoraTargetModule = Literal[
    "all", "q_proj", "k_proj", "v_proj", "o_proj", "q_a_proj", "kv_a_proj_with_mqa", "q_b_proj", "kv_b_proj",
    "wq_b", "wk", "weights_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj", "gate_up_proj",
    "embed_tokens", "lm_head", "qkvr", "wo_ud",
]
CUDA_ATTENTION_BACKENDS: tuple[str, ...] = get_args(CudaAttentionBackend)
LORA_TARGET_MODULES: tuple[str, ...] = get_args(LoraTargetModule)


class SGLangPlatformConfig(BaseModel):
    """Platform-dependent SGLang server options (the rest of the command is the supervisor's).

    A field that becomes a server flag's value declares the flag (`server_flag`); the launch plan
    (services/common/platform.py) hands such values to the command builder only as SpecOptions.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    cuda_attention_backend: CudaAttentionBackend = Field(
        "fa3",
        json_schema_extra=server_flag("--attention-backend"),
        description="Attention backend on NVIDIA GPUs. fa3 (Hopper) is one SGLang accepts in deterministic "
        "mode and the one miles' true on-policy work uses; set flashinfer/triton for other GPUs.",
    )
    lora_backend: Literal["triton", "csgmv", "torch_native", "triton_v2"] | None = Field(
        None, json_schema_extra=server_flag("--lora-backend"),
        description="SGLang's LoRA kernel backend (--lora-backend). On NVIDIA GPUs None keeps SGLang's default "
        "(csgmv); on ROCm it is always triton (the others are CUDA-only), so anything else is refused there.",
    )
    max_lora_rank: int | None = Field(
        None, ge=1, le=1024, json_schema_extra=server_flag("--max-lora-rank"),
        description="Serve LoRA adapters up to this rank (--enable-lora --max-lora-rank): needed by a run with "
        "trainer.lora, whose rank must not exceed it. None: no LoRA. Not available on CPU (services/common/platform.py says why).",
    )
    lora_target_modules: tuple[LoraTargetModule, ...] = Field(
        ("all",), min_length=1, max_length=len(LORA_TARGET_MODULES),
        json_schema_extra=server_flag("--lora-target-modules"),
        description="Modules the server prepares LoRA buffers for (--lora-target-modules): 'all' alone, or SGLang's "
        "module names (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, ...). Used with max_lora_rank.",
    )
    deterministic: bool = Field(
        False,
        description="Pass --enable-deterministic-inference (batch-invariant kernels, per-request sampling seeds). "
        "GPU only: SGLang refuses it with the CPU torch_native backend, so CPU + deterministic is an error.",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", json_schema_extra=server_flag("--dtype"),
        description="Weights/activations dtype (--dtype). Must equal the trainer's. On CPU only float32 "
        "(or auto, meaning float32) is accepted: that is the configuration whose log-probs were measured.",
    )
    cpu_max_total_tokens: int = Field(
        8192,
        ge=256,
        json_schema_extra=server_flag("--max-total-tokens"),
        description="KV-cache size in tokens on CPU (--max-total-tokens). Without it SGLang sizes the pool from "
        "the free RAM of a machine shared with other processes.",
    )
    mem_fraction_static: float | None = Field(
        None,
        gt=0,
        lt=1,
        json_schema_extra=server_flag("--mem-fraction-static"),
        description="GPU memory fraction for weights + KV cache (--mem-fraction-static); None = SGLang's default. "
        "Set it when the trainer shares the GPU (colocated).",
    )
    chunked_prefill_size: int | None = Field(
        None,
        ge=-1,
        le=1 << 20,
        json_schema_extra=server_flag("--chunked-prefill-size"),
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

    @field_validator("lora_target_modules")
    @classmethod
    def _all_stands_alone(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        # SGLang asserts this at start-up (sglang/srt/arg_groups/lora_hook.py); refused here, at submit.
        if "all" in v and len(v) > 1:
            raise ValueError("'all' targets every module and cannot be combined with module names")
        if len(set(v)) != len(v):
            raise ValueError("names a module twice")
        return v
