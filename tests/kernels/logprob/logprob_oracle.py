"""The fp64 oracle and the accuracy checks every log-prob backend must pass.

Shared by test_logprob_accuracy.py (reference and Triton through the public API)
and test_logprob_native_source.py (the native .cu compiled for the CPU), so the
native kernel meets exactly the bounds the others do.
"""
from __future__ import annotations

import torch

from kernels.logprob import token_logprobs


def oracle(logits: torch.Tensor, targets: torch.Tensor, tau: float, gvs: int | None = None):
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
    ent = -(p * torch.where(p > 0, ls, torch.zeros_like(ls))).sum(-1)  # no 0 * -inf, in value or gradient
    return x, logp, lse, ent


def close(got: torch.Tensor, want: torch.Tensor, atol: float) -> None:
    torch.testing.assert_close(got.double(), want.detach().double(), rtol=0, atol=atol, equal_nan=True)


def check_padded_columns_are_excluded(backend: str) -> None:
    """global_vocab_size < V_local: columns past it are padding, even if they hold huge values."""
    g = torch.Generator().manual_seed(12)
    logits = torch.randn(4, 200, generator=g)
    logits[:, 190:] = 1e4  # padding that would dominate if it were counted
    logits.requires_grad_()
    targets = torch.tensor([0, 5, 189, 190])  # the last is padding: out of range -> NaN
    logp, lse = token_logprobs(logits, targets, global_vocab_size=190, backend=backend)
    x, r_logp, r_lse, _ = oracle(logits, targets, 1.0, gvs=190)
    close(logp[:3], r_logp[:3], 2e-5)
    close(lse, r_lse, 2e-5)
    assert torch.isnan(logp[3])
    logp[:3].sum().backward()
    assert torch.all(logits.grad[:, 190:] == 0)
    r_logp[:3].sum().backward()
    close(logits.grad, x.grad, 2e-6)


def check_adversarial_rows(backend: str) -> None:
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
    xd, r_logp, r_lse, _ = oracle(logits, targets, 1.0)
    assert torch.equal(torch.isnan(logp), torch.isnan(r_logp)) and torch.isnan(logp[4])
    assert logp[3] == float("-inf") and lse[4] == float("-inf")
    close(logp[0], r_logp[0], 1e30 * 2e-7)  # fp32 carries ~7 digits of a 1e30-sized difference
    close(lse[0], r_lse[0], 1e30 * 2e-7)
    for i in (1, 2, 5, 6):
        close(logp[i], r_logp[i], 1e-5 * max(1.0, abs(r_lse[i].item()) / 100))
        close(lse[i], r_lse[i], 1e-5 * max(1.0, abs(r_lse[i].item()) / 100))
    assert abs(logp[1].item() + torch.log(torch.tensor(float(V), dtype=torch.float64)).item()) < 1e-6
    # Gradient of the well-defined rows against fp64 autograd; impossible columns get exactly 0.
    rows = [1, 2, 5, 6]
    logp[rows].sum().backward()
    r_logp[rows].sum().backward()
    close(logits.grad[rows], xd.grad[rows], 2e-6)
    assert torch.all(logits.grad[2, ::2] == 0)
