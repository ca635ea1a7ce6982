"""flash_attn varlen backend (Dao-AILab flash-attn 2.x), CUDA and ROCm.

On ROCm the only build that runs on MI300 without composable_kernel wheels is
the Triton-AMD one, chosen at import time by FLASH_ATTENTION_TRITON_AMD_ENABLE=TRUE
(on a Qwen3-8B MI325 run: with it, step-1 IW mean was 0.9996; without flash-attn the trainer fell
back to SDPA and IW mean was 0.41). The probe refuses a ROCm import without that
variable so the failure names the fix instead of a missing CUDA symbol.
"""
from __future__ import annotations

import functools
import os

import torch

from kernels.attention.contract import PackedLayout

_HINT = ("pip install flash-attn --no-build-isolation (on ROCm: "
         "FLASH_ATTENTION_TRITON_AMD_ENABLE=TRUE pip install flash-attn==2.8.3 --no-build-isolation, "
         "and the same variable set when the trainer starts)")


@functools.cache
def _flash_varlen_func():
    from flash_attn import flash_attn_varlen_func

    return flash_attn_varlen_func


def unavailable_reason(platform: str) -> str | None:
    if platform == "rocm" and os.environ.get("FLASH_ATTENTION_TRITON_AMD_ENABLE", "").upper() != "TRUE":
        return f"on ROCm flash_attn must be the Triton-AMD build with FLASH_ATTENTION_TRITON_AMD_ENABLE=TRUE; {_HINT}"
    try:
        _flash_varlen_func()
    except ImportError as exc:
        return f"flash_attn is not importable ({exc}); {_HINT}"
    if not torch.cuda.is_available():
        return "no GPU device"
    return None


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: PackedLayout, scale: float,
              window: int | None, deterministic: bool) -> torch.Tensor:
    cu = layout.cu_seqlens
    # GQA is native (k/v with fewer heads); window_size counts keys to the left excluding the token.
    return _flash_varlen_func()(
        q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=layout.max_seqlen, max_seqlen_k=layout.max_seqlen,
        dropout_p=0.0, softmax_scale=scale, causal=True,
        window_size=(-1, -1) if window is None else (window - 1, 0), deterministic=deterministic)
