"""On a GPU at Qwen3 size (V=151936, H=2560, N=16384, bf16): the fused lm_head + log-prob head.

Bitwise chunk invariance, agreement with the unfused path (`token_logprobs_with_entropy(h @ W.T)`)
within the bf16 bound derived below, and peak memory of forward + backward against the unfused
path's (the numbers are printed: run with -s).

Run on the device machine: `python -m pytest -m gpu -s tests/kernels/logprob/test_logprob_linear_gpu.py`.
"""
from __future__ import annotations

import math

import pytest
import torch

from kernels.logprob import DEFAULT_CHUNK_TOKENS, linear_token_logprobs, token_logprobs_with_entropy

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU"),
]
V, H, N = 151936, 2560, 16384
TAU = 0.9
BACKEND = "triton"


@pytest.fixture(scope="module")
def inputs():
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(N, H, generator=g, device="cuda").to(torch.bfloat16)
    # Logits of std ~2.5 and max ~13, as a trained lm_head gives after the final norm.
    weight = (torch.randn(V, H, generator=g, device="cuda") * (2.5 / math.sqrt(H))).to(torch.bfloat16)
    targets = torch.randint(0, V, (N,), generator=g, device="cuda")
    up = torch.randn(3, N, generator=g, device="cuda")  # upstream gradients of logp, lse, entropy
    return hidden, weight, targets, up


def _fused(hidden, weight, targets, up, with_entropy=True):
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logp, lse, ent = linear_token_logprobs(h, w, targets, temperature=TAU, with_entropy=with_entropy, backend=BACKEND)
    loss = (logp * up[0] + lse * up[1]).sum() + ((ent * up[2]).sum() if with_entropy else 0)
    loss.backward()
    return logp.detach(), lse.detach(), (ent.detach() if with_entropy else None), h.grad, w.grad


def test_chunking_changes_no_bit(inputs):
    hidden, weight, targets, up = inputs
    full = _fused(hidden, weight, targets, up)
    again = _fused(hidden, weight, targets, up)
    assert all(torch.equal(a, b) for a, b in zip(full, again)), "two identical calls differ (d_weight included)"
    # Chunk bounds shifted by 777 rows, a short last chunk, a single token, a reversed order.
    for rows in (torch.arange(777, 777 + 5000, device="cuda"), torch.tensor([12345], device="cuda"),
                 torch.arange(N - 1, N - 3001, -1, device="cuda")):
        part = _fused(hidden[rows], weight, targets[rows], up[:, rows])
        for i, name in enumerate(("logp", "lse", "entropy", "d_hidden")):
            assert torch.equal(part[i], full[i][rows]), f"{name} of {len(rows)} rows changed bits"


def _bf16_ulp(a: torch.Tensor) -> torch.Tensor:
    """Spacing of bf16 numbers at |a| (8 significant bits): 2^(floor(log2 |a|) - 7)."""
    return torch.exp2(torch.floor(torch.log2(a.abs().clamp_min(2.0 ** -126))) - 7)


