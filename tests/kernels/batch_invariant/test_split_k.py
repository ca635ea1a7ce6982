"""Split-K matmuls: K is reduced in SPLIT_K splits folded into the total in split order, and a row's bits are the
same whether its splits ran inline in one program (the trainer, large batches) or in one program each followed by
the combine pass (decode of a few rows), and whatever other rows share the call.

K = 300 here: two splits (one full, one with a K tail inside a BLOCK_K step) in both dtypes (fp32: 10 steps of 32,
bf16: 5 of 64). Triton runs interpreted on CPU (compiled on a GPU) with the row-ordering numpy matmul installed,
so no check passes by numpy's BLAS; the same checks at the Qwen3 shapes on a GPU are in test_fused_decode_gpu.py.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels.batch_invariant import bi_linear, reference, triton_launch
from kernels.batch_invariant.errors import BatchInvariantInputError
from kernels.batch_invariant.fused import gate_up, grouped_linear
from kernels.moe.grouped import reference as grouped_reference
from tests.kernels.batch_invariant.batch_invariant_support import assert_bitwise
from tests.kernels.interpreted_dot import row_position_dependent_matmul

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

K = 300
ROWS = (1, 3, 17, 70)  # 70: two BLOCK_M tiles
TOL = {torch.float32: dict(rtol=2e-5, atol=2e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


@pytest.fixture(autouse=True)
def numpy_matmul_that_orders_each_row_by_its_index(monkeypatch):
    if DEVICE == "cpu":
        monkeypatch.setattr(np, "matmul", row_position_dependent_matmul)


def _data(dtype, n, seed, rows=70):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, K, generator=g).to(DEVICE, dtype)
    w = (torch.randn(n, K, generator=g) / K ** 0.5).to(DEVICE, dtype)
    b = torch.randn(n, generator=g).to(DEVICE, dtype)
    return g, x, w, b


def test_reference_sums_split_by_split_from_zero():
    """The reference's order is the kernels': total = 0, then + each SPLIT_K slice's sum, in order."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(5, 2 * reference.SPLIT_K + 7, generator=g), torch.randn(2 * reference.SPLIT_K + 7, generator=g)
    s = reference.SPLIT_K
    want = ((torch.zeros(5) + (a[:, :s] * b[:s]).sum(-1)) + (a[:, s:2 * s] * b[s:2 * s]).sum(-1)) + \
        (a[:, 2 * s:] * b[2 * s:]).sum(-1)
    assert torch.equal(reference.split_k_sum(a, b), want)
    assert torch.equal(reference.split_k_sum(a[:, :s], b[:s]), (a[:, :s] * b[:s]).sum(-1)), "one split: a plain sum"
    assert torch.equal(reference.split_k_sum(a[:, :0], b[:0]), torch.zeros(5))


def test_reference_linear_and_moe_reference_share_the_split_order():
    """The MoE grouped GEMM's reference gives each expert bi_linear's reference bits over a K of several splits."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(9, 2 * reference.SPLIT_K + 40, generator=g).bfloat16()
    w = torch.randn(3, 24, x.shape[1], generator=g).bfloat16()
    counts = torch.tensor([4, 0, 5])
    y = grouped_reference(x, w, counts)
    assert_bitwise(y[:4], reference.linear(x[:4], w[0], None), "expert 0")
    assert_bitwise(y[4:], reference.linear(x[4:], w[2], None), "expert 2")


def test_the_plan_splits_k_in_split_k_elements():
    cfg = triton_launch.matmul_config(torch.bfloat16, 40, "cuda")
    plan = triton_launch.split_k_plan(cfg, K, 1, 1, torch.device(DEVICE), True)
    assert (plan.steps, plan.splits, plan.partial) == (reference.SPLIT_K // cfg.block_k, 2, True)
    assert not triton_launch.split_k_plan(cfg, K, 1, 1, torch.device("cpu"), None).partial, \
        "interpreted runs take the one-program schedule unless asked"
    assert triton_launch.split_k_plan(cfg, reference.SPLIT_K, 1, 1, torch.device(DEVICE), True).splits == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_k_schedule_gives_the_one_program_bits_for_every_row(dtype):
    g, x, w, b = _data(dtype, 40, 2)  # N = 40: one N tile with a tail; 70 rows: two M tiles
    one = triton_launch.linear(x, w, b, split_k=False)
    torch.testing.assert_close(one.float(), bi_linear(x, w, b, impl="reference").float(), **TOL[dtype])
    assert_bitwise(triton_launch.linear(x, w, b, split_k=True), one, "split-K, all rows")
    for m in ROWS[:-1]:
        idx = torch.randperm(x.shape[0], generator=g)[:m]
        assert_bitwise(triton_launch.linear(x[idx], w, b, split_k=True), one[idx], f"split-K M={m}")
    assert_bitwise(triton_launch.linear(x[5:6], w, None, split_k=True),
                   triton_launch.linear(x[5:6], w, None, split_k=False), "one row, no bias")


def test_grouped_projections_split_k_equal_one_program_and_bi_linear():
    _, x, w, _ = _data(torch.bfloat16, 40, 3, rows=17)
    g = torch.Generator().manual_seed(4)
    ws = [w, (torch.randn(24, K, generator=g) / 17).to(DEVICE, torch.bfloat16)]
    bs = [torch.randn(n.shape[0], generator=g).to(DEVICE, torch.bfloat16) for n in ws]
    one = grouped_linear(x, ws, bs, impl="triton", split_k=False)
    assert_bitwise(one, torch.cat([triton_launch.linear(x, wi, bi, split_k=False) for wi, bi in zip(ws, bs)], -1),
                   "one program == bi_linear per weight")
    assert_bitwise(grouped_linear(x, ws, bs, impl="triton", split_k=True), one, "split-K, 17 rows")
    assert_bitwise(grouped_linear(x[3:4], ws, bs, impl="triton", split_k=True), one[3:4], "split-K, one row")
    assert_bitwise(grouped_linear(x[:3], ws, None, impl="triton", split_k=True),
                   grouped_linear(x[:3], ws, None, impl="triton", split_k=False), "no bias")


@pytest.mark.parametrize("silu_mul", [True, False], ids=["silu_mul", "concat"])
def test_gate_up_split_k_equals_one_program(silu_mul):
    _, x, wg, _ = _data(torch.bfloat16, 24, 5, rows=17)
    wu = wg.flip(0) * 2
    one = gate_up(x, wg, wu, silu_mul=silu_mul, impl="triton", split_k=False)
    if not silu_mul:
        assert_bitwise(one, torch.cat([triton_launch.linear(x, wg, None), triton_launch.linear(x, wu, None)], -1),
                       "gate | up == bi_linear each")
    assert_bitwise(gate_up(x, wg, wu, silu_mul=silu_mul, impl="triton", split_k=True), one, "split-K, 17 rows")
    assert_bitwise(gate_up(x[2:3], wg, wu, silu_mul=silu_mul, impl="triton", split_k=True), one[2:3], "one row")


def test_forcing_split_k_on_the_legacy_order_is_refused(monkeypatch):
    """The benchmark's legacy order (one chain over K) has no splits to spread: forcing split-K on it fails loud."""
    monkeypatch.setattr(triton_launch, "matmul_split_steps", lambda cfg: 0)
    _, x, w, b = _data(torch.bfloat16, 8, 6, rows=1)
    with pytest.raises(BatchInvariantInputError, match="split_k=True"):
        triton_launch.linear(x, w, b, split_k=True)
