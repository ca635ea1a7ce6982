"""The public entry point: accuracy vs fp64 torch, temperature, autograd, masking, input checks."""
from __future__ import annotations

import pytest
import torch

from kernels.logprob import token_logprobs, token_logprobs_with_entropy
from tests.kernels.logprob.logprob_oracle import oracle


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tau", [1.0, 0.6, 1.7])
def test_forward_backward_match_fp64(dtype, tau):
    g = torch.Generator().manual_seed(1)
    T, V = 9, 333
    logits = (torch.randn(T, V, generator=g) * 4).to(dtype).requires_grad_()
    targets = torch.randint(0, V, (T,), generator=g)
    logp, lse = token_logprobs(logits, targets, temperature=tau)
    assert logp.dtype == lse.dtype == torch.float32
    x, ref_logp, ref_lse, _ = oracle(logits, targets, tau)
    torch.testing.assert_close(logp.double(), ref_logp.detach(), rtol=0, atol=2e-5)
    torch.testing.assert_close(lse.double(), ref_lse.detach(), rtol=0, atol=2e-5)
    up = torch.randn(T, generator=g)
    up2 = torch.randn(T, generator=g)
    ((logp * up).sum() + (lse * up2).sum()).backward()
    ((ref_logp * up).sum() + (ref_lse * up2).sum()).backward()
    # The gradient is returned in the logits dtype, so compare at that dtype's resolution.
    atol = {torch.float32: 4e-6, torch.bfloat16: 8e-3, torch.float16: 1e-3}[dtype]
    torch.testing.assert_close(logits.grad.double(), x.grad, rtol=0, atol=atol)


def test_entropy_and_its_gradient():
    g = torch.Generator().manual_seed(2)
    logits = (torch.randn(5, 200, generator=g) * 3).requires_grad_()
    targets = torch.randint(0, 200, (5,), generator=g)
    _, _, ent = token_logprobs_with_entropy(logits, targets, temperature=0.8)
    x, _, _, ref_ent = oracle(logits, targets, 0.8)
    torch.testing.assert_close(ent.double(), ref_ent.detach(), rtol=0, atol=2e-5)
    ent.sum().backward()
    ref_ent.sum().backward()
    torch.testing.assert_close(logits.grad.double(), x.grad, rtol=0, atol=2e-6)


def test_mask_zeroes_outputs_and_gradient():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 50, generator=g).requires_grad_()
    targets = torch.tensor([1, -100, 7, 3])  # an inactive token may carry any id
    mask = torch.tensor([True, False, True, False])
    logp, lse = token_logprobs(logits, targets, mask=mask)
    assert logp[1] == 0 and lse[1] == 0 and logp[3] == 0 and lse[3] == 0
    full, _ = token_logprobs(logits, targets.clamp(min=0))
    assert torch.equal(logp[mask], full[mask])
    (logp.sum() + lse.sum()).backward()
    assert torch.all(logits.grad[~mask] == 0) and torch.all(logits.grad[mask].abs().sum(-1) > 0)


def test_out_of_range_target_is_nan_not_garbage():
    logits = torch.randn(3, 10)
    logp, lse = token_logprobs(logits, torch.tensor([0, 10, -1]))
    assert torch.isfinite(logp[0]) and torch.isnan(logp[1]) and torch.isnan(logp[2])
    assert torch.isfinite(lse).all()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(temperature=0.0), "temperature"),
        (dict(temperature=float("inf")), "temperature"),
        (dict(vocab_start=5), "vocab_start"),
        (dict(global_vocab_size=11), "global_vocab_size"),
        (dict(backend="nope"), "nope"),
    ],
)
def test_bad_arguments_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        token_logprobs(torch.randn(2, 10), torch.tensor([0, 1]), **kwargs)


def test_bad_tensors_are_refused():
    with pytest.raises(ValueError, match="targets"):
        token_logprobs(torch.randn(2, 10), torch.tensor([0, 1], dtype=torch.int32))
    with pytest.raises(ValueError, match="logits"):
        token_logprobs(torch.randn(2, 10).to(torch.int64), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="mask"):
        token_logprobs(torch.randn(2, 10), torch.tensor([0, 1]), mask=torch.ones(2))


def test_resolved_backend_names_what_auto_runs():
    from kernels.logprob import resolved_backend

    assert resolved_backend(torch.randn(2, 10)) == "reference"
    with pytest.raises(ValueError, match="native: no cpu implementation"):
        resolved_backend(torch.randn(2, 10), backend="native")


@pytest.mark.parametrize("backend", ["reference", "auto"])
def test_inference_calls_skip_autograd_and_give_the_same_bits(backend):
    """Without a graph to record (no grad mode, or logits that need none) the forward runs
    outside the autograd Function: same bits, and nothing to backpropagate through."""
    g = torch.Generator().manual_seed(4)
    logits = (torch.randn(6, 300, generator=g) * 3).requires_grad_()
    targets = torch.randint(0, 300, (6,), generator=g)
    with_graph = token_logprobs_with_entropy(logits, targets, temperature=0.9, backend=backend)
    assert all(t.grad_fn is not None for t in with_graph)
    with torch.no_grad():
        no_grad = token_logprobs_with_entropy(logits, targets, temperature=0.9, backend=backend)
    detached = token_logprobs_with_entropy(logits.detach(), targets, temperature=0.9, backend=backend)
    for a, b, c in zip(with_graph, no_grad, detached):
        assert b.grad_fn is None and not b.requires_grad and c.grad_fn is None
        assert torch.equal(a.detach(), b) and torch.equal(a.detach(), c)
