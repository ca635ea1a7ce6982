"""Transcendental elementwise ops whose CPU bits do not depend on where a row sits in the tensor.

On the CPU, torch runs an elementwise op over the flat tensor in SIMD vectors and finishes the last
(numel mod 2 x vector width) elements, and each thread's share, with the scalar function. For exp,
sigmoid and SiLU the two paths may round differently, so a row that lands in a tail (a router row of 8
experts, the [T, 1] shared-expert gate of Qwen2-MoE) can get other bits in another batch. Here every row
is padded to a multiple of PAD_TO elements and the rows go through in slabs of at most SLAB elements (below
torch's parallel grain, so one thread walks a slab), so every element of every row takes the vector path.
CUDA elementwise kernels compute one function per element whatever the vectorisation: a plain call there.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

PAD_TO = 64
"""Row length multiple: 2 x the widest CPU vector (AVX-512, 16-bit elements: 32 lanes)."""
SLAB = 32768
"""Elements per call (torch's CPU GRAIN_SIZE: a smaller op is not split across threads)."""


def rowwise(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
    """fn(x) for an elementwise fn, each element's bits independent of the rest of x. Differentiable."""
    if x.device.type != "cpu" or x.numel() == 0:
        return fn(x)
    width = x.shape[-1]
    padded = -(-width // PAD_TO) * PAD_TO
    rows = x.reshape(-1, width)
    if padded != width:
        rows = torch.cat([rows, rows.new_full((rows.shape[0], padded - width), fill)], dim=-1)
    step = max(1, SLAB // padded)
    out = torch.cat([fn(rows[r:r + step]) for r in range(0, rows.shape[0], step)])
    return out[:, :width].reshape(x.shape)
