"""The pure-torch (CPU) batch-invariant ops: guarantees (1), (2) and (4), bitwise where promised.

(1) a row's output bits do not depend on which other rows are in the call, nor how many;
(2) decode_attention for the query at position t equals packed_attention's row t, bit for bit;
(4) gradients through bi_linear / bi_rms_norm / packed_attention match plain torch.
Plus accuracy against plain torch (these are the oracles of the Triton kernels) and the argument
checks. The same invariance checks also run in a subprocess under ATEN_CPU_CAPABILITY=default
(torch's scalar kernels instead of AVX-512).
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from kernels.batch_invariant import (
    KEY_BLOCK,
    BatchInvariantInputError,
    bi_linear,
    bi_rms_norm,
    decode_attention,
    packed_attention,
)
from tests.kernels.batch_invariant.batch_invariant_support import (
    ROW_COUNTS,
    assert_bitwise,
    decode_rows_of_sequences,
    make_qkv,
    pack_lengths,
    sdpa_packed,
)

DTYPES = [torch.float32, torch.bfloat16]
LENGTHS = [1, 5, KEY_BLOCK - 1, KEY_BLOCK, KEY_BLOCK + 1, 2 * KEY_BLOCK + 3, 17]


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---- (1) rows ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_row_bits_do_not_depend_on_the_batch(dtype, with_bias):
    g = _gen(1)
    x = torch.randn(200, 200, generator=g).to(dtype)
    w = (torch.randn(72, 200, generator=g) / 14).to(dtype)
    b = torch.randn(72, generator=g).to(dtype) if with_bias else None
    full = bi_linear(x, w, b)
    assert full.dtype == dtype and full.shape == (200, 72)
    for m in ROW_COUNTS:
        idx = torch.randperm(200, generator=g)[:m]
        assert_bitwise(bi_linear(x[idx], w, b), full[idx], f"M={m}")
    # Leading dims are rows too.
    assert_bitwise(bi_linear(x.reshape(4, 50, 200), w, b).reshape(200, 72), full, "[4, 50, K]")


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_row_bits_do_not_depend_on_the_batch(dtype):
    g = _gen(2)
    x = (torch.randn(200, 96, generator=g) * 3).to(dtype)
    w = (1 + torch.randn(96, generator=g) / 10).to(dtype)
    full = bi_rms_norm(x, w, 1e-6)
    for m in ROW_COUNTS:
        idx = torch.randperm(200, generator=g)[:m]
        assert_bitwise(bi_rms_norm(x[idx], w, 1e-6), full[idx], f"M={m}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_packed_attention_sequence_bits_do_not_depend_on_the_pack(dtype):
    q, k, v = make_qkv(sum(LENGTHS), 4, 2, 16, dtype, seed=3)
    cu = pack_lengths(LENGTHS)
    full = packed_attention(q, k, v, cu, max(LENGTHS), 0.25)
    starts = cu.tolist()
    g = _gen(3)
    for n in (1, 3, 5):
        chosen = torch.randperm(len(LENGTHS), generator=g)[:n].tolist()
        rows = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in chosen])
        sub_lengths = [LENGTHS[i] for i in chosen]
        out = packed_attention(q[rows], k[rows], v[rows], pack_lengths(sub_lengths), max(sub_lengths), 0.25)
        assert_bitwise(out, full[rows], f"sequences {chosen}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_attention_row_bits_do_not_depend_on_the_batch(dtype):
    g = _gen(4)
    b, cap = 200, 3 * KEY_BLOCK
    q = torch.randn(b, 4, 16, generator=g).to(dtype)
    kc, vc = (torch.randn(b, 2, cap, 16, generator=g).to(dtype) for _ in range(2))
    lengths = torch.randint(1, cap + 1, (b,), generator=g, dtype=torch.int32)
    full = decode_attention(q, kc, vc, lengths, 0.25)
    for m in ROW_COUNTS:
        idx = torch.randperm(b, generator=g)[:m]
        assert_bitwise(decode_attention(q[idx], kc[idx], vc[idx], lengths[idx], 0.25), full[idx], f"M={m}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_bits_do_not_depend_on_the_cpu_thread_count(dtype):
    """Trainer and rollout processes may pin different thread counts (a BLAS GEMM changes bits then)."""
    g = _gen(9)
    x = torch.randn(64, 512, generator=g).to(dtype)
    w = (torch.randn(160, 512, generator=g) / 22).to(dtype)
    q, k, v = make_qkv(sum(LENGTHS), 4, 2, 16, dtype, seed=9)
    cu = pack_lengths(LENGTHS)
    kc = k[:KEY_BLOCK + 1].transpose(0, 1).unsqueeze(0).expand(8, -1, -1, -1).contiguous()
    lengths = torch.tensor([1, 2, 30, 63, 64, 65, 65, 40], dtype=torch.int32)

    def run():
        return (bi_linear(x, w), bi_rms_norm(x, w[0], 1e-6), packed_attention(q, k, v, cu, max(LENGTHS), 0.25),
                decode_attention(q[:8], kc, kc, lengths, 0.25))

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run()
        torch.set_num_threads(2)
        two = run()
    finally:
        torch.set_num_threads(before)
    for name, a, b in zip(("linear", "rms_norm", "packed", "decode"), one, two):
        assert_bitwise(a, b, f"{name}: 1 vs 2 threads")


# ---- (2) decode == packed -----------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [(4, 2), (3, 3), (4, 1)])
def test_decode_equals_packed_prefill_at_every_position(dtype, heads):
    n_heads, n_kv = heads
    q, k, v = make_qkv(sum(LENGTHS), n_heads, n_kv, 16, dtype, seed=5)
    cu = pack_lengths(LENGTHS)
    packed = packed_attention(q, k, v, cu, max(LENGTHS), 0.3)
    # One decode row per token: its sequence's keys up to and including it, NaN beyond.
    dq, kc, vc, lengths = decode_rows_of_sequences(q, k, v, LENGTHS, cap=3 * KEY_BLOCK, fill=float("nan"))
    decoded = decode_attention(dq, kc, vc, lengths, 0.3)
    assert not decoded.isnan().any()
    assert_bitwise(decoded, packed, "decode row vs packed row")


# ---- accuracy against plain torch ---------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_ops_agree_with_plain_torch(dtype):
    g = _gen(6)
    x = torch.randn(37, 200, generator=g).to(dtype)
    w = (torch.randn(72, 200, generator=g) / 14).to(dtype)
    b = torch.randn(72, generator=g).to(dtype)
    ref = F.linear(x.double(), w.double(), b.double())
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(bi_linear(x, w, b).double(), ref, rtol=tol, atol=tol)

    nw = (1 + torch.randn(200, generator=g) / 10).to(dtype)
    xf = x.float()
    hf = nw * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
    torch.testing.assert_close(bi_rms_norm(x, nw, 1e-6), hf, rtol=tol, atol=tol)

    q, k, v = make_qkv(sum(LENGTHS), 4, 2, 16, dtype, seed=6)
    cu = pack_lengths(LENGTHS)
    ref_attn = sdpa_packed(q.double(), k.double(), v.double(), cu, 0.25)
    out = packed_attention(q, k, v, cu, max(LENGTHS), 0.25)
    torch.testing.assert_close(out.double(), ref_attn, rtol=tol, atol=tol)


def test_fp32_rms_norm_is_bitwise_hf():
    g = _gen(7)
    x = torch.randn(33, 64, generator=g)
    w = torch.randn(64, generator=g)
    hf = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
    assert_bitwise(bi_rms_norm(x, w, 1e-5), hf, "fp32 rms_norm vs HF formula")


def test_rms_norm_output_dtype_follows_hf_promotion():
    x = torch.randn(3, 8).bfloat16()
    assert bi_rms_norm(x, torch.ones(8), 1e-6).dtype == torch.float32
    assert bi_rms_norm(x, torch.ones(8, dtype=torch.bfloat16), 1e-6).dtype == torch.bfloat16


# ---- (4) autograd ----------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_gradients_match_plain_torch(dtype):
    g = _gen(8)
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)

    def grads(fn, *inputs):
        leaves = [t.detach().clone().requires_grad_() for t in inputs]
        out = fn(*leaves)
        out.backward(torch.ones_like(out) if out.dim() == 0 else upstream[: out.numel()].reshape(out.shape).to(out.dtype))
        return out.detach(), [t.grad for t in leaves]

    upstream = torch.randn(100000, generator=g)
    x = torch.randn(2, 9, 40, generator=g).to(dtype)
    w = (torch.randn(24, 40, generator=g) / 6).to(dtype)
    b = torch.randn(24, generator=g).to(dtype)
    out, got = grads(bi_linear, x, w, b)
    _, want = grads(F.linear, x, w, b)
    for a, e in zip(got, want):
        torch.testing.assert_close(a.float(), e.float(), **tol)

    nw = (1 + torch.randn(40, generator=g) / 10).to(dtype)

    def hf_norm(t, weight):
        tf = t.float()
        return weight * (tf * torch.rsqrt(tf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(t.dtype)

    _, got = grads(lambda t, weight: bi_rms_norm(t, weight, 1e-6), x, nw)
    _, want = grads(hf_norm, x, nw)
    for a, e in zip(got, want):
        torch.testing.assert_close(a.float(), e.float(), **tol)

    q, k, v = make_qkv(sum(LENGTHS), 4, 2, 16, dtype, seed=8)
    cu = pack_lengths(LENGTHS)
    _, got = grads(lambda a, b_, c: packed_attention(a, b_, c, cu, max(LENGTHS), 0.25), q, k, v)
    _, want = grads(lambda a, b_, c: sdpa_packed(a, b_, c, cu, 0.25), q, k, v)
    for a, e in zip(got, want):
        torch.testing.assert_close(a.float(), e.float(), **tol)


def test_decode_attention_refuses_autograd():
    q = torch.randn(2, 2, 16, requires_grad=True)
    kc = torch.randn(2, 2, 8, 16)
    with pytest.raises(BatchInvariantInputError, match="inference-only"):
        decode_attention(q, kc, kc, torch.tensor([3, 8], dtype=torch.int32), 0.25)


# ---- argument checks ----------------------------------------------------------------------------------
def test_bad_arguments_are_refused_by_name():
    x = torch.randn(3, 8)
    with pytest.raises(BatchInvariantInputError, match="x's last dim"):
        bi_linear(x, torch.randn(4, 7))
    with pytest.raises(BatchInvariantInputError, match="dtype"):
        bi_linear(x, torch.randn(4, 8).bfloat16())
    with pytest.raises(BatchInvariantInputError, match="x has dtype torch.int64"):
        bi_linear(torch.ones(3, 8, dtype=torch.int64), torch.randn(4, 8))
    with pytest.raises(BatchInvariantInputError, match="impl"):
        bi_linear(x, torch.randn(4, 8), impl="fast")
    with pytest.raises(BatchInvariantInputError, match="eps"):
        bi_rms_norm(x, torch.ones(8), -1.0)
    q, k, v = make_qkv(6, 4, 3, 16, torch.float32, seed=0)
    with pytest.raises(BatchInvariantInputError, match="multiple of k's kv heads"):
        packed_attention(q, k, v, pack_lengths([6]), 6, 0.25)
    q, k, v = make_qkv(6, 4, 2, 16, torch.float32, seed=0)
    with pytest.raises(BatchInvariantInputError, match="cu_seqlens must be 1-D int32"):
        packed_attention(q, k, v, pack_lengths([6]).long(), 6, 0.25)
    with pytest.raises(BatchInvariantInputError, match="max_seqlen=3"):
        packed_attention(q, k, v, pack_lengths([6]), 3, 0.25)
    with pytest.raises(BatchInvariantInputError, match="from 0 to T=6"):
        packed_attention(q, k, v, pack_lengths([2, 3]), 3, 0.25)
    kc = torch.randn(2, 2, 8, 16)
    with pytest.raises(BatchInvariantInputError, match="lengths must lie in"):
        decode_attention(torch.randn(2, 4, 16), kc, kc, torch.tensor([0, 3], dtype=torch.int32), 0.25)
    with pytest.raises(BatchInvariantInputError, match="lengths must be int32"):
        decode_attention(torch.randn(2, 4, 16), kc, kc, torch.tensor([1, 3]), 0.25)


# ---- the same invariance under torch's scalar CPU kernels ---------------------------------------------
def test_invariance_holds_under_default_cpu_capability(repo_root):
    env = dict(os.environ, ATEN_CPU_CAPABILITY="default", PYTHONPATH=str(repo_root))
    proc = subprocess.run([sys.executable, "-m", "tests.kernels.batch_invariant.batch_invariant_support"], cwd=repo_root, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "capability=DEFAULT" in proc.stdout and "invariance ok" in proc.stdout, proc.stdout
