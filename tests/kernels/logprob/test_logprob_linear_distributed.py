"""The fused lm_head + log-prob over real torch.distributed (gloo) vocab shards vs one process, bitwise.

Each rank holds rows [r * V_local, (r + 1) * V_local) of the lm_head and the full hidden states;
outputs and d(hidden) must be the single-process bits on every rank, d(weight) the matching rows.
Processes are forked on one thread each, as in test_logprob_distributed.py.
"""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from kernels.logprob import LogprobContractError, linear_token_logprobs  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")
N, H, GVS = 7, 64, 500  # tiles of 8 columns, blocks of 64; chunks of 4 tokens: a full one and a padded one
BACKENDS = ("reference", "triton")


def _inputs(rows: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(50)
    hidden = torch.randn(N, H, generator=g).to(dtype)
    # A flat softmax, so that every block adds to d(hidden) and a wrong summation order shows
    # (in fp32: bf16's final rounding of d(hidden) hides most such differences).
    weight = (torch.randn(rows, H, generator=g) * 0.1).to(dtype)
    targets = torch.tensor([0, 499, 255, 256, 100, 63, 64])  # shard and block bounds, the last real column
    mask = torch.tensor([True, True, False, True, True, True, True])
    up = torch.randn(3, N, generator=g)
    return hidden, weight, targets, mask, up


def _run_one(hidden, weight, targets, mask, up, backend, **kw):
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logp, lse, ent = linear_token_logprobs(h, w, targets, temperature=0.9, with_entropy=True, chunk_tokens=4,
                                           global_vocab_size=GVS, backend=backend, mask=mask, **kw)
    (logp * up[0] + lse * up[1] + ent * up[2]).sum().backward()
    return {"logp": logp.detach(), "lse": lse.detach(), "ent": ent.detach(), "d_hidden": h.grad, "d_weight": w.grad}


def _worker(rank: int, world: int, rows: int, dtype: torch.dtype, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)  # see test_logprob_distributed.py: forked children must not open thread teams
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        hidden, weight, targets, mask, up = _inputs(rows, dtype)
        V_local = rows // world
        shard = weight[rank * V_local : (rank + 1) * V_local].contiguous()
        results = {}
        for backend in BACKENDS:
            results[backend] = _run_one(hidden, shard, targets, mask, up, backend, vocab_start=rank * V_local,
                                        tp_group=dist.group.WORLD)
        try:  # ranks that chunk differently would merge logits of different GEMMs: all must refuse
            linear_token_logprobs(hidden, shard, targets, chunk_tokens=4 + rank, vocab_start=rank * V_local,
                                  global_vocab_size=GVS, tp_group=dist.group.WORLD, backend="reference")
            results["mismatch"] = "accepted"
        except LogprobContractError as e:
            results["mismatch"] = str(e)
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


# (world, lm_head rows): 512 rows = 8 blocks, 4 and 2 per rank (aligned subtrees of the d(hidden)
# tree); 576 over 3 ranks and 768 over 2 hold 3 and 6 blocks per rank, padding blocks included
# (per-block gather).
@pytest.mark.parametrize("world,rows", [(2, 512), (4, 512), (3, 576), (2, 768)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gloo_vocab_parallel_matches_one_process_bitwise(world, rows, dtype, tmp_path):
    hidden, weight, targets, mask, up = _inputs(rows, dtype)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the ranks' thread count: CPU GEMMs and reductions split work by it
    try:
        single = {b: _run_one(hidden, weight, targets, mask, up, b) for b in BACKENDS}
    finally:
        torch.set_num_threads(threads)
    if dist.is_initialized():
        # A Trainer earlier in this process formed a world-of-one group. Leave it here, before the fork:
        # a child cannot shut down a group whose threads it did not inherit (it waits for them forever).
        dist.destroy_process_group()
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_worker, args=(r, world, rows, dtype, str(tmp_path / "init"), str(tmp_path)))
             for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
    hung = [p for p in procs if p.is_alive()]
    for p in hung:
        p.kill()
        p.join()
    assert not hung and all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    V_local = rows // world
    for rank in range(world):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        for b in BACKENDS:
            for key in ("logp", "lse", "ent", "d_hidden"):
                assert torch.equal(got[b][key], single[b][key]), f"{b} {key} rank {rank} differs from one process"
            want = single[b]["d_weight"][rank * V_local : (rank + 1) * V_local]
            assert torch.equal(got[b]["d_weight"], want), f"{b} d_weight shard of rank {rank} differs"
        assert "disagree on the logprob contract" in got["mismatch"]
        assert "chunk_tokens=" in got["mismatch"]
