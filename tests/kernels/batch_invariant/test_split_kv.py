"""Split-KV decode: the online softmax restarts every SPLIT_BLOCKS key blocks, and a token's bits are the same
whether its splits ran inline in one program (packed prefill, decode of a large batch) or in one program each
followed by the combine pass (decode of a few rows).

Sequences here cross two split boundaries (SPLIT_BLOCKS * KEY_BLOCK keys each). Per implementation (pure torch;
Triton interpreted on CPU, compiled on a GPU), bit for bit:
- decode (dense and paged) at positions on both sides of every split boundary == packed prefill;
- the split-KV schedule == the one-program schedule, for every row, in any batch;
and the Triton kernels agree with the reference within a dtype tolerance.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels.batch_invariant import KEY_BLOCK, decode_attention, packed_attention, paged_decode_attention
from kernels.batch_invariant import triton_launch
from kernels.batch_invariant.reference import SPLIT_BLOCKS
from tests.kernels.batch_invariant.batch_invariant_support import assert_bitwise, make_qkv, pack_lengths
from tests.kernels.batch_invariant.test_batch_invariant_paged import scatter_into_pool
from tests.kernels.interpreted_dot import row_position_dependent_matmul

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter evaluates masked lanes

SPLIT_KEYS = SPLIT_BLOCKS * KEY_BLOCK
LENGTHS = [2 * SPLIT_KEYS + 3, 5]
TOL = {torch.float32: dict(rtol=2e-5, atol=2e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


@pytest.fixture(autouse=True)
def numpy_matmul_that_orders_each_row_by_its_index(monkeypatch):
    if DEVICE == "cpu":
        monkeypatch.setattr(np, "matmul", row_position_dependent_matmul)


def _positions() -> list[tuple[int, int]]:
    """(sequence, position) pairs on both sides of each key-block and split edge of the long sequence, and the
    short sequence's first and last (all its positions lie in one key block of one split)."""
    edges = (0, KEY_BLOCK - 1, KEY_BLOCK, SPLIT_KEYS - 1, SPLIT_KEYS, SPLIT_KEYS + 1, 2 * SPLIT_KEYS - 1,
             2 * SPLIT_KEYS, LENGTHS[0] - 1)
    return [(0, t) for t in edges] + [(1, 0), (1, LENGTHS[1] - 1)]


