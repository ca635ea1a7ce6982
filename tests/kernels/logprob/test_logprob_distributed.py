"""Real torch.distributed (gloo) in 2 and 4 processes: outputs and gradients bitwise equal to TP=1.

Processes are forked (no CUDA is touched before the fork), which keeps the test
to a few seconds on a small CPU machine; each rank writes its results to a file
that the test compares with a single-process run.
"""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch.distributed as dist  # noqa: E402
from tests.support.forked_ranks import run_forked_ranks  # noqa: E402

from kernels.logprob import LogprobContractError, token_logprobs, token_logprobs_with_entropy  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")
T, PADDED, GVS = 5, 512, 500  # 64 tiles of 8 columns: shards of 256 and 128 sit on tile bounds
BACKENDS = ("reference", "triton")


def _inputs():
    g = torch.Generator().manual_seed(30)
    logits = (torch.randn(T, PADDED, generator=g) * 4).to(torch.bfloat16)
    targets = torch.tensor([0, 499, 255, 256, 100])  # either side of a shard bound, last real column
    mask = torch.tensor([True, True, False, True, True])
    return logits, targets, mask


def _run_one(logits, targets, mask, backend, **kw):
    x = logits.clone().requires_grad_()
    logp, lse, ent = token_logprobs_with_entropy(x, targets, mask=mask, backend=backend, temperature=0.9, **kw)
    (logp * 1.5 + lse * 0.25 + ent * 0.5).sum().backward()
    return {"logp": logp.detach(), "lse": lse.detach(), "ent": ent.detach(), "grad": x.grad}


def _worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    # One thread in the forked child: GNU OpenMP keeps the parent's thread-team bookkeeping across
    # fork without its threads, so a child that opens a parallel region after the parent changed
    # its thread count (an earlier test did) waits forever for threads that do not exist.
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        logits, targets, mask = _inputs()
        V_local = PADDED // world
        shard = logits[:, rank * V_local : (rank + 1) * V_local].contiguous()
        results = {}
        for backend in BACKENDS:
            results[backend] = _run_one(
                shard, targets, mask, backend, vocab_start=rank * V_local, global_vocab_size=GVS,
                tp_group=dist.group.WORLD,
            )
        # Ranks disagreeing on the definition must all refuse before merging anything.
        try:
            token_logprobs(shard, targets, temperature=1.0 + rank, vocab_start=rank * V_local,
                           global_vocab_size=GVS, tp_group=dist.group.WORLD, backend="reference")
            results["mismatch"] = "accepted"
        except LogprobContractError as e:
            results["mismatch"] = str(e)
        try:
            token_logprobs(shard, targets, vocab_start=rank * V_local, global_vocab_size=GVS,
                           tp_group=dist.group.WORLD)
            results["auto"] = "accepted"
        except ValueError as e:
            results["auto"] = str(e)
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_gloo_tp_matches_single_process_bitwise(world, tmp_path):
    logits, targets, mask = _inputs()
    # The ranks compute on one thread (see _worker); so does the TP=1 baseline, since CPU reductions
    # split work by thread count and bitwise claims hold at a fixed count.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        single = {b: _run_one(logits, targets, mask, b, global_vocab_size=GVS) for b in BACKENDS}
    finally:
        torch.set_num_threads(threads)
    run_forked_ranks(_worker, world, tmp_path)
    V_local = PADDED // world
    for rank in range(world):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        for b in BACKENDS:
            for key in ("logp", "lse", "ent"):
                assert torch.equal(got[b][key], single[b][key]), f"{b} {key} rank {rank} differs from TP=1"
            want = single[b]["grad"][:, rank * V_local : (rank + 1) * V_local]
            assert torch.equal(got[b]["grad"], want), f"{b} gradient shard of rank {rank} differs from TP=1"
        assert "disagree on the logprob contract" in got["mismatch"]
        assert "auto" in got["auto"] and "refused" in got["auto"]
