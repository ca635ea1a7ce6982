"""The fused lm_head + log-prob (kernels/logprob/linear_head.py) on CPU: accuracy, bitwise invariance, memory.

Reference: the unfused path (`token_logprobs_with_entropy(hidden @ weight.T)`, same backend) and
fp64 autograd from hidden and weight. Triton runs in its interpreter (slow: small shapes only).
"""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from kernels.logprob import (  # noqa: E402
    LogprobBackendError,
    LogprobContractError,
    ShardLayout,
    linear_token_logprobs,
    token_logprobs_with_entropy,
)
from kernels.logprob.vocab_blocks import pairwise_tree_sum, plan_vocab_blocks  # noqa: E402
from tests.conftest import require  # noqa: E402
from tests.kernels.logprob.logprob_oracle import oracle  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")
H, V, GVS = 16, 512, 500  # 64 tiles of 8 columns; blocks of 8 tiles = 64 columns, the last real one cut at 500


def _need(backend: str) -> None:
    if backend == "triton":
        try:
            import triton  # noqa: F401
        except ImportError:
            require(False, "triton is not installed")


def _data(N, dtype, seed, rows=V):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g).to(dtype)
    weight = (torch.randn(rows, H, generator=g) * 0.8).to(dtype)
    targets = torch.randint(0, GVS, (N,), generator=g)
    up = torch.randn(3, N, generator=g)  # upstream gradients of logp, lse, entropy
    return hidden, weight, targets, up


def _loss(logp, lse, ent, up):
    out = logp * up[0] + lse * up[1]
    return (out + ent * up[2] if ent is not None else out).sum()


def _fused(hidden, weight, targets, up, **kw):
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logp, lse, ent = linear_token_logprobs(h, w, targets, global_vocab_size=GVS, **kw)
    _loss(logp, lse, ent, up).backward()
    return logp.detach(), lse.detach(), None if ent is None else ent.detach(), h.grad, w.grad


def _unfused(hidden, weight, targets, up, *, with_entropy, chunk_tokens=None, **kw):
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logp, lse, ent = token_logprobs_with_entropy(h @ w.t(), targets, global_vocab_size=GVS, **kw)
    ent = ent if with_entropy else None
    _loss(logp, lse, ent, up).backward()
    return logp.detach(), lse.detach(), None if ent is None else ent.detach(), h.grad, w.grad


def _oracle(hidden, weight, targets, up, tau, mask, with_entropy):
    """The shared fp64 oracle on the exact (fp64) product hidden @ weight.T, its logits gradient
    carried to hidden and weight by the chain rule; inactive rows contribute nothing."""
    h, w = hidden.detach().double(), weight.detach().double()
    x, logp, lse, ent = oracle(h @ w.t(), targets, tau, gvs=GVS)
    keep = torch.ones_like(lse) if mask is None else mask.double()
    logp, lse, ent = logp * keep, lse * keep, (ent * keep if with_entropy else None)
    _loss(logp, lse, ent, up.double()).backward()
    return logp.detach(), lse.detach(), None if ent is None else ent.detach(), x.grad @ w, x.grad.t() @ h


def _maxerr(a, b):
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


CASES = [(1.0, False, False), (0.7, True, True)]  # (temperature, entropy, mask)


