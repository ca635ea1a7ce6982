"""On a GPU: Triton and native backends against the reference and fp64, bitwise batch/TP invariance.

The native-only tests at the bottom cover what only the native kernels have to prove on hardware:
fp16, entropy, mask and temperature through every step, the element-load path of unaligned rows,
and the bitwise claims for each (tests/kernels/test_logprob_native_source.py runs the same source
on a CPU emulator, without the platform's exp2, fp16 conversions and shuffles).

Run on the device machine: `python -m pytest -m gpu tests/kernels/logprob/test_logprob_gpu.py`.
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


DTYPES = [torch.bfloat16, torch.float16, torch.float32]  # both fast backends read all three


def _inputs(T, dtype, seed, vocab=V):
    g = torch.Generator(device="cuda").manual_seed(seed)
    logits = (torch.randn(T, vocab, generator=g, device="cuda") * 4).to(dtype)
    targets = torch.randint(0, vocab, (T,), generator=g, device="cuda")
    return logits, targets


@pytest.mark.parametrize("backend", FAST)
@pytest.mark.parametrize("tau", [1.0, 0.7])
def test_matches_fp64_and_reference(backend, tau):
    for dtype in DTYPES:
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


# ---- native backend: fp16, entropy, mask, temperature, unaligned rows; bitwise claims for each ----

# Gradients come back in the logits dtype: one rounding at its resolution (rtol), plus the fp32
# error of the gradient itself (atol). fp32 with entropy: the term g_ent * p * (mean_x - x) carries
# mean_x = lse - entropy, whose fp32 error (~1e-5: two ~20-sized terms cancel) sets the floor.
GRAD_TOL = {torch.float32: (1e-5, 2e-5), torch.float16: (2 ** -10, 4e-3), torch.bfloat16: (2 ** -7, 3e-2)}
GRAD_TOL_ENT_FP32 = (1e-5, 1e-4)


def _native():
    return registered_backends()["native"].load(platform_of(torch.device("cuda")))


def _entropy_oracle(logits, targets, tau):
    """fp64 logp, lse, entropy; the entropy written so that -inf logits give 0, not NaN, in value and gradient."""
    xd = logits.double().requires_grad_()
    ls = torch.log_softmax(xd / tau, -1)
    p = ls.exp()
    ent = -(p * torch.where(p > 0, ls, torch.zeros_like(ls))).sum(-1)
    return xd, ls.gather(1, targets[:, None])[:, 0], torch.logsumexp(xd / tau, -1), ent


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tau", [1.0, 0.7])
def test_native_entropy_with_mask_matches_fp64_and_reference(dtype, tau):
    T = 64
    logits, targets = _inputs(T, dtype, seed=11)
    logits[3, ::3] = float("-inf")
    targets[3] = 1  # a live column of that row
    mask = torch.ones(T, dtype=torch.bool, device="cuda")
    mask[5] = False
    x = logits.clone().requires_grad_()
    logp, lse, ent = token_logprobs_with_entropy(x, targets, temperature=tau, backend="native", mask=mask)
    up = torch.randn(3, T, generator=torch.Generator(device="cuda").manual_seed(12), device="cuda")
    ((logp * up[0]) + (lse * up[1]) + (ent * up[2])).sum().backward()
    xd, r_logp, r_lse, r_ent = _entropy_oracle(logits, targets, tau)
    (((r_logp * up[0]) + (r_lse * up[1]) + (r_ent * up[2])) * mask).sum().backward()
    on = mask
    torch.testing.assert_close(logp[on].double(), r_logp[on].detach(), rtol=0, atol=5e-5)
    torch.testing.assert_close(lse[on].double(), r_lse[on].detach(), rtol=0, atol=5e-5)
    torch.testing.assert_close(ent[on].double(), r_ent[on].detach(), rtol=0, atol=5e-5)
    assert logp[5] == 0 and lse[5] == 0 and ent[5] == 0
    assert torch.all(x.grad[5] == 0) and torch.all(x.grad[3, ::3] == 0)
    rtol, atol = GRAD_TOL_ENT_FP32 if dtype == torch.float32 else GRAD_TOL[dtype]
    torch.testing.assert_close(x.grad.double(), xd.grad, rtol=rtol, atol=atol)
    ref = token_logprobs_with_entropy(logits, targets, temperature=tau, backend="reference", mask=mask)
    # Both sides round lse and logp (~20-30 in size) a few times: a few ulps of 2e-6.
    torch.testing.assert_close(logp, ref[0], rtol=0, atol=8e-6)
    torch.testing.assert_close(lse, ref[1], rtol=0, atol=8e-6)
    torch.testing.assert_close(ent, ref[2], rtol=0, atol=4e-5)  # lse - W/S: ~1e-5 on each side


@pytest.mark.parametrize("dtype", DTYPES)
def test_native_gradient_of_entropy_alone_and_of_summed_logp(dtype):
    """The autograd Function hands the native backward None for the outputs no gradient flows to, and
    `.sum()` gradients as stride-0 rows: each combination against fp64."""
    logits, targets = _inputs(16, dtype, seed=13)
    xd, r_logp, _, r_ent = _entropy_oracle(logits, targets, 0.9)
    for pick in ("entropy", "logp"):
        x = logits.clone().requires_grad_()
        logp, _, ent = token_logprobs_with_entropy(x, targets, temperature=0.9, backend="native")
        (ent if pick == "entropy" else logp).sum().backward()
        xd.grad = None
        (r_ent if pick == "entropy" else r_logp).sum().backward(retain_graph=True)
        rtol, atol = GRAD_TOL_ENT_FP32 if dtype == torch.float32 else GRAD_TOL[dtype]
        torch.testing.assert_close(x.grad.double(), xd.grad, rtol=rtol, atol=atol, msg=lambda m: f"{pick}: {m}")


def _native_fwd_bwd(logits, targets, rows=None, tau=0.8, mask=None):
    x = (logits if rows is None else logits[rows]).clone().requires_grad_()
    t = targets if rows is None else targets[rows]
    a = mask if rows is None or mask is None else mask[rows]
    logp, lse, ent = token_logprobs_with_entropy(x, t, temperature=tau, backend="native", mask=a)
    (logp * 1.5 + lse * 0.25 - ent * 0.5).sum().backward()
    return logp.detach(), lse.detach(), ent.detach(), x.grad


@pytest.mark.parametrize("dtype", DTYPES)
def test_native_batch_composition_changes_no_bit_with_entropy_mask_and_temperature(dtype):
    logits, targets = _inputs(96, dtype, seed=14)
    mask = torch.arange(96, device="cuda") % 7 != 3
    full = _native_fwd_bwd(logits, targets, mask=mask)
    perm = torch.randperm(96, device="cuda")
    for rows in (perm, torch.arange(0, 1, device="cuda"), torch.arange(7, 40, device="cuda")):
        got = _native_fwd_bwd(logits, targets, rows, mask=mask)
        for name, a, b in zip(("logp", "lse", "entropy", "grad"), got, full):
            assert torch.equal(a, b[rows]), f"{name} changed with the batch ({len(rows)} rows)"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gvs, padded", [(V, V), (385, 392)])
def test_native_tp_1_2_4_8_bitwise_with_entropy_mask_and_temperature(dtype, gvs, padded):
    """Shards as each rank runs them: partials with entropy, laid out as the all-gather delivers them
    (rank-major), merged; then each rank's backward with the entropy term, None g_lse and a stride-0
    g_logp. Every tile's partials and every output bit equal for TP 1, 2, 4, 8; TP 1 equal to the
    public entry point. 385 padded to 392: tiles of 7, shards of 196/98/49 columns, on tile bounds
    but not on 16-byte bounds (element loads, shards starting mid-vector)."""
    T, tau = 48, 0.8
    logits, _ = _inputs(T, dtype, seed=15, vocab=padded)
    targets = torch.randint(0, gvs, (T,), generator=torch.Generator(device="cuda").manual_seed(18), device="cuda")
    mask = torch.arange(T, device="cuda") % 5 != 2
    impl = _native()
    g_logp = torch.full((1,), 1.5, device="cuda").expand(T)
    g_ent = torch.randn(T, generator=torch.Generator(device="cuda").manual_seed(16), device="cuda")
    n_tiles = ShardLayout(gvs, 0, padded).num_slots

    def run(tp):
        Vl = padded // tp
        layouts = [ShardLayout(gvs, r * Vl, Vl, r, tp) for r in range(tp)]
        parts = [impl.partials(logits[:, r * Vl:(r + 1) * Vl], targets, layouts[r], tau, True) for r in range(tp)]
        m, s, w = (torch.cat([p[i] for p in parts], dim=1) for i in range(3))
        tgt = torch.stack([p[3] for p in parts], dim=1).amax(dim=1)  # -inf on every rank but the owner
        logp, lse, ent = impl.merge(m, s, w, tgt, targets, gvs, mask)
        grads = [impl.backward(logits[:, r * Vl:(r + 1) * Vl], targets, lse, lse - ent, g_logp, None, g_ent, mask,
                               layouts[r], tau) for r in range(tp)]
        # Real tiles only: padding slots past the vocab are identities, their count depends on TP.
        return m[:, :n_tiles], s[:, :n_tiles], w[:, :n_tiles], logp, lse, ent, torch.cat(grads, dim=1)

    names = ("max", "sumexp", "sum e*x", "logp", "lse", "entropy", "grad")
    one = run(1)
    direct = token_logprobs_with_entropy(logits, targets, temperature=tau, backend="native", mask=mask,
                                         global_vocab_size=gvs)
    for name, a, b in zip(names[3:6], direct, one[3:6]):
        assert torch.equal(a, b), f"TP=1 {name} differs from the public entry point"
    for tp in (2, 4, 8):
        for name, a, b in zip(names, run(tp), one):
            assert torch.equal(a, b), f"TP={tp} {name} differs from TP=1"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["column_offset", "odd_stride"])
def test_native_unaligned_rows_take_element_loads_with_the_same_bits(dtype, layout):
    """Rows that do not start on 16-byte bounds (a view one column into a wider buffer, or a row
    stride of V+3 elements) are read element by element; the in-tile order and the arithmetic are
    those of the vector path, so forward and backward give the same bits as a contiguous copy."""
    T = 32
    logits, targets = _inputs(T, dtype, seed=17)
    mask = torch.arange(T, device="cuda") % 6 != 1
    width, col = (V + 8, 1) if layout == "column_offset" else (V + 3, 0)
    buf = torch.zeros(T, width, dtype=dtype, device="cuda")
    buf[:, col:col + V] = logits
    leaf = buf.requires_grad_()
    view = leaf[:, col:col + V]
    ext = _native()._ext
    assert ext.vector_loads(logits, 0) and not ext.vector_loads(view.detach(), 0)
    for tau in (1.0, 0.7):
        want = _native_fwd_bwd(logits, targets, tau=tau, mask=mask)
        leaf.grad = None
        logp, lse, ent = token_logprobs_with_entropy(view, targets, temperature=tau, backend="native", mask=mask)
        (logp * 1.5 + lse * 0.25 - ent * 0.5).sum().backward()
        got = (logp, lse, ent, leaf.grad[:, col:col + V])
        for name, a, b in zip(("logp", "lse", "entropy", "grad"), got, want):
            assert torch.equal(a, b), f"{name} differs between element and vector loads (tau={tau})"


def test_triton_compiled_launches_give_the_jit_bits():
    """The Triton backend on CUDA re-launches compiled kernels without the JIT's per-call binding
    (triton_launch.py). Against a backend that binds every call through the JIT: same bits for
    every shape the cache key must tell apart -- T of 1, odd and multiple-of-16 rows, aligned and
    unaligned logits, temperature, entropy, mask, TP shards, backward with and without g_lse."""
    import triton

    from kernels.logprob import triton_kernels
    from kernels.logprob.contract import Platform
    from kernels.logprob.triton_backend import TritonBackend

    fast = TritonBackend(triton_kernels, reuse_compiled=True)
    jit = TritonBackend(triton_kernels, reuse_compiled=False)
    assert registered_backends()["triton"].load(Platform.CUDA)._partials._reuse == triton.__version__.startswith("3.6.")
    base, targets = _inputs(97, torch.bfloat16, seed=11, vocab=V + 8)
    cases = []
    for T in (1, 7, 16, 97, 1, 16):  # repeats: the second time each key is served from the cache
        for offset in (0, 3):  # 3: the logits view starts 6 bytes into a row (scalar loads)
            x = base[:T, offset:offset + V]
            cases.append((x, targets[:T], 1.0, False, None, ShardLayout(V, 0, V)))
    mask = torch.rand(97, device="cuda", generator=torch.Generator(device="cuda").manual_seed(2)) > 0.3
    x = base[:, :V]
    cases.append((x, targets, 0.7, True, mask, ShardLayout(V, 0, V)))
    cases.append((x[:, : V // 4], targets, 1.0, False, None, ShardLayout(V, 0, V // 4, 0, 4)))
    cases.append((x[:, V // 4: V // 2], targets, 0.7, True, mask, ShardLayout(V, V // 4, V // 4, 1, 4)))
    for logits, tg, tau, ent, active, lay in cases:
        outs = []
        for impl in (fast, jit):
            m, s, w, tgt = impl.partials(logits, tg, lay, tau, ent)
            merged = impl.merge(m, s, w, tgt, tg, lay.global_vocab_size, active)
            ones = torch.full_like(merged[1], 0.5)
            g_a = impl.backward(logits, tg, merged[1], (merged[1] - merged[2]) if ent else None, ones, ones,
                                ones if ent else None, active, lay, tau)
            g_b = impl.backward(logits, tg, merged[1], None, ones[:1].expand(ones.shape[0]), None, None, active,
                                lay, tau)
            local = impl.local_forward(logits, tg, lay, tau, ent, active) if lay.tp_world_size == 1 else merged
            outs.append([m, s, tgt, *[o for o in merged if o is not None], *[o for o in local if o is not None],
                         g_a, g_b])
        for a, b in zip(*outs):
            assert torch.equal(a.view(torch.int32) if a.dtype == torch.float32 else a,
                               b.view(torch.int32) if b.dtype == torch.float32 else b), "compiled launch changed bits"
    keys = fast._partials.cached_keys()
    assert keys and len(keys) <= 8, keys  # a handful of specializations, not one per shape
    assert fast._backward.cached_keys() and fast._merge.cached_keys()
