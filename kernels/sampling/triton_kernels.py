"""Triton Gumbel-max sampling: the stream of kernels.sampling.stream, fused with the argmax.

One program per row walks the vocabulary in fixed blocks, computes each
token's noise from (row key, token id) in registers and keeps the running
maximum (strictly greater wins, so ties go to the lowest id). The vocabulary size is a
compile-time constant (one specialisation per model). It reads the logits once and writes one int64 per row: no [B, V] noise tensor exists.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.sampling.hash import FMIX_C1, FMIX_C2, TOKEN_MULT

BLOCK_V = 2048


@triton.jit
def _fmix32(x, c1, c2):
    x = x ^ (x >> 16)
    x = x * c1
    x = x ^ (x >> 13)
    x = x * c2
    return x ^ (x >> 16)


@triton.jit
def _gumbel_argmax_kernel(logits_ptr, stride_row, keys_ptr, out_ptr, temperature, VOCAB: tl.constexpr,
                          C1: tl.constexpr, C2: tl.constexpr, MULT: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    c1 = tl.full((BLOCK,), C1, tl.uint32)
    c2 = tl.full((BLOCK,), C2, tl.uint32)
    mult = tl.full((BLOCK,), MULT, tl.uint32)
    key = tl.load(keys_ptr + row).to(tl.uint32)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    best_val = tl.full((), float("-inf"), tl.float32)
    best_idx = tl.full((), 0, tl.int32)
    for start in range(0, VOCAB, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        inside = offs < VOCAB
        x = tl.load(row_ptr + offs, mask=inside, other=float("-inf")).to(tl.float32)
        bits = _fmix32(key ^ (offs.to(tl.uint32) * mult), c1, c2)
        u = ((bits >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)
        z = x / temperature - tl.log(-tl.log(u))
        z = tl.where(inside, z, float("-inf"))
        block_max = tl.max(z, axis=0)
        block_idx = start + tl.argmax(z, axis=0, tie_break_left=True)
        better = block_max > best_val
        best_idx = tl.where(better, block_idx, best_idx)
        best_val = tl.where(better, block_max, best_val)
    tl.store(out_ptr + row, best_idx.to(tl.int64))


def gumbel_argmax(logits: torch.Tensor, keys: torch.Tensor, temperature: float) -> torch.Tensor:
    """int64 [B]: argmax_v(logits[b, v] / temperature + gumbel(keys[b], v)); logits [B, V] (last dim contiguous)."""
    if logits.dim() != 2 or logits.stride(-1) != 1:
        raise ValueError(f"logits: expected [B, V] with a contiguous last dim, got shape {tuple(logits.shape)} "
                         f"strides {logits.stride()}")
    if keys.shape != (logits.shape[0],):
        raise ValueError(f"keys: expected shape ({logits.shape[0]},), got {tuple(keys.shape)}")
    out = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    if logits.shape[0]:
        _gumbel_argmax_kernel[(logits.shape[0],)](
            logits, logits.stride(0), keys.contiguous(), out, float(temperature), VOCAB=logits.shape[1],
            C1=FMIX_C1, C2=FMIX_C2, MULT=TOKEN_MULT, BLOCK=BLOCK_V)
    return out