def test_agrees_with_the_unfused_path_within_the_bf16_bound(inputs):
    """Bound. Both paths round fp32 accumulations of the same bf16 products to bf16 logits; the
    accumulations differ by far less than a bf16 ulp, so |dx_v| <= ulp(x_v) <= u := ulp(max_v |x_v|)
    per row, and dy = dx / tau. To first order: |d lse| <= u/tau, |d logp| <= 2u/tau,
    |d entropy| <= max|dy| * sum_v p_v |E[y] - y_v| <= 2 (u/tau) max|y|; plus 1e-5 of fp32 kernel error.
    Gradient of logp and lse (entropy aside: its gradient has no relative bound near y_v = E[y]):
    G_v = ((g_lse - g_logp) p_v + g_logp [v = t]) / tau in bf16; the two G_v differ by at most an ulp
    of G_v (2^-7 |G_v|) plus |g_lse - g_logp| |dp_v| / tau, with |dp_v| <= 2 p_v max|dy|. So per
    element |dG| <= E := 2^-7 |G| + 2 max|dy| P with P = |g_lse - g_logp| p / tau, and
    |d d_hidden| <= E @ |W| + 2^-7 |d_hidden|,  |d d_weight| <= E^T @ |h| + 2^-7 |d_weight|
    (the last term: each side's final rounding to bf16; fp32 accumulation error is far below)."""
    hidden, weight, targets, up = inputs
    fused = _fused(hidden, weight, targets, up)
    logits = (hidden @ weight.t()).requires_grad_()
    logp, lse, ent = token_logprobs_with_entropy(logits, targets, temperature=TAU, backend=BACKEND)
    with torch.no_grad():
        u = _bf16_ulp(logits.detach().abs().amax(1)) / TAU
        y_max = logits.detach().abs().amax(1) / TAU
    bounds = {"lse": u + 1e-5, "logp": 2 * u + 1e-5, "entropy": 2 * u * y_max + 1e-5}
    for name, got, want in (("logp", fused[0], logp), ("lse", fused[1], lse), ("entropy", fused[2], ent)):
        diff = (got - want.detach()).abs()
        print(f"{name}: max |fused - unfused| {diff.max().item():.3e}, median bound {bounds[name].median().item():.3e}")
        assert torch.all(diff <= bounds[name]), f"{name}: {int((diff > bounds[name]).sum())} tokens beyond the bound"
    del ent
    # Gradients of the logp and lse terms only (see the docstring), fused vs unfused.
    fused = _fused(hidden, weight, targets, up, with_entropy=False)
    logits.grad = None
    (logp * up[0] + lse * up[1]).sum().backward()
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logits2 = h @ w.t()
    logp2, lse2 = token_logprobs_with_entropy(logits2, targets, temperature=TAU, backend=BACKEND)[:2]
    (logp2 * up[0] + lse2 * up[1]).sum().backward()
    del logits2, logp2, lse2
    G = logits.grad
    bound_h = torch.zeros(N, H, device="cuda")
    bound_w = torch.zeros(V, H, device="cuda")
    with torch.no_grad():
        coef = (up[1] - up[0]).abs() / TAU
        for s in range(0, N, 2048):  # [2048, V] fp32 pieces of E
            x = logits[s : s + 2048].float() / TAU
            p = torch.exp(x - lse[s : s + 2048, None])
            E = 2.0 ** -7 * G[s : s + 2048].float().abs() + (2 * u[s : s + 2048, None]) * coef[s : s + 2048, None] * p
            del x, p
            bound_h[s : s + 2048] = E @ weight.float().abs()
            bound_w += E.t() @ hidden[s : s + 2048].float().abs()
            del E
    for name, got, want, bound in (("d_hidden", fused[3], h.grad, bound_h), ("d_weight", fused[4], w.grad, bound_w)):
        diff = (got.float() - want.float()).abs()
        limit = bound + 2.0 ** -7 * want.float().abs()
        ratio = (diff / limit.clamp_min(1e-30)).max().item()
        print(f"{name}: max |fused - unfused| {diff.max().item():.3e}, max diff/bound {ratio:.3f}")
        assert torch.all(diff <= limit), f"{name}: {int((diff > limit).sum())} elements beyond the bound"


def _peak_extra(fn) -> tuple[int, float]:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base, start.elapsed_time(end)


def test_peak_memory_far_below_the_unfused_path(inputs):
    hidden, weight, targets, up = inputs
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()

    def fused():
        logp, lse, ent = linear_token_logprobs(h, w, targets, temperature=TAU, with_entropy=True, backend=BACKEND)
        (logp * up[0] + lse * up[1] + ent * up[2]).sum().backward()

    def unfused():
        logp, lse, ent = token_logprobs_with_entropy(h @ w.t(), targets, temperature=TAU, backend=BACKEND)
        (logp * up[0] + lse * up[1] + ent * up[2]).sum().backward()

    for fn in (fused, unfused):  # warm-up: Triton compiles, cuBLAS workspaces
        fn()
        h.grad = w.grad = None
    fused_peak, fused_ms = _peak_extra(fused)
    h.grad = w.grad = None
    unfused_peak, unfused_ms = _peak_extra(unfused)
    C, block = DEFAULT_CHUNK_TOKENS, 18992
    # What the design holds at once: d_weight in fp32 and its bf16 cast, d_hidden, one block of
    # logits and of d(logits), one [block, H] fp32 d_weight piece, the d(hidden) tree's fp32 nodes
    # (<= log2(8) + 2 of [C, H]), the staging buffer, and the [N, 64] fp32 tile partials (x3, x2).
    design = (V * H * (4 + 2) + N * H * 2 + 2 * C * block * 2 + block * H * 4 + 5 * C * H * 4 + C * H * 2
              + 2 * N * 64 * 3 * 4)
    print(f"peak extra memory fwd+bwd: fused {fused_peak / 2**30:.2f} GiB ({fused_ms:.1f} ms), unfused "
          f"{unfused_peak / 2**30:.2f} GiB ({unfused_ms:.1f} ms); design bound of the fused path "
          f"{design / 2**30:.2f} GiB; chunk_tokens {C}")
    assert fused_peak <= 1.1 * design + 2**27, "the fused path holds more than its design says"
    assert fused_peak * 3 < unfused_peak
