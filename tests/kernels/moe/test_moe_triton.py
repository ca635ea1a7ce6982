"""The batch-invariant grouped GEMM kernel in Triton's interpreter on CPU (compiled on a GPU): each expert's
rows get bi_linear's Triton bits for that expert's weight, a row's bits do not depend on the other rows,
and the kernel agrees with the pure-torch reference. Rests on the fixed-order interpreted dot
(tests/kernels/conftest.py) and runs with numpy's matmul replaced by a row-position-dependent one."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels.batch_invariant import bi_linear
from kernels.moe import grouped_linear
from kernels.moe.grouped_triton import tile_schedule
from tests.kernels.batch_invariant.batch_invariant_support import assert_bitwise
from tests.kernels.interpreted_dot import row_position_dependent_matmul

pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


@pytest.fixture(autouse=True)
def numpy_matmul_that_orders_each_row_by_its_index(monkeypatch):
    if DEVICE == "cpu":
        monkeypatch.setattr(np, "matmul", row_position_dependent_matmul)


def test_tile_schedule_covers_every_row_once_with_one_expert_per_tile():
    counts = torch.tensor([3, 0, 70, 1, 64, 0, 130])
    expert, start, end = tile_schedule(counts, int(counts.sum()), 64)
    assert expert.shape[0] == -(-268 // 64) + 7
    seen = torch.zeros(268, dtype=torch.int64)
    bounds = torch.cumsum(counts, 0)
    for e, s, t in zip(expert.tolist(), start.tolist(), end.tolist()):
        assert 0 <= t - s <= 64
        if t > s:
            assert bounds[e] - counts[e] <= s and t <= bounds[e]
            seen[s:t] += 1
    assert torch.equal(seen, torch.ones_like(seen))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_interpreted_grouped_kernel_is_bi_linear_per_expert_and_row_invariant(dtype):
    g = torch.Generator().manual_seed(0)
    counts = torch.tensor([3, 0, 70, 1, 5])
    x = torch.randn(int(counts.sum()), 80, generator=g).to(DEVICE, dtype)   # K: a full BLOCK_K step and a tail
    w = (torch.randn(5, 72, 80, generator=g) / 9).to(DEVICE, dtype)          # N: a full and a partial tile
    counts = counts.to(DEVICE)
    y = grouped_linear(x, w, counts, impl="triton")
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(y.float(), grouped_linear(x, w, counts, impl="reference").float(), **tol)
    start = 0
    for e, c in enumerate(counts.tolist()):
        if c:
            assert_bitwise(y[start:start + c], bi_linear(x[start:start + c], w[e], impl="triton"), f"expert {e}")
        start += c
    # Expert 2's rows 5..9 alone, with one row of expert 4 after them.
    sub = torch.cat([x[8:13], x[-1:]])
    got = grouped_linear(sub, w, torch.tensor([0, 0, 5, 0, 1], device=DEVICE), impl="triton")
    assert_bitwise(got[:5], y[8:13], "expert 2 rows alone")
    assert_bitwise(got[5:], y[-1:], "expert 4 row alone")
