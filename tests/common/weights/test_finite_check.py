"""The finite checks of received weights (one min/max reduction per tensor, and the integer check over raw
bytes the stream receiver runs on its worker threads) refuse every
NaN, +inf and -inf wherever it sits, in every floating dtype, on one thread and on several; finite
extremes and empty tensors pass."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from services.common.weights.finite_check import all_finite, bucket_non_finite, bytes_all_finite, checks_bytes, non_finite
from services.rollout.embedded.torch_engine import one_intra_op_thread

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
BITS = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32, torch.float64: torch.int64}
# Sizes below, at and well above a vector register's and a parallel grain's width, with a ragged tail.
SIZES = [1, 7, 64, 4099, 70_001]


def _nan_patterns(dtype: torch.dtype) -> list[torch.Tensor]:
    """Quiet NaN, negative NaN and a NaN with a low payload bit (every exponent bit set, mantissa != 0)."""
    finfo_bits = {torch.float16: (5, 10), torch.bfloat16: (8, 7), torch.float32: (8, 23), torch.float64: (11, 52)}
    exp_bits, man_bits = finfo_bits[dtype]
    exponent = ((1 << exp_bits) - 1) << man_bits
    sign = 1 << (exp_bits + man_bits)
    raw = [exponent | (1 << (man_bits - 1)), exponent | 1, sign | exponent | 1]
    width = {torch.int16: 16, torch.int32: 32, torch.int64: 64}[BITS[dtype]]
    signed = [r - (1 << width) if r >= 1 << (width - 1) else r for r in raw]
    return [torch.tensor([v], dtype=BITS[dtype]).view(dtype) for v in signed]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_non_finite_value_is_found_anywhere(dtype, threads):
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for size in SIZES:
            finite = torch.linspace(-3, 3, size, dtype=torch.float64).to(dtype)
            assert all_finite(finite), (dtype, size)
            bad_values = [torch.tensor([float("inf")], dtype=dtype), torch.tensor([float("-inf")], dtype=dtype),
                          *_nan_patterns(dtype)]
            for bad in bad_values:
                assert not bool(torch.isfinite(bad).all())
                for position in sorted({0, size // 2, size - 1}):
                    t = finite.clone()
                    t[position] = bad[0]
                    assert not all_finite(t), (dtype, size, position, bad)
                    assert not all_finite(t.reshape(1, -1).t()), (dtype, size, position, bad)  # a 2-d view
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("dtype", DTYPES)
def test_finite_extremes_and_empty_tensors_pass(dtype):
    info = torch.finfo(dtype)
    assert all_finite(torch.tensor([info.max, info.min, info.tiny, -info.tiny, 0.0, -0.0], dtype=dtype))
    assert all_finite(torch.empty(0, 5, dtype=dtype))
    assert not all_finite(torch.tensor([info.max], dtype=dtype) * 2)  # overflow to inf


def test_one_intra_op_thread_restores_the_thread_count():
    previous = torch.get_num_threads()
    with one_intra_op_thread("cpu"):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == previous
    with pytest.raises(RuntimeError), one_intra_op_thread("cpu"):
        raise RuntimeError("a failed update")
    assert torch.get_num_threads() == previous


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_bytes_check_agrees_with_torch_on_every_value_class(dtype):
    info = torch.finfo(dtype)
    finite = [info.max, info.min, info.tiny, -info.tiny, info.tiny / 4, 0.0, -0.0, 1.5, -2.25]
    bad = [torch.tensor([float("inf")], dtype=dtype), torch.tensor([float("-inf")], dtype=dtype),
           *_nan_patterns(dtype)]
    for size in SIZES:
        base = torch.tensor(finite, dtype=dtype).repeat(size // len(finite) + 1)[:size].contiguous()
        assert bytes_all_finite(base.view(torch.uint8).numpy(), dtype) and all_finite(base)
        for value in bad:
            for position in sorted({0, size // 2, size - 1}):
                t = base.clone()
                t[position] = value[0]
                assert not bytes_all_finite(t.view(torch.uint8).numpy(), dtype), (dtype, size, position, value)
    assert bytes_all_finite(np.empty(0, dtype=np.uint8), dtype)


def test_the_bytes_check_refuses_a_partial_value_or_another_layout():
    with pytest.raises(ValueError, match="whole torch.float32 values, got uint8 of 6 bytes"):
        bytes_all_finite(np.zeros(6, dtype=np.uint8), torch.float32)
    with pytest.raises(ValueError, match="need flat uint8"):
        bytes_all_finite(np.zeros(4, dtype=np.float32), torch.float32)
    assert checks_bytes(torch.bfloat16) and not checks_bytes(torch.int64)


def test_a_whole_set_names_exactly_its_non_finite_floating_tensors():
    named = {f"{dtype}": torch.linspace(-3, 3, 4099, dtype=torch.float64).to(dtype) for dtype in DTYPES}
    named["ints"] = torch.arange(10)
    named["empty"] = torch.empty(0, dtype=torch.bfloat16)
    assert non_finite(named) == [] and non_finite({}) == []
    named[str(torch.bfloat16)][4098] = float("nan")
    named[str(torch.float64)][0] = float("-inf")
    assert non_finite(named) == [str(torch.bfloat16), str(torch.float64)]  # in the set's order


def test_a_bucket_is_checked_run_by_run_and_padding_never_names_a_tensor():
    values = {"a": torch.linspace(-1, 1, 100).to(torch.bfloat16), "a2": torch.linspace(0, 1, 8).to(torch.bfloat16),
              "b": torch.linspace(-2, 2, 37), "c": torch.linspace(-3, 3, 64).to(torch.bfloat16),
              "ids": torch.arange(2)}
    # One bf16 run (a, a2, with alignment padding between them), a float32 one, a bf16 one, an integer.
    slots = [("a", torch.bfloat16, 0, 200), ("a2", torch.bfloat16, 256, 16), ("b", torch.float32, 512, 148),
             ("c", torch.bfloat16, 768, 128), ("ids", torch.int64, 896, 16), ("none", torch.bfloat16, 960, 0)]
    buffer = torch.zeros(1024, dtype=torch.uint8)
    for name, _dtype, offset, nbytes in slots[:-1]:
        buffer[offset:offset + nbytes] = values[name].view(torch.uint8)
    assert bucket_non_finite(buffer, slots) == []
    buffer[200:202] = torch.tensor([float("nan")], dtype=torch.bfloat16).view(torch.uint8)  # padding inside a run
    buffer[896:904] = torch.tensor([-1], dtype=torch.int64).view(torch.uint8)  # an integer's bits: never checked
    assert bucket_non_finite(buffer, slots) == []
    buffer[768 + 126:768 + 128] = torch.tensor([float("-inf")], dtype=torch.bfloat16).view(torch.uint8)
    buffer[512:516] = torch.tensor([float("nan")], dtype=torch.float32).view(torch.uint8)
    buffer[256:258] = torch.tensor([float("inf")], dtype=torch.bfloat16).view(torch.uint8)
    assert bucket_non_finite(buffer, slots) == ["a2", "b", "c"]
