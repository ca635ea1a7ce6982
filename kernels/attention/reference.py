"""Reference backend: each sequence of the packed buffer through its own SDPA call.

Boundaries are honoured by construction (a sequence's call never sees another
sequence's keys), which is why every other backend is tested against this one.
It issues exactly the call Hugging Face's `sdpa` attention issues for one
unpadded sequence ([1, H, L, D] views, `is_causal=L > 1`, `enable_gqa`), so a
packed forward through it can match one-sequence-at-a-time forwards bit for
bit wherever the surrounding matmuls do (tests/kernels/attention/test_attention_hf.py).
Slow by design: a Python loop over sequences and a host read of cu_seqlens.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.attention.contract import PackedLayout


def _window_mask(length: int, window: int, device: torch.device) -> torch.Tensor:
    i = torch.arange(length, device=device)[:, None]
    j = torch.arange(length, device=device)[None, :]
    return (j <= i) & (j > i - window)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: PackedLayout, scale: float,
              window: int | None, deterministic: bool) -> torch.Tensor:
    del deterministic  # CPU SDPA has one path; the capability table says where that is reproducible
    gqa = q.shape[1] != k.shape[1]
    bounds = layout.cu_seqlens.tolist()
    lengths = [end - start for start, end in zip(bounds[:-1], bounds[1:])]
    # split, not one slice per sequence: the same views forward, but the backward of a slice writes its
    # gradient into a zero-filled tensor of the whole buffer, so N slices cost N buffers' worth of fills
    # and adds, while split's backward is one concatenation.
    outs = []
    for length, q_seq, k_seq, v_seq in zip(lengths, *(x.split(lengths) for x in (q, k, v))):
        # [L, H, D] -> [1, H, L, D] views, the strides HF's sdpa path sees for one sequence.
        qi, ki, vi = (x.transpose(0, 1).unsqueeze(0) for x in (q_seq, k_seq, v_seq))
        if window is not None and window < length:
            o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=_window_mask(length, window, q.device),
                                               scale=scale, enable_gqa=gqa)
        else:
            o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=length > 1, scale=scale, enable_gqa=gqa)
        outs.append(o[0].transpose(0, 1))
    return torch.cat(outs, dim=0)
