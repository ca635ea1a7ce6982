"""One GEMM per projection over all experts: rows sorted by expert, each multiplied by its expert's weight.

    y = grouped_linear(x, weight, counts, impl="auto")   # x [M, K] sorted by expert, weight [E, N, K],
                                                          # counts [E] rows per expert -> y [M, N]

Implementations (explicit, never a fallback between them):

* `reference` — pure torch, batch-invariant: every output is an elementwise product of the row with its
  expert's weight row, reduced over the contiguous K axis split by split (reference.split_k_sum, the loop
  `bi_linear`'s reference uses), rows taken ROW_CHUNK at a time with their experts' weights gathered. No
  BLAS GEMM (whose kernel choice and K split follow the group's row count), so a row has the bits it has
  alone. The CPU path of `true_on_policy`, and the oracle of the kernels.
* `triton` — the batch-invariant Triton kernel (grouped_triton.py): fixed tiles per dtype, one program per
  (row tile of one expert, column tile), K reduced in BLOCK_K steps folded per SPLIT_K split inline
  (bi_linear's one-program order; no split-K schedule). The GPU path of `true_on_policy`.
* `grouped_mm` — torch's grouped matmul (`torch._grouped_mm`: CUTLASS on sm_90, a loop of GEMMs on CPU):
  the fastest, its tile choice may follow the group sizes, so it promises no batch invariance. `fast` mode.

`auto` picks `reference` on CPU and `triton` on CUDA: the batch-invariant path of the device. Backward
is plain torch math on `torch._grouped_mm` (d(x) = dy @ W_e, d(W_e) = dy_e^T x_e): its bits never reach a
log-prob.
"""
from __future__ import annotations

import os
from typing import Literal

import torch

from kernels.batch_invariant.errors import BatchInvariantInputError
from kernels.batch_invariant.reference import split_k_sum

GroupedImpl = Literal["auto", "reference", "triton", "grouped_mm"]
IMPLS = ("auto", "reference", "triton", "grouped_mm")

ROW_CHUNK = 16
"""Rows per step of the reference (with their experts' weights gathered: ROW_CHUNK x columns x K)."""
PRODUCT_BUDGET = 1 << 22
"""Elements of one reference step's [rows, columns, K] fp32 product."""


def offsets_of(counts: torch.Tensor) -> torch.Tensor:
    """End offset of each expert's rows (int32), the form torch._grouped_mm takes."""
    return torch.cumsum(counts, 0).to(torch.int32)


def _check(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> None:
    if x.dim() != 2 or weight.dim() != 3:
        raise BatchInvariantInputError(f"grouped_linear: x must be [M, K] and weight [E, N, K]; got {tuple(x.shape)} "
                                       f"and {tuple(weight.shape)}")
    if x.shape[1] != weight.shape[2]:
        raise BatchInvariantInputError(f"grouped_linear: x's K ({x.shape[1]}) != weight's K ({weight.shape[2]})")
    if x.dtype != weight.dtype or x.device != weight.device:
        raise BatchInvariantInputError(f"grouped_linear: x and weight must share dtype and device; got {x.dtype} "
                                       f"{x.device} and {weight.dtype} {weight.device}")
    if counts.shape != (weight.shape[0],) or counts.dtype not in (torch.int32, torch.int64):
        raise BatchInvariantInputError(f"grouped_linear: counts must be int [E]=[{weight.shape[0]}], got "
                                       f"{counts.dtype} {tuple(counts.shape)}")


def row_experts(counts: torch.Tensor, rows: int) -> torch.Tensor:
    """Expert of each sorted row (int64 [rows]) from the per-expert counts, on the device, no host sync."""
    return torch.repeat_interleave(torch.arange(counts.shape[0], device=counts.device), counts.to(torch.int64),
                                   output_size=rows)


def reference(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """x [M, K] (sorted by expert) @ weight[e(row)].T, fp32 accumulation, x.dtype out; batch-invariant."""
    m, k = x.shape
    n = weight.shape[1]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    experts = row_experts(counts, m)
    cols = max(1, PRODUCT_BUDGET // (ROW_CHUNK * max(k, 1)))
    for c0 in range(0, n, cols):
        c1 = min(c0 + cols, n)
        columns = weight[:, c0:c1]
        for r0 in range(0, m, ROW_CHUNK):
            r1 = min(r0 + ROW_CHUNK, m)
            w32 = columns[experts[r0:r1]].float()  # [R, C, K]
            out[r0:r1, c0:c1] = split_k_sum(x[r0:r1].float().unsqueeze(1), w32)
    return out


def torch_grouped_mm(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """torch's grouped matmul: x [M, K] @ weight[e].T per group (weight [E, N, K])."""
    if x.shape[0] == 0:
        return x.new_empty(0, weight.shape[1])
    return torch._grouped_mm(x, weight.transpose(-2, -1), offs=offsets_of(counts))


def _resolve(impl: str, device: torch.device) -> str:
    if impl not in IMPLS:
        raise BatchInvariantInputError(f"grouped_linear: impl must be one of {list(IMPLS)}, got {impl!r}")
    if device.type not in ("cpu", "cuda"):
        raise BatchInvariantInputError(f"grouped_linear: tensors on {device.type!r}; runs on cpu and cuda/rocm")
    if impl == "auto":
        return "reference" if device.type == "cpu" else "triton"
    if impl == "triton" and device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise BatchInvariantInputError("grouped_linear: impl='triton' on CPU tensors needs TRITON_INTERPRET=1")
    return impl


def _forward(x, weight, counts, impl: str) -> torch.Tensor:
    if impl == "reference":
        return reference(x, weight, counts)
    if impl == "grouped_mm":
        return torch_grouped_mm(x, weight, counts)
    from kernels.moe import grouped_triton

    return grouped_triton.grouped_linear(x, weight, counts)


class _GroupedLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, counts, impl):
        ctx.save_for_backward(x, weight, counts)
        return _forward(x, weight, counts, impl)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, counts = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        grad_x = grad_w = None
        offs = offsets_of(counts)
        if ctx.needs_input_grad[0]:
            grad_x = (torch._grouped_mm(grad_out, weight, offs=offs) if x.shape[0]
                      else torch.zeros_like(x))
        if ctx.needs_input_grad[1]:
            if x.shape[0]:
                # [N, M] x [M, K] per group -> [E, N, K]; a group without rows gets zeros.
                grad_w = torch._grouped_mm(grad_out.t(), x, offs=offs)
                # Selected, not trusted: an expert no row reached must get exact zeros.
                grad_w = torch.where((counts > 0)[:, None, None], grad_w, 0.0)
            else:
                grad_w = torch.zeros_like(weight)
        return grad_x, grad_w, None, None


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor, *,
                   impl: GroupedImpl = "auto") -> torch.Tensor:
    """Rows of x sorted by expert (counts[e] rows of expert e, in expert order) times their expert's
    weight [N, K] transposed; fp32 accumulation, x.dtype out. See the module docstring for `impl`."""
    _check(x, weight, counts)
    chosen = _resolve(impl, x.device)
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _GroupedLinearFn.apply(x, weight, counts, chosen)
    return _forward(x, weight, counts, chosen)
