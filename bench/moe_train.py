"""MoE training throughput at the Qwen3-30B-A3B layer shape: train-step MFU on active parameters with
float32 masters and the AdamW step included, and the grouped expert GEMM against the HBM and bf16
tensor-core limits measured in the same run. Prints one JSON object (and writes it to --out).

Added on branch h/moe (issue 40) in commit b270198 ("bench: moe_train.py at the Qwen3-30B-A3B layer
shape, and MoE GPU tests"); `git log --oneline -- bench/moe_train.py` lists later changes.

GPU (the measurement, one H200: 6 layers of fp32 masters + grads + AdamW are ~70 GB):

    python bench/moe_train.py --out bench/results/moe_train_h200.json
    python bench/moe_train.py --numerics true_on_policy --out bench/results/moe_train_h200_true_on_policy.json
    python bench/moe_train.py --compile-layers --samples 64 --microbatch-tokens 16384 --profile

CPU smoke (tiny shape, seconds; what tests/bench/test_moe_train_smoke.py runs):

    python bench/moe_train.py --small

What runs:
- limits, measured first: a bf16 8192^3 GEMM (the tensor-core rate every MFU here divides by) and a 1 GiB
  device-to-device copy (HBM bandwidth: bytes read + written over time);
- the grouped GEMM of one MoE layer at the shape (tokens x top-k rows routed uniformly at random over the
  experts, seeded): gate_up [rows, 2048] x [128, 1536, 2048] and down [rows, 768] x [128, 2048, 768], each
  with `grouped_mm` (torch._grouped_mm, fast mode) and `triton` (the batch-invariant kernel,
  true_on_policy); per impl: median ms, TFLOP/s, fraction of the dense GEMM rate, the HBM floor
  (weights + inputs + outputs at the copy bandwidth) and the roofline fraction max(compute floor,
  HBM floor) / time; for `triton` also whether one expert's rows alone got the bits they get in the call;
- the real `Trainer` (services/trainer): a Qwen3-MoE model directory at the shape and --layers (random
  init, bf16 safetensors), loaded as float32 masters sharded by FSDP2 with bf16 compute, `train_step`
  on --samples trajectories of bench/packing.py's RL length mix capped at the microbatch budget. Step 1's
  rollout log-probs are the trainer's own scores (ScoredTokens), so the step-1 gate passes in both
  numerics modes; steady state is the median of the steps after the first two.
  Model FLOPs: 6 x (active non-embedding parameters: attention, norms, routers and top-k of the experts'
  weights) per token + 6 x V x H per scored (response) token for the lm_head (prompt rows are never
  projected) + causal attention 6 L^2 (heads x head_dim) per layer per sequence. `mfu` is that over the
  measured GEMM rate; `mfu_head_on_every_token` counts the head on every token, as "active parameters =
  non-embedding weights plus the output head" does (work the trainer does not do, so an upper reading).
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

from bench.packing import sample_prompt_response_lengths  # noqa: E402

QWEN3_30B_A3B_LAYER = dict(hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                           num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                           intermediate_size=6144, norm_topk_prob=True, vocab_size=151936)
SMALL_LAYER = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
                   num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=64, norm_topk_prob=True,
                   vocab_size=512)


# ---- timing and limits ------------------------------------------------------------------------------
def timed_ms(fn, reps: int, device: str, warmup: int = 2) -> float:
    """Median milliseconds of fn(): CUDA events around each call on GPUs, wall clock on the CPU."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if device == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def dense_gemm_tflops(device: str, dtype: torch.dtype, n: int) -> float:
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    return 2 * n ** 3 / (timed_ms(lambda: a @ b, 10, device) / 1e3) / 1e12


