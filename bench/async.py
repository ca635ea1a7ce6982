"""Async RL: samples/s for async.max_staleness K = 0, 1, 2 in fixed_lag and streaming mode, real services.

Prints one JSON object (and writes it to --out).

A LocalStack (trainer, rollout replica(s) and coordinator as separate processes on loopback, embedded
Redis) runs the CPU demo's shape: the tiny_arith recipe's model dimensions (random init: throughput does not
depend on what the policy knows), task and rollout batch (32 prompts x 8 samples, 5 new tokens). For each mode
and K one run of --steps steps is submitted through the REST API (K > 0 with mismatch_correction 'truncate',
which async runs require; K = 0 is the synchronous loop in either mode); from the recorded step timings of steps 2 .. steps-1 (step 1 has nothing to overlap
with, the last one evaluates) it reports samples/s (samples per step over the mean step wall time) and the
mean fraction of step time the rollout was busy, the trainer was busy, and both were (overlap). The load
average before and after each run is reported: the host may be shared, and then the ratios are what mean
something, not the absolute numbers.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

from recipes.tiny_arith import MODEL, TASK_OPTIONS
from services.common.tiny_model import build_model_dir
from services.local_stack import LocalStack

PROMPTS, SAMPLES, NEW_TOKENS = 32, 8, 5


def run_spec(model: Path, mode: str, k: int, steps: int, seed: int) -> dict:
    spec = {
        "name": f"bench-async-{mode}-k{k}", "model_path": str(model), "seed": seed, "steps": steps,
        "task": {"name": "arithmetic", "options": dict(TASK_OPTIONS, heldout_size=8)},
        "rollout": {"prompts_per_step": PROMPTS, "samples_per_prompt": SAMPLES,
                    "sampling": {"temperature": 1.0, "max_new_tokens": NEW_TOKENS}},
        "trainer": {"lr": 3e-4, "temperature": 1.0},
        "eval": {"every": 0, "heldout_size": 8},
        "async": {"max_staleness": k, "mode": mode},
    }
    if k > 0:
        spec["trainer"]["mismatch_correction"] = {"mode": "truncate"}
    return spec


def measure(client, model: Path, mode: str, k: int, steps: int, seed: int) -> dict:
    load_before = os.getloadavg()
    began = time.monotonic()
    run = client.submit(run_spec(model, mode, k, steps, seed))
    done = client.wait(run["id"], timeout_s=3600)
    if done["status"] != "completed":
        raise SystemExit(f"{mode} K={k}: run ended {done['status']}: {done.get('error')}")
    wall = time.monotonic() - began
    timed = [s["timings"] for s in client.metrics(run["id"])["steps"]][1:-1]
    total = statistics.mean(t["total"] for t in timed)

    def fraction(key: str) -> float:
        return statistics.mean(t.get(key, 0.0) / t["total"] for t in timed)

    steps_metrics = [s["metrics"] for s in client.metrics(run["id"])["steps"]]
    return {
        "mode": mode, "max_staleness": k, "steps_timed": len(timed), "step_seconds_mean": round(total, 4),
        "samples_per_s": round(PROMPTS * SAMPLES / total, 2),
        "rollout_busy_fraction": round(fraction("rollout"), 3), "train_busy_fraction": round(fraction("train"), 3),
        "overlap_fraction": round(fraction("overlap"), 3), "weight_sync_fraction": round(fraction("weight_sync"), 3),
        "run_wall_s": round(wall, 2), "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
        "token_staleness_max": max((m.get("token_staleness_max", 0.0) for m in steps_metrics), default=0.0),
        "trajectories_dropped_stale": sum(m.get("trajectories_dropped_stale", 0) for m in steps_metrics),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each service")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--note", default="", help="free text kept in the output (e.g. how loaded the host was)")
    parser.add_argument("--modes", default="fixed_lag,streaming", help="comma-separated async.mode values")
    parser.add_argument("--warmup-steps", type=int, default=4,
                        help="a synchronous run of this many steps first, not reported: the stack's first run "
                        "pays one-off costs (imports, allocations) that would depress whichever run came first")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-async-") as tmp:
        root = Path(tmp)
        model = build_model_dir(root / "model", MODEL, seed=args.seed)
        with LocalStack(root / "stack", path_roots=[root], num_threads=args.threads) as stack:
            client = stack.client()
            try:
                if args.warmup_steps:
                    measure(client, model, "fixed_lag", 0, max(3, args.warmup_steps), args.seed)
                results = [measure(client, model, mode, k, args.steps, args.seed)
                           for mode in args.modes.split(",") for k in (0, 1, 2)]
            finally:
                client.close()
    base = {r["mode"]: r["samples_per_s"] for r in results if r["max_staleness"] == 0}
    out = {
        "bench": "async", "note": args.note, "warmup_steps": args.warmup_steps, "device": "cpu", "host": platform.node(), "cpus": os.cpu_count(),
        "threads_per_service": args.threads, "shape": "tiny_arith (random init)",
        "batch": {"prompts": PROMPTS, "samples_per_prompt": SAMPLES, "max_new_tokens": NEW_TOKENS},
        "results": results,
        "speedup_vs_k0": {f"{r['mode']} {r['max_staleness']}": round(r["samples_per_s"] / base[r["mode"]], 3)
                          for r in results},
    }
    text = json.dumps(out, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
