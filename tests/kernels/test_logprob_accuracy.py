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

BACKENDS = ["reference", "triton"]
# The interpreter evaluates masked-off lanes too (exp(-inf - -inf) and the like) and warns; results are where()'d.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def _need(backend: str) -> None:
    if backend == "triton":
        try:
            import triton  # noqa: F401
        except ImportError:
            require(False, "triton is not installed")


def _oracle(logits: torch.Tensor, targets: torch.Tensor, tau: float, gvs: int | None = None):
    """fp64 log_softmax over the real vocab (columns >= gvs are padding, excluded)."""
    x = logits.detach().double().requires_grad_()
    xs = x / tau
    if gvs is not None:
        xs = xs[:, :gvs]
    ls = torch.log_softmax(xs, dim=-1)
    safe = targets.clamp(0, ls.shape[1] - 1)
    logp = ls.gather(1, safe[:, None])[:, 0]
    lse = torch.logsumexp(xs, dim=-1)
    p = ls.exp()
    ent = -(torch.where(p > 0, p * ls, torch.zeros_like(p))).sum(-1)
    return x, logp, lse, ent


def _close(got: torch.Tensor, want: torch.Tensor, atol: float) -> None:
    torch.testing.assert_close(got.double(), want.detach().double(), rtol=0, atol=atol, equal_nan=True)


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
    x, r_logp, r_lse, r_ent = _oracle(logits, targets, tau)
    _close(logp, r_logp, 3e-5)
    _close(lse, r_lse, 3e-5)
    _close(ent, r_ent, 3e-5)
    up = torch.randn(3, T, generator=g)
    ((logp * up[0]).sum() + (lse * up[1]).sum() + (ent * up[2]).sum()).backward()
    ((r_logp * up[0]).sum() + (r_lse * up[1]).sum() + (r_ent * up[2]).sum()).backward()
    # Gradients come back in the logits dtype: one rounding at that dtype's resolution.
    atol = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}[dtype]
    _close(logits.grad, x.grad, atol)


@pytest.mark.parametrize("backend", BACKENDS)
def test_vocab_not_divisible_by_tile_count(backend):
    """GPT-2's 50257: tiles of ceil(50257/64) = 786, the last one holds 739 columns."""
    _need(backend)
    g = torch.Generator().manual_seed(11)
    T, V = 3, 50257
    logits = (torch.randn(T, V, generator=g) * 3).to(torch.bfloat16).requires_grad_()
    targets = torch.tensor([0, 50256, 49518])  # first column, last column, first column of the last tile
    logp, lse = token_logprobs(logits, targets, backend=backend)
    x, r_logp, r_lse, _ = _oracle(logits, targets, 1.0)
    _close(logp, r_logp, 3e-5)
    _close(lse, r_lse, 3e-5)
    logp.sum().backward()
    r_logp.sum().backward()
    _close(logits.grad, x.grad, 4e-3)


@pytest.mark.parametrize("backend", BACKENDS)
def test_padded_columns_are_excluded(backend):
    """global_vocab_size < V_local: columns past it are padding, even if they hold huge values."""
    _need(backend)
    g = torch.Generator().manual_seed(12)
    logits = torch.randn(4, 200, generator=g)
    logits[:, 190:] = 1e4  # padding that would dominate if it were counted
    logits.requires_grad_()
    targets = torch.tensor([0, 5, 189, 190])  # the last is padding: out of range -> NaN
    logp, lse = token_logprobs(logits, targets, global_vocab_size=190, backend=backend)
    x, r_logp, r_lse, _ = _oracle(logits, targets, 1.0, gvs=190)
    _close(logp[:3], r_logp[:3], 2e-5)
    _close(lse, r_lse, 2e-5)
    assert torch.isnan(logp[3])
    logp[:3].sum().backward()
    assert torch.all(logits.grad[:, 190:] == 0)
    r_logp[:3].sum().backward()
    _close(logits.grad, x.grad, 2e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_adversarial_rows(backend):
    _need(backend)
    g = torch.Generator().manual_seed(13)
    T, V = 7, 256
    x = torch.randn(T, V, generator=g)
    x[0] = x[0] * 1e30  # huge magnitudes (fp32 only: beyond bf16/fp16 in part)
    x[1] = 0.0  # ties everywhere: logp = -log(V)
    x[2, ::2] = float("-inf")  # half the vocab impossible; target on a live column
    x[3, ::2] = float("-inf")  # target on an impossible column -> logp = -inf
    x[4] = float("-inf")  # no distribution at all: lse = -inf, logp = NaN (as fp64 torch)
    x[5, 17] = 80.0  # one dominant logit: logp(17) ~ 0, others ~ -80
    x[6] = -3e4  # large negative offset: lse must not underflow
    targets = torch.tensor([3, 9, 1, 2, 0, 17, 100])
    logits = x.requires_grad_()
    logp, lse = token_logprobs(logits, targets, backend=backend)
    xd, r_logp, r_lse, _ = _oracle(logits, targets, 1.0)
    assert torch.equal(torch.isnan(logp), torch.isnan(r_logp)) and torch.isnan(logp[4])
    assert logp[3] == float("-inf") and lse[4] == float("-inf")
    _close(logp[0], r_logp[0], 1e30 * 2e-7)  # fp32 carries ~7 digits of a 1e30-sized difference
    _close(lse[0], r_lse[0], 1e30 * 2e-7)
    for i in (1, 2, 5, 6):
        _close(logp[i], r_logp[i], 1e-5 * max(1.0, abs(r_lse[i].item()) / 100))
        _close(lse[i], r_lse[i], 1e-5 * max(1.0, abs(r_lse[i].item()) / 100))
    assert abs(logp[1].item() + torch.log(torch.tensor(float(V), dtype=torch.float64)).item()) < 1e-6
    # Gradient of the well-defined rows against fp64 autograd; impossible columns get exactly 0.
    rows = [1, 2, 5, 6]
    logp[rows].sum().backward()
    r_logp[rows].sum().backward()
    _close(logits.grad[rows], xd.grad[rows], 2e-6)
    assert torch.all(logits.grad[2, ::2] == 0)


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