def copy_gbps(device: str, nbytes: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    return 2 * nbytes / (timed_ms(lambda: dst.copy_(src), 10, device) / 1e3) / 1e9


# ---- the grouped GEMM -------------------------------------------------------------------------------
def random_routing(tokens: int, n_experts: int, k: int, seed: int) -> torch.Tensor:
    """[tokens, k] distinct experts per token, uniform at random (seeded)."""
    g = torch.Generator().manual_seed(seed)
    return torch.rand(tokens, n_experts, generator=g).argsort(-1)[:, :k]


def grouped_gemm_probe(shape: dict, tokens: int, device: str, dtype: torch.dtype, impls: list[str],
                       gemm_tflops: float, hbm_gbps: float, seed: int) -> dict:
    from kernels.moe import grouped_linear, sort_by_expert

    h, e, k, inter = shape["hidden_size"], shape["num_experts"], shape["num_experts_per_tok"], \
        shape["moe_intermediate_size"]
    experts = random_routing(tokens, e, k, seed).to(device)
    order, counts = sort_by_expert(experts, e)
    rows = tokens * k
    g = torch.Generator(device=device).manual_seed(seed)
    projections = {
        "gate_up": (torch.randn(rows, h, generator=g, device=device).to(dtype),
                    (torch.randn(e, 2 * inter, h, generator=g, device=device) * h ** -0.5).to(dtype)),
        "down": (torch.randn(rows, inter, generator=g, device=device).to(dtype),
                 (torch.randn(e, h, inter, generator=g, device=device) * inter ** -0.5).to(dtype)),
    }
    out = {"tokens": tokens, "rows": rows, "experts": e, "top_k": k,
           "rows_per_expert_min_max": [int(counts.min()), int(counts.max())], "projections": {}}
    elt = torch.finfo(dtype).bits // 8
    for name, (x, w) in projections.items():
        m, kk = x.shape
        n = w.shape[1]
        flops = 2 * m * n * kk
        nbytes = (m * kk + e * n * kk + m * n) * elt
        compute_floor = flops / (gemm_tflops * 1e12) * 1e3
        hbm_floor = nbytes / (hbm_gbps * 1e9) * 1e3
        entry = {"m": m, "n": n, "k": kk, "gflop": round(flops / 1e9, 2), "mbytes": round(nbytes / 1e6, 1),
                 "compute_floor_ms": round(compute_floor, 4), "hbm_floor_ms": round(hbm_floor, 4)}
        for impl in impls:
            ms = timed_ms(lambda: grouped_linear(x, w, counts, impl=impl), 5 if device == "cpu" else 20, device)
            res = {"ms": round(ms, 4), "tflops": round(flops / ms / 1e9, 4),
                   "fraction_of_dense_gemm_rate": round(flops / ms / 1e9 / gemm_tflops, 4),
                   "fraction_of_hbm_floor": round(hbm_floor / ms, 4),
                   "roofline_fraction": round(max(compute_floor, hbm_floor) / ms, 4)}
            if impl in ("triton", "reference"):
                # One expert's rows alone must get the bits they get among all rows (batch invariance).
                full = grouped_linear(x, w, counts, impl=impl)
                first = int(counts.argmax())
                start = int(counts[:first].sum())
                alone_counts = torch.zeros_like(counts)
                alone_counts[first] = counts[first]
                alone = grouped_linear(x[start:start + int(counts[first])], w, alone_counts, impl=impl)
                res["expert_rows_alone_bitwise"] = bool(torch.equal(alone, full[start:start + int(counts[first])]))
            entry[impl] = res
        out["projections"][name] = entry
    return out


def experts_block_probe(shape: dict, tokens: int, device: str, dtype: torch.dtype, gemm_tflops: float,
                        seed: int) -> dict:
    """One layer's experts, forward and backward on the same routed tokens, four ways: Hugging Face's
    `Qwen3MoeExperts` forward (its grouped_mm implementation, the stock `fast` path), kernels/moe's
    fast_experts_forward (the `fast` mode binding) with either combination, and experts_forward with
    torch's grouped matmul (true_on_policy's structure). Reports milliseconds, the GEMMs' share of the dense GEMM rate, and each
    output's and input gradient's largest difference from Hugging Face's."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    from kernels.moe.experts import experts_forward
    from kernels.moe.fast_experts import fast_experts_forward

    h, e, k, inter = shape["hidden_size"], shape["num_experts"], shape["num_experts_per_tok"], \
        shape["moe_intermediate_size"]
    config = Qwen3MoeConfig(hidden_size=h, num_experts=e, num_experts_per_tok=k, moe_intermediate_size=inter)
    config._experts_implementation = "grouped_mm"
    module = Qwen3MoeExperts(config).to(device=device, dtype=dtype)
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        module.gate_up_proj.copy_(torch.randn(module.gate_up_proj.shape, generator=g, device=device) * h ** -0.5)
        module.down_proj.copy_(torch.randn(module.down_proj.shape, generator=g, device=device) * inter ** -0.5)
    experts = random_routing(tokens, e, k, seed).to(device)
    weights = torch.softmax(torch.randn(tokens, k, generator=g, device=device), -1).to(dtype)
    hidden = torch.randn(tokens, h, generator=g, device=device).to(dtype).requires_grad_()
    upstream = torch.randn(tokens, h, generator=g, device=device).to(dtype)
    act = module.act_fn
    ways = {
        "huggingface": lambda x: module(x, experts, weights),
        "lockstep_fast": lambda x: fast_experts_forward(x, experts, weights, module.gate_up_proj, module.down_proj, act),
        "lockstep_exact_structure_grouped_mm": lambda x: experts_forward(
            x, experts, weights, module.gate_up_proj, module.down_proj, act, impl="grouped_mm"),
        # fast_experts_forward with the weighting and rank sum as elementwise ops instead of its bmm.
        "lockstep_fast_elementwise_combine": lambda x: fast_experts_forward(
            x, experts, weights, module.gate_up_proj, module.down_proj, act, combine="elementwise"),
    }

    def step(fn):
        hidden.grad = None
        module.zero_grad(set_to_none=True)
        out = fn(hidden)
        out.backward(upstream)
        return out

    flops = 3 * 2 * tokens * k * (2 * inter * h + h * inter)  # forward and the two backward GEMMs
    result = {"tokens": tokens, "gemm_gflop_forward_backward": round(flops / 1e9, 1), "ways": {}}
    want = step(ways["huggingface"]).detach()
    want_grad = hidden.grad.detach().clone()
    for name, fn in ways.items():
        ms = timed_ms(lambda: step(fn), 5 if device == "cpu" else 20, device)
        got = step(fn).detach()
        result["ways"][name] = {
            "ms": round(ms, 4), "fraction_of_dense_gemm_rate": round(flops / ms / 1e9 / gemm_tflops, 4),
            "output_max_abs_diff_from_huggingface": float((got.float() - want.float()).abs().max()),
            "input_grad_max_abs_diff_from_huggingface": float((hidden.grad.float() - want_grad.float()).abs().max())}
    return result


# ---- the training step ------------------------------------------------------------------------------
def write_model(shape: dict, layers: int, directory: Path, device: str, save_dtype: torch.dtype, seed: int) -> dict:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(num_hidden_layers=layers, max_position_embeddings=40960,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6}, tie_word_embeddings=False,
                         decoder_sparse_step=1, mlp_only_layers=[], architectures=["Qwen3MoeForCausalLM"], **shape)
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen3MoeForCausalLM(cfg)
    model.to(save_dtype).save_pretrained(str(directory))
    v, h = shape["vocab_size"], shape["hidden_size"]
    experts = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)
    total = sum(p.numel() for p in model.parameters())
    non_embedding = total - 2 * v * h
    active = non_embedding - experts + experts * shape["num_experts_per_tok"] // shape["num_experts"]
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return {"params": total, "expert_params": experts, "non_embedding_params": non_embedding,
            "active_non_embedding_params": active, "lm_head_params": v * h}


def make_request(step: int, lengths: list[tuple[int, int]], vocab: int, seed: int, logps=None):
    from services.trainer.data.batching import TrainSample
    from services.trainer.data.wire import StepRequest

    g = torch.Generator().manual_seed(seed * 1000 + step)
    samples = []
    for i, (p, r) in enumerate(lengths):
        ids = torch.randint(0, vocab, (p + r,), generator=g)
        lp = logps[i] if logps is not None else torch.full((r,), -math.log(vocab))
        samples.append(TrainSample(f"s{i}", f"g{i // 8}", ids[:p], ids[p:], lp, 1.0, 1.0 if i % 2 else -1.0))
    return StepRequest("bench", step, step - 1, samples)


def trainers_own_logps(trainer, request, lengths) -> list[torch.Tensor]:
    """The trainer's scores of the request's response tokens, per sample in request order: what a rollout in
    the same numerics reports (bitwise in true_on_policy), so the step-1 gate passes."""
    from services.trainer.data.batching import canonical_order

    scored = trainer.score_tokens(request)
    ordered = canonical_order(request.samples)
    by_id = {s.sample_id: torch.empty(len(s.response_ids)) for s in request.samples}
    for lp, si, pos in zip(scored.logp.tolist(), scored.sample_index.tolist(), scored.positions.tolist()):
        sample = ordered[si]
        by_id[sample.sample_id][pos - len(sample.prompt_ids)] = lp
    return [by_id[s.sample_id] for s in request.samples]


def model_flops(lengths, counts: dict, shape: dict, layers: int, *, head_on_every_token: bool) -> float:
    tokens = sum(p + r - 1 for p, r in lengths)
    scored = tokens if head_on_every_token else sum(r for _, r in lengths)
    d_attn = shape["num_attention_heads"] * shape["head_dim"]
    attention = sum(6 * (p + r - 1) ** 2 * d_attn for p, r in lengths) * layers
    return 6 * counts["active_non_embedding_params"] * tokens + 6 * counts["lm_head_params"] * scored + attention


def train_run(shape: dict, layers: int, numerics: str, args, device: str, gemm_tflops: float) -> dict:
    from services.trainer.trainer import Trainer

    budget = args.microbatch_tokens
    lengths = [(min(p, budget // 2), min(r, budget - min(p, budget // 2) + 1))
               for p, r in sample_prompt_response_lengths(args.samples, args.seed)]
    compute = "bfloat16" if device == "cuda" else "float32"
    with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
        counts = write_model(shape, layers, Path(tmp), device,
                             torch.bfloat16 if device == "cuda" else torch.float32, args.seed)
        trainer = Trainer(device=device, num_threads=8 if device == "cuda" else 1)
        run_config = {"lr": 1e-6, "dtype": compute, "microbatch_tokens": budget, "grad_clip": 1.0,
                      "numerics": numerics, "activation_checkpointing": args.activation_checkpointing,
                      "compile_layers": args.compile_layers,
                      "parity_gate": {"iw_mean_tolerance": 1e9, "iw_max": 1e30, "logprob_abs_diff_mean": 1e9}}
        t0 = time.monotonic()
        trainer.configure(run_id="bench", model_path=tmp, seed=args.seed, config_json=json.dumps(run_config))
        configure_s = time.monotonic() - t0
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    step_times, metrics = [], []
    for step in range(1, args.steps + 1):
        request = make_request(step, lengths, shape["vocab_size"], args.seed)
        if step == 1:
            request = make_request(step, lengths, shape["vocab_size"], args.seed,
                                   trainers_own_logps(trainer, request, lengths))
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        outcome = trainer.train_step(request)
        if device == "cuda":
            torch.cuda.synchronize()
        step_times.append(time.perf_counter() - t0)
        metrics.append(outcome.metrics)
    profile = None
    if args.profile and device == "cuda":
        from bench.train import profile_step

        profile = profile_step(trainer, make_request(args.steps + 1, lengths, shape["vocab_size"], args.seed))
    steady = step_times[2:] if len(step_times) > 2 else step_times[-1:]
    seconds = statistics.median(steady)
    tokens = sum(p + r for p, r in lengths)
    flops = model_flops(lengths, counts, shape, layers, head_on_every_token=False)
    flops_all = model_flops(lengths, counts, shape, layers, head_on_every_token=True)
    state_bytes = sum(p.numel() for p in trainer.run.optimizer.param_groups[0]["params"]) * 16
    result = {
        "numerics": numerics, "layers": layers, **counts, "samples": len(lengths), "tokens_per_step": tokens,
        "response_tokens_per_step": sum(r for _, r in lengths), "microbatch_tokens": budget,
        "activation_checkpointing": args.activation_checkpointing, "compile_layers": args.compile_layers,
        "configure_seconds": round(configure_s, 1),
        "step_seconds": [round(t, 4) for t in step_times], "steady_step_seconds": round(seconds, 4),
        "tokens_per_second": round(tokens / seconds, 1),
        "model_tflop_per_second": round(flops / seconds / 1e12, 3),
        "mfu": float(f"{flops / seconds / 1e12 / gemm_tflops:.4g}"),
        "mfu_head_on_every_token": float(f"{flops_all / seconds / 1e12 / gemm_tflops:.4g}"),
        "fp32_state_gb": round(state_bytes / 1e9, 2),
        "step1_iw_min_max": [metrics[0].get("iw_min"), metrics[0].get("iw_max")],
        "step1_logprob_abs_diff_max": metrics[0].get("logprob_abs_diff_max"),
        "moe_metrics_last_step": {k: v for k, v in metrics[-1].items() if k.startswith("moe_")},
    }
    if profile is not None:
        result["profile"] = profile
    if device == "cuda":
        result["peak_memory_gb"] = round(torch.cuda.max_memory_allocated() / 1e9, 2)
    del trainer
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return result


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="CPU smoke: a tiny MoE shape, float32, seconds")
    ap.add_argument("--layers", type=int, default=6, help="decoder layers (>= 6 at the full shape)")
    ap.add_argument("--numerics", default="fast", help="comma-separated: fast, true_on_policy")
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--microbatch-tokens", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--probe-tokens", type=int, default=8192, help="tokens of the grouped GEMM probe")
    ap.add_argument("--activation-checkpointing", action="store_true")
    ap.add_argument("--compile-layers", action="store_true",
                    help="torch.compile each decoder layer (run config compile_layers): the router, the experts' "
                    "gather, gating and combination and the norms fused around the grouped GEMMs; attention stays "
                    "eager (its varlen kernel is excluded from the graph)")
    ap.add_argument("--profile", action="store_true", help="profile one extra step: GPU time by kernel")
    ap.add_argument("--skip-train", action="store_true", help="only the limits and the grouped GEMM probe")
    ap.add_argument("--block-probe", action="store_true",
                    help="also time one layer's experts forward+backward four ways (experts_block_probe)")
    ap.add_argument("--fewer-layers", action="store_true",
                    help="allow --layers < 6: an A/B comparison on a GPU that cannot hold 6 layers' fp32 state "
                    "(an 80 GB H100), not the issue's measurement")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tmp", default=None)
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    numerics = [m.strip() for m in args.numerics.split(",") if m.strip()]
    if not set(numerics) <= {"fast", "true_on_policy"}:
        raise SystemExit(f"--numerics: {args.numerics!r}: each must be 'fast' or 'true_on_policy'")
    if args.small:
        shape, device, dtype = SMALL_LAYER, "cpu", torch.float32
        args.layers = min(args.layers, 2)
        args.samples, args.steps = min(args.samples, 4), min(args.steps, 3)
        args.microbatch_tokens, args.probe_tokens = min(args.microbatch_tokens, 96), min(args.probe_tokens, 64)
        gemm = dense_gemm_tflops("cpu", torch.float32, 256)
        hbm = copy_gbps("cpu", 64 << 20)
        impls = ["reference", "grouped_mm"]
    else:
        if not torch.cuda.is_available():
            raise SystemExit("needs a CUDA/ROCm GPU (or --small for the CPU smoke)")
        if args.layers < 6 and not args.fewer_layers:
            raise SystemExit("--layers: the measurement is defined at >= 6 layers (--fewer-layers for an A/B run)")
        shape, device, dtype = QWEN3_30B_A3B_LAYER, "cuda", torch.bfloat16
        gemm = dense_gemm_tflops("cuda", torch.bfloat16, 8192)
        hbm = copy_gbps("cuda", 1 << 30)
        impls = ["grouped_mm", "triton"]
    import transformers

    out = {"device": torch.cuda.get_device_name() if device == "cuda" else f"cpu ({platform.processor()})",
           "torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
           "small": args.small, "shape": shape,
           # Significant digits, not decimals: a loaded CPU's rate can round to 0.000 TFLOPS.
           "dense_gemm_tflops": float(f"{gemm:.4g}"), "copy_gbps": float(f"{hbm:.4g}"),
           "grouped_gemm": grouped_gemm_probe(shape, args.probe_tokens, device, dtype, impls, gemm, hbm, args.seed),
           "train": []}
    print(json.dumps({"grouped_gemm": out["grouped_gemm"]}), flush=True)
    if args.block_probe:
        out["experts_block"] = experts_block_probe(shape, args.probe_tokens, device, dtype, gemm, args.seed)
        print(json.dumps({"experts_block": out["experts_block"]}), flush=True)
    if not args.skip_train:
        for mode in numerics:
            try:
                out["train"].append(train_run(shape, args.layers, mode, args, device, gemm))
            except torch.OutOfMemoryError as exc:
                out["train"].append({"numerics": mode, "error": f"out of memory: {str(exc).splitlines()[0]}"})
            gc.collect()
            print(json.dumps(out["train"][-1]), flush=True)
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return out


if __name__ == "__main__":
    main()
