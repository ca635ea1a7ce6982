"""tl.dot for Triton's interpreter with one summation order for every output, and a matmul built to lack one.

Why the CPU tests need it. Triton's interpreter evaluates `tl.dot(a, b, acc)` as
`np.matmul(a, b, dtype=acc.dtype) + acc` (`InterpreterBuilder.create_dot`,
triton/runtime/interpreter.py), so an interpreted kernel sums K in the order numpy's BLAS picks,
and OpenBLAS picks it by a row's position in the tile. numpy passes the row-major product to
`cblas_sgemm`, which OpenBLAS computes column-major as C^T = B^T A^T: the tile's rows are BLAS's
N dimension. On x86 CPUs with AVX2 but no AVX-512 (OpenBLAS's Haswell and Zen cores: AMD Zen 1-3,
Intel cores without AVX-512) the micro-kernel, kernel/x86_64/sgemm_kernel_8x4_haswell_2.c, takes
those rows in panels of 12 and computes rows 0-5 and 6-11 of a panel with staggered 6-row
kernels: some (`*_k2m8n6`, and `m8n4` for the 4 rows of a 64-row tile left after five panels) sum
even and odd k in two FMA chains added at the end, the others (`*_k2m16n6`) in one chain. A row's
bits thus depend on its index mod 12 in the tile and on whether it falls in the last panel.

The kernels' tile shapes never change with the batch ([64, 32] @ [32, 64] for the fp32 matmul,
[64, 64] @ [64, 64] for bf16 after the cast to fp32, [64, 16] @ [16, 64] and [64, 64] @ [64, 16]
in attention), but where a row sits in its tile does: a linear row r is tile row r mod 64, and
row 0 when alone (M=1); a packed token is its position in the sequence mod BLOCK_M, the same token
in decode its query head's index in the kv group. With AVX-512 (OpenBLAS's SkylakeX core) such
small products go through `sgemm_direct`, one k-ascending FMA chain per output, so the bitwise
tests pass there and fail on AVX2-only hosts.

A compiled kernel has no such dependence: every row of a tile goes through the same MMA
instructions in the same K steps. What the tests need from an interpreted dot is that property,
not any particular order: `fixed_order_dot` computes each output from its own row of `a`, its own
column of `b` and its own accumulator, in one order for all. tests/kernels/conftest.py installs
it, and test_batch_invariant_triton.py runs the interpreted kernels with `np.matmul` replaced by
`row_position_dependent_matmul`.
"""
from __future__ import annotations

from typing import Callable

import numpy as np


def fixed_order_dot(a: np.ndarray, b: np.ndarray, acc: np.ndarray) -> np.ndarray:
    """acc + a @ b, every output [.., i, j] reduced the same way in acc's dtype.

    The K products a[i, k] * b[k, j] are rounded to acc's dtype, then summed as a tree: the first
    half of the terms plus the second half, elementwise, until one is left (an odd last term is
    carried to the next level); that sum is added to acc[i, j]. numpy's elementwise multiply and
    add are single IEEE operations in any SIMD width (no FMA contraction), so an output is a
    function of a[i, :], b[:, j] and acc[i, j] alone, on any CPU and with any BLAS. (A tree rather
    than a k-ascending chain: log2(K) numpy calls per dot instead of 2K, for the same guarantee.)
    """
    if a.ndim < 2 or b.ndim < 2 or a.shape[-1] != b.shape[-2]:
        raise ValueError(f"fixed_order_dot: operands {a.shape} and {b.shape} do not form a matrix product")
    a = a.astype(acc.dtype, copy=False)
    b = b.astype(acc.dtype, copy=False)
    # terms[k] = a[.., :, k, None] * b[.., k, None, :]: the K product matrices, k leading.
    terms = np.multiply(np.moveaxis(a, -1, 0)[..., :, None], np.moveaxis(b, -2, 0)[..., None, :])
    if terms.shape[0] == 0:
        return np.array(np.broadcast_to(acc, terms.shape[1:]), dtype=acc.dtype)
    while terms.shape[0] > 1:
        half = terms.shape[0] // 2
        summed = terms[:half] + terms[half:2 * half]
        terms = summed if terms.shape[0] % 2 == 0 else np.concatenate([summed, terms[2 * half:]])
    return acc + terms[0]


_TRITON_CREATE_DOT: list = []  # Triton's own, kept before the first install replaces it


def triton_create_dot():
    """Triton's own InterpreterBuilder.create_dot, np.matmul(a, b) + acc, even once the fixed-order one is installed."""
    from triton.runtime.interpreter import InterpreterBuilder

    if not _TRITON_CREATE_DOT:
        _TRITON_CREATE_DOT.append(InterpreterBuilder.create_dot)
    return _TRITON_CREATE_DOT[0]


def _fixed_order_create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
    """InterpreterBuilder.create_dot through fixed_order_dot; integer dots (exact in any order) as Triton has them."""
    from triton.runtime.interpreter import TensorHandle

    if all(t.data.dtype.kind == "f" for t in (a, b, d)):
        # input_precision is ignored, as Triton's interpreter ignores it: fp32 products and sums.
        return TensorHandle(fixed_order_dot(a.data, b.data, d.data), d.dtype.scalar)
    if a.dtype.is_int() and b.dtype.is_int():
        return triton_create_dot()(self, a, b, d, input_precision, max_num_imprecise_acc)
    # bf16 and fp8 are raw integer bits in the interpreter; the kernels give tl.dot fp32 there.
    raise TypeError(f"interpreted tl.dot of {a.dtype} x {b.dtype} -> {d.dtype}: the fixed-order dot takes float "
                    "operands numpy can multiply (convert bf16/fp8 to fp32 first, as the kernels do)")


def install_fixed_order_dot() -> Callable[[], None]:
    """Make Triton's interpreter evaluate tl.dot with fixed_order_dot; returns the undo."""
    from triton.runtime.interpreter import InterpreterBuilder

    triton_create_dot()
    previous = InterpreterBuilder.create_dot
    InterpreterBuilder.create_dot = _fixed_order_create_dot

    def undo() -> None:
        InterpreterBuilder.create_dot = previous

    return undo


def row_position_dependent_matmul(a, b, /, out=None, *, dtype=None, **kwargs):
    """np.matmul that sums output row i over k = i, i+1, .., K-1, 0, .., i-1: each row's order set by its index.

    A correct product whose bits for a row change with where the row sits, as OpenBLAS's do on
    AVX2 CPUs: kernels that stay row-invariant under it do not owe that to numpy's BLAS. 2-D only.
    """
    if out is not None or kwargs or np.ndim(a) != 2 or np.ndim(b) != 2:
        raise NotImplementedError(f"row_position_dependent_matmul takes two 2-D operands, got {np.shape(a)} x "
                                  f"{np.shape(b)} with out={out is not None}, {sorted(kwargs)}")
    a, b = np.asarray(a), np.asarray(b)
    dtype = np.dtype(dtype) if dtype is not None else np.result_type(a, b)
    a, b = a.astype(dtype, copy=False), b.astype(dtype, copy=False)
    m, k = a.shape
    rows = np.arange(m)
    result = np.zeros((m, b.shape[1]), dtype)
    for step in range(k):
        ks = (rows + step) % k
        result += a[rows, ks][:, None] * b[ks]
    return result
