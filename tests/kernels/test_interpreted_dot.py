"""The interpreted tl.dot the kernel tests install: one summation order for every output, BLAS or not.

The kernel tests' bitwise claims under Triton's interpreter rest on it (interpreted_dot.py says
why numpy's matmul cannot carry them). Here: the adversarial matmul really does give a row other
bits at another position, Triton's own interpreter dot inherits that, and the installed dot does
not, matching its definition bit for bit. No kernel is launched, so this runs on any host.
"""
from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import require
from tests.kernels.interpreted_dot import fixed_order_dot, row_position_dependent_matmul, triton_create_dot

try:
    import triton.language as tl
    from triton.runtime.interpreter import InterpreterBuilder, TensorHandle
except ImportError:  # the checks of the installed dot `require` Triton
    tl = None

# The tile shapes of the kernels' dots (fp32 and bf16 matmul, attention q @ k and p @ v, BLOCK_M = 128
# attention), and an odd K, whose last term the tree carries up a level.
TILES = [(64, 32, 64), (64, 64, 64), (64, 16, 64), (64, 64, 16), (128, 16, 64), (24, 13, 8)]
ROW, AT = 0, 37  # a row alone at tile row 0 (M = 1) and the same row at tile row 37 of a full tile


def _operands(m, k, n, seed):
    g = np.random.default_rng(seed)
    return (g.standard_normal((m, k)).astype(np.float32), g.standard_normal((k, n)).astype(np.float32),
            g.standard_normal((m, n)).astype(np.float32))


def _at(a, b, acc, src, dst):
    """(a, b, acc) with row src of a and acc moved to row dst and the other rows zero, as masked rows load."""
    a2, acc2 = np.zeros_like(a), np.zeros_like(acc)
    a2[dst], acc2[dst] = a[src], acc[src]
    return a2, b, acc2


def _bits(x):
    return x.view(np.int32)


def _by_definition(a_row, b, acc_row):
    """fixed_order_dot's definition, one output at a time: fp32 products, halves summed until one is left, + acc."""
    out = np.empty(b.shape[1], np.float32)
    for j in range(b.shape[1]):
        terms = [np.float32(a_row[k] * b[k, j]) for k in range(a_row.shape[0])]
        while len(terms) > 1:
            half = len(terms) // 2
            terms = [np.float32(x + y) for x, y in zip(terms[:half], terms[half:2 * half])] + terms[2 * half:]
        out[j] = np.float32(acc_row[j] + terms[0])
    return out


def _interpreted_dot(create_dot, a, b, acc):
    h = lambda x: TensorHandle(x, tl.float32)  # noqa: E731
    return create_dot(InterpreterBuilder(), h(a), h(b), h(acc), "ieee", 0).data


def test_adversarial_matmul_is_a_matmul_whose_row_bits_depend_on_the_row_position():
    a, b, acc = _operands(64, 32, 64, seed=0)
    np.testing.assert_allclose(row_position_dependent_matmul(a, b), a.astype(np.float64) @ b, rtol=1e-4, atol=1e-4)
    here = row_position_dependent_matmul(*_at(a, b, acc, ROW, ROW)[:2])[ROW]
    there = row_position_dependent_matmul(*_at(a, b, acc, ROW, AT)[:2])[AT]
    assert not np.array_equal(_bits(here), _bits(there))


@pytest.mark.parametrize("m, k, n", TILES)
def test_fixed_order_dot_is_its_definition_and_ignores_the_row_position(m, k, n):
    a, b, acc = _operands(m, k, n, seed=m + k + n)
    full = fixed_order_dot(a, b, acc)
    for r in (0, 5, 6, m - 1):
        np.testing.assert_array_equal(_bits(full[r]), _bits(_by_definition(a[r], b, acc[r])))
    for src, dst in ((0, 0), (0, m // 2 + 1), (m // 2 + 1, 0), (m - 1, 3)):
        np.testing.assert_array_equal(_bits(fixed_order_dot(*_at(a, b, acc, src, dst))[dst]), _bits(full[src]))
    # A batch of tiles (a 3-D tl.dot) is the 2-D dot per tile.
    batched = fixed_order_dot(np.stack([a, a[::-1]]), np.stack([b, b]), np.stack([acc, acc[::-1]]))
    np.testing.assert_array_equal(_bits(batched[1]), _bits(full[::-1]))


def test_triton_interpreter_dot_follows_numpy_matmul_and_the_installed_dot_does_not(monkeypatch):
    """The failure the installed dot prevents, on purpose: Triton's own dot under a row-position-dependent matmul."""
    require(tl is not None, "triton is not installed")
    monkeypatch.setattr(np, "matmul", row_position_dependent_matmul)
    a, b, acc = _operands(64, 32, 64, seed=1)
    for create_dot, position_free in ((triton_create_dot(), False), (InterpreterBuilder.create_dot, True)):
        here = _interpreted_dot(create_dot, *_at(a, b, acc, ROW, ROW))[ROW]
        there = _interpreted_dot(create_dot, *_at(a, b, acc, ROW, AT))[AT]
        assert np.array_equal(_bits(here), _bits(there)) == position_free, create_dot
    installed = _interpreted_dot(InterpreterBuilder.create_dot, a, b, acc)
    np.testing.assert_array_equal(_bits(installed), _bits(fixed_order_dot(a, b, acc)))


def test_installed_dot_refuses_operands_it_cannot_multiply():
    require(tl is not None, "triton is not installed")
    raw_bf16 = TensorHandle(np.zeros((16, 16), np.uint16), tl.bfloat16)
    acc = TensorHandle(np.zeros((16, 16), np.float32), tl.float32)
    with pytest.raises(TypeError, match="fixed-order dot takes float operands"):
        InterpreterBuilder().create_dot(raw_bf16, raw_bf16, acc, "ieee", 0)