def _decode_inputs(q, k, v, cap: int):
    """Decode rows for _positions(): queries, NaN-tailed dense caches, lengths, and the packed rows they match."""
    starts = [0] + np.cumsum(LENGTHS).tolist()[:-1]
    picks = _positions()
    rows = torch.tensor([starts[s] + t for s, t in picks])
    n_kv, d = k.shape[1:]
    kc = torch.full((len(picks), n_kv, cap, d), float("nan"), dtype=k.dtype, device=k.device)
    vc = torch.full_like(kc, float("nan"))
    for i, (s, t) in enumerate(picks):
        kc[i, :, : t + 1] = k[starts[s]:starts[s] + t + 1].transpose(0, 1)
        vc[i, :, : t + 1] = v[starts[s]:starts[s] + t + 1].transpose(0, 1)
    lens = torch.tensor([t + 1 for _, t in picks], dtype=torch.int32, device=k.device)
    return q[rows.to(q.device)], kc, vc, lens, rows.to(q.device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_decode_across_splits_equals_packed(dtype):
    q, k, v = make_qkv(sum(LENGTHS), 4, 2, 16, dtype, seed=11)
    packed = packed_attention(q, k, v, pack_lengths(LENGTHS), max(LENGTHS), 0.3, impl="reference")
    dq, kc, vc, lens, rows = _decode_inputs(q, k, v, cap=LENGTHS[0] + 9)
    decoded = decode_attention(dq, kc, vc, lens, 0.3, impl="reference")
    assert not decoded.isnan().any()
    assert_bitwise(decoded, packed[rows], "reference decode vs packed across splits")


def test_a_fold_on_a_rows_first_split_returns_the_partial_exactly():
    """The fold's identity: the first split's partial passes (-inf, 0, 0) + partial bit for bit."""
    from kernels.batch_invariant.reference import _fold

    g = torch.Generator().manual_seed(0)
    m_c, l_c = torch.randn(5, generator=g), torch.rand(5, generator=g) + 0.5
    acc_c = torch.randn(5, 3, generator=g)
    m, l, acc = _fold(torch.full((5,), float("-inf")), torch.zeros(5), torch.zeros(5, 3), m_c, l_c, acc_c,
                      torch.ones(5, dtype=torch.bool))
    assert_bitwise(m, m_c, "m")
    assert_bitwise(l, l_c, "l")
    assert_bitwise(acc, acc_c, "acc")
    kept = _fold(m, l, acc, m_c + 1, l_c, acc_c, torch.zeros(5, dtype=torch.bool))
    assert all(torch.equal(a, b) for a, b in zip(kept, (m, l, acc)))


# bf16 on a GPU only: in the interpreter the paged test below runs the split and one-program schedules in bf16
# (the arithmetic of both kernels, shared by dense and paged caches, which differ only in addresses) and this one
# the dense addresses in fp32; bf16 dense decode is checked against the reference in test_batch_invariant_triton.py.
@pytest.mark.parametrize("dtype", [torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else []))
def test_triton_split_kv_decode_equals_one_program_decode_and_packed(dtype):
    q, k, v = make_qkv(sum(LENGTHS), 4, 2, 16, dtype, seed=12, device=DEVICE)
    packed = packed_attention(q, k, v, pack_lengths(LENGTHS, DEVICE), max(LENGTHS), 0.3, impl="triton")
    dq, kc, vc, lens, rows = _decode_inputs(q, k, v, cap=LENGTHS[0] + 9)
    one = triton_launch.decode_attention(dq, kc, vc, lens, 0.3, split_kv=False)
    split = triton_launch.decode_attention(dq, kc, vc, lens, 0.3, split_kv=True)
    assert not split.isnan().any()
    assert_bitwise(one, packed[rows], "one-program decode vs packed")
    assert_bitwise(split, one, "split-KV decode vs one-program decode")
    torch.testing.assert_close(split.float(), decode_attention(dq, kc, vc, lens, 0.3, impl="reference").float(),
                               **TOL[dtype])
    # A row's bits do not depend on the batch around it under the split schedule either.
    for idx in ([2], [9, 0], [len(rows) - 1, 4, 5]):
        sub = torch.tensor(idx, device=DEVICE)
        assert_bitwise(triton_launch.decode_attention(dq[sub], kc[sub], vc[sub], lens[sub], 0.3, split_kv=True),
                       split[sub], f"split-KV rows {idx}")


def test_triton_split_kv_paged_decode_equals_one_program_and_packed():
    dtype = torch.bfloat16
    q, k, v = make_qkv(sum(LENGTHS), 6, 2, 16, dtype, seed=13, device=DEVICE)  # GQA group 3
    packed = packed_attention(q, k, v, pack_lengths(LENGTHS, DEVICE), max(LENGTHS), 0.3, impl="triton")
    k_pool, v_pool, tables = scatter_into_pool(k, v, LENGTHS)
    picks = _positions()
    rows = torch.tensor([sum(LENGTHS[:s]) + t for s, t in picks], device=DEVICE)
    seq = torch.tensor([s for s, _ in picks], device=DEVICE)
    lens = torch.tensor([t + 1 for _, t in picks], dtype=torch.int32, device=DEVICE)
    one = triton_launch.paged_decode_attention(q[rows], k_pool, v_pool, tables[seq], lens, 0.3, split_kv=False)
    split = triton_launch.paged_decode_attention(q[rows], k_pool, v_pool, tables[seq], lens, 0.3, split_kv=True)
    assert not split.isnan().any()
    assert_bitwise(one, packed[rows], "paged one-program decode vs packed")
    assert_bitwise(split, one, "paged split-KV decode vs one-program decode")
    if DEVICE == "cuda":  # interpreted, the public entry takes the one-program schedule (the test below): `one`
        assert_bitwise(paged_decode_attention(q[rows], k_pool, v_pool, tables[seq], lens, 0.3, impl="triton"), one,
                       "the public entry point, whichever schedule it picks")


def test_the_schedule_is_a_function_of_the_batch_shape_only():
    """CPU (interpreted) never splits unless asked; on a GPU a few rows split and a full batch does not."""
    assert not triton_launch.use_split_kv(1, torch.device("cpu"))
    if DEVICE == "cuda":
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        assert triton_launch.use_split_kv(8, torch.device("cuda"))
        assert not triton_launch.use_split_kv(triton_launch.SPLIT_KV_MIN_PROGRAMS_PER_SM * sms, torch.device("cuda"))
