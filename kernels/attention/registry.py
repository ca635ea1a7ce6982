"""Attention backend registry: capabilities per platform, selection that fails closed.

Each backend declares, per platform (cpu, cuda, rocm), a `Capability`: whether
it honours sequence boundaries, dtypes, head dims, determinism, sliding window.
`select_backend` picks the first capable available backend in priority order,
or the forced one; anything else raises `AttentionBackendError` naming the
backend and the reason. There is no fallback: if the forced backend cannot
serve the call, the call fails; if no backend can, the call fails listing
every backend with its reason.

Backends are imported lazily (`module:function` strings) so that importing
this package never imports flash_attn, FlexAttention or varlen kernels.

Usage accounting: every dispatch counts the backend name, so the step-1
parity gate can report which attention actually ran (`backend_usage()`).
"""
from __future__ import annotations

import contextlib
import importlib
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Iterator, Mapping

import torch

from contract.trainer_settings import AttentionPolicy
from kernels.attention.contract import (
    PLATFORMS,
    AttentionBackendError,
    Capability,
    PackedLayout,
    check_layout_values,
    check_qkv,
    platform_of,
)

# fn(q, k, v, layout, scale, window, deterministic) -> out, all per the contract in contract.py;
# `deterministic` tells kernels with a switch (flash_attn's backward) to take their reproducible path.
BackendFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, PackedLayout, float, "int | None", bool],
                     torch.Tensor]


@dataclass(frozen=True)
class AttentionBackend:
    name: str
    target: str
    """'module:function' implementing the contract; imported on first use."""
    capabilities: Mapping[str, Capability]
    """Platform ('cpu' | 'cuda' | 'rocm') -> what it offers there. A platform not listed is refused."""
    priority: int
    """Auto-selection order, lower first. The reference is last: correct everywhere, fast nowhere."""
    probe: str | None = None
    """'module:function' returning None when usable on a platform (arg), else the reason with an install hint."""
    description: str = ""
    _fn: list = field(default_factory=list, compare=False, repr=False)  # memo of the imported fn

    def load(self) -> BackendFn:
        if not self._fn:
            self._fn.append(_import(self.target))
        return self._fn[0]

    def unavailable_reason(self, platform: str) -> str | None:
        return _import(self.probe)(platform) if self.probe else None


def _import(target: str) -> Callable:
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


