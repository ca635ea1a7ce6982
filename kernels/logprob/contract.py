"""The typed contract a log-prob call is dispatched against, and its cross-rank fingerprint.

A contract says what is asked (sharding, input dtype, mask mode, temperature,
determinism scope, outputs) independently of which backend answers it. The
registry matches it against each backend's declared capabilities; TP ranks
compare its fingerprint before first use so that no two ranks ever run
different definitions (another backend, another temperature, another tiling)
and merge the results as if they were one.
"""
from __future__ import annotations

import enum
import hashlib
import json
from dataclasses import dataclass

import torch

from contract.platforms import Platform
from kernels.logprob.tiling import TILE_COUNT, ShardLayout


class BackendUnavailable(RuntimeError):
    """Raised by a loader when its backend cannot run here (package missing, build failed)."""


class LogprobContractError(ValueError):
    """A request that no definition-preserving execution can serve (refused before any work)."""


class DeterminismScope(str, enum.Enum):
    FIXED_TOPOLOGY = "fixed_topology"
    """Bitwise reproducible for a fixed TP degree, batch composition aside; shards may cut tiles."""
    CROSS_TP_BITWISE = "cross_tp_bitwise"
    """Additionally bitwise equal across TP degrees: needs every shard bound on a tile bound."""


class MaskMode(str, enum.Enum):
    NONE = "none"
    """Every token is active."""
    EXPLICIT_ACTIVE_MASK = "explicit_active_mask"
    """A bool [T] tensor marks active tokens; inactive ones get logp = lse = 0 and zero gradient."""


def platform_of(device: torch.device) -> Platform:
    """ROCm builds of torch expose AMD GPUs as device type 'cuda'; torch.version.hip tells them apart."""
    if device.type == "cpu":
        return Platform.CPU
    if device.type == "cuda":
        return Platform.ROCM if getattr(torch.version, "hip", None) else Platform.CUDA
    raise LogprobContractError(f"device type {device.type!r} is not a supported platform (cpu, cuda, rocm)")


@dataclass(frozen=True)
class OutputSpec:
    """What comes back: always fp32 and replicated (identical) on every TP rank."""

    entropy: bool = False
    """Also return the entropy of softmax(logits / temperature)."""
    dtype: torch.dtype = torch.float32
    """Output dtype of logp, lse (and entropy): fixed fp32 so both sides compare exactly."""


@dataclass(frozen=True)
class LogprobContract:
    sharding: ShardLayout
    """Global/padded vocab, this rank's shard bounds, TP rank and world size."""
    input_dtype: torch.dtype
    """dtype of the logits shard (bf16, fp16 or fp32)."""
    platform: Platform
    """Where the logits live."""
    temperature: float = 1.0
    """Scores log_softmax(logits / temperature); must equal the sampling temperature."""
    mask_mode: MaskMode = MaskMode.NONE
    determinism: DeterminismScope = DeterminismScope.CROSS_TP_BITWISE
    output: OutputSpec = OutputSpec()

    def __post_init__(self) -> None:
        if not (self.temperature > 0 and self.temperature < float("inf")):
            raise LogprobContractError(f"temperature: must be > 0 and finite, got {self.temperature}")
        if self.input_dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise LogprobContractError(f"logits: dtype must be bf16, fp16 or fp32, got {self.input_dtype}")
        if self.determinism is DeterminismScope.CROSS_TP_BITWISE and not self.sharding.tile_aligned:
            s = self.sharding
            raise LogprobContractError(
                f"determinism=cross_tp_bitwise needs shard bounds on tile bounds, but shards of {s.local_vocab_size} "
                f"columns cut tiles of {s.tile_width} (V={s.global_vocab_size}, {TILE_COUNT} tiles, TP={s.tp_world_size}); "
                f"use a vocab whose shards are multiples of {s.tile_width} columns, or determinism='fixed_topology'"
            )

    def fingerprint(self) -> str:
        """sha256 of everything ranks must agree on; rank-specific fields (rank, shard start) are left out."""
        s = self.sharding
        ident = {
            "definition": "lockstep.logprob/v1",
            "global_vocab_size": s.global_vocab_size,
            "padded_vocab_size": s.padded_vocab_size,
            "local_vocab_size": s.local_vocab_size,
            "tp_world_size": s.tp_world_size,
            "tile_count": TILE_COUNT,
            "tile_width": s.tile_width,
            "input_dtype": str(self.input_dtype),
            "platform": self.platform.value,
            "temperature": float(self.temperature).hex(),  # exact, unlike a decimal repr
            "mask_mode": self.mask_mode.value,
            "determinism": self.determinism.value,
            "entropy": self.output.entropy,
        }
        return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()
