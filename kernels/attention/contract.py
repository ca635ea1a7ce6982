"""The packed causal self-attention contract every backend implements.

Layout (the flash-attention "varlen" layout, no batch dimension):

    q:  [T, Hq,  D]   all sequences of a microbatch concatenated along T
    k:  [T, Hkv, D]   Hq % Hkv == 0 (grouped-query attention when Hkv < Hq)
    v:  [T, Hkv, D]
    cu_seqlens: int32 [N + 1], cu_seqlens[0] == 0, strictly increasing,
                cu_seqlens[-1] == T; sequence i owns rows cu[i]:cu[i+1]
    max_seqlen: int == max(cu[i+1] - cu[i])
    out: [T, Hq, D], same dtype as q

Semantics: token t of sequence i attends to keys j of the *same* sequence with
j <= t and, when `window` is set, j > t - window (HF's `sliding_window`: the
window counts the token itself). No token ever sees another sequence. That
sentence is the whole point of this package: when a
backend treats the packed buffer as one long sequence a Qwen3-8B run's importance weights were 0.41
at step 1, max 1.5e5, with rewards looking fine.

Everything here is cheap, host-side checking; the value checks that need the
contents of `cu_seqlens` (and so a device sync) run once per layout, cached by
tensor identity, because every decoder layer of a forward sees the same
`cu_seqlens` object.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from contract.platforms import Platform


class AttentionError(RuntimeError):
    """Base class: something about an attention call is refused. Never caught to fall back."""


class AttentionContractError(AttentionError, ValueError):
    """The inputs violate the packed-attention contract (shapes, cu_seqlens, masks, kwargs)."""


class AttentionBackendError(AttentionError):
    """No backend may serve this call, or the forced one may not. The message names the backend(s)."""


PLATFORMS = tuple(p.value for p in Platform)


def platform_of(device: torch.device) -> str:
    """'cpu', 'cuda' or 'rocm'. ROCm exposes AMD GPUs as torch 'cuda' devices; torch.version.hip tells them apart."""
    if device.type == "cpu":
        return "cpu"
    if device.type == "cuda":
        return "rocm" if torch.version.hip else "cuda"
    # mps, xpu, ...: no backend declares them, so selection refuses with this name.
    return device.type


@dataclass(frozen=True)
class Capability:
    """What one backend offers on one platform. Selection refuses anything outside it."""

    honours_boundaries: bool
    """True iff no query attends to a key of another sequence of the packed buffer (uses cu_seqlens)."""
    dtypes: frozenset[torch.dtype]
    """Input dtypes it computes in (out has the input dtype)."""
    max_head_dim: int
    """Largest head dim; head dims must also be a multiple of `head_dim_multiple`."""
    head_dim_multiple: int = 1
    deterministic: bool = False
    """Forward and backward give the same bits for the same inputs on the same device when
    `torch.use_deterministic_algorithms(True)` is on (some kernels pick their reduction then)."""
    sliding_window: bool = False
    """Supports `window` (local causal attention)."""

    def refusal(self, *, dtype: torch.dtype, head_dim: int, packed: bool, window: int | None,
                deterministic: bool) -> str | None:
        """Why this capability cannot serve the request, or None when it can."""
        if packed and not self.honours_boundaries:
            return ("does not honour sequence boundaries (cu_seqlens): a packed batch through it would "
                    "let tokens attend across sequences")
        if dtype not in self.dtypes:
            return f"does not compute in {dtype} (supports {sorted(str(d) for d in self.dtypes)})"
        if head_dim > self.max_head_dim or head_dim % self.head_dim_multiple:
            return (f"does not support head_dim={head_dim} (max {self.max_head_dim}, "
                    f"multiple of {self.head_dim_multiple})")
        if window is not None and not self.sliding_window:
            return f"does not support a sliding window (window={window})"
        if deterministic and not self.deterministic:
            return "is not deterministic and deterministic algorithms are required"
        return None


@dataclass(frozen=True)
class PackedLayout:
    """Boundaries of a packed buffer: the part of the contract that is not q/k/v."""

    cu_seqlens: torch.Tensor  # int32 [N+1], on the device of q
    max_seqlen: int

    @property
    def num_seqs(self) -> int:
        return self.cu_seqlens.numel() - 1

    @property
    def packed(self) -> bool:
        """More than one sequence shares the buffer, so boundaries matter."""
        return self.num_seqs > 1

    @staticmethod
    def from_lengths(lengths: list[int] | tuple[int, ...], device: torch.device | str = "cpu") -> "PackedLayout":
        if not lengths or min(lengths) < 1:
            raise AttentionContractError(f"sequence lengths must be >= 1 and non-empty, got {list(lengths)[:16]}")
        cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
        cu[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0).to(torch.int32)
        return PackedLayout(cu.to(device), int(max(lengths)))


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: PackedLayout,
              window: int | None) -> None:
    """Shape/dtype/device checks that need no device sync; run on every call."""
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise AttentionContractError(
            f"q/k/v must be [T, H, D]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if not (q.shape[0] == k.shape[0] == v.shape[0]):
        raise AttentionContractError(
            f"q/k/v must share T (self-attention over one packed buffer); got {q.shape[0]}, {k.shape[0]}, {v.shape[0]}")
    if k.shape != v.shape or q.shape[2] != k.shape[2]:
        raise AttentionContractError(f"k/v must be [T, Hkv, D] with q's D; got q {tuple(q.shape)}, "
                                     f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.shape[1] % k.shape[1]:
        raise AttentionContractError(f"query heads ({q.shape[1]}) must be a multiple of kv heads ({k.shape[1]})")
    if not (q.dtype == k.dtype == v.dtype):
        raise AttentionContractError(f"q/k/v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device == layout.cu_seqlens.device):
        raise AttentionContractError(
            f"q/k/v/cu_seqlens must share a device; got {q.device}, {k.device}, {v.device}, {layout.cu_seqlens.device}")
    cu = layout.cu_seqlens
    if cu.dim() != 1 or cu.numel() < 2 or cu.dtype != torch.int32:
        raise AttentionContractError(
            f"cu_seqlens must be a 1-D int32 tensor of N+1 >= 2 offsets; got {cu.dtype} {tuple(cu.shape)}")
    if not isinstance(layout.max_seqlen, int) or isinstance(layout.max_seqlen, bool):
        raise AttentionContractError(
            f"max_seqlen must be a Python int (a tensor would force a device sync in every layer); "
            f"got {type(layout.max_seqlen).__name__}")
    if window is not None and (not isinstance(window, int) or window < 1):
        raise AttentionContractError(f"window must be None or an int >= 1, got {window!r}")


class _LayoutCache:
    """Remembers the last few layouts whose *values* were checked.

    Keyed by tensor identity plus the tensor's version counter (bumped by any
    in-place write), and holding a strong reference so an id cannot be reused
    while cached. All decoder layers of one forward pass share one cu_seqlens
    tensor, so the device sync happens once per microbatch, not once per layer.
    """

    def __init__(self, size: int = 8) -> None:
        self._size = size
        self._entries: list[tuple[tuple, tuple]] = []  # (key, strong refs)

    @staticmethod
    def key(*tensors: torch.Tensor | None, extra: tuple = ()) -> tuple:
        return tuple((id(t), t._version) if t is not None else None for t in tensors) + extra

    def seen(self, key: tuple) -> bool:
        return any(k == key for k, _ in self._entries)

    def add(self, key: tuple, refs: tuple) -> None:
        self._entries.append((key, refs))
        del self._entries[: -self._size]

    def clear(self) -> None:
        self._entries.clear()


_checked_layouts = _LayoutCache()


def check_layout_values(layout: PackedLayout, total_tokens: int, position_ids: torch.Tensor | None = None) -> None:
    """Check cu_seqlens / max_seqlen (and position_ids, when given) against each other; syncs once per layout.

    position_ids, when given, must restart at 0 at every boundary and count up by one inside a
    sequence: otherwise RoPE sees positions the rollout engine never saw, which is a parity bug
    of its own even when attention honours the boundaries.
    """
    key = _LayoutCache.key(layout.cu_seqlens, position_ids, extra=(layout.max_seqlen, total_tokens))
    if _checked_layouts.seen(key):
        return
    cu = layout.cu_seqlens.detach().to("cpu", torch.int64)
    lengths = cu[1:] - cu[:-1]
    if int(cu[0]) != 0 or int(cu[-1]) != total_tokens:
        raise AttentionContractError(
            f"cu_seqlens must start at 0 and end at T={total_tokens}; got {cu[0].item()}..{cu[-1].item()}")
    if bool((lengths < 1).any()):
        bad = (lengths < 1).nonzero().flatten()[:8].tolist()
        raise AttentionContractError(f"cu_seqlens must be strictly increasing (empty sequences at {bad})")
    if int(lengths.max()) != layout.max_seqlen:
        raise AttentionContractError(
            f"max_seqlen={layout.max_seqlen} but the longest sequence in cu_seqlens has {int(lengths.max())} "
            "tokens (a smaller value makes varlen kernels skip keys; a larger one wastes work)")
    if position_ids is not None:
        pos = position_ids.detach().reshape(-1).to("cpu", torch.int64)
        if pos.numel() != total_tokens:
            raise AttentionContractError(f"position_ids has {pos.numel()} entries for {total_tokens} tokens")
        expected = torch.arange(total_tokens) - torch.repeat_interleave(cu[:-1], lengths)
        if not torch.equal(pos, expected):
            t = int((pos != expected).nonzero()[0])
            raise AttentionContractError(
                f"position_ids disagree with cu_seqlens at token {t}: got {int(pos[t])}, expected {int(expected[t])} "
                "(positions must restart at 0 at each sequence boundary)")
    _checked_layouts.add(key, (layout.cu_seqlens, position_ids))
