"""The fused TP-1 Triton forward (one launch, last program of a row merges) against partials + merge.

The contract is bitwise: the fused path must give exactly the bits of the two-launch path that
TP > 1 uses, or TP invariance breaks. Runs in the interpreter on CPU and natively on a GPU.
"""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from kernels.logprob import ShardLayout, registered_backends, token_logprobs  # noqa: E402
from kernels.logprob import triton_backend  # noqa: E402
from kernels.logprob.contract import platform_of  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _impl():
    return registered_backends()["triton"].load(platform_of(torch.device(DEV)))


def _case(T, V, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(T, V, generator=g) * 5).to(dtype)
    logits[1, ::7] = float("-inf")
    logits[2] = float("-inf")  # a row with nothing live
    logits[3, :5] = 1e4  # huge values
    targets = torch.randint(0, V, (T,), generator=g)
    mask = torch.ones(T, dtype=torch.bool)
    mask[4] = False
    return logits.to(DEV), targets.to(DEV), mask.to(DEV)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("V,gvs", [(384, None), (520, 517)])  # 517: a padded, untidy vocab
@pytest.mark.parametrize("tau,ent,masked", [(1.0, False, False), (0.7, True, True)])
def test_fused_equals_partials_then_merge_bitwise(dtype, V, gvs, tau, ent, masked):
    logits, targets, mask = _case(7, V, seed=V, dtype=dtype)
    active = mask if masked else None
    impl = _impl()
    layout = ShardLayout(gvs or V, 0, V)
    m, s, w, tgt = impl.partials(logits, targets, layout, tau, ent)
    two = impl.merge(m, s, w, tgt, targets, layout.global_vocab_size, active)
    one = impl.fused_forward(logits, targets, layout, tau, ent, active)
    for a, b in zip(two, one):
        if a is None:
            assert b is None
            continue
        assert a.dtype == b.dtype == torch.float32 and a.shape == b.shape
        assert torch.equal(a.view(torch.int32), b.view(torch.int32)), "fused path changed bits"
    assert torch.isfinite(one[1][:2]).all() and torch.isfinite(one[1][3:]).all()


@pytest.mark.parametrize("tau,ent,masked", [(1.0, False, False), (0.7, True, True)])
def test_tp1_short_path_equals_partials_then_merge_bitwise(tau, ent, masked):
    """TP 1 hands the slot-major scratch straight to the merge kernel; TP > 1 goes through the
    transposed [T, S] views (and the all-gather). Both must give the same bits."""
    logits, targets, mask = _case(9, 520, seed=5, dtype=torch.bfloat16)
    active = mask if masked else None
    impl = _impl()
    layout = ShardLayout(517, 0, 520)
    m, s, w, tgt = impl.partials(logits, targets, layout, tau, ent)
    two = impl.merge(m, s, w, tgt, targets, layout.global_vocab_size, active)
    short = impl.local_forward(logits, targets, layout, tau, ent, active)
    assert (short[2] is None) == (not ent)
    for a, b in zip(two, short):
        if a is not None:
            assert torch.equal(a.view(torch.int32), b.view(torch.int32)), "TP-1 short path changed bits"


def test_public_entry_point_uses_fused_and_matches_unfused(monkeypatch):
    logits, targets, _ = _case(5, 384, seed=9, dtype=torch.bfloat16)
    calls = []
    monkeypatch.setattr(triton_backend, "FUSED_FORWARD", True)  # off by default (slower on the H200)
    real = triton_backend.TritonBackend.fused_forward
    monkeypatch.setattr(triton_backend.TritonBackend, "fused_forward",
                        lambda self, *a: calls.append(1) or real(self, *a))
    fused = token_logprobs(logits, targets, backend="triton")
    assert calls, "TP-1 Triton call did not take the fused path"
    monkeypatch.setattr(triton_backend, "FUSED_FORWARD", False)
    unfused = token_logprobs(logits, targets, backend="triton")
    assert len(calls) == 1
    for a, b in zip(fused, unfused):  # bit views: the all -inf row gives NaN, which torch.equal rejects
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))


def test_fused_refuses_a_shard():
    logits, targets, _ = _case(6, 384, seed=1, dtype=torch.float32)
    with pytest.raises(ValueError, match="TP 1"):
        _impl().fused_forward(logits[:, :192], targets, ShardLayout(384, 0, 192, 0, 2), 1.0, False, None)


def test_backward_without_lse_gradient_equals_explicit_zeros():
    """`.sum()` on logp alone: g_lse None and g_logp of stride 0 take the no-copy kernel path;
    it must match the kernel fed materialized zeros and a contiguous g_logp."""
    logits, targets, mask = _case(6, 384, seed=3, dtype=torch.bfloat16)
    x = logits.clone().requires_grad_()
    logp, lse = token_logprobs(x, targets, backend="triton", temperature=0.9, mask=mask)
    logp.sum().backward()
    impl = _impl()
    want = impl.backward(logits, targets, lse.detach(), None, torch.ones_like(lse), torch.zeros_like(lse), None,
                         mask, ShardLayout(384, 0, 384), 0.9)
    assert torch.equal(x.grad, want)


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_zero_rows_give_empty_outputs_and_gradient(backend):
    x = torch.randn(0, 384, device=DEV, requires_grad=True)
    t = torch.empty(0, dtype=torch.long, device=DEV)
    logp, lse = token_logprobs(x, t, backend=backend)
    assert logp.shape == lse.shape == (0,)
    (logp.sum() + lse.sum()).backward()
    assert x.grad.shape == (0, 384)
    with torch.no_grad():
        from kernels.logprob import token_logprobs_with_entropy
        assert all(o.shape == (0,) for o in token_logprobs_with_entropy(x, t, backend=backend))
