"""Host (CPU) cost per call of each layer of the log-prob forward, on a GPU machine.

    python bench/logprob_host.py [--vocab 151936] [--tokens 8] [--calls 2000] [--out FILE]

At T=2048 an isolated call's latency is the host's time to issue the launches plus the
kernels' GPU time, so the host layers matter as much as the kernels. Each figure here
is wall time over back-to-back calls at a tiny T (GPU work negligible, so the host is the
bottleneck), then one synchronize: microseconds of CPU per call, median of 7 rounds.
Layers, outermost first: the public entry point with and without a graph to record;
the backend's TP-1 forward (two launches through kernels/logprob/triton_launch.py); the
partials launch alone; that launch through the JIT (`kernel[grid](...)`, binding every
argument) and through the compiled kernel's launcher (what the binding costs is the
difference); one torch.empty; an empty autograd Function. Prints one JSON object.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kernels.logprob import registered_backends, token_logprobs  # noqa: E402
from kernels.logprob.contract import Platform  # noqa: E402
from kernels.logprob.tiling import ShardLayout  # noqa: E402


ROUNDS = 7


def per_call_us(fn, calls: int) -> float:
    """Median over ROUNDS rounds of calls/ROUNDS back-to-back calls (host timings on a shared
    machine are noisy; the median of rounds resists a round that a neighbour slowed)."""
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    per_round = max(1, calls // ROUNDS)
    rounds = []
    for _ in range(ROUNDS):
        t0 = time.perf_counter()
        for _ in range(per_round):
            fn()
        torch.cuda.synchronize()
        rounds.append((time.perf_counter() - t0) / per_round * 1e6)
    return statistics.median(rounds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--out", type=str, default=None)
    args = ap.parse_args()
    import triton
    from kernels.logprob import triton_backend as tb

    T, V, n = args.tokens, args.vocab, args.calls
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(T, V, generator=g, device="cuda").to(torch.bfloat16)
    targets = torch.randint(0, V, (T,), generator=g, device="cuda")
    x = logits.clone().requires_grad_()
    impl = registered_backends()["triton"].load(Platform.CUDA)
    layout = ShardLayout(V, 0, V)
    res: dict[str, float] = {}
    res["token_logprobs_no_graph"] = per_call_us(lambda: token_logprobs(logits, targets, backend="triton"), n)
    res["token_logprobs_with_graph"] = per_call_us(lambda: token_logprobs(x, targets, backend="triton"), n)
    res["backend_local_forward"] = per_call_us(
        lambda: impl.local_forward(logits, targets, layout, 1.0, False, None), n)
    from kernels.logprob.triton_backend import TritonBackend

    jit_only = TritonBackend(impl._k, reuse_compiled=False)  # every launch binds through the JIT
    res["backend_local_forward_jit_binding"] = per_call_us(
        lambda: jit_only.local_forward(logits, targets, layout, 1.0, False, None), n)
    res["backend_partials_only"] = per_call_us(lambda: impl._launch_partials(logits, targets, layout, 1.0, False), n)

    # The partials launch as the backend issues it, with arguments prepared once.
    m, s, w, tgt = impl._launch_partials(logits, targets, layout, 1.0, False)
    cfg = tb.PartialsConfig.for_tile(layout.tile_width, logits.dtype, layout.slots_per_rank, True)
    S = layout.slots_per_rank
    kargs = (logits, targets, m, s, s, tgt, logits.stride(0), V, V, 0, 0, V, T, S, 1.0, tgt, tgt, tgt, tgt, tgt)
    kw = dict(TILE_W=cfg.tile_w, CHUNK=cfg.chunk, ALIGN=cfg.align, NUM_CHUNKS=cfg.num_chunks,
              SPP=cfg.slots_per_program, WITH_ENT=False, SCALE=False, num_warps=cfg.num_warps)
    kern = impl._k.logprob_partials_kernel
    res["triton_jit_launch_partials"] = per_call_us(lambda: kern[(T, S)](*kargs, **kw), n)
    compiled = kern[(T, S)](*kargs, **kw)
    runner = compiled[(T, S, 1)]
    full = kargs + tuple(kw[k] for k in ("TILE_W", "CHUNK", "ALIGN", "NUM_CHUNKS", "SPP", "WITH_ENT", "SCALE")) \
        + (False, 1, False)  # FUSED, N_SLOTS, HAS_MASK defaults
    try:
        res["triton_compiled_runner_partials"] = per_call_us(lambda: runner(*full), n)
    except Exception as e:  # the low-level launcher's calling convention differs across Triton versions
        res["triton_compiled_runner_partials_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    res["torch_empty"] = per_call_us(lambda: torch.empty(2 * S * T + T, device="cuda"), n)
    res["torch_autograd_identity_function"] = per_call_us(lambda: _Identity.apply(x), n)
    out = {"benchmark": "logprob_host", "unit": "microseconds of host time per call", "T": T, "V": V,
           "calls": n, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "triton": triton.__version__, "python": platform.python_version(), "cpu": platform.processor(),
           "results": res}
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


class _Identity(torch.autograd.Function):
    """Cost floor of any autograd Function call (a view of the input, nothing else)."""

    @staticmethod
    def forward(ctx, t):
        return t.view_as(t)

    @staticmethod
    def backward(ctx, g):
        return g


if __name__ == "__main__":
    os.environ.pop("TRITON_INTERPRET", None)
    main()
