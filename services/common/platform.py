"""Which platform this process runs on, and every decision that follows from it.

One place for platform facts (docs/DESIGN.md, "Portability without an AMD GPU"):
ROCm behaviour can't be run here, so it is tested by the decisions this
module makes given an environment. Two pure functions carry them:

- `detect_platform(env, torch_hip=..., cuda_available=...)`: CPU, CUDA or ROCm.
- `sglang_launch_plan(platform, config, env)`: the SGLang server flags and the
  child process's environment changes for that platform.

Why each ROCm decision (as miles' Qwen3-4B LoRA RL launcher for AMD found them):
- SGLang's default attention and LoRA kernels on CUDA (flashinfer / fa3 /
  csgmv) are CUDA-only; on ROCm both are pinned to Triton.
- Ray resets *_VISIBLE_DEVICES when it starts workers unless told not to
  (RAY_EXPERIMENTAL_NOSET_{HIP,CUDA}_VISIBLE_DEVICES=1), which would move a
  worker onto another GPU than the one the operator chose.
- Code above the HIP runtime reads CUDA_VISIBLE_DEVICES, so the operator's
  HIP_VISIBLE_DEVICES is copied there.
- NCCL_NVLS_ENABLE=0: NVLink SHARP does not exist on ROCm and RCCL's topology
  probe for it must not run.

LoRA serving (`max_lora_rank` set) is refused on CPU: SGLang 0.5.23 builds its
LoRA layers with a pinned host tensor (sglang/srt/lora/layers.py,
`torch.tensor(..., pin_memory=True)`), which on a host without CUDA fails at
server start with "RuntimeError: Found no NVIDIA driver on your system",
whichever --lora-backend is chosen (torch_native included).

Log-prob parity with the trainer on ROCm (measured on MI300X with Qwen3:
exact agreement needed every one of these):
- SGLANG_ROPE_CACHE_FP32=1: SGLang keeps its RoPE cos/sin cache in fp32 on
  CUDA but casts it to the model dtype on every other platform unless told
  not to; the trainer's (Hugging Face) rotary tables are fp32, and the BF16
  cache alone kept the log-probs apart.
- deterministic mode adds `--rl-on-policy-target fsdp` (SGLang's kernels
  follow the Hugging Face / FSDP training forward: RMSNorm cast order, RoPE
  numerics, decode through the extend attention kernel) and
  NCCL_ALGO=allreduce:tree (RCCL reduces in one fixed order under tensor
  parallelism), beside --enable-deterministic-inference.
"""
from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from contract.command_line import SpecOption, spec_option
from contract.platforms import Platform, SGLangPlatformConfig

PLATFORM_ENV = "LOCKSTEP_PLATFORM"
"""Operator override of detection: 'cpu', 'cuda' or 'rocm'."""

# Entry-point name and activation variable of the out-of-tree SGLang CPU
# platform (deploy/sglang/cpu_platform). Kept here, beside the other platform
# decisions, and checked against the plugin's own constants by a test.
SGLANG_CPU_PLUGIN_NAME = "lockstep_cpu"
SGLANG_CPU_PLUGIN_ENV = "LOCKSTEP_SGLANG_CPU_PLATFORM"

# Set for every SGLang server on ROCm (why: module docstring).
ROCM_LOGPROB_PARITY_ENV: dict[str, str] = {"SGLANG_ROPE_CACHE_FP32": "1"}
# Added on ROCm in deterministic mode.
ROCM_DETERMINISTIC_FLAGS: tuple[str, ...] = ("--rl-on-policy-target=fsdp",)
ROCM_DETERMINISTIC_ENV: dict[str, str] = {"NCCL_ALGO": "allreduce:tree"}
CONSTANT_FLAG = re.compile(r"--[a-z0-9][a-z0-9-]*(=[^-\s\x00][^\s\x00]*)?")
"""One element of a launch plan's own flags: '--switch' or '--flag=value', the value not readable as a flag."""
SERVER_FIELD_PREFIX = "engine_config.server."
"""Where SGLangPlatformConfig sits in the engine options (for the names in errors)."""


def detect_platform(env: Mapping[str, str], *, torch_hip: str | None, cuda_available: bool) -> Platform:
    """The platform for these facts. Pure: the caller passes what torch reports.

    `LOCKSTEP_PLATFORM` wins (an operator may want the CPU path on a GPU host);
    an unknown value is an error, not a guess. Otherwise a ROCm build of torch
    (torch.version.hip set) that sees a device is ROCm, a device without it is
    CUDA, and no device is CPU.
    """
    override = env.get(PLATFORM_ENV, "").strip().lower()
    if override:
        try:
            return Platform(override)
        except ValueError:
            raise ValueError(
                f"{PLATFORM_ENV}: unknown platform {override!r}; expected one of {[p.value for p in Platform]}"
            ) from None
    if cuda_available:
        return Platform.ROCM if torch_hip else Platform.CUDA
    return Platform.CPU


def probe_platform(env: Mapping[str, str]) -> Platform:
    """`detect_platform` with the facts read from this process's torch."""
    import torch

    return detect_platform(
        env, torch_hip=getattr(torch.version, "hip", None), cuda_available=torch.cuda.is_available()
    )


