"""Trainer throughput, MFU and memory: the real `Trainer` on Qwen3-shaped models (random init).

Prints one JSON object (and writes it to --out). Needs CUDA/ROCm GPUs: one, or
`--world-size N` of one host (an FSDP group over NCCL, rank 0 in this process).

Per run (`--runs SHAPE@MICROBATCH[+ac][+compile]`, Qwen3 0.6B/4B/8B dimensions, vocab
151936): a model directory is written (bf16 safetensors, random init),
`Trainer.configure` loads it as float32 masters sharded by FSDP2 with bf16
compute, and `train_step` runs `--steps` steps of `--samples` trajectories
whose lengths follow bench/packing.py's RL mix (prompts 100-500 tokens,
responses log-normal around 450 with a tail to 8192), capped at the
microbatch budget. Measured:
- step 1 at lr 1e-6 (+lora: 2e-5, adapters only): the fraction of float32 master elements with a nonzero
  gradient (AdamW's exp_avg after step 1) whose value changed (over rank 0's
  shards in a group);
- steady state (steps after the first two): tokens/s, model FLOP/s and MFU.
  Model FLOPs are counted as work the step must do: 6 x (non-embedding
  parameters) per token, 6 x V x H per scored (response) token for the
  lm_head (prompt rows are never projected to the vocabulary), and causal
  attention 6 x L^2 x (heads x head_dim) per layer per sequence of length L;
  MFU is that rate over N x a bf16 8192^3 GEMM's rate measured in the same process;
- peak GPU memory (torch.cuda.max_memory_allocated, rank 0's GPU) over the
  run, and what rank 0's float32 state (masters + gradients + AdamW) takes.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.packing import sample_prompt_response_lengths, timed  # noqa: E402

SHAPES = {
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "qwen3-4b": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "qwen3-8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, tie_word_embeddings=False),
}
VOCAB = 151936


def gemm_tflops(n: int = 8192, reps: int = 20) -> float:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    return 2 * n ** 3 / (timed(lambda: a @ b, reps, warmup=3) / 1e3) / 1e12


def write_model(shape: str, directory: Path, seed: int) -> dict:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=VOCAB, max_position_embeddings=40960, rope_theta=1e6, **SHAPES[shape])
    torch.manual_seed(seed)
    with torch.device("cuda"):
        model = Qwen3ForCausalLM(cfg)
    model.to(torch.bfloat16).save_pretrained(str(directory))
    counts = {
        "params": sum(p.numel() for p in model.parameters()),
        "embedding_params": model.get_input_embeddings().weight.numel(),
    }
    counts["lm_head_params"] = model.get_output_embeddings().weight.numel()
    counts["non_embedding_params"] = counts["params"] - counts["embedding_params"] - (
        0 if cfg.tie_word_embeddings else counts["lm_head_params"])
    del model
    torch.cuda.empty_cache()
    return counts


def make_request(step: int, lengths: list[tuple[int, int]], seed: int):
    from services.trainer.data.batching import TrainSample
    from services.trainer.data.wire import StepRequest

    g = torch.Generator().manual_seed(seed * 1000 + step)
    samples = []
    for i, (p, r) in enumerate(lengths):
        ids = torch.randint(0, VOCAB, (p + r,), generator=g)
        # A random-init model is near uniform: rollout log-probs of -ln V keep the PPO ratio near 1.
        samples.append(TrainSample(f"s{i}", f"g{i // 8}", ids[:p], ids[p:],
                                   torch.full((r,), -math.log(VOCAB)), 1.0, 1.0 if i % 2 else -1.0))
    return StepRequest("bench", step, step - 1, samples)


def model_flops(lengths: list[tuple[int, int]], counts: dict, cfg: dict, *, frozen_base: bool = False) -> float:
    """6 flops per weight per token (forward, activation and weight gradients); 4 for a frozen (LoRA)
    base, whose weight gradients are never computed (the adapters' own work is not counted)."""
    tokens = sum(p + r - 1 for p, r in lengths)
    scored = sum(r for _, r in lengths)
    d_attn = cfg["num_attention_heads"] * cfg["head_dim"]
    # Causal: QK^T and PV over half the L x L square, 2 flops per MAC -> 2 L^2 d forward, x3 with backward.
    attention = sum(6 * (p + r - 1) ** 2 * d_attn for p, r in lengths) * cfg["num_hidden_layers"]
    per_weight = 4 if frozen_base else 6
    return (per_weight * counts["non_embedding_params"] * tokens + per_weight * VOCAB * cfg["hidden_size"] * scored
            + attention)


def master_shards(trainer) -> dict[str, torch.Tensor]:
    """This process's shard of every float32 master (the whole tensor at world size 1), on the CPU."""
    names = {id(p): n for n, p in trainer.run.policy.lm.named_parameters()}
    return {names[id(p)]: p.detach().to_local().cpu() for p in trainer.run.optimizer.param_groups[0]["params"]}


def moved_fraction(trainer, before: dict[str, torch.Tensor]) -> dict:
    """Over rank 0's shards (every element at world size 1)."""
    run = trainer.run
    names = {id(p): n for n, p in run.policy.lm.named_parameters()}
    with_grad = moved = 0
    for group in run.optimizer.param_groups:
        for p in group["params"]:
            has_grad = run.optimizer.state[p]["exp_avg"].to_local() != 0
            changed = p.detach().to_local() != before[names[id(p)]].to(p.device)
            with_grad += int(has_grad.sum())
            moved += int((changed & has_grad).sum())
    return {"elements_with_gradient": with_grad, "moved": moved, "moved_fraction": moved / max(with_grad, 1)}


def profile_step(trainer, request, top: int = 30) -> dict:
    """One more step under torch.profiler: GPU time by kernel (top `top`; kernels only, so nothing is counted
    twice), the step's GPU-busy share, and GPU time by operator and input shapes (which tensor a copy or an
    elementwise kernel worked on: the head's logits, an expert's rows, a master weight...)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        trainer.train_step(request)
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    kernels = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    rows = sorted(((e.key, e.self_device_time_total / 1e3, e.count) for e in kernels), key=lambda r: -r[1])
    busy = sum(r[1] for r in rows) / 1e3
    # An operator's device time is that of the kernels it launched itself (self): no parent counts its children.
    ops = [e for e in prof.key_averages(group_by_input_shape=True)
           if e.device_type.name == "CPU" and e.self_device_time_total > 0]
    by_shape = sorted(((e.key, str(e.input_shapes)[:120], e.self_device_time_total / 1e3, e.count) for e in ops),
                      key=lambda r: -r[2])
    return {"wall_seconds": round(wall, 3), "gpu_kernel_seconds": round(busy, 3),
            "top_kernels_ms": [[k[:90], round(ms, 2), n] for k, ms, n in rows[:top]],
            "top_ops_by_input_shape_ms": [[k, shapes, round(ms, 2), n] for k, shapes, ms, n in by_shape[:top]]}


def bench_shape(shape: str, budget: int, flags: frozenset[str], args, gemm: float) -> dict:
    from services.trainer.trainer import Trainer
    from services.trainer.distributed.worker_group import GroupSpec, GroupTrainer

    cfg = SHAPES[shape]
    # Capped so that every trajectory fits one microbatch (a longer one would be refused).
    lengths = [(p, min(r, budget - p + 1)) for p, r in sample_prompt_response_lengths(args.samples, args.seed)]
    with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
        counts = write_model(shape, Path(tmp), args.seed)
        torch.cuda.reset_peak_memory_stats()
        if args.world_size == 1:
            trainer = Trainer(device="cuda", num_threads=8)
        else:
            trainer = GroupTrainer(GroupSpec(world_size=args.world_size, device="cuda", num_threads=8,
                                             timeout_s=1800))
        run_config = {
            "lr": 1e-6, "dtype": "bfloat16", "microbatch_tokens": budget, "grad_clip": 1.0,
            "activation_checkpointing": "ac" in flags, "compile_layers": "compile" in flags,
            **({"lora": LORA, "lr": LORA_LR} if "lora" in flags else {}),
            **({"objective": "sft"} if "sft" in flags else {}),
            "parity_gate": {"iw_mean_tolerance": 1e9, "iw_max": 1e30, "logprob_abs_diff_mean": 1e9},
        }
        t0 = time.monotonic()
        trainer.configure(run_id="bench", model_path=tmp, seed=args.seed, config_json=json.dumps(run_config))
        configure_s = time.monotonic() - t0
    state_bytes = sum(p.numel() for p in trainer.run.optimizer.param_groups[0]["params"]) * 16
    before = master_shards(trainer)
    torch.cuda.reset_peak_memory_stats()  # the peak of training, not of this snapshot
    step_times, metrics = [], []
    for step in range(1, args.steps + 1):
        request = make_request(step, lengths, args.seed)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = trainer.train_step(request)
        torch.cuda.synchronize()
        step_times.append(time.perf_counter() - t0)
        metrics.append(out.metrics)
        if step == 1:
            moved = moved_fraction(trainer, before)
            del before
    profile = profile_step(trainer, make_request(args.steps + 1, lengths, args.seed)) if args.profile else None
    steady = step_times[2:] if len(step_times) > 2 else step_times[-1:]
    seconds = statistics.median(steady)
    tokens = sum(p + r for p, r in lengths)
    flops = model_flops(lengths, counts, cfg, frozen_base="lora" in flags)
    result = {
        "shape": shape, **cfg, "vocab_size": VOCAB, **counts,
        "samples": len(lengths), "tokens_per_step": tokens, "response_tokens_per_step": sum(r for _, r in lengths),
        "longest_sample": max(p + r for p, r in lengths), "microbatch_tokens": budget,
        "activation_checkpointing": "ac" in flags, "compile_layers": "compile" in flags,
        "lora": LORA if "lora" in flags else None, "trainable_params": state_bytes // 16,
        "objective": "sft" if "sft" in flags else "policy_gradient",
        "configure_seconds": round(configure_s, 1),
        "step_seconds": [round(t, 4) for t in step_times], "steady_step_seconds": round(seconds, 4),
        "tokens_per_second": round(tokens / seconds, 1),
        "model_tflops_per_step": round(flops / 1e12, 2), "model_tflop_per_second": round(flops / seconds / 1e12, 1),
        "world_size": args.world_size,
        "mfu": round(flops / seconds / 1e12 / gemm / args.world_size, 4),
        "peak_memory_gb": round(torch.cuda.max_memory_allocated() / 1e9, 2),  # rank 0's GPU
        "fp32_state_gb": round(state_bytes / 1e9, 2),  # rank 0's shards
        ("lr_2e-5_step" if "lora" in flags else "lr_1e-6_step"): moved,
        "step1_loss": metrics[0]["loss"], "last_loss": metrics[-1]["loss"],
    }
    if profile is not None:
        result["profile"] = profile
    if args.world_size > 1:
        trainer.close()
    del trainer
    torch.cuda.empty_cache()
    return result


RUN_FLAGS = {"ac": "activation checkpointing", "compile": "torch.compile each decoder layer",
             "lora": "LoRA rank 64, alpha 32 on every linear layer, lr 2e-5 (recipes/qwen3_4b_lora_grpo)",
             "sft": "objective sft: the supervised NLL of the response tokens in place of the policy loss "
                    "(an SFT step; its model FLOPs are the RL step's)"}
LORA = {"rank": 64, "alpha": 32.0, "dropout": 0.0, "target_modules": "all-linear"}
LORA_LR = 2e-5


def parse_runs(text: str) -> list[tuple[str, int, frozenset[str]]]:
    """'qwen3-4b@16384+ac+compile,qwen3-0.6b@32768' -> [(shape, microbatch_tokens, flags)]."""
    runs = []
    for item in text.split(","):
        head, _, budget = item.strip().partition("@")
        budget, *flags = budget.split("+")
        if head not in SHAPES or not budget.isdigit() or not set(flags) <= set(RUN_FLAGS):
            raise SystemExit(f"--runs: {item!r} is not SHAPE@TOKENS[+FLAG...] with SHAPE one of {sorted(SHAPES)} "
                             f"and FLAG one of {sorted(RUN_FLAGS)}")
        runs.append((head, int(budget), frozenset(flags)))
    return runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", default="qwen3-0.6b@32768+ac,qwen3-4b@16384+ac",
                    help="comma-separated SHAPE@MICROBATCH_TOKENS[+FLAG...]; flags: "
                    + ", ".join(f"+{k} ({v})" for k, v in RUN_FLAGS.items()))
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--profile", action="store_true", help="profile one extra step: GPU time by kernel")
    ap.add_argument("--world-size", type=int, default=1,
                    help="FSDP ranks on this host, one GPU each (rank 0 in this process; NCCL)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tmp", default=None, help="where model directories are written")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    runs = parse_runs(args.runs)
    import transformers
    import triton

    gemm = gemm_tflops()
    out = {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
        "transformers": transformers.__version__, "python": platform.python_version(),
        "gemm_bf16_8192_tflops": round(gemm, 1), "runs": [],
    }
    for shape, budget, flags in runs:
        try:
            out["runs"].append(bench_shape(shape, budget, flags, args, gemm))
        except torch.OutOfMemoryError as exc:
            out["runs"].append({"shape": shape, "microbatch_tokens": budget, "flags": sorted(flags),
                                "error": f"out of memory: {str(exc).splitlines()[0]}"})
        gc.collect()  # a failed run's trainer lives in its traceback until collected
        torch.cuda.empty_cache()
        print(json.dumps(out["runs"][-1]), flush=True)
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
