"""torch.nn.attention.varlen.varlen_attn backend (torch >= 2.10, CUDA).

The FlashAttention-2 varlen kernels that ship inside PyTorch: no extra wheel.
API drift handled here, by inspecting the signature once:
- causal is `window_size=(-1, 0)`; a sliding window W (HF convention: W keys
  including the token itself) is `window_size=(W - 1, 0)`.
- torch 2.11 has no `enable_gqa`: KV heads are repeated to the query heads
  (costs a copy of K and V; 2.13 takes `enable_gqa=True` and skips it).
"""
from __future__ import annotations

import functools
import inspect

import torch

from kernels.attention.contract import PackedLayout

_HINT = "needs torch >= 2.10 built with CUDA (torch.nn.attention.varlen.varlen_attn)"


@functools.cache
def _varlen():
    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    return varlen_attn, "enable_gqa" in params, "window_size" in params


def unavailable_reason(platform: str) -> str | None:
    if platform != "cuda":
        return f"varlen_attn is only declared on cuda, not {platform}"
    try:
        _, _, has_window = _varlen()
    except ImportError as exc:
        return f"{_HINT}; import failed: {exc}"
    if not has_window:
        return f"this torch's varlen_attn has no window_size argument; {_HINT}"
    if not torch.cuda.is_available():
        return "no CUDA device"
    return None


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: PackedLayout, scale: float,
              window: int | None, deterministic: bool) -> torch.Tensor:
    # deterministic: aten's flash backward reads torch.are_deterministic_algorithms_enabled()
    # itself; a policy that demands determinism without that flag set cannot be honoured here.
    if deterministic and not torch.are_deterministic_algorithms_enabled():
        raise RuntimeError("torch_varlen: deterministic attention requires "
                           "torch.use_deterministic_algorithms(True) (aten's flash backward keys off it)")
    varlen_attn, has_gqa, _ = _varlen()
    kwargs = {}
    if q.shape[1] != k.shape[1]:
        if has_gqa:
            kwargs["enable_gqa"] = True
        else:
            rep = q.shape[1] // k.shape[1]
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
    cu = layout.cu_seqlens
    return varlen_attn(q, k, v, cu, cu, layout.max_seqlen, layout.max_seqlen, scale=scale,
                       window_size=(-1, 0) if window is None else (window - 1, 0), **kwargs)
