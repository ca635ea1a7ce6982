"""Bitwise claims: batch composition and TP degree (simulated shards) change no bit, per backend."""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from kernels.logprob import (  # noqa: E402
    LogprobContractError,
    ShardLayout,
    emulate_tensor_parallel,
    registered_backends,
    token_logprobs,
)
from kernels.logprob.contract import Platform  # noqa: E402

BACKENDS = ["reference", "triton"]
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def _logits(T: int, V: int, seed: int, dtype=torch.bfloat16) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(T, V, generator=g) * 4).to(dtype)


def _fwd_bwd(logits, targets, backend, **kw):
    x = logits.clone().requires_grad_()
    logp, lse = token_logprobs(x, targets, backend=backend, **kw)
    (logp * 1.25 + lse * 0.5).sum().backward()
    return logp.detach(), lse.detach(), x.grad


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("tau", [1.0, 0.8])
def test_batch_composition_changes_no_bit(backend, tau):
    T, V = 10, 384
    logits = _logits(T, V, seed=20)
    targets = torch.randint(0, V, (T,), generator=torch.Generator().manual_seed(21))
    full = _fwd_bwd(logits, targets, backend, temperature=tau)
    perm = torch.randperm(T, generator=torch.Generator().manual_seed(22))
    permuted = _fwd_bwd(logits[perm], targets[perm], backend, temperature=tau)
    for a, b in zip(full, permuted):
        assert torch.equal(a[perm], b), "row permutation changed bits"
    pieces = [_fwd_bwd(logits[a:b], targets[a:b], backend, temperature=tau) for a, b in ((0, 1), (1, 4), (4, 10))]
    for i, whole in enumerate(full):
        assert torch.equal(torch.cat([p[i] for p in pieces]), whole), "sub-batching changed bits"


def _sharded_run(logits, targets, tp, backend, gvs):
    """Forward through emulate_tensor_parallel, backward shard by shard as each rank would run it."""
    logp, lse = emulate_tensor_parallel(logits, targets, tp=tp, backend=backend, global_vocab_size=gvs)
    impl = registered_backends()[backend].load(Platform.CPU)
    V_local = logits.shape[1] // tp
    g_logp, g_lse = torch.full_like(lse, 1.25), torch.full_like(lse, 0.5)
    grads = []
    for r in range(tp):
        layout = ShardLayout(gvs, r * V_local, V_local, r, tp)
        shard = logits[:, r * V_local : (r + 1) * V_local]
        grads.append(impl.backward(shard, targets, lse, None, g_logp, g_lse, None, None, layout, 1.0))
    return logp, lse, torch.cat(grads, dim=1)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("gvs, padded", [(512, 512), (50257, 50304)])
def test_tp_degree_changes_no_bit(backend, gvs, padded):
    """TP 1/2/4/8 with shards on tile bounds: 512 = 64 tiles of 8; 50257 padded to 64 x 786."""
    T = 3 if padded < 4096 else 2  # the interpreter is slow on the 50k vocab
    logits = _logits(T, padded, seed=23)
    targets = torch.tensor([0, gvs - 1, gvs // 3])[:T]
    one = _sharded_run(logits, targets, 1, backend, gvs)
    direct = _fwd_bwd(logits, targets, backend, global_vocab_size=gvs)
    for a, b in zip(one, direct):
        assert torch.equal(a, b), "emulated TP=1 differs from the public entry point"
    for tp in (2, 4, 8):
        for a, b in zip(one, _sharded_run(logits, targets, tp, backend, gvs)):
            assert torch.equal(a, b), f"TP={tp} differs from TP=1"


def test_shards_that_cut_tiles_are_refused_for_cross_tp_bitwise():
    """Megatron-style padding to a multiple of 128*tp leaves shard bounds inside tiles."""
    layout = ShardLayout(1000, 0, 334, 0, 3)
    assert not layout.tile_aligned
    logits = _logits(2, 1002, seed=24, dtype=torch.float32)
    with pytest.raises(LogprobContractError, match="cross_tp_bitwise needs shard bounds on tile bounds"):
        emulate_tensor_parallel(logits, torch.tensor([1, 2]), tp=3, backend="reference", global_vocab_size=1000)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fixed_topology_serves_cut_tiles_correctly_and_reproducibly(backend):
    logits = _logits(3, 1002, seed=25, dtype=torch.float32)
    targets = torch.tensor([0, 333, 999])  # 333: last column of rank 0, inside a cut tile
    kw = dict(tp=3, backend=backend, global_vocab_size=1000, determinism="fixed_topology")
    logp, lse = emulate_tensor_parallel(logits, targets, **kw)
    ref = torch.log_softmax(logits[:, :1000].double(), -1).gather(1, targets[:, None])[:, 0]
    torch.testing.assert_close(logp.double(), ref, rtol=0, atol=2e-5)
    again = emulate_tensor_parallel(logits, targets, **kw)
    assert torch.equal(logp, again[0]) and torch.equal(lse, again[1])
