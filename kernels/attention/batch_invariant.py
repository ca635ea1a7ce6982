"""Registry adapter of kernels.batch_invariant.packed_attention (the `batch_invariant` backend).

Forward: causal attention per sequence with keys reduced in KEY_BLOCK blocks aligned to each
sequence's start, so a token's output bits do not depend on the rest of the packed buffer and
equal KV-cache decode through decode_attention. Backward: plain torch attention recomputed per
sequence (ops.py). Never auto-selected (its priority is after the reference): the numerics
mode that needs it forces it.
"""
from __future__ import annotations

import torch

from kernels.attention.contract import AttentionContractError, PackedLayout
from kernels.batch_invariant import packed_attention


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: PackedLayout, scale: float,
              window: int | None, deterministic: bool) -> torch.Tensor:
    # deterministic: the forward always is; the backward follows torch.use_deterministic_algorithms.
    del deterministic
    if window is not None:
        # The capability table declares no sliding window, so selection refuses before this.
        raise AttentionContractError(f"batch_invariant attention has no sliding window (window={window})")
    return packed_attention(q, k, v, layout.cu_seqlens, layout.max_seqlen, scale)
