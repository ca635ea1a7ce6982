"""Fail-closed backend registry: capabilities per platform, selection by contract.

Each backend declares, per platform, what it can serve (dtypes, determinism
scopes, mask modes, TP, entropy) and a loader that imports/builds it lazily.
Selection never substitutes one backend for another: an explicitly named
backend either serves the contract or raises; `auto` walks the platform's
preference order and, if nothing fits, raises an error that lists every
candidate with the reason it was rejected. `auto` is refused under TP > 1,
because two ranks resolving `auto` differently would merge partials of two
different definitions.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch

from contract.engine_options import LOGPROB_BACKEND_NAMES
from kernels.logprob.contract import (
    BackendUnavailable, DeterminismScope, LogprobContract, LogprobContractError, MaskMode, Platform,
)

BACKEND_NAMES = LOGPROB_BACKEND_NAMES  # the names a run spec may choose (torch-free contract)


class LogprobBackendError(LogprobContractError):
    """No backend (or not the one named) can serve the contract; the message lists why for each."""


class LogprobBackend(Protocol):
    """What the autograd Function in api.py calls; see reference.py for the semantics of each."""

    name: str

    def partials(self, logits, targets, layout, temperature, with_entropy): ...
    def merge(self, m, s, w, tgt, targets, global_vocab_size, active): ...
    def backward(self, logits, targets, lse, mean_x, g_logp, g_lse, g_ent, active, layout, temperature): ...


@dataclass(frozen=True)
class Capability:
    """What one backend serves on one platform."""

    dtypes: frozenset[torch.dtype]
    """Logit dtypes it reads."""
    determinism_scopes: frozenset[DeterminismScope] = frozenset(DeterminismScope)
    """Scopes whose promise its kernels keep (fixed in-tile order, tile-order merge)."""
    mask_modes: frozenset[MaskMode] = frozenset(MaskMode)
    tensor_parallel: bool = True
    """Can run on a vocab shard with partials all-gathered over a TP group."""
    entropy: bool = True
    """Can also return the entropy."""

    def rejection(self, contract: LogprobContract) -> str | None:
        """None if this capability serves `contract`, else the reason it does not."""
        if contract.input_dtype not in self.dtypes:
            have = ", ".join(sorted(str(d).removeprefix("torch.") for d in self.dtypes))
            return f"dtype {str(contract.input_dtype).removeprefix('torch.')} not supported (has {have})"
        if contract.determinism not in self.determinism_scopes:
            return f"determinism scope {contract.determinism.value} not supported"
        if contract.mask_mode not in self.mask_modes:
            return f"mask mode {contract.mask_mode.value} not supported"
        if contract.sharding.tp_world_size > 1 and not self.tensor_parallel:
            return "tensor-parallel vocab shards not supported"
        if contract.output.entropy and not self.entropy:
            return "entropy output not supported"
        return None


@dataclass
class BackendEntry:
    name: str
    capabilities: dict[Platform, Capability]
    """Platforms absent here are not served at all."""
    loader: Callable[[Platform], LogprobBackend]
    """Imports/builds the backend; raises BackendUnavailable(reason). Called once per platform, result cached."""
    _loaded: dict[Platform, LogprobBackend | BackendUnavailable] = field(default_factory=dict)

    def load(self, platform: Platform) -> LogprobBackend:
        with _LOCK:
            if platform not in self._loaded:
                try:
                    self._loaded[platform] = self.loader(platform)
                except BackendUnavailable as e:
                    self._loaded[platform] = e  # remembered: a failed build is not retried on every call
            got = self._loaded[platform]
        if isinstance(got, BackendUnavailable):
            raise got
        return got


_LOCK = threading.Lock()
_REGISTRY: dict[str, BackendEntry] = {}
# `auto` preference per platform. CPU prefers the reference: Triton on CPU is the
# interpreter (correctness only) and the native backend has no CPU build.
AUTO_ORDER: dict[Platform, tuple[str, ...]] = {
    Platform.CPU: ("reference", "triton"),
    Platform.CUDA: ("triton", "native", "reference"),
    Platform.ROCM: ("triton", "native", "reference"),
}


_GENERATION = [0]  # bumped on every change, so api.py's per-call plan cache never serves a stale selection


def register_backend(entry: BackendEntry) -> None:
    """Add or replace a backend (replacing is for tests that install a fake)."""
    with _LOCK:
        _REGISTRY[entry.name] = entry
        _GENERATION[0] += 1


def unregister_backend(name: str) -> None:
    with _LOCK:
        _REGISTRY.pop(name, None)
        _GENERATION[0] += 1


def registry_generation() -> tuple[int, int]:
    return (id(_REGISTRY), _GENERATION[0])


def registered_backends() -> dict[str, BackendEntry]:
    with _LOCK:
        return dict(_REGISTRY)


def _reject_reason(entry: BackendEntry | None, contract: LogprobContract) -> str | None:
    if entry is None:
        return "not registered"
    cap = entry.capabilities.get(contract.platform)
    if cap is None:
        return f"no {contract.platform.value} implementation"
    return cap.rejection(contract)


def select(requested: str, contract: LogprobContract) -> LogprobBackend:
    """The backend that serves `contract`, or LogprobBackendError naming every rejected candidate."""
    registry = registered_backends()
    if requested == "auto":
        if contract.sharding.tp_world_size > 1:
            raise LogprobBackendError(
                "backend='auto' is refused when TP > 1: ranks could resolve it differently; "
                f"name one of {', '.join(BACKEND_NAMES)} explicitly on every rank"
            )
        candidates = AUTO_ORDER[contract.platform]
    elif requested in registry or requested in BACKEND_NAMES:
        candidates = (requested,)
    else:
        raise LogprobBackendError(
            f"unknown logprob backend {requested!r}; choose one of {', '.join(BACKEND_NAMES)} or 'auto'"
        )
    rejected: list[str] = []
    for name in candidates:
        entry = registry.get(name)
        reason = _reject_reason(entry, contract)
        if reason is None:
            try:
                return entry.load(contract.platform)
            except BackendUnavailable as e:
                reason = f"unavailable: {e}"
        rejected.append(f"  {name}: {reason}")
    what = "no backend serves" if requested == "auto" else f"backend {requested!r} cannot serve"
    raise LogprobBackendError(
        f"{what} this logprob contract (platform={contract.platform.value}, "
        f"dtype={str(contract.input_dtype).removeprefix('torch.')}, determinism={contract.determinism.value}, "
        f"mask={contract.mask_mode.value}, tp={contract.sharding.tp_world_size}, "
        f"entropy={contract.output.entropy}); rejected candidates:\n" + "\n".join(rejected)
    )


# ---- group agreement: ranks compare (contract fingerprint, backend) before first use ----

_VERIFIED: set[tuple[int, str]] = set()


def verify_group_agreement(group: Any, contract: LogprobContract, backend_name: str) -> None:
    """All-gather a digest of (fingerprint, backend) once per group and contract; raise on any mismatch."""
    import hashlib

    import torch.distributed as dist

    digest = hashlib.sha256(f"{contract.fingerprint()}|{backend_name}".encode()).hexdigest()
    key = (id(group), digest)
    if key in _VERIFIED:
        return
    world = dist.get_world_size(group)
    mine = [None] * world
    dist.all_gather_object(mine, (dist.get_rank(group), digest, backend_name), group=group)
    differing = [f"rank {r}: {b} {d[:12]}" for r, d, b in mine if d != digest]
    if differing:
        raise LogprobContractError(
            f"TP ranks disagree on the logprob contract (this rank {dist.get_rank(group)}: {backend_name} "
            f"{digest[:12]}); differing: {'; '.join(differing)}. Same backend, temperature, dtype, vocab and "
            "determinism scope are required on every rank"
        )
    _VERIFIED.add(key)


# ---- built-in backends ----

_ALL_FLOAT = frozenset({torch.bfloat16, torch.float16, torch.float32})


def _load_reference(platform: Platform) -> LogprobBackend:
    from kernels.logprob.reference import ReferenceBackend

    return ReferenceBackend()


def _load_triton(platform: Platform) -> LogprobBackend:
    from kernels.logprob.triton_backend import load_triton_backend

    return load_triton_backend(platform)


def _load_native(platform: Platform) -> LogprobBackend:
    from kernels.logprob.native import load_native_backend

    return load_native_backend(platform)


register_backend(BackendEntry(
    "reference",
    {p: Capability(dtypes=_ALL_FLOAT) for p in Platform},
    _load_reference,
))
register_backend(BackendEntry(
    "triton",
    {p: Capability(dtypes=_ALL_FLOAT) for p in Platform},
    _load_triton,
))
# The native kernels (CUDA/HIP, one source) read bf16, fp16 and fp32 and return the entropy too.
register_backend(BackendEntry(
    "native",
    {p: Capability(dtypes=_ALL_FLOAT) for p in (Platform.CUDA, Platform.ROCM)},
    _load_native,
))
