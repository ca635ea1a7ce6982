"""Async RL: samples/s for async.max_staleness K = 0, 1, 2 in fixed_lag and streaming mode, real services.

Prints one JSON object (and writes it to --out).

A LocalStack (trainer, rollout replica(s) and coordinator as separate processes on loopback, embedded
Redis) runs one of two workloads, each on random init (throughput does not depend on what the policy knows):

- `--shape tiny_arith` (the CPU demo): the tiny_arith recipe's model dimensions, task and rollout batch
  (32 prompts x 8 samples, 5 new tokens), float32 on CPU.
- `--shape qwen3-0.6b` (or `tiny`, its CPU smoke): that shape of bench/rollout_longtail.py, bf16,
  `numerics: true_on_policy`, on `--device` (trainer and rollout replica share it), 32 prompts x 8 samples
  of the arithmetic task's prompts with the engine issue's long-tailed response lengths: next-token
  distributions near uniform, each decode step stops a row with probability about stop_tokens / vocab
  (geometric lengths of mean about vocab / --stop-tokens), capped at --cap. rollout_longtail.py has
  --stop-tokens ids end a sequence; the services stop at the tokenizer's eos alone, so here eos alone
  carries that probability: the model's hidden dimension 0 is held at a constant through the residual
  stream (every token embeds it, no attention or MLP output writes it) and eos's lm_head weight on it is
  set by bisection on hidden states of prompts and sampled tokens. The response lengths the runs drew are
  reported. The tokenizer is the character tokenizer grown to the shape's vocabulary. The MoE shapes
  (`qwen3-30b-a3b-6l`, the Qwen3-30B-A3B layer shape at 6 layers; `tiny-moe`, its CPU smoke) are Qwen3-MoE
  models with every expert's down projection kept off that dimension; step 1's exactness through the whole
  stack is reported beside the throughput (IW range, max |logp - rollout logp|, and the lowest per-layer
  routing agreement). The 6-layer shape needs an H200: fp32 masters, gradients and AdamW state are 70 GB
  beside the replica's bf16 weights.

For each mode and K one run of --steps steps is submitted through the REST API (K > 0 with
mismatch_correction 'truncate', which async runs require; K = 0 is the synchronous loop in either mode);
from the recorded step timings of steps 2 .. steps-1 (step 1 has nothing to overlap with, the last one
evaluates) it reports samples/s (samples per step over the mean step wall time) and the mean fraction of
step time the rollout was busy, the trainer was busy, and both were (overlap). The load average before and
after each run is reported: the host may be shared, and then the ratios are what mean something, not the
absolute numbers.

    python bench/async.py --steps 20 --out bench/results/async_cpu.json
    python bench/async.py --shape qwen3-0.6b --device cuda --out bench/results/async_h200.json
    python bench/async.py --shape qwen3-0.6b --device cuda --modes fixed_lag --weight-sync grpc,shared_path \
        --out 'bench/results/async_h200_{weight_sync}.json'
    python bench/async.py --shape qwen3-0.6b --device cuda --ks 0,1 --weight-sync ipc \
        --out bench/results/async_h200_ipc.json
    python bench/async.py --shape qwen3-30b-a3b-6l --device cuda --modes fixed_lag --ks 0 --steps 3 \
        --warmup-steps 0 --weight-sync ipc --out bench/results/async_moe_6l_h200.json
    python -m bench.async --shape tiny-moe --device cpu --modes fixed_lag --ks 0 --steps 3 --warmup-steps 0 \
        --cap 32 --stop-tokens 24      # the MoE smoke on CPU
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from bench.rollout_longtail import LONGTAIL_SHAPES, is_moe
from recipes.char_tokenizer import CHARACTERS, EOS_ID, CharVocab
from recipes.tiny_arith import MODEL, TASK_OPTIONS
from recipes.tiny_model import TinyQwen3Config, build_model_dir, build_tiny_qwen3, save_model_dir
from recipes.tiny_moe import TinyMoeConfig, build_tiny_moe
from services.local_stack import LocalStack

PROMPTS, SAMPLES, NEW_TOKENS = 32, 8, 5
HELD_DIM = 0
"""The hidden dimension the long-tail model holds constant (it carries eos's logit)."""


def longtail_vocab(size: int) -> CharVocab:
    """The character vocabulary grown to `size` ids: printable ASCII, then code points from U+20000 (the CJK
    extension planes and unassigned ones after them: no whitespace, no surrogates, one token each)."""
    extra = size - CharVocab().size
    if extra < 0:
        raise SystemExit(f"--shape: vocabulary {size} is smaller than the character tokenizer's {CharVocab().size}")
    return CharVocab(characters=CHARACTERS + tuple(chr(0x20000 + i) for i in range(extra)))


def build_random_model(shape: str, *, cap: int, seed: int, vocab: CharVocab):
    """Random-init `shape` (float32, CPU): a Qwen3, or a Qwen3-MoE when the shape has experts."""
    dims = {k: v for k, v in LONGTAIL_SHAPES[shape].items() if k not in ("vocab_size", "tie_word_embeddings")}
    if is_moe(shape):
        dims.pop("intermediate_size")  # every MLP of the MoE shapes is routed; TinyMoeConfig has no dense width
        return build_tiny_moe(TinyMoeConfig(**dims, max_position_embeddings=cap + 64), seed=seed, vocab=vocab)
    return build_tiny_qwen3(TinyQwen3Config(**dims, max_position_embeddings=cap + 64, rope_theta=1e6), seed=seed,
                            vocab=vocab)


def mlp_output_weights(mlp: torch.nn.Module) -> list[torch.Tensor]:
    """The weights whose rows (dim -2) write an MLP's output: the dense down projection, or every expert's."""
    return [mlp.experts.down_proj] if hasattr(mlp, "experts") else [mlp.down_proj.weight]


@torch.no_grad()
def build_longtail_model(out: Path, shape: str, *, stop_tokens: int, cap: int, seed: int, device: str) -> dict:
    """Random-init `shape` whose every decode step samples eos with probability about stop_tokens / vocab."""
    vocab = longtail_vocab(LONGTAIL_SHAPES[shape]["vocab_size"])
    model = build_random_model(shape, cap=cap, seed=seed, vocab=vocab)
    inner, head = model.model, model.lm_head.weight
    # Dimension HELD_DIM of the residual stream is 1.0 at every position: every embedding holds it and no
    # attention or MLP output adds to it, so after the final RMSNorm it is about 1 / rms(residual) > 0.
    inner.embed_tokens.weight[:, HELD_DIM] = 1.0
    for layer in inner.layers:
        layer.self_attn.o_proj.weight[HELD_DIM] = 0.0
        for weight in mlp_output_weights(layer.mlp):
            weight[..., HELD_DIM, :] = 0.0
    head[EOS_ID, HELD_DIM] = 0.0
    model.to(device)
    gen = torch.Generator().manual_seed(seed)
    size = head.shape[0]
    # The positions a rollout decodes from: arithmetic-like prompts followed by uniformly sampled tokens.
    digits = torch.randint(4 + CHARACTERS.index("0"), 4 + CHARACTERS.index("9") + 1, (16, 6), generator=gen)
    ids = torch.cat([digits, torch.randint(4, size, (16, 58), generator=gen)], dim=1).to(device)
    hidden = inner(input_ids=ids).last_hidden_state.reshape(-1, head.shape[1]).float()
    logits = hidden @ head.float().T
    base = logits[:, EOS_ID].clone()
    logits[:, EOS_ID] = -1e30
    others = torch.logsumexp(logits, dim=-1)
    entropy = float(-(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1).mean())
    held = hidden[:, HELD_DIM]
    target = stop_tokens / size

    def p_stop(weight: float) -> float:
        return float(torch.sigmoid(base + weight * held - others).mean())

    lo, hi = 0.0, 1e4
    for _ in range(60):  # p_stop grows with the weight: held > 0 at every position
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if p_stop(mid) < target else (lo, mid)
    head[EOS_ID, HELD_DIM] = (lo + hi) / 2
    reached = p_stop((lo + hi) / 2)
    params = sum(p.numel() for p in model.parameters())
    model.to("cpu")
    save_model_dir(model, out, vocab)
    del model, logits, hidden
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return {"eos_weight": round((lo + hi) / 2, 4), "stop_probability_target": round(target, 6),
            "stop_probability_reached": round(reached, 6), "held_dim_min_max": [round(float(held.min()), 3),
                                                                               round(float(held.max()), 3)],
            "next_token_entropy_nats_without_eos": round(entropy, 3), "params": params}


@contextlib.contextmanager
def mps_daemon(root: Path) -> Iterator[dict[str, str]]:
    """An MPS control daemon of the bench's own (pipe and log directories under `root`, so it touches no
    other user's daemon); yields the environment its clients need. Started before any CUDA context."""
    exe = shutil.which("nvidia-cuda-mps-control")
    if exe is None:
        raise SystemExit("--mps: nvidia-cuda-mps-control is not on PATH (it comes with the NVIDIA driver's utilities)")
    env = {"CUDA_MPS_PIPE_DIRECTORY": str(root / "mps-pipe"), "CUDA_MPS_LOG_DIRECTORY": str(root / "mps-log")}
    for directory in env.values():
        Path(directory).mkdir()
    subprocess.run([exe, "-d"], env=os.environ | env, check=True, timeout=30)
    os.environ.update(env)  # this process builds the model on the GPU: a client as well
    try:
        yield env
    finally:
        # The daemon ends its server once the clients are gone; this process still holds a context, so the
        # quit may wait for it: bounded, and the daemon dies with the machine in any case.
        with contextlib.suppress(subprocess.TimeoutExpired):
            subprocess.run([exe], input=b"quit\n", env=os.environ | env, check=False, timeout=10)


def mps_client_pids() -> list[int]:
    """The processes the bench's MPS daemon has taken as clients so far (its control log's NEW CLIENT lines):
    evidence that the services ran under MPS, not beside it."""
    log = Path(os.environ["CUDA_MPS_LOG_DIRECTORY"]) / "control.log"
    return sorted({int(pid) for pid in re.findall(r"NEW CLIENT (\d+)", log.read_text())})


def run_spec(model: Path, mode: str, k: int, steps: int, seed: int, args, weight_sync: str = "grpc") -> dict:
    longtail = args.shape != "tiny_arith"
    spec = {
        "name": f"bench-async-{mode}-k{k}", "model_path": str(model), "seed": seed, "steps": steps,
        "task": {"name": "arithmetic", "options": dict(TASK_OPTIONS, heldout_size=8)},
        "rollout": {"prompts_per_step": PROMPTS, "samples_per_prompt": SAMPLES,
                    "sampling": {"temperature": 1.0, "max_new_tokens": args.cap if longtail else NEW_TOKENS}},
        "trainer": {"lr": 3e-4, "temperature": 1.0},
        "eval": {"every": 0, "heldout_size": 8},
        "async": {"max_staleness": k, "mode": mode},
    }
    spec["rollout"]["weight_sync"] = weight_sync
    if longtail:
        # One cache capacity for every step: the prompts are <= 8 tokens, the shape's context cap + 64.
        spec["numerics"] = "true_on_policy"
        spec["rollout"]["engine_options"] = {"device": args.device, "dtype": "bfloat16",
                                             "max_batch_size": PROMPTS * SAMPLES, "max_context_tokens": args.cap + 64}
        spec["trainer"].update(lr=1e-6, dtype="bfloat16", microbatch_tokens=args.microbatch_tokens)
    if k > 0:
        spec["trainer"]["mismatch_correction"] = {"mode": "truncate"}
    return spec


def measure(client, model: Path, mode: str, k: int, steps: int, seed: int, args, weight_sync: str = "grpc") -> dict:
    load_before = os.getloadavg()
    began = time.monotonic()
    run = client.submit(run_spec(model, mode, k, steps, seed, args, weight_sync))
    done = client.wait(run["id"], timeout_s=3600)
    if done["status"] != "completed":
        raise SystemExit(f"{mode} K={k}: run ended {done['status']}: {done.get('error')}")
    wall = time.monotonic() - began
    recorded = client.metrics(run["id"])["steps"]
    timed = [s["timings"] for s in recorded][1:-1]
    total = statistics.mean(t["total"] for t in timed)

    def fraction(key: str) -> float:
        return statistics.mean(t.get(key, 0.0) / t["total"] for t in timed)

    steps_metrics = [s["metrics"] for s in recorded]
    lengths = [m["response_length_mean"] for m in steps_metrics[1:-1] if "response_length_mean" in m]
    return {
        "mode": mode, "max_staleness": k, "weight_sync": weight_sync, "steps_timed": len(timed), "step_seconds_mean": round(total, 4),
        "samples_per_s": round(PROMPTS * SAMPLES / total, 2),
        "rollout_busy_fraction": round(fraction("rollout"), 3), "train_busy_fraction": round(fraction("train"), 3),
        "overlap_fraction": round(fraction("overlap"), 3), "weight_sync_fraction": round(fraction("weight_sync"), 3),
        "step_seconds": {key: round(statistics.mean(t.get(key, 0.0) for t in timed), 3)
                         for key in ("rollout", "train", "overlap", "weight_sync")},
        # Every step's sync, step 1 included: the first sync of a run must cost no more than a later one.
        "weight_sync_seconds_every_step": [round(s["timings"].get("weight_sync", 0.0), 3) for s in recorded],
        "step1_iw_min_max": [steps_metrics[0].get("iw_min"), steps_metrics[0].get("iw_max")],
        "step1_logprob_abs_diff_max": steps_metrics[0].get("logprob_abs_diff_max"),
        # MoE shapes: per layer, the fraction of tokens whose rollout experts equal the trainer's
        "step1_moe_routing_agreement_min": steps_metrics[0].get("moe_routing_agreement_min"),
        "response_length_mean": round(statistics.mean(lengths), 1) if lengths else None,
        "response_length_mean_min_max": [round(min(lengths), 1), round(max(lengths), 1)] if lengths else None,
        "run_wall_s": round(wall, 2), "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
        "token_staleness_max": max((m.get("token_staleness_max", 0.0) for m in steps_metrics), default=0.0),
        "trajectories_dropped_stale": sum(m.get("trajectories_dropped_stale", 0) for m in steps_metrics),
        # per step, 1 when its sync ran while it trained, else 0 (services/coordinator/run/fixed_lag_step.py and
        # streaming_step.py)
        "weight_sync_beside_training": [m.get("weight_sync_beside_training") for m in steps_metrics],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="tiny_arith", choices=("tiny_arith", *sorted(LONGTAIL_SHAPES)),
                        help="tiny_arith: the CPU demo's workload; a rollout_longtail.py shape: the long-tail one")
    parser.add_argument("--device", default="cpu", help="where the trainer and the rollout replica run")
    parser.add_argument("--cap", type=int, default=512, help="long tail: max new tokens per sequence")
    parser.add_argument("--stop-tokens", type=int, default=1216,
                        help="long tail: eos probability per step is this / vocab (mean length ~ vocab / this)")
    parser.add_argument("--microbatch-tokens", type=int, default=16384, help="long tail: the trainer's microbatch")
    parser.add_argument("--weight-sync", default="grpc",
                        help="comma-separated rollout.weight_sync values (grpc, shared_path, broadcast, ipc), each measured "
                        "for every mode and K in one stack; with more than one, --out names {weight_sync}")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each service")
    parser.add_argument("--out", help="where to write the JSON; '{weight_sync}' in it is replaced by each one's")
    parser.add_argument("--note", default="", help="free text kept in the output (e.g. how loaded the host was)")
    parser.add_argument("--modes", default="fixed_lag,streaming", help="comma-separated async.mode values")
    parser.add_argument("--ks", default="0,1,2", help="comma-separated async.max_staleness values (0 is the "
                        "baseline every ratio is taken against, so it is required)")
    parser.add_argument("--mps", action="store_true",
                        help="run the CUDA processes under an MPS daemon of the bench's own (see the docstring)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="measure every mode and K this many times, in turn (K = 0, K = 1, ... then again), "
                        "and take each ratio from the medians: the host's drift between runs then falls on both "
                        "sides of it")
    parser.add_argument("--warmup-steps", type=int, default=4,
                        help="a synchronous run of this many steps first, not reported: the stack's first run "
                        "pays one-off costs (imports, allocations) that would depress whichever run came first")
    args = parser.parse_args()
    syncs = args.weight_sync.split(",")
    ks = [int(k) for k in args.ks.split(",")]
    if 0 not in ks or min(ks) < 0:
        raise SystemExit(f"--ks: {args.ks!r}: non-negative staleness bounds, 0 among them (the baseline)")
    if not set(syncs) <= {"grpc", "shared_path", "broadcast", "ipc"}:
        raise SystemExit(f"--weight-sync: {args.weight_sync!r}: each must be grpc, shared_path, broadcast or ipc")
    if len(syncs) > 1 and args.out and "{weight_sync}" not in args.out:
        raise SystemExit("--out: with several --weight-sync values it must contain {weight_sync}")
    longtail = args.shape != "tiny_arith"
    if not longtail and args.device != "cpu":
        raise SystemExit("--device: the tiny_arith workload runs on cpu; pick a long-tail --shape for a GPU")
    if args.repeats < 1:
        raise SystemExit(f"--repeats: must be >= 1, got {args.repeats}")
    if args.mps and not args.device.startswith("cuda"):
        raise SystemExit("--mps: needs --device cuda")
    extra_env = {"LOCKSTEP_TRAINER_DEVICE": args.device} if longtail else {}
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench-async-") as tmp, contextlib.ExitStack() as daemons:
        root = Path(tmp)
        if args.mps:
            extra_env.update(daemons.enter_context(mps_daemon(root)))
        model_info = None
        if longtail:
            model_info = build_longtail_model(root / "model", args.shape, stop_tokens=args.stop_tokens, cap=args.cap,
                                              seed=args.seed, device=args.device)
            model = root / "model"
            print(json.dumps({"model": model_info, "built_s": round(time.monotonic() - began, 1)}), flush=True)
        else:
            model = build_model_dir(root / "model", MODEL, seed=args.seed)
        with LocalStack(root / "stack", path_roots=[root], num_threads=args.threads, extra_env=extra_env) as stack:
            client = stack.client()
            try:
                if args.warmup_steps:
                    measure(client, model, "fixed_lag", 0, max(3, args.warmup_steps), args.seed, args)
                for weight_sync in syncs:  # each value's file is written as soon as its runs are done
                    results = []
                    for repeat in range(args.repeats):
                        for mode in args.modes.split(","):
                            for k in ks:
                                results.append({**measure(client, model, mode, k, args.steps, args.seed, args,
                                                          weight_sync), "repeat": repeat})
                                print(json.dumps(results[-1]), flush=True)
                    report(args, weight_sync, results, model_info, began)
            except BaseException:
                for p in stack.processes:  # the run directory goes with the temporary directory
                    print(f"--- {p.name} log tail\n{p.tail(60)}", flush=True)
                raise
            finally:
                client.close()


def report(args, weight_sync: str, results: list[dict], model_info: dict | None, began: float) -> None:
    """One weight_sync value's JSON: printed, and written to --out."""
    longtail = args.shape != "tiny_arith"
    by_config: dict[tuple[str, int], list[float]] = {}
    for r in results:
        by_config.setdefault((r["mode"], r["max_staleness"]), []).append(r["samples_per_s"])
    median = {key: statistics.median(values) for key, values in by_config.items()}
    out = {
        "bench": "async", "note": args.note, "warmup_steps": args.warmup_steps, "device": args.device,
        "host": platform.node(), "cpus": os.cpu_count(), "threads_per_service": args.threads, "mps": args.mps,
        "shape": f"{args.shape} (random init)", "weight_sync": weight_sync,
        "batch": {"prompts": PROMPTS, "samples_per_prompt": SAMPLES,
                  "max_new_tokens": args.cap if longtail else NEW_TOKENS},
        "results": results,
        "repeats": args.repeats,
        # of the median samples/s over the repeats (the one run's with --repeats 1), against its mode's K = 0
        "samples_per_s_median": {f"{mode} {k}": round(v, 2) for (mode, k), v in median.items()},
        "speedup_vs_k0": {f"{mode} {k}": round(v / median[mode, 0], 3) for (mode, k), v in median.items()},
        "wall_s": round(time.monotonic() - began, 1),  # since the command started
    }
    if args.mps:
        out["mps_client_pids"] = mps_client_pids()
    if longtail:
        out["longtail"] = {"stop_tokens": args.stop_tokens, "cap": args.cap, "numerics": "true_on_policy",
                           "dtype": "bfloat16", "microbatch_tokens": args.microbatch_tokens, "model": model_info}
        if args.device.startswith("cuda"):
            out["gpu"] = torch.cuda.get_device_name()
    text = json.dumps(out, indent=2)
    if args.out:
        Path(args.out.replace("{weight_sync}", weight_sync)).write_text(text + "\n")
    print(text, flush=True)


if __name__ == "__main__":
    main()