@pytest.mark.parametrize("backend,N", [("reference", 1), ("reference", 3), ("reference", 13), ("triton", 5)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tau,ent,masked", CASES)
def test_matches_unfused_path_and_fp64(backend, N, dtype, tau, ent, masked):
    """N=1, N < chunk_tokens (3 < 4) and N not a multiple of it (13; Triton, interpreted, pays per row: 5, a full
    chunk and a padded one); temperature, entropy, mask."""
    _need(backend)
    hidden, weight, targets, up = _data(N, dtype, seed=N)
    mask = (torch.arange(N) % 5 != 2) if masked else None
    kw = dict(temperature=tau, backend=backend, mask=mask, with_entropy=ent)
    fused = _fused(hidden, weight, targets, up, chunk_tokens=4, **kw)
    unfused = _unfused(hidden, weight, targets, up, **kw)
    oracle = _oracle(hidden, weight, targets, up, tau, mask, ent)
    assert (fused[2] is None) == (not ent)
    # Forward: the logits of either path are hidden @ W.T rounded once to the dtype (|dx| <= 2^-8 |x|
    # in bf16, fp32's accumulation error in fp32); logp and lse move by at most 2 max|dx| / tau,
    # the entropy by 2 max|dx| * max|x| / tau^2; plus the kernel's fp32 error (3e-5, as its own tests).
    x_max = (hidden.double() @ weight.double().t()).abs().max().item()
    dx = x_max * (2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -20)
    bounds = (2 * dx / tau + 3e-5, 2 * dx / tau + 3e-5, 2 * dx * x_max / tau ** 2 + 3e-5)
    for i, name in enumerate(("logp", "lse", "entropy")):
        if fused[i] is None:
            continue
        err_f, err_u = _maxerr(fused[i], oracle[i]), _maxerr(unfused[i], oracle[i])
        assert err_f <= bounds[i], f"{name}: {err_f} vs fp64 exceeds the bound {bounds[i]}"
        assert err_f <= 1.5 * err_u + 3e-5, f"{name}: fused {err_f} vs unfused {err_u} from fp64"
    # Gradients: both paths round d(logits) to the dtype and the result once more; the fused one
    # accumulates in fp32 across blocks and chunks, so it may not be worse than the unfused path.
    for i, name in ((3, "d_hidden"), (4, "d_weight")):
        assert fused[i].dtype == dtype and fused[i].shape == unfused[i].shape
        err_f, err_u = _maxerr(fused[i], oracle[i]), _maxerr(unfused[i], oracle[i])
        scale = oracle[i].abs().max().item()
        floor = scale * (2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -19)
        assert err_f <= 1.5 * err_u + floor, f"{name}: fused {err_f} vs unfused {err_u} from fp64 (scale {scale})"
    if masked:
        off = ~mask
        assert torch.all(fused[0][off] == 0) and torch.all(fused[1][off] == 0)
        assert torch.all(fused[3][off] == 0), "inactive rows got a hidden gradient"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_exact_logits_give_the_unfused_bits(dtype):
    """With dyadic inputs every GEMM is exact in any order, so the logits equal the unfused path's
    bit for bit, and so must every output: the head adds no definition of its own."""
    g = torch.Generator().manual_seed(3)
    N = 11
    hidden = (torch.randint(-2, 3, (N, H), generator=g) / 4).to(dtype)
    weight = (torch.randint(-2, 3, (V, H), generator=g) / 8).to(dtype)
    targets = torch.randint(0, GVS, (N,), generator=g)
    mask = torch.arange(N) != 4
    for with_entropy in (False, True):
        a = linear_token_logprobs(hidden, weight, targets, temperature=0.9, with_entropy=with_entropy,
                                  chunk_tokens=4, global_vocab_size=GVS, backend="reference", mask=mask)
        b = token_logprobs_with_entropy(hidden @ weight.t(), targets, temperature=0.9, global_vocab_size=GVS,
                                        backend="reference", mask=mask)
        for x, y in zip(a, b):
            if x is not None:
                assert torch.equal(x, y)
        assert (a[2] is None) == (not with_entropy)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_a_token_does_not_depend_on_the_rest_of_the_call(backend):
    """Same token, calls of different N and chunk boundaries: bitwise equal outputs and d(hidden) row.
    Triton (interpreted: it pays per row and vocab block) takes 6 tokens, a full chunk and a padded one."""
    _need(backend)
    N = 14 if backend == "reference" else 6
    hidden, weight, targets, up = _data(N, torch.bfloat16, seed=40)
    kw = dict(temperature=0.8, with_entropy=True, chunk_tokens=4, backend=backend)
    full = _fused(hidden, weight, targets, up, **kw)
    again = _fused(hidden, weight, targets, up, **kw)
    for a, b in zip(full, again):
        assert torch.equal(a, b), "two identical calls differ (d_weight included)"
    perm = torch.randperm(N, generator=torch.Generator().manual_seed(41))
    for rows in (torch.arange(3, N - 1), torch.tensor([5]), perm):  # boundaries shift; N=1; order
        part = _fused(hidden[rows], weight, targets[rows], up[:, rows], **kw)
        for i in range(4):
            assert torch.equal(part[i], full[i][rows]), f"output {i} of rows {rows.tolist()} changed bits"
    if backend == "triton":
        # Another chunk_tokens changes the head's GEMM (torch, the same for every backend: this test's reference
        # case checks it) and the rows per backend launch (test_logprob_invariance.py checks the Triton kernels
        # bitwise across those).
        return
    # Another chunk_tokens is another GEMM shape: close, not promised bitwise.
    other = _fused(hidden, weight, targets, up, **{**kw, "chunk_tokens": 16})
    for a, b in zip(other, full):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)


def test_vocab_blocks_tile_the_vocab_and_refuse_straddling_shards():
    one = plan_vocab_blocks(ShardLayout(50257, 0, 50257), 8)
    assert (one.width, one.real_blocks, one.tree_leaves, one.local_blocks) == (6288, 8, 8, 8)
    assert one.local_rows(7) == (44016, 50257)  # the last block is cut by the weight's end
    qwen_tp8 = plan_vocab_blocks(ShardLayout(151936, 3 * 18992, 18992, 3, 8), 8)
    assert (qwen_tp8.width, qwen_tp8.first_block, qwen_tp8.local_blocks) == (18992, 3, 1)
    assert qwen_tp8.subtree_aligned and qwen_tp8.block_layout(3).tile_aligned
    padded = plan_vocab_blocks(ShardLayout(500, 384, 384, 1, 2), 8)  # 768 rows for 500 real: 6 blocks each
    assert not padded.subtree_aligned and padded.real_blocks == 8 and not padded.is_real(8)
    with pytest.raises(LogprobContractError, match="vocab_block_tiles: blocks of 8 tiles"):
        plan_vocab_blocks(ShardLayout(151936, 9496, 9496, 1, 16), 8)  # TP 16: 4 tiles per shard
    assert plan_vocab_blocks(ShardLayout(151936, 9496, 9496, 1, 16), 4).local_blocks == 1
    with pytest.raises(LogprobContractError, match="vocab_block_tiles: must be an int >= 1"):
        plan_vocab_blocks(ShardLayout(512, 0, 512), 0)


@pytest.mark.parametrize("count", range(1, 10))
def test_pairwise_tree_matches_the_reference_tree_and_its_subtrees(count):
    g = torch.Generator().manual_seed(count)
    leaves = [torch.randn(3, 5, generator=g) * 10 ** torch.randint(-3, 4, (1,), generator=g).item()
              for _ in range(count)]
    whole = pairwise_tree_sum(iter(leaves), count)
    total = 1 << (count - 1).bit_length()
    level = torch.stack(leaves + [torch.zeros(3, 5)] * (total - count))
    while level.shape[0] > 1:  # neighbours pair up, so a rank's contiguous blocks form one subtree
        level = level[0::2] + level[1::2]
    assert torch.equal(whole, level[0])
    padded = leaves + [None] * (total - count)
    for width in (1, 2, 4):  # ranks of `width` leaves each, then the tree over their sums
        if width > total:
            continue
        sums = [pairwise_tree_sum(iter(padded[i : i + width]), width) for i in range(0, total, width)]
        sums = [torch.zeros(3, 5) if s is None else s for s in sums]  # as the all-gather delivers them
        assert torch.equal(pairwise_tree_sum(iter(sums), len(sums)), whole), f"subtrees of {width}"
    with pytest.raises(ValueError, match="announced"):
        pairwise_tree_sum(iter(leaves), count + 1)


def test_forward_saves_no_logits():
    """What autograd keeps between forward and backward: the inputs and O(N) fp32, never [N, V]."""
    N = 64
    hidden, weight, targets, _ = _data(N, torch.bfloat16, seed=7)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    mask = torch.ones(N, dtype=torch.bool)

    def saved_by(fn):
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            out = fn()
        return saved, out

    saved, out = saved_by(lambda: linear_token_logprobs(h, w, targets, with_entropy=True, chunk_tokens=8,
                                                        global_vocab_size=GVS, backend="reference", mask=mask))
    inputs = {h.data_ptr(), w.data_ptr()}
    extra = [t for t in saved if t.data_ptr() not in inputs]
    assert {t.data_ptr() for t in saved} >= inputs
    assert all(t.numel() <= N for t in extra), [tuple(t.shape) for t in extra]
    assert sum(t.numel() * t.element_size() for t in extra) <= N * (4 + 4 + 8 + 1)  # lse, E[x], targets, mask
    _loss(*out, torch.ones(3, N)).backward()  # and the graph still differentiates
    assert h.grad is not None and w.grad is not None
    unfused, _ = saved_by(lambda: token_logprobs_with_entropy(h @ w.t(), targets, backend="reference"))
    assert max(t.numel() for t in unfused) >= N * V, "the unfused path should save its logits"


class _LargestOutput(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.largest = (0, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.numel() > self.largest[0]:
                self.largest = (t.numel(), f"{func} {tuple(t.shape)}")
        return out


def test_no_tensor_of_forward_or_backward_holds_more_than_a_block_of_logits():
    """Every tensor any op creates, forward and backward: the largest is the [V, H] weight
    gradient, the [N, 64] tile partials or a [chunk, block] piece of logits, far below N x V."""
    N, C = 128, 8
    hidden, weight, targets, up = _data(N, torch.bfloat16, seed=8)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    with _LargestOutput() as seen:
        logp, lse, ent = linear_token_logprobs(h, w, targets, with_entropy=True, chunk_tokens=C,
                                               global_vocab_size=GVS, backend="reference")
        _loss(logp, lse, ent, up).backward()
    block = 64
    bound = max(V * H, N * 64, C * block, block * H)
    assert seen.largest[0] <= bound < N * V // 4, seen.largest
    with _LargestOutput() as unfused:
        token_logprobs_with_entropy(h @ w.t(), targets, backend="reference")
    assert unfused.largest[0] >= N * V  # the same probe sees the unfused path's logits


def test_bad_arguments_are_refused_with_the_field_named():
    hidden, weight, targets, _ = _data(4, torch.float32, seed=9)
    cases = [
        (dict(hidden=hidden.bfloat16()), "weight: dtype"),
        (dict(weight=weight[:, :8]), "weight: hidden size 8"),
        (dict(hidden=hidden[0]), "hidden: expected"),
        (dict(targets=targets.int()), "targets: expected int64"),
        (dict(mask=torch.ones(3, dtype=torch.bool)), "mask: expected bool"),
        (dict(chunk_tokens=0), "chunk_tokens: must be an int"),
        (dict(vocab_block_tiles=0), "vocab_block_tiles"),
        (dict(temperature=0.0), "temperature"),
    ]
    for override, message in cases:
        args = dict(hidden=hidden, weight=weight, targets=targets) | override
        with pytest.raises(ValueError, match=message):
            linear_token_logprobs(args.pop("hidden"), args.pop("weight"), args.pop("targets"),
                                  global_vocab_size=GVS, **args)
    with pytest.raises(LogprobBackendError, match="unknown logprob backend"):
        linear_token_logprobs(hidden, weight, targets, backend="fast")


def test_zero_tokens_and_no_grad():
    hidden, weight, targets, _ = _data(5, torch.float32, seed=10)
    h = hidden[:0].clone().requires_grad_()
    w = weight.clone().requires_grad_()
    logp, lse, ent = linear_token_logprobs(h, w, targets[:0], with_entropy=True, backend="reference")
    assert logp.shape == lse.shape == ent.shape == (0,)
    (logp.sum() + ent.sum()).backward()
    assert h.grad.shape == (0, H) and torch.all(w.grad == 0)
    with torch.no_grad():
        a = linear_token_logprobs(hidden, weight, targets, chunk_tokens=2, global_vocab_size=GVS, backend="reference")
    b = linear_token_logprobs(hidden, weight, targets, chunk_tokens=2, global_vocab_size=GVS, backend="reference")
    assert a[2] is None and torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_a_backend_that_cannot_serve_vocab_shards_is_refused(monkeypatch):
    """The head runs every vocab block as a shard of the kernel's TP path; a backend declared
    without that capability must be refused up front, not run on a contract it never promised."""
    from kernels.logprob import BackendEntry, Capability, Platform, register_backend
    from kernels.logprob import registry
    from kernels.logprob.reference import ReferenceBackend

    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    register_backend(BackendEntry(
        "reference",
        {Platform.CPU: Capability(dtypes=frozenset({torch.float32}), tensor_parallel=False)},
        lambda platform: ReferenceBackend(),
    ))
    hidden, weight, targets, _ = _data(3, torch.float32, seed=11)
    with pytest.raises(LogprobBackendError, match="tensor-parallel vocab shards not supported"):
        linear_token_logprobs(hidden, weight, targets, global_vocab_size=GVS, backend="reference")
    logits = hidden @ weight.t()  # the unfused path on the whole vocab is still served
    assert torch.isfinite(token_logprobs_with_entropy(logits, targets, global_vocab_size=GVS,
                                                      backend="reference")[0]).all()


def test_weight_gradient_accumulates_in_fp32_across_chunks():
    """256 chunks of one token each: d(W) summed in bf16 would round 256 times; the fp32
    accumulator rounds once, so the fused d(W) is as close to fp64 as the unfused one."""
    N = 256
    hidden, weight, targets, up = _data(N, torch.bfloat16, seed=12)
    fused = _fused(hidden, weight, targets, up, chunk_tokens=1, backend="reference", with_entropy=False)
    unfused = _unfused(hidden, weight, targets, up, backend="reference", with_entropy=False)
    want = _oracle(hidden, weight, targets, up, 1.0, None, False)[4]
    err_f, err_u = _maxerr(fused[4], want), _maxerr(unfused[4], want)
    assert err_f <= 1.5 * err_u, f"d_weight: fused {err_f} vs unfused {err_u} from fp64"
