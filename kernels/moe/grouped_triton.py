"""The batch-invariant grouped GEMM in Triton: rows sorted by expert, one program per (row tile, column tile).

A row's output is its dot product with its expert's weight rows, accumulated in fp32 over K in BLOCK_K
steps by the same `tl.dot` shapes whatever the rest of the call holds: the tiles come from
`triton_launch.matmul_config` (a function of dtype, weight rows and platform, never of the row count,
the config `bi_linear` uses, and its K loop, splits folded inline: so an expert's rows get `bi_linear`'s
bits for that expert's weight), there is no split-K schedule, a tile never mixes experts (a tile's rows
are one expert's, masked at the group's end),
and the row count is `do_not_specialize`.

The tile list is built on the device from the per-expert counts (no host sync, so a decode step that
routes inside a CUDA graph can be captured): at most cdiv(M, BLOCK_M) + E tiles, the unused ones empty.
INTERPRETED: the same conventions as kernels/batch_invariant/triton_kernels.py (fp32 dot operands, while
loops), so the CPU tests run it in Triton's interpreter against the reference.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.batch_invariant.triton_kernels import _split_k_loop
from kernels.batch_invariant.triton_launch import (
    INTERPRETED,
    _device_scope,
    _last_dim_contiguous,
    _platform,
    matmul_config,
    matmul_split_steps,
    triton_cdiv,
)


@triton.jit(do_not_specialize=["M"])
def bi_grouped_matmul_kernel(x_ptr, w_ptr, out_ptr, tile_expert_ptr, tile_start_ptr, tile_end_ptr, M, N, K,
                             stride_xm, stride_xk, stride_we, stride_wn, stride_wk, stride_om, stride_on,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                             SPLIT_STEPS: tl.constexpr, DOT_PRECISION: tl.constexpr, INTERPRETED: tl.constexpr):
    """out[r, :] = x[r, :] @ w[e(r)].T for the rows [start, end) of one tile, all of expert e."""
    pid_n = tl.program_id(0)
    pid_t = tl.program_id(1)
    expert = tl.load(tile_expert_ptr + pid_t).to(tl.int64)
    start = tl.load(tile_start_ptr + pid_t)
    end = tl.load(tile_end_ptr + pid_t)
    offs_m = start + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < end
    n_ok = offs_n < N
    # bi_linear's own K loop over the expert's weight: the rows get bi_linear's bits for that weight.
    acc = _split_k_loop(x_ptr, w_ptr + expert * stride_we, offs_m, offs_n, m_ok, n_ok, K, stride_xm, stride_xk,
                        stride_wn, stride_wk, BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_STEPS, False, DOT_PRECISION,
                        INTERPRETED)
    out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :] * stride_on
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def tile_schedule(counts: torch.Tensor, rows: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(expert, first row, end row) int32 of each of cdiv(rows, block_m) + E tiles, computed on the device;
    tiles past the last expert's are empty (start == end == 0)."""
    n_experts = counts.shape[0]
    counts = counts.to(torch.int64)
    tiles = (counts + block_m - 1) // block_m
    tile_end = torch.cumsum(tiles, 0)
    seg_end = torch.cumsum(counts, 0)
    seg_start = seg_end - counts
    p = torch.arange(triton_cdiv(rows, block_m) + n_experts, device=counts.device)
    expert = torch.searchsorted(tile_end, p, right=True)
    valid = expert < n_experts
    e = expert.clamp(max=n_experts - 1)
    start = seg_start[e] + (p - (tile_end[e] - tiles[e])) * block_m
    end = torch.minimum(start + block_m, seg_end[e])
    zero = torch.zeros_like(start)
    return (e.to(torch.int32), torch.where(valid, start, zero).to(torch.int32),
            torch.where(valid, end, zero).to(torch.int32))


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    m, k = x.shape
    n_experts, n, _ = weight.shape
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    x = _last_dim_contiguous(x)
    weight = _last_dim_contiguous(weight)
    cfg = matmul_config(x.dtype, n, _platform())
    tile_expert, tile_start, tile_end = tile_schedule(counts, m, cfg.block_m)
    grid = (triton_cdiv(n, cfg.block_n), tile_expert.shape[0])
    with _device_scope(x):
        bi_grouped_matmul_kernel[grid](
            x, weight, out, tile_expert, tile_start, tile_end, m, n, k,
            x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), weight.stride(2), out.stride(0),
            out.stride(1), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
            SPLIT_STEPS=matmul_split_steps(cfg), DOT_PRECISION=cfg.dot_precision, INTERPRETED=INTERPRETED,
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages)
    return out
