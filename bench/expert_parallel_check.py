"""Expert parallelism on several GPUs (NCCL) or CPU processes (gloo): the bitwise check and the throughput.
Prints one JSON object on rank 0 (and writes it to --out); exits 1 when a batch-invariant impl's output
is not bitwise one process's.

Added on branch h/ep (issue 40, item 8); `git log --oneline -- bench/expert_parallel_check.py` lists later
changes. kernels/moe/expert_parallel.py is the code; docs/moe.md ("Expert parallelism") the design.

GPUs (one process per GPU, the Qwen3-30B-A3B layer shape: hidden 2048, 128 experts, top-8, width 768):

    torchrun --nproc-per-node 8 bench/expert_parallel_check.py --out bench/results/expert_parallel_h100x8.json
    torchrun --nproc-per-node 2 bench/expert_parallel_check.py --out bench/results/expert_parallel_h100x2.json

CPU smoke (gloo, a tiny shape, seconds):

    torchrun --nproc-per-node 2 bench/expert_parallel_check.py --small

What runs, on every rank (each holds --tokens tokens; the group holds P x --tokens):
- check: the same seeded hidden states, router logits and full expert weights on every rank; routing by
  kernels/moe/routing.route. Rank r keeps its slice of the weights and, dealt two ways (contiguous blocks;
  every P-th token of the reversed batch), its tokens; `expert_parallel_forward` on them must give every
  token the bits `experts_forward` gives it in one call over the whole batch with all the weights (each
  rank computes that reference itself). Gradients of (out * upstream).sum(), against one process over the
  ranks' tokens in rank order, are reported (max |diff| and whether bitwise), not asserted: the backward
  GEMMs promise no summation order.
- timing (median of --reps, the slowest rank's): the expert-parallel forward and forward+backward, against
  the baseline of one GPU running `experts_forward` with all E experts on the same --tokens (pure data
  parallelism, were the weights replicated); and the floor of this implementation (nothing overlaps):
  the two row all-to-alls alone at the same split sizes (measured bandwidth of the bytes that leave a
  rank) plus the owner's expert MLP alone on the rows it receives. `fraction_of_floor` = floor / forward.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.moe_train import timed_ms  # noqa: E402
from kernels.moe import experts_forward, route, sort_by_expert  # noqa: E402
from kernels.moe.expert_parallel import expert_parallel_forward, expert_slice  # noqa: E402
from kernels.moe.experts import expert_mlp  # noqa: E402

QWEN3_30B_A3B = dict(hidden=2048, experts=128, top_k=8, inter=768)
SMALL = dict(hidden=64, experts=8, top_k=2, inter=32)


def make_inputs(shape: dict, tokens: int, device: str, dtype: torch.dtype, seed: int) -> dict:
    """The whole batch and all the weights, the same bits on every rank (one seed, one device type)."""
    g = torch.Generator(device=device).manual_seed(seed)
    h, e, inter = shape["hidden"], shape["experts"], shape["inter"]

    def randn(*size, scale=1.0):
        return (torch.randn(*size, generator=g, device=device) * scale).to(dtype)

    hidden = randn(tokens, h)
    logits = randn(tokens, e)
    weights, experts = route(logits, shape["top_k"], norm_topk_prob=True)
    return {"hidden": hidden, "experts": experts, "weights": weights,
            "gate_up": randn(e, 2 * inter, h, scale=h ** -0.5), "down": randn(e, h, inter, scale=inter ** -0.5),
            "upstream": torch.randn(tokens, h, generator=g, device=device)}


def deals(total: int, ranks: int, device: str) -> dict[str, list[torch.Tensor]]:
    everything = torch.arange(total, device=device)
    per = total // ranks
    return {"contiguous": [everything[r * per:(r + 1) * per] for r in range(ranks)],
            "strided_reversed": [everything.flip(0)[r::ranks] for r in range(ranks)]}


def run_experts(fn, inp: dict, take: torch.Tensor, gate_up, down, grads: bool):
    leaves = [t.detach().clone().requires_grad_(grads) for t in (inp["hidden"][take], inp["weights"][take],
                                                                 gate_up, down)]
    out = fn(leaves[0], inp["experts"][take], leaves[1], leaves[2], leaves[3])
    if grads:
        (out.float() * inp["upstream"][take]).sum().backward()
    return out.detach(), [t.grad for t in leaves] if grads else None


def slowest(value: float, device: str) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def every_rank(ok: bool, device: str) -> bool:
    t = torch.tensor([0 if ok else 1], device=device)
    dist.all_reduce(t)
    return int(t) == 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="CPU smoke (gloo): a tiny shape, float32")
    ap.add_argument("--tokens", type=int, default=4096, help="tokens per rank")
    ap.add_argument("--impl", default="auto", choices=["auto", "reference", "triton", "grouped_mm"],
                    help="grouped GEMM (auto: the device's batch-invariant one, as true_on_policy runs)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    if "RANK" not in os.environ:
        raise SystemExit("run under torchrun (see the module docstring)")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if args.small:
        shape, device, dtype = SMALL, "cpu", torch.float32
        args.tokens, args.reps = min(args.tokens, 64), min(args.reps, 3)
        torch.set_num_threads(1)
    else:
        if not torch.cuda.is_available():
            raise SystemExit("needs GPUs (or --small for the CPU smoke)")
        shape, device, dtype = QWEN3_30B_A3B, "cuda", torch.bfloat16
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", timeout=datetime.timedelta(seconds=300))
    rank, ranks = dist.get_rank(), dist.get_world_size()
    owned = expert_slice(shape["experts"], ranks, rank)
    inp = make_inputs(shape, args.tokens * ranks, device, dtype, args.seed)
    gate_up, down = inp["gate_up"][owned].contiguous(), inp["down"][owned].contiguous()

    def ep(h, e, w, gu, dn):
        return expert_parallel_forward(h, e, w, gu, dn, F.silu, impl=args.impl)

    def one(h, e, w, gu, dn):
        return experts_forward(h, e, w, gu, dn, F.silu, impl=args.impl)

    # ---- check
    everything = torch.arange(args.tokens * ranks, device=device)
    full, _ = run_experts(one, inp, everything, inp["gate_up"], inp["down"], grads=False)
    bitwise = {}
    for name, takes in deals(args.tokens * ranks, ranks, device).items():
        got, _ = run_experts(ep, inp, takes[rank], gate_up, down, grads=False)
        bitwise[name] = every_rank(torch.equal(got, full[takes[rank]]), device)
    take = deals(args.tokens * ranks, ranks, device)["contiguous"]
    _, ep_grads = run_experts(ep, inp, take[rank], gate_up, down, grads=True)
    _, one_grads = run_experts(one, inp, everything, inp["gate_up"], inp["down"], grads=True)
    rows = take[rank]
    want = [one_grads[0][rows], one_grads[1][rows], one_grads[2][owned], one_grads[3][owned]]
    grads = {}
    for name, g, w in zip(("d_hidden", "d_weights", "d_gate_up", "d_down"), ep_grads, want):
        diff = slowest(float((g.double() - w.double()).abs().max()), device)
        grads[name] = {"max_abs_diff": diff, "bitwise": every_rank(torch.equal(g, w), device),
                       "max_abs": slowest(float(w.abs().max()), device)}
    del full, one_grads, ep_grads

    # ---- timing
    own = take[rank]
    baseline = slowest(timed_ms(lambda: run_experts(one, inp, own, inp["gate_up"], inp["down"], False), args.reps,
                                device), device)
    forward = slowest(timed_ms(lambda: run_experts(ep, inp, own, gate_up, down, False), args.reps, device), device)
    baseline_fb = slowest(timed_ms(lambda: run_experts(one, inp, own, inp["gate_up"], inp["down"], True), args.reps,
                                   device), device)
    forward_backward = slowest(timed_ms(lambda: run_experts(ep, inp, own, gate_up, down, True), args.reps, device),
                               device)
    # The floor's parts at this routing's split sizes.
    local = shape["experts"] // ranks
    _, counts = sort_by_expert(inp["experts"][own], shape["experts"])
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts)
    received = received.view(ranks, local)
    send, recv = counts.view(ranks, local).sum(1).tolist(), received.sum(1).tolist()
    rows_out = torch.randn(sum(send), shape["hidden"], device=device).to(dtype)
    rows_in = torch.empty(sum(recv), shape["hidden"], device=device, dtype=dtype)

    def there_and_back():
        dist.all_to_all_single(rows_in, rows_out, recv, send)
        dist.all_to_all_single(rows_out, rows_in, send, recv)

    exchange = slowest(timed_ms(there_and_back, args.reps, device), device)
    leaving = (sum(send) - send[rank] + sum(recv) - recv[rank]) * shape["hidden"] * rows_out.element_size()
    leaving_all = slowest(float(leaving), device)  # the busiest rank's bytes
    local_rows = torch.randn(sum(recv), shape["hidden"], device=device).to(dtype)
    mlp = slowest(timed_ms(lambda: expert_mlp(local_rows, gate_up, down, received.sum(0), F.silu, impl=args.impl),
                           args.reps, device), device)
    floor = exchange + mlp
    global_tokens = args.tokens * ranks
    result = {
        "device": (torch.cuda.get_device_name() if device == "cuda" else f"cpu ({platform.processor()})"),
        "backend": dist.get_backend(), "ranks": ranks, "torch": torch.__version__, "shape": shape,
        "dtype": str(dtype), "tokens_per_rank": args.tokens, "impl": args.impl,
        "bitwise_guaranteed": args.impl != "grouped_mm",
        "forward_bitwise_equal_one_process": bitwise, "gradients_vs_one_process": grads,
        "ms": {"ep_forward": forward, "ep_forward_backward": forward_backward,
               "baseline_forward_all_experts_one_rank": baseline,
               "baseline_forward_backward_all_experts_one_rank": baseline_fb,
               "floor_forward": floor, "exchange_there_and_back": exchange, "local_expert_mlp": mlp},
        "tokens_per_s": {"ep_forward": global_tokens / (forward / 1e3),
                         "ep_forward_per_rank": args.tokens / (forward / 1e3),
                         "baseline_forward_per_rank": args.tokens / (baseline / 1e3),
                         "ep_forward_backward": global_tokens / (forward_backward / 1e3)},
        "ratio_ep_over_baseline_forward": baseline / forward,
        "ratio_ep_over_baseline_forward_backward": baseline_fb / forward_backward,
        "fraction_of_floor": floor / forward,
        "exchange_gbps_busiest_rank": leaving_all / (exchange / 1e3) / 1e9,
    }
    ok = not result["bitwise_guaranteed"] or all(bitwise.values())
    if rank == 0:
        text = json.dumps(result, indent=1)
        print(text, flush=True)
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(text + "\n")
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