class AttentionRegistry:
    def __init__(self) -> None:
        self._backends: dict[str, AttentionBackend] = {}
        self._policy = AttentionPolicy()
        self._usage: Counter[str] = Counter()
        self._selection_cache: dict[tuple, AttentionBackend] = {}

    # ---- registration -------------------------------------------------------------------
    def register(self, backend: AttentionBackend, *, replace: bool = False) -> None:
        if backend.name in self._backends and not replace:
            raise ValueError(f"attention backend {backend.name!r} is already registered")
        unknown = set(backend.capabilities) - set(PLATFORMS)
        if unknown:
            raise ValueError(f"attention backend {backend.name!r}: unknown platforms {sorted(unknown)}")
        self._backends[backend.name] = backend
        self._selection_cache.clear()

    def unregister(self, name: str) -> None:
        self._backends.pop(name)
        self._selection_cache.clear()

    def names(self) -> list[str]:
        return sorted(self._backends, key=lambda n: (self._backends[n].priority, n))

    def get(self, name: str) -> AttentionBackend:
        try:
            return self._backends[name]
        except KeyError:
            raise AttentionBackendError(
                f"attention backend {name!r} is not registered (registered: {self.names()})") from None

    # ---- policy -----------------------------------------------------------------------------
    @property
    def policy(self) -> AttentionPolicy:
        return self._policy

    def set_policy(self, policy: AttentionPolicy) -> None:
        if policy.backend is not None:
            self.get(policy.backend)  # an unknown name fails now, not at the first forward
        self._policy = policy
        self._selection_cache.clear()

    @contextlib.contextmanager
    def use_policy(self, policy: AttentionPolicy) -> Iterator[None]:
        old = self._policy
        self.set_policy(policy)
        try:
            yield
        finally:
            self.set_policy(old)

    def forced(self, name: str) -> contextlib.AbstractContextManager[None]:
        """Force one backend inside a `with` block (tests, benchmarks, user override)."""
        return self.use_policy(self._policy.model_copy(update={"backend": name}))

    # ---- selection ----------------------------------------------------------------------------
    def select(self, *, device: torch.device, dtype: torch.dtype, head_dim: int, packed: bool,
               window: int | None) -> AttentionBackend:
        deterministic = self.deterministic_required()
        platform = platform_of(device)
        key = (platform, dtype, head_dim, packed, window is not None, deterministic, self._policy.backend)
        hit = self._selection_cache.get(key)
        if hit is not None:
            return hit
        request = dict(dtype=dtype, head_dim=head_dim, packed=packed, window=window, deterministic=deterministic)
        what = (f"platform={platform} dtype={dtype} head_dim={head_dim} packed={packed} "
                f"window={window} deterministic={deterministic}")
        if self._policy.backend is not None:
            backend = self.get(self._policy.backend)
            reason = self._refusal(backend, platform, request)
            if reason is not None:
                raise AttentionBackendError(
                    f"forced attention backend {backend.name!r} refused: it {reason} [{what}]")
            chosen = backend
        else:
            reasons = []
            chosen = None
            for name in self.names():
                backend = self._backends[name]
                reason = self._refusal(backend, platform, request)
                if reason is None:
                    chosen = backend
                    break
                reasons.append(f"{name}: {reason}")
            if chosen is None:
                raise AttentionBackendError(
                    f"no attention backend can serve [{what}]: " + "; ".join(reasons))
        self._selection_cache[key] = chosen
        return chosen

    def _refusal(self, backend: AttentionBackend, platform: str, request: dict) -> str | None:
        cap = backend.capabilities.get(platform)
        if cap is None:
            return f"does not run on platform {platform!r} (declares {sorted(backend.capabilities)})"
        reason = cap.refusal(**request)
        if reason is not None:
            return reason
        missing = backend.unavailable_reason(platform)
        if missing is not None:
            return f"is unavailable: {missing}"
        return None

    # ---- dispatch -------------------------------------------------------------------------------
    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: PackedLayout, *,
                  scale: float | None = None, window: int | None = None,
                  position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Packed causal self-attention through the selected backend (see contract.py)."""
        check_qkv(q, k, v, layout, window)
        check_layout_values(layout, q.shape[0], position_ids)
        deterministic = self.deterministic_required()
        backend = self.select(device=q.device, dtype=q.dtype, head_dim=q.shape[-1],
                              packed=layout.packed, window=window)
        self._usage[backend.name] += 1
        scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
        return backend.load()(q, k, v, layout, scale, window, deterministic)

    def deterministic_required(self) -> bool:
        required = self._policy.require_deterministic
        return torch.are_deterministic_algorithms_enabled() if required is None else required

    def usage(self) -> dict[str, int]:
        """Dispatch counts per backend since the last reset: what the parity gate reports as 'in use'."""
        return dict(self._usage)

    def reset_usage(self) -> None:
        self._usage.clear()


def _caps(platforms: tuple[str, ...], **kw) -> dict[str, Capability]:
    return {p: Capability(**kw) for p in platforms}


_HALF = frozenset({torch.float16, torch.bfloat16})
_FLOAT = frozenset({torch.float32, torch.float16, torch.bfloat16})

REGISTRY = AttentionRegistry()

REGISTRY.register(AttentionBackend(
    name="flash_attn",
    target="kernels.attention.flash_varlen:attention",
    probe="kernels.attention.flash_varlen:unavailable_reason",
    # deterministic: flash_attn's backward takes deterministic=True (we pass it when required).
    capabilities=_caps(("cuda", "rocm"), honours_boundaries=True, dtypes=_HALF, max_head_dim=256,
                       head_dim_multiple=8, deterministic=True, sliding_window=True),
    priority=10,
    description="flash_attn.flash_attn_varlen_func (Dao-AILab; on ROCm the Triton-AMD build, "
                "FLASH_ATTENTION_TRITON_AMD_ENABLE=TRUE)",
))
REGISTRY.register(AttentionBackend(
    name="torch_varlen",
    target="kernels.attention.torch_varlen:attention",
    probe="kernels.attention.torch_varlen:unavailable_reason",
    # deterministic: aten's flash backward runs its deterministic path when
    # torch.use_deterministic_algorithms(True) (checked on the H200 by the gpu test).
    capabilities=_caps(("cuda",), honours_boundaries=True, dtypes=_HALF, max_head_dim=256,
                       head_dim_multiple=8, deterministic=True, sliding_window=True),
    priority=20,
    description="torch.nn.attention.varlen.varlen_attn (torch >= 2.10, FlashAttention-2 kernels in aten)",
))
REGISTRY.register(AttentionBackend(
    name="flex",
    target="kernels.attention.flex:attention",
    probe="kernels.attention.flex:unavailable_reason",
    # Not declared deterministic: its Triton backward accumulates dK/dV with atomics
    # for GQA/blocks; not declared on cpu: eager flex there materialises scores.
    capabilities=_caps(("cuda", "rocm"), honours_boundaries=True, dtypes=_FLOAT, max_head_dim=256,
                       deterministic=False, sliding_window=True),
    priority=30,
    description="torch.nn.attention.flex_attention with a document (+causal, +window) block mask",
))
REGISTRY.register(AttentionBackend(
    name="reference",
    target="kernels.attention.reference:attention",
    capabilities={
        # CPU SDPA is deterministic; on GPUs its fused kernels' backward is not promised to be.
        "cpu": Capability(honours_boundaries=True, dtypes=_FLOAT, max_head_dim=1 << 16,
                          deterministic=True, sliding_window=True),
        **_caps(("cuda", "rocm"), honours_boundaries=True, dtypes=_FLOAT, max_head_dim=1 << 16,
                deterministic=False, sliding_window=True),
    },
    priority=1000,
    description="one scaled_dot_product_attention call per sequence: the definition the others are tested against",
))

REGISTRY.register(AttentionBackend(
    name="batch_invariant",
    target="kernels.attention.batch_invariant:attention",
    # deterministic: the forward is bitwise reproducible by construction; the backward recomputes
    # with SDPA restricted to flash (deterministic under use_deterministic_algorithms) or math.
    # Head dims: the Triton kernel zero-pads to a power of two up to 256; the CPU code takes any.
    capabilities={
        "cpu": Capability(honours_boundaries=True, dtypes=_FLOAT, max_head_dim=1 << 16, deterministic=True),
        **_caps(("cuda", "rocm"), honours_boundaries=True, dtypes=_FLOAT, max_head_dim=256, deterministic=True),
    },
    # After the reference: only ever used when forced (the true_on_policy numerics mode).
    priority=2000,
    description="kernels.batch_invariant.packed_attention: fixed KEY_BLOCK key reduction, a token's bits "
                "independent of the batch and equal to KV-cache decode (Triton on GPUs, pure torch on CPU)",
))


def packed_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                            max_seqlen: int, *, scale: float | None = None, window: int | None = None,
                            position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """The contract's entry point through the process-wide registry."""
    return REGISTRY.attention(q, k, v, PackedLayout(cu_seqlens, max_seqlen), scale=scale, window=window,
                              position_ids=position_ids)
