"""Attention registry and contract (CPU): selection fails closed, refusals name the backend,
and the reference backend computes the contract (checked against a dense block-diagonal mask in fp64)."""
from __future__ import annotations

import math

import pytest
import torch

from kernels.attention import (
    REGISTRY,
    AttentionBackend,
    AttentionBackendError,
    AttentionContractError,
    AttentionPolicy,
    Capability,
    PackedLayout,
    packed_causal_attention,
)

from tests.support.boundary_blind_attention import backend as boundary_blind_backend

FLOAT = frozenset({torch.float32, torch.float64, torch.bfloat16, torch.float16})


def dense_reference(q, k, v, lengths, scale, window=None):
    """Independent definition: one dense attention over the whole buffer with a block-diagonal causal mask."""
    T, hq, d = q.shape
    seq = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    allowed = (seq[:, None] == seq[None, :]) & (j <= i)
    if window is not None:
        allowed &= j > i - window
    rep = hq // k.shape[1]
    kk, vv = k.repeat_interleave(rep, 1).double(), v.repeat_interleave(rep, 1).double()
    scores = torch.einsum("thd,shd->hts", q.double(), kk) * scale
    scores = scores.masked_fill(~allowed, -math.inf)
    return torch.einsum("hts,shd->thd", scores.softmax(-1), vv)


@pytest.fixture
def blind_backend():
    """The boundary-blind attention, declared honestly: it does not honour boundaries."""
    REGISTRY.register(boundary_blind_backend(honours_boundaries=False))
    yield "test_boundary_blind"
    REGISTRY.unregister("test_boundary_blind")


def _qkv(T, hq=4, hkv=2, d=16, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(T, hq, d, generator=g, dtype=dtype), torch.randn(T, hkv, d, generator=g, dtype=dtype),
            torch.randn(T, hkv, d, generator=g, dtype=dtype))


@pytest.mark.parametrize("lengths", [[1], [5], [1, 1, 1, 1], [3, 17, 1, 64, 2], [200, 1, 37]])
@pytest.mark.parametrize("hkv", [4, 2, 1])
def test_reference_matches_dense_block_diagonal(lengths, hkv):
    q, k, v = _qkv(sum(lengths), hkv=hkv)
    lay = PackedLayout.from_lengths(lengths)
    with REGISTRY.forced("reference"):
        out = packed_causal_attention(q, k, v, lay.cu_seqlens, lay.max_seqlen)
    ref = dense_reference(q, k, v, lengths, 16 ** -0.5)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert (out.double() - ref).abs().max() < 2e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_gradients_are_each_sequences_own_bit_for_bit(dtype):
    """The backward of a packed call gives every token the gradient it gets when its sequence runs alone:
    the buffer is cut into per-sequence views whose gradients are put back side by side, and nothing of
    another sequence reaches them."""
    lengths = [3, 1, 17, 5]
    q, k, v = (x.requires_grad_() for x in _qkv(sum(lengths), dtype=dtype))
    grad_out = _qkv(sum(lengths), dtype=dtype, seed=1)[0]
    lay = PackedLayout.from_lengths(lengths)
    with REGISTRY.forced("reference"):
        packed_causal_attention(q, k, v, lay.cu_seqlens, lay.max_seqlen).backward(grad_out)
        start = 0
        for n in lengths:
            parts = [x.detach()[start:start + n].clone().requires_grad_() for x in (q, k, v)]
            alone = PackedLayout.from_lengths([n])
            packed_causal_attention(*parts, alone.cu_seqlens, alone.max_seqlen).backward(grad_out[start:start + n])
            for whole, part in zip((q, k, v), parts):
                assert torch.equal(whole.grad[start:start + n], part.grad)
            start += n


@pytest.mark.parametrize("window", [1, 4, 50])
def test_reference_sliding_window(window):
    lengths = [30, 7, 60]
    q, k, v = _qkv(sum(lengths))
    lay = PackedLayout.from_lengths(lengths)
    with REGISTRY.forced("reference"):
        out = packed_causal_attention(q, k, v, lay.cu_seqlens, lay.max_seqlen, window=window)
    assert (out.double() - dense_reference(q, k, v, lengths, 16 ** -0.5, window)).abs().max() < 2e-6


def test_auto_selection_on_cpu_is_the_reference_and_usage_is_counted():
    q, k, v = _qkv(10)
    lay = PackedLayout.from_lengths([4, 6])
    REGISTRY.reset_usage()
    packed_causal_attention(q, k, v, lay.cu_seqlens, lay.max_seqlen)
    packed_causal_attention(q, k, v, lay.cu_seqlens, lay.max_seqlen)
    assert REGISTRY.usage() == {"reference": 2}


def test_auto_selection_skips_a_backend_that_ignores_boundaries(blind_backend):
    # The blind backend has the best priority: it wins for one sequence, never for a packed buffer.
    assert REGISTRY.select(device=torch.device("cpu"), dtype=torch.float32, head_dim=16, packed=False,
                           window=None).name == blind_backend
    assert REGISTRY.select(device=torch.device("cpu"), dtype=torch.float32, head_dim=16, packed=True,
                           window=None).name == "reference"


def test_forcing_a_boundary_blind_backend_on_packed_input_raises_naming_it(blind_backend):
    q, k, v = _qkv(10)
    lay = PackedLayout.from_lengths([4, 6])
    with REGISTRY.forced(blind_backend):
        with pytest.raises(AttentionBackendError,
                           match=r"forced attention backend 'test_boundary_blind' refused: it does not honour "
                                 r"sequence boundaries"):
            packed_causal_attention(q, k, v, lay.cu_seqlens, lay.max_seqlen)
        # One sequence has no boundary to violate: allowed, and equal to the reference there.
        one = PackedLayout.from_lengths([10])
        out = packed_causal_attention(q, k, v, one.cu_seqlens, one.max_seqlen)
    assert (out.double() - dense_reference(q, k, v, [10], 16 ** -0.5)).abs().max() < 2e-6