@dataclass(frozen=True)
class SGLangLaunchPlan:
    """What the platform decides about an SGLang server: flags, the run's options, environment changes.

    `flags` are this module's constants, each one element (`--switch` or `--flag=constant`); every value
    taken from the run's config is in `options`, which only the command builder renders
    (contract.command_line.render_spec_options), checking each against its grammar.
    """

    platform: Platform
    flags: tuple[str, ...]
    options: tuple[SpecOption, ...] = ()
    env_updates: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for flag in self.flags:  # no element on its own that a value could occupy
            if not CONSTANT_FLAG.fullmatch(flag):
                raise ValueError(f"launch plan flag {flag!r}: not one '--flag' or '--flag=value' element")

    def child_env(self, base: Mapping[str, str]) -> dict[str, str]:
        """The child process's environment: `base` with this plan's updates applied."""
        return {**base, **self.env_updates}


def sglang_launch_plan(platform: Platform, config: SGLangPlatformConfig, env: Mapping[str, str]) -> SGLangLaunchPlan:
    """Flags, run options and environment for an SGLang server on `platform`. Pure; tested exactly per platform.

    --enable-metrics everywhere: SGLang's own Prometheus metrics are scraped
    beside Lockstep's.
    """
    env_updates: dict[str, str] = {}
    options: list[SpecOption] = []

    def option(name: str) -> None:  # a config value: rendered by the command builder only
        options.append(spec_option(config, name, SERVER_FIELD_PREFIX))

    if platform is Platform.CPU:
        if config.max_lora_rank is not None:
            raise ValueError(
                "max_lora_rank: SGLang cannot serve LoRA adapters on CPU (its LoRA layers pin host memory, "
                "sglang/srt/lora/layers.py, and fail at start with 'RuntimeError: Found no NVIDIA driver on your "
                "system'); on CPU use engine=torch for LoRA runs"
            )
        if config.deterministic:
            raise ValueError(
                "deterministic: SGLang's --enable-deterministic-inference needs a GPU attention backend "
                "(fa3/flashinfer/triton); on CPU use engine=torch for deterministic runs"
            )
        if config.dtype not in ("auto", "float32"):
            raise ValueError(f"dtype: SGLang on CPU runs float32 only, got {config.dtype!r}")
        flags = [
            "--device=cpu",
            # Plain SDPA over the paged KV cache: no Triton, flashinfer or sgl-kernel on a CPU.
            "--attention-backend=torch_native",
            "--disable-cuda-graph",
            "--dtype=float32",
            # Warm-up sends a text request; with input ids only (no tokenizer) it is pure start-up cost.
            "--skip-server-warmup",
            # An idle scheduler otherwise polls its sockets in a busy loop: a whole core, on a host whose
            # cores the trainer and the other services share. Asleep, it wakes on the next request.
            "--sleep-on-idle",
        ]
        option("cpu_max_total_tokens")
        env_updates[SGLANG_CPU_PLUGIN_ENV] = "1"
        # Select the plugin by name: SGLang then fails at start-up, naming it,
        # when it is not installed, instead of falling back to another platform.
        env_updates["SGLANG_PLATFORM"] = SGLANG_CPU_PLUGIN_NAME
    elif platform is Platform.ROCM:
        if config.lora_backend not in (None, "triton"):
            raise ValueError(f"lora_backend: {config.lora_backend!r} is CUDA-only; on ROCm SGLang's LoRA runs on triton")
        flags = ["--attention-backend=triton", "--lora-backend=triton"]
        option("dtype")
        hip = env.get("HIP_VISIBLE_DEVICES")
        if hip is not None:
            env_updates["CUDA_VISIBLE_DEVICES"] = hip
        env_updates["RAY_EXPERIMENTAL_NOSET_HIP_VISIBLE_DEVICES"] = "1"
        env_updates["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"] = "1"
        env_updates["NCCL_NVLS_ENABLE"] = "0"
        env_updates.update(ROCM_LOGPROB_PARITY_ENV)
        if config.deterministic:
            flags += ROCM_DETERMINISTIC_FLAGS
            env_updates.update(ROCM_DETERMINISTIC_ENV)
    elif platform is Platform.CUDA:
        flags = []
        option("cuda_attention_backend")
        option("dtype")
        if config.lora_backend is not None:
            option("lora_backend")
    else:  # pragma: no cover - exhaustive over the enum
        raise ValueError(f"platform: unsupported {platform!r}")
    if platform is not Platform.CPU and config.mem_fraction_static is not None:
        option("mem_fraction_static")
    if config.chunked_prefill_size is not None:
        option("chunked_prefill_size")
    if config.max_lora_rank is not None:
        flags.append("--enable-lora")
        option("max_lora_rank")
        option("lora_target_modules")
    if config.deterministic:
        flags.append("--enable-deterministic-inference")
    flags.append("--enable-metrics")
    return SGLangLaunchPlan(platform=platform, flags=tuple(flags), options=tuple(options), env_updates=env_updates)
