"""Every backend runnable here against fp64 torch: random and adversarial logits, forward and backward.

On CPU the Triton kernels run in Triton's interpreter (TRITON_INTERPRET=1 must be
set before they are imported, hence before kernels.logprob's first Triton use).
"""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from kernels.logprob import token_logprobs, token_logprobs_with_entropy  # noqa: E402
from tests.conftest import require  # noqa: E402
from tests.kernels.logprob.logprob_oracle import (  # noqa: E402
    check_adversarial_rows,
    check_padded_columns_are_excluded,
    close,
    oracle,
)

BACKENDS = ["reference", "triton"]
# The interpreter evaluates masked-off lanes too (exp(-inf - -inf) and the like) and warns; results are where()'d.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def _need(backend: str) -> None:
    if backend == "triton":
        try:
            import triton  # noqa: F401
        except ImportError:
            require(False, "triton is not installed")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("tau", [1.0, 0.7])
def test_random_logits_forward_backward(backend, dtype, tau):
    _need(backend)
    g = torch.Generator().manual_seed(10)
    T, V = 6, 320
    logits = (torch.randn(T, V, generator=g) * 5).to(dtype).requires_grad_()
    targets = torch.randint(0, V, (T,), generator=g)
    logp, lse, ent = token_logprobs_with_entropy(logits, targets, temperature=tau, backend=backend)
    x, r_logp, r_lse, r_ent = oracle(logits, targets, tau)
    close(logp, r_logp, 3e-5)
    close(lse, r_lse, 3e-5)
    close(ent, r_ent, 3e-5)
    up = torch.randn(3, T, generator=g)
    ((logp * up[0]).sum() + (lse * up[1]).sum() + (ent * up[2]).sum()).backward()
    ((r_logp * up[0]).sum() + (r_lse * up[1]).sum() + (r_ent * up[2]).sum()).backward()
    # Gradients come back in the logits dtype: one rounding at that dtype's resolution.
    atol = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}[dtype]
    close(logits.grad, x.grad, atol)


@pytest.mark.parametrize("backend", BACKENDS)
def test_vocab_not_divisible_by_tile_count(backend):
    """GPT-2's 50257: tiles of ceil(50257/64) = 786, the last one holds 739 columns."""
    _need(backend)
    g = torch.Generator().manual_seed(11)
    T, V = 3, 50257
    logits = (torch.randn(T, V, generator=g) * 3).to(torch.bfloat16).requires_grad_()
    targets = torch.tensor([0, 50256, 49518])  # first column, last column, first column of the last tile
    logp, lse = token_logprobs(logits, targets, backend=backend)
    x, r_logp, r_lse, _ = oracle(logits, targets, 1.0)
    close(logp, r_logp, 3e-5)
    close(lse, r_lse, 3e-5)
    logp.sum().backward()
    r_logp.sum().backward()
    close(logits.grad, x.grad, 4e-3)


@pytest.mark.parametrize("backend", BACKENDS)
def test_padded_columns_are_excluded(backend):
    _need(backend)
    check_padded_columns_are_excluded(backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_adversarial_rows(backend):
    _need(backend)
    check_adversarial_rows(backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_masked_rows_are_zero_with_zero_gradient(backend):
    _need(backend)
    g = torch.Generator().manual_seed(14)
    logits = torch.randn(5, 128, generator=g).to(torch.bfloat16).requires_grad_()
    targets = torch.tensor([1, -100, 3, 4, 99999])  # inactive tokens may hold any id
    mask = torch.tensor([True, False, True, True, False])
    logp, lse, ent = token_logprobs_with_entropy(logits, targets, mask=mask, backend=backend)
    assert torch.all(logp[~mask] == 0) and torch.all(lse[~mask] == 0) and torch.all(ent[~mask] == 0)
    ref, ref_lse = token_logprobs(logits.detach(), targets.clamp(0, 127), backend=backend)
    assert torch.equal(logp[mask], ref[mask]) and torch.equal(lse[mask], ref_lse[mask])
    (logp.sum() + lse.sum() + ent.sum()).backward()
    assert torch.all(logits.grad[~mask] == 0)
    assert torch.all(logits.grad[mask].float().abs().sum(-1) > 0)


def test_triton_matches_reference_closely():
    """The two backends share the definition, not the bits: their gap is rounding only."""
    _need("triton")
    g = torch.Generator().manual_seed(15)
    logits = (torch.randn(5, 640, generator=g) * 4).to(torch.bfloat16)
    targets = torch.randint(0, 640, (5,), generator=g)
    a = token_logprobs(logits, targets, backend="reference", temperature=0.9)
    b = token_logprobs(logits, targets, backend="triton", temperature=0.9)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=0, atol=2e-6)
