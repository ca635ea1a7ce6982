"""Real NCCL, one process per GPU: vocab-parallel outputs and gradient shards bitwise equal to TP=1.

Needs 2 GPUs of one kind (run on the device machine's nvidia-h200-x2:
`python -m pytest -m gpu tests/kernels/logprob/test_logprob_nccl.py`). Qwen3's vocab in bf16: each rank
holds 32 of the 64 tiles, computes its partials, all-gathers them over NCCL and merges the same
list; the single-process reference runs the whole vocab on GPU 0.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs for NCCL"),
]
V, T, WORLD = 151936, 96, 2
BACKENDS = ("triton", "native", "reference")


def _inputs(device):
    g = torch.Generator(device=device).manual_seed(41)
    logits = (torch.randn(T, V, generator=g, device=device) * 4).to(torch.bfloat16)
    targets = torch.randint(0, V, (T,), generator=g, device=device)
    targets[:4] = torch.tensor([0, V // 2 - 1, V // 2, V - 1], device=device)  # either side of the shard bound
    mask = torch.ones(T, dtype=torch.bool, device=device)
    mask[5] = False
    return logits, targets, mask


def _run(logits, targets, mask, backend, **kw):
    from kernels.logprob import token_logprobs_with_entropy

    x = logits.clone().requires_grad_()
    logp, lse, ent = token_logprobs_with_entropy(x, targets, mask=mask, backend=backend, temperature=0.8, **kw)
    (logp * 1.5 + lse * 0.25 + ent * 0.5).sum().backward()
    return {"logp": logp.detach().cpu(), "lse": lse.detach().cpu(), "ent": ent.detach().cpu(), "grad": x.grad.cpu()}


def _worker(rank: int, init_file: str, out_dir: str) -> None:
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # no NVLink multicast on shared hosts
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=WORLD,
                            device_id=torch.device("cuda", rank))
    try:
        logits, targets, mask = _inputs(f"cuda:{rank}")
        V_local = V // WORLD
        shard = logits[:, rank * V_local:(rank + 1) * V_local].contiguous()
        results = {b: _run(shard, targets, mask, b, vocab_start=rank * V_local, global_vocab_size=V,
                           tp_group=dist.group.WORLD) for b in BACKENDS}
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_nccl_tp2_matches_one_gpu_bitwise(tmp_path):
    logits, targets, mask = _inputs("cuda:0")
    single = {b: _run(logits, targets, mask, b) for b in BACKENDS}
    mp.start_processes(_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=WORLD, start_method="spawn")
    V_local = V // WORLD
    for rank in range(WORLD):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        for b in BACKENDS:
            for key in ("logp", "lse", "ent"):
                assert torch.equal(got[b][key].view(torch.int32), single[b][key].view(torch.int32)), \
                    f"{b} {key} on rank {rank} differs from TP=1"
            want = single[b]["grad"][:, rank * V_local:(rank + 1) * V_local]
            assert torch.equal(got[b]["grad"], want), f"{b} gradient shard of rank {rank} differs from TP=1"
