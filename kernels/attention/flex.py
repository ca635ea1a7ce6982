"""FlexAttention backend: the packed buffer as one [1, H, T, D] sequence plus a document mask.

The mask says what the boundaries are: query t may see key j iff both lie in
the same document (sequence) and j <= t (and t - j < window). Documents come
from cu_seqlens. The block mask is built once per layout (all layers of a
forward share it) and flex_attention is compiled once with dynamic shapes,
because microbatch lengths change every step and a static compile would
recompile per length until dynamo's limit and then silently run eager.
"""
from __future__ import annotations

import functools

import torch

from kernels.attention.contract import PackedLayout


def unavailable_reason(platform: str) -> str | None:
    try:
        import torch.nn.attention.flex_attention  # noqa: F401
    except ImportError as exc:
        return f"needs torch >= 2.5 with torch.nn.attention.flex_attention; import failed: {exc}"
    if platform in ("cuda", "rocm") and not torch.cuda.is_available():
        return "no GPU device"
    return None


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=True)


_last: list = []  # [(cu_seqlens tensor, version, T, window, block_mask)]: one entry, reused by every layer


def _block_mask(layout: PackedLayout, total: int, window: int | None, device: torch.device):
    from torch.nn.attention.flex_attention import create_block_mask

    cu = layout.cu_seqlens
    if _last and _last[0][0] is cu and _last[0][1:4] == (cu._version, total, window):
        return _last[0][4]
    lengths = (cu[1:] - cu[:-1]).long()
    doc = torch.repeat_interleave(torch.arange(lengths.numel(), device=device), lengths, output_size=total)

    def mask_mod(b, h, q_idx, kv_idx):
        keep = (doc[q_idx] == doc[kv_idx]) & (kv_idx <= q_idx)
        if window is not None:
            keep = keep & (q_idx - kv_idx < window)
        return keep

    bm = create_block_mask(mask_mod, B=None, H=None, Q_LEN=total, KV_LEN=total, device=device)
    _last[:] = [(cu, cu._version, total, window, bm)]
    return bm


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: PackedLayout, scale: float,
              window: int | None, deterministic: bool) -> torch.Tensor:
    del deterministic  # declared non-deterministic; selection never sends it a deterministic request
    total = q.shape[0]
    bm = _block_mask(layout, total, window, q.device)
    qh, kh, vh = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))  # [1, H, T, D]
    out = _compiled_flex()(qh, kh, vh, block_mask=bm, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return out[0].transpose(0, 1)
