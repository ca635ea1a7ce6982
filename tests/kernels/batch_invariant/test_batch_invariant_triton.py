"""The batch-invariant Triton kernels in Triton's interpreter on CPU (compiled, on a GPU): (3) against the reference
within a dtype tolerance, and guarantees (1) and (2) bit for bit for the kernels themselves.

The interpreter runs each program in numpy (tens of ms each), so the shapes are tiny; they still
cross every boundary the kernels have: a K tail inside a BLOCK_K step, N and M tails, sequences of
1, KEY_BLOCK-1, KEY_BLOCK+1 and 2*KEY_BLOCK+2 keys, GQA groups, NaN in cache tails. The same
checks at the Qwen3-0.6B shape on a GPU are in test_batch_invariant_gpu.py.

Interpreted, tl.dot is numpy's matmul, whose BLAS may sum a row's K in an order set by the row's
place in the tile (OpenBLAS does on AVX2-only CPUs); the bitwise checks rest on the fixed-order
interpreted dot that tests/kernels/conftest.py installs, and every test here runs with np.matmul
replaced by one that orders each row's sum by the row's index, so none can pass by numpy's BLAS.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels.batch_invariant import KEY_BLOCK, bi_linear, bi_rms_norm, decode_attention, packed_attention
from tests.kernels.batch_invariant.batch_invariant_support import (
    assert_bitwise,
    checked_rows,
    decode_rows_at,
    make_qkv,
    pack_lengths,
)
from tests.kernels.interpreted_dot import row_position_dependent_matmul

# On a machine with CUDA the same tests run the compiled kernels on tiny GPU tensors.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The interpreter evaluates masked-off lanes too (exp2(-inf - -inf) and the like) and warns; results are where()'d.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

DTYPES = [torch.float32, torch.bfloat16]
TOL = {torch.float32: dict(rtol=2e-5, atol=2e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}
ROWS = (1, 3, 17, 64, 200)
LENGTHS = [1, KEY_BLOCK - 1, KEY_BLOCK + 1, 9]


@pytest.fixture(autouse=True)
def numpy_matmul_that_orders_each_row_by_its_index(monkeypatch):
    """Interpreted kernels must be row-invariant whatever BLAS numpy has, so they run with the worst kind."""
    if DEVICE == "cpu":
        monkeypatch.setattr(np, "matmul", row_position_dependent_matmul)


def _gen(seed):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_linear_matches_reference_and_is_row_invariant(dtype):
    g = _gen(0)
    x = torch.randn(200, 80, generator=g).to(DEVICE, dtype)  # K = 80: one full BLOCK_K step and a tail
    w = (torch.randn(72, 80, generator=g) / 9).to(DEVICE, dtype)  # N = 72: a full and a partial N tile
    b = torch.randn(72, generator=g).to(DEVICE, dtype)
    full = bi_linear(x, w, b, impl="triton")
    torch.testing.assert_close(full.float(), bi_linear(x, w, b, impl="reference").float(), **TOL[dtype])
    for m in ROWS:
        idx = torch.randperm(200, generator=g)[:m]
        assert_bitwise(bi_linear(x[idx], w, b, impl="triton"), full[idx], f"M={m}")
    # Rows at an address that is not 16-byte aligned take the same compiled path (the launcher realigns them).
    shifted = torch.cat([x.new_zeros(1), x.flatten()])[1:].view(200, 80)
    assert shifted.data_ptr() % 16
    assert_bitwise(bi_linear(shifted[:3], w, b, impl="triton"), full[:3], "misaligned rows")


def test_triton_linear_wide_weight_tiles_are_row_invariant(monkeypatch):
    """Weights of N >= WIDE_N rows (an lm_head) take the 128 x 128 tiles: same guarantees.
    (WIDE_N is lowered here: the interpreter pays per program, and a real lm_head has ~1200 per row block.)"""
    from kernels.batch_invariant import triton_launch

    monkeypatch.setattr(triton_launch, "WIDE_N", 256)
    assert triton_launch.matmul_config(torch.bfloat16, 300, "cuda").block_n == 128
    g = _gen(7)
    x = torch.randn(150, 80, generator=g).to(DEVICE, torch.bfloat16)
    w = (torch.randn(300, 80, generator=g) / 9).to(DEVICE, torch.bfloat16)
    full = bi_linear(x, w, impl="triton")
    torch.testing.assert_close(full.float(), bi_linear(x, w, impl="reference").float(), **TOL[torch.bfloat16])
    for m in (1, 3, 17, 64):
        idx = torch.randperm(150, generator=g)[:m]
        assert_bitwise(bi_linear(x[idx], w, impl="triton"), full[idx], f"wide M={m}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_rms_norm_matches_reference_and_is_row_invariant(dtype):
    g = _gen(1)
    x = (torch.randn(64, 96, generator=g) * 2).to(DEVICE, dtype)
    w = (1 + torch.randn(96, generator=g) / 10).to(DEVICE, dtype)
    full = bi_rms_norm(x, w, 1e-6, impl="triton")
    torch.testing.assert_close(full.float(), bi_rms_norm(x, w, 1e-6, impl="reference").float(), **TOL[dtype])
    for m in (1, 3, 17):
        idx = torch.randperm(64, generator=g)[:m]
        assert_bitwise(bi_rms_norm(x[idx], w, 1e-6, impl="triton"), full[idx], f"M={m}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_packed_attention_matches_reference_and_ignores_the_pack(dtype):
    lengths = [5, 2 * KEY_BLOCK + 2, 1, KEY_BLOCK]
    q, k, v = (t.to(DEVICE) for t in make_qkv(sum(lengths), 4, 2, 16, dtype, seed=2))
    cu = pack_lengths(lengths, DEVICE)
    full = packed_attention(q, k, v, cu, max(lengths), 0.25, impl="triton")
    ref = packed_attention(q, k, v, cu, max(lengths), 0.25, impl="reference")
    torch.testing.assert_close(full.float(), ref.float(), **TOL[dtype])
    starts = cu.tolist()
    for chosen in ([1], [3, 0], [2, 1]):
        rows = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in chosen])
        sub = [lengths[i] for i in chosen]
        out = packed_attention(q[rows], k[rows], v[rows], pack_lengths(sub, DEVICE), max(sub), 0.25, impl="triton")
        assert_bitwise(out, full[rows], f"sequences {chosen}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_decode_equals_triton_packed_position_by_position(dtype):
    q, k, v = (t.to(DEVICE) for t in make_qkv(sum(LENGTHS), 4, 2, 16, dtype, seed=3))
    packed = packed_attention(q, k, v, pack_lengths(LENGTHS, DEVICE), max(LENGTHS), 0.3, impl="triton")
    rows = checked_rows(LENGTHS, KEY_BLOCK, DEVICE == "cuda", DEVICE)
    dq, kc, vc, lens = decode_rows_at(rows, q, k, v, LENGTHS, cap=2 * KEY_BLOCK)
    decoded = decode_attention(dq, kc, vc, lens, 0.3, impl="triton")
    assert not decoded.isnan().any()
    assert_bitwise(decoded, packed[rows], "triton decode row vs triton packed row")
    torch.testing.assert_close(decoded.float(), decode_attention(dq, kc, vc, lens, 0.3).float(), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_decode_rows_are_batch_invariant(dtype):
    g = _gen(4)
    # Decode runs a program per batch row (and kv head): 24 rows hold the sub-batches below and lengths of 1 to 3
    # key blocks; more rows are more of the same programs (tens of ms each, interpreted).
    b, cap = 24, 2 * KEY_BLOCK + 8
    q = torch.randn(b, 3, 16, generator=g).to(DEVICE, dtype)  # 3 query heads over one kv head
    kc, vc = (torch.randn(b, 1, cap, 16, generator=g).to(DEVICE, dtype) for _ in range(2))
    lengths = torch.randint(1, cap + 1, (b,), generator=g, dtype=torch.int32).to(DEVICE)
    full = decode_attention(q, kc, vc, lengths, 0.25, impl="triton")
    for m in (1, 3, 17):
        idx = torch.randperm(b, generator=g)[:m]
        assert_bitwise(decode_attention(q[idx], kc[idx], vc[idx], lengths[idx], 0.25, impl="triton"), full[idx],
                       f"M={m}")


def test_triton_kernels_refuse_unsupported_head_dims():
    from kernels.batch_invariant import BatchInvariantInputError

    q, k, v = (t.to(DEVICE) for t in make_qkv(4, 2, 2, 264, torch.float32, seed=0))
    with pytest.raises(BatchInvariantInputError, match="head_dim"):
        packed_attention(q, k, v, pack_lengths([4], DEVICE), 4, 0.25, impl="triton")


def test_triton_head_dim_that_is_not_a_power_of_two_is_zero_padded():
    lengths = [3, KEY_BLOCK + 2]
    q, k, v = (t.to(DEVICE) for t in make_qkv(sum(lengths), 2, 1, 24, torch.bfloat16, seed=5))
    cu = pack_lengths(lengths, DEVICE)
    packed = packed_attention(q, k, v, cu, max(lengths), 0.2, impl="triton")
    torch.testing.assert_close(packed.float(), packed_attention(q, k, v, cu, max(lengths), 0.2,
                                                                impl="reference").float(), **TOL[torch.bfloat16])
    rows = checked_rows(lengths, KEY_BLOCK, DEVICE == "cuda", DEVICE)
    dq, kc, vc, lens = decode_rows_at(rows, q, k, v, lengths, cap=KEY_BLOCK + 8)
    assert_bitwise(decode_attention(dq, kc, vc, lens, 0.2, impl="triton"), packed[rows],
                   "head_dim 24: decode vs packed")


def test_triton_fully_masked_key_blocks_leave_rows_untouched(monkeypatch):
    """With BLOCK_M = 2 * KEY_BLOCK a packed tile's first rows walk a key block they cannot see at all;
    their state must pass through it bit for bit (decode of the same rows never visits that block). The rows
    decoded in the interpreter include the first two and the last (63) of those rows."""
    from dataclasses import replace

    from kernels.batch_invariant import triton_launch

    wide = {dt: replace(cfg, block_m=2 * KEY_BLOCK) for dt, cfg in triton_launch.ATTENTION_CONFIGS.items()}
    monkeypatch.setattr(triton_launch, "ATTENTION_CONFIGS", wide)
    lengths = [2 * KEY_BLOCK + 1]
    q, k, v = (t.to(DEVICE) for t in make_qkv(sum(lengths), 1, 1, 16, torch.float32, seed=6))
    packed = packed_attention(q, k, v, pack_lengths(lengths, DEVICE), max(lengths), 0.3, impl="triton")
    rows = checked_rows(lengths, KEY_BLOCK, DEVICE == "cuda", DEVICE)
    assert {0, 1, KEY_BLOCK - 1} <= set(rows.tolist())
    dq, kc, vc, lens = decode_rows_at(rows, q, k, v, lengths, cap=2 * KEY_BLOCK + 8)
    assert_bitwise(decode_attention(dq, kc, vc, lens, 0.3, impl="triton"), packed[rows],
                   "BLOCK_M=128: decode vs packed")