@pytest.mark.parametrize("name, match", [
    ("torch_varlen", r"forced attention backend 'torch_varlen' refused: it does not run on platform 'cpu'"),
    ("flash_attn", r"forced attention backend 'flash_attn' refused: it does not run on platform 'cpu'"),
    ("flex", r"forced attention backend 'flex' refused: it does not run on platform 'cpu'"),
])
def test_forcing_a_gpu_backend_on_cpu_raises_naming_it(name, match):
    q, k, v = _qkv(6, dtype=torch.bfloat16)
    lay = PackedLayout.from_lengths([2, 4])
    with REGISTRY.forced(name), pytest.raises(AttentionBackendError, match=match):
        packed_causal_attention(q, k, v, lay.cu_seqlens, lay.max_seqlen)


def test_unknown_backend_is_refused_when_the_policy_is_set():
    with pytest.raises(AttentionBackendError, match=r"'nope' is not registered"):
        REGISTRY.set_policy(AttentionPolicy(backend="nope"))
    assert REGISTRY.policy.backend is None


def test_no_capable_backend_lists_every_reason():
    with pytest.raises(AttentionBackendError) as exc:
        REGISTRY.select(device=torch.device("cpu"), dtype=torch.int8, head_dim=16, packed=True, window=None)
    msg = str(exc.value)
    for name in ("reference", "torch_varlen", "flash_attn", "flex"):
        assert f"{name}:" in msg
    assert "does not compute in torch.int8" in msg


def test_deterministic_requirement_refuses_a_nondeterministic_backend():
    REGISTRY.register(AttentionBackend(
        name="test_nondet", target="kernels.attention.reference:attention", priority=0,
        capabilities={"cpu": Capability(honours_boundaries=True, dtypes=FLOAT, max_head_dim=512,
                                        deterministic=False)}))
    try:
        pick = dict(device=torch.device("cpu"), dtype=torch.float32, head_dim=16, packed=True, window=None)
        with REGISTRY.use_policy(AttentionPolicy(require_deterministic=False)):
            assert REGISTRY.select(**pick).name == "test_nondet"
        with REGISTRY.use_policy(AttentionPolicy(require_deterministic=True)):
            assert REGISTRY.select(**pick).name == "reference"
            with REGISTRY.forced("test_nondet"), pytest.raises(AttentionBackendError, match="not deterministic"):
                REGISTRY.select(**pick)
        # None follows torch's global switch (what services/common/determinism.py sets).
        before = torch.are_deterministic_algorithms_enabled()
        torch.use_deterministic_algorithms(True)
        try:
            assert REGISTRY.select(**pick).name == "reference"
        finally:
            torch.use_deterministic_algorithms(before)
    finally:
        REGISTRY.unregister("test_nondet")


@pytest.mark.parametrize("cu, max_seqlen, match", [
    ([0, 4, 4, 10], 6, "strictly increasing"),
    ([1, 4, 10], 6, "must start at 0 and end at T=10"),
    ([0, 4, 9], 5, "must start at 0 and end at T=10"),
    ([0, 4, 10], 5, "max_seqlen=5 but the longest sequence"),
    ([0, 4, 10], 7, "max_seqlen=7 but the longest sequence"),
])
def test_bad_cu_seqlens_are_refused(cu, max_seqlen, match):
    q, k, v = _qkv(10)
    with pytest.raises(AttentionContractError, match=match):
        packed_causal_attention(q, k, v, torch.tensor(cu, dtype=torch.int32), max_seqlen)


def test_contract_shape_dtype_and_position_checks():
    q, k, v = _qkv(10)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    with pytest.raises(AttentionContractError, match="1-D int32"):
        packed_causal_attention(q, k, v, cu.long(), 6)
    with pytest.raises(AttentionContractError, match="Python int"):
        packed_causal_attention(q, k, v, cu, torch.tensor(6))
    with pytest.raises(AttentionContractError, match="multiple of kv heads"):
        packed_causal_attention(q, k[:, :1].expand(10, 3, 16).contiguous(), v[:, :1].expand(10, 3, 16), cu, 6)
    with pytest.raises(AttentionContractError, match="share T"):
        packed_causal_attention(q[:9], k, v, cu, 6)
    good = torch.tensor([0, 1, 2, 3, 0, 1, 2, 3, 4, 5])
    packed_causal_attention(q, k, v, cu, 6, position_ids=good)
    with pytest.raises(AttentionContractError, match="position_ids disagree with cu_seqlens at token 4"):
        packed_causal_attention(q, k, v, cu, 6, position_ids=torch.arange(10))


def test_layout_check_is_cached_per_tensor_but_sees_in_place_edits():
    q, k, v = _qkv(10)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    packed_causal_attention(q, k, v, cu, 6)
    cu[1] = 0  # in-place write bumps the version counter: the cached verdict must not be reused
    with pytest.raises(AttentionContractError, match="strictly increasing"):
        packed_causal_attention(q, k, v, cu, 6)


def test_policy_is_a_typed_config_with_documented_fields():
    for name, f in AttentionPolicy.model_fields.items():
        assert f.description, name
    with pytest.raises(ValueError):
        AttentionPolicy(backend="reference", bogus=1)
