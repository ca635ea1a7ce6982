"""On a GPU: Triton and native backends against the reference and fp64, bitwise batch/TP invariance.

Run on the device machine: `python -m pytest -m gpu tests/kernels/test_logprob_gpu.py`.
"""
from __future__ import annotations

import pytest
import torch

from kernels.logprob import emulate_tensor_parallel, registered_backends, token_logprobs, token_logprobs_with_entropy
from kernels.logprob.contract import platform_of
from kernels.logprob.tiling import ShardLayout

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU"),
]
V = 151936  # Qwen3: 64 tiles of 2374
FAST = ["triton", "native"]


def _dtypes(backend):
    return [torch.bfloat16, torch.float32] + ([torch.float16] if backend == "triton" else [])


def _inputs(T, dtype, seed, vocab=V):
    g = torch.Generator(device="cuda").manual_seed(seed)
    logits = (torch.randn(T, vocab, generator=g, device="cuda") * 4).to(dtype)
    targets = torch.randint(0, vocab, (T,), generator=g, device="cuda")
    return logits, targets


@pytest.mark.parametrize("backend", FAST)
@pytest.mark.parametrize("tau", [1.0, 0.7])
def test_matches_fp64_and_reference(backend, tau):
    for dtype in _dtypes(backend):
        logits, targets = _inputs(64, dtype, seed=1)
        logits[3, ::3] = float("-inf")
        mask = torch.ones(64, dtype=torch.bool, device="cuda")
        mask[5] = False
        x = logits.clone().requires_grad_()
        logp, lse = token_logprobs(x, targets, temperature=tau, backend=backend, mask=mask)
        (logp * 1.5 + lse * 0.25).sum().backward()
        xd = logits.double().requires_grad_()
        ls = torch.log_softmax(xd / tau, -1)
        r_logp = ls.gather(1, targets[:, None])[:, 0]
        r_lse = torch.logsumexp(xd / tau, -1)
        ((r_logp * 1.5 + r_lse * 0.25) * mask).sum().backward()
        on = mask
        torch.testing.assert_close(logp[on].double(), r_logp[on].detach(), rtol=0, atol=5e-5, equal_nan=True)
        torch.testing.assert_close(lse[on].double(), r_lse[on].detach(), rtol=0, atol=5e-5)
        assert logp[5] == 0 and lse[5] == 0 and torch.all(x.grad[5] == 0)
        atol = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}[dtype]
        torch.testing.assert_close(x.grad.double(), xd.grad, rtol=0, atol=atol)
        ref = token_logprobs(logits, targets, temperature=tau, backend="reference", mask=mask)
        torch.testing.assert_close(logp, ref[0], rtol=0, atol=5e-6)
        torch.testing.assert_close(lse, ref[1], rtol=0, atol=5e-6)


def test_triton_entropy_on_gpu():
    logits, targets = _inputs(32, torch.bfloat16, seed=2)
    x = logits.clone().requires_grad_()
    _, _, ent = token_logprobs_with_entropy(x, targets, backend="triton", temperature=0.8)
    ent.sum().backward()
    xd = logits.double().requires_grad_()
    ls = torch.log_softmax(xd / 0.8, -1)
    r = -(ls.exp() * ls).sum(-1)
    r.sum().backward()
    torch.testing.assert_close(ent.double(), r.detach(), rtol=0, atol=5e-5)
    torch.testing.assert_close(x.grad.double(), xd.grad, rtol=0, atol=3e-2)


@pytest.mark.parametrize("backend", FAST + ["reference"])
def test_batch_composition_changes_no_bit(backend):
    logits, targets = _inputs(96, torch.bfloat16, seed=3)
    x = logits.clone().requires_grad_()
    logp, lse = token_logprobs(x, targets, backend=backend, temperature=0.9)
    (logp + lse * 0.5).sum().backward()
    perm = torch.randperm(96, device="cuda")
    for rows in (perm, torch.arange(0, 1, device="cuda"), torch.arange(7, 40, device="cuda")):
        y = logits[rows].clone().requires_grad_()
        a, b = token_logprobs(y, targets[rows], backend=backend, temperature=0.9)
        (a + b * 0.5).sum().backward()
        assert torch.equal(a, logp[rows]) and torch.equal(b, lse[rows]) and torch.equal(y.grad, x.grad[rows])


@pytest.mark.parametrize("backend", FAST + ["reference"])
def test_tp_1_2_4_8_bitwise(backend):
    logits, targets = _inputs(48, torch.bfloat16, seed=4)
    one = emulate_tensor_parallel(logits, targets, tp=1, backend=backend)
    direct = token_logprobs(logits, targets, backend=backend)
    assert torch.equal(one[0], direct[0]) and torch.equal(one[1], direct[1])
    impl = registered_backends()[backend].load(platform_of(logits.device))
    g1, g2 = torch.full_like(one[1], 1.5), torch.full_like(one[1], 0.25)
    full_grad = impl.backward(logits, targets, one[1], None, g1, g2, None, None, ShardLayout(V, 0, V), 1.0)
    for tp in (2, 4, 8):
        got = emulate_tensor_parallel(logits, targets, tp=tp, backend=backend)
        assert torch.equal(got[0], one[0]) and torch.equal(got[1], one[1]), f"TP={tp}"
        Vl = V // tp
        shards = [impl.backward(logits[:, r * Vl:(r + 1) * Vl], targets, got[1], None, g1, g2, None, None,
                                ShardLayout(V, r * Vl, Vl, r, tp), 1.0) for r in range(tp)]
        assert torch.equal(torch.cat(shards, 1), full_grad), f"TP={tp} gradient"


@pytest.mark.parametrize("backend", FAST)
def test_vocab_50257_and_repeatability(backend):
    logits, targets = _inputs(40, torch.bfloat16, seed=5, vocab=50257)
    a = token_logprobs(logits, targets, backend=backend)
    b = token_logprobs(logits, targets, backend=backend)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    r = torch.log_softmax(logits.double(), -1).gather(1, targets[:, None])[:, 0]
    torch.testing.assert_close(a[0].double(), r, rtol=0, atol=5e-5)
