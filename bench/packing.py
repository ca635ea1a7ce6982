"""Packed vs padded training throughput on Qwen3-8B-shaped decoder layers, and the registry's overhead.

Prints one JSON object. Needs a CUDA GPU and torch >= 2.10 (varlen_attn).

What is measured (all forward + backward, bf16, random init, real Qwen3-8B dims:
hidden 4096, MLP 12288, 32 query heads, 8 KV heads, head dim 128):
- stack: `--layers` HF Qwen3DecoderLayer modules over `--samples` RL-like samples
  (prompts 100-500 tokens, responses 200-8192 with a long tail; see sample_lengths):
    packed  = first-fit-decreasing microbatches under `--budget` tokens through the
              registry's HF attention ('lockstep_packed' -> torch_varlen)
    direct  = the same microbatches through an HF attention that calls varlen_attn itself
              (the registry's overhead is packed / direct - 1; fresh cu_seqlens tensors each
              pass, so the once-per-microbatch layout check is inside the packed time)
    padded  = every sample right-padded to the longest (the layout the issue's figure uses),
              in chunks of rows of about `--budget` tokens, through HF's SDPA (causal, no mask:
              right padding needs none)
  Ideal speedup = padded tokens / real tokens; target: packed reaches >= 80% of it.
- attention: one attention over all samples in one buffer (registry vs direct varlen_attn),
  and padded SDPA over [samples, longest], (a Qwen3-8B attention over 48 long-tail samples: 14.7 ms packed vs 150.8 ms padded).
- limits measured in the same process: a bf16 8192^3 GEMM and a device copy; the stack's
  model FLOP rate is reported against the GEMM rate.
Timing: CUDA events around whole passes, warm-up first, median of `--reps`.
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kernels.attention import REGISTRY, packed_causal_attention, packed_forward_kwargs, register_hf_attention  # noqa: E402
from services.trainer.data.packing import plan_microbatches  # noqa: E402

HIDDEN, MLP, HQ, HKV, HEAD_DIM = 4096, 12288, 32, 8, 128


def sample_prompt_response_lengths(n: int, seed: int) -> list[tuple[int, int]]:
    """RL-like (prompt, response) lengths: prompts uniform in [100, 500]; responses log-normal around 450
    tokens, one in ten instead log-uniform in [2000, 8192] (the long reasoning tail), clipped to [200, 8192]."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(100, 501, (n,), generator=g)
    body = torch.exp(torch.randn(n, generator=g, dtype=torch.float64) * 0.8 + math.log(450))
    tail = torch.exp(torch.rand(n, generator=g, dtype=torch.float64) * math.log(8192 / 2000) + math.log(2000))
    responses = torch.where(torch.rand(n, generator=g) < 0.1, tail, body).round().clamp(200, 8192).long()
    return list(zip(prompts.tolist(), responses.tolist()))


def sample_lengths(n: int, seed: int) -> list[int]:
    """Total (prompt + response) lengths of `sample_prompt_response_lengths`."""
    return [p + r for p, r in sample_prompt_response_lengths(n, seed)]


def timed(fn, reps: int, warmup: int = 2) -> float:
    """Median milliseconds of fn() over reps, CUDA events around each call."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def _no_math_sdpa():
    """SDPA restricted to fused kernels: the math fallback would materialise [B, H, S, S] scores (OOM), and
    an unsupported case should fail loudly rather than time a different algorithm."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION])


def _varlen_kwargs():
    import inspect

    from torch.nn.attention.varlen import varlen_attn

    return varlen_attn, "enable_gqa" in inspect.signature(varlen_attn).parameters


def direct_varlen_hf(module, query, key, value, attention_mask, scaling=None, cu_seq_lens_q=None,
                     max_length_q=None, **kwargs):
    """Baseline HF attention: varlen_attn called directly, no registry, no checks."""
    varlen_attn, has_gqa = _varlen_kwargs()
    _, h, s, d = query.shape
    q, k, v = (x.transpose(1, 2).reshape(s, x.shape[1], d) for x in (query, key, value))
    extra = {}
    if has_gqa:
        extra["enable_gqa"] = True
    else:
        k, v = (x.repeat_interleave(h // x.shape[1], dim=1) for x in (k, v))
    out = varlen_attn(q, k, v, cu_seq_lens_q, cu_seq_lens_q, max_length_q, max_length_q, scale=scaling,
                      window_size=(-1, 0), **extra)
    return out.view(1, s, h, d), None


def build_stack(n_layers: int, device):
    import transformers
    from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer, Qwen3RotaryEmbedding

    cfg = transformers.Qwen3Config(hidden_size=HIDDEN, intermediate_size=MLP, num_attention_heads=HQ,
                                   num_key_value_heads=HKV, head_dim=HEAD_DIM, num_hidden_layers=n_layers,
                                   max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1e6)
    torch.manual_seed(0)
    with torch.device(device):
        layers = torch.nn.ModuleList(Qwen3DecoderLayer(cfg, i) for i in range(n_layers)).to(torch.bfloat16)
        rope = Qwen3RotaryEmbedding(cfg)
    for p in layers.parameters():
        torch.nn.init.normal_(p, std=0.02) if p.dim() > 1 else torch.nn.init.ones_(p)
    return cfg, layers, rope


def run_stack(cfg, layers, rope, impl, hidden, position_ids, kwargs):
    cfg._attn_implementation = impl
    kwargs = {k: v for k, v in kwargs.items() if k not in ("position_ids", "attention_mask")}
    h = hidden
    pe = rope(h, position_ids)
    for layer in layers:
        h = layer(h, attention_mask=None, position_ids=position_ids, position_embeddings=pe, **kwargs)
    return h


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--samples", type=int, default=48)
    ap.add_argument("--budget", type=int, default=16384, help="tokens per microbatch (packed and padded)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=str, default="")
    args = ap.parse_args()
    dev = torch.device("cuda")
    import transformers

    lengths = sample_lengths(args.samples, args.seed)
    real, longest = sum(lengths), max(lengths)
    padded_tokens = args.samples * longest
    result: dict = {
        "bench": "packing", "device": torch.cuda.get_device_name(), "torch": torch.__version__,
        "cuda": torch.version.cuda, "transformers": transformers.__version__, "python": platform.python_version(),
        "shapes": {"hidden": HIDDEN, "mlp": MLP, "q_heads": HQ, "kv_heads": HKV, "head_dim": HEAD_DIM,
                   "layers": args.layers, "dtype": "bfloat16"},
        "samples": {"n": args.samples, "seed": args.seed, "real_tokens": real, "longest": longest,
                    "padded_tokens": padded_tokens, "median_len": int(statistics.median(lengths))},
        "reps": args.reps, "timing": "median of CUDA-event timed passes after 2 warm-ups",
    }

    # ---- limits in this process ---------------------------------------------------------------------
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    gemm_ms = timed(lambda: a @ b, 20)
    x = torch.randn(2 * 1024**3 // 2, device=dev, dtype=torch.bfloat16)
    y = torch.empty_like(x)
    copy_ms = timed(lambda: y.copy_(x), 20)
    result["limits"] = {"gemm_bf16_tflops": 2 * 8192**3 / gemm_ms / 1e9,
                        "copy_tb_s": 2 * x.numel() * 2 / copy_ms / 1e9}
    del a, b, x, y

    # ---- attention alone: one buffer of all samples -----------------------------------------------------
    name = register_hf_attention()
    transformers.AttentionInterface.register("bench_direct_varlen", direct_varlen_hf)
    transformers.masking_utils.AttentionMaskInterface.register("bench_direct_varlen", lambda *a, **k: None)
    g = torch.Generator(device=dev).manual_seed(1)
    q = torch.randn(real, HQ, HEAD_DIM, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_()
    k = torch.randn(real, HKV, HEAD_DIM, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_()
    v = torch.randn(real, HKV, HEAD_DIM, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_()
    cu_cpu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    go = torch.randn(real, HQ, HEAD_DIM, device=dev, dtype=torch.bfloat16, generator=g)
    varlen_attn, has_gqa = _varlen_kwargs()

    def attn_registry():
        cu = cu_cpu.to(dev, non_blocking=True)  # fresh tensor per step: the layout check runs every time
        out = packed_causal_attention(q, k, v, cu, longest)
        out.backward(go)

    def attn_direct():
        cu = cu_cpu.to(dev, non_blocking=True)
        kk, vv = (k, v) if has_gqa else (k.repeat_interleave(HQ // HKV, 1), v.repeat_interleave(HQ // HKV, 1))
        out = varlen_attn(q, kk, vv, cu, cu, longest, longest, window_size=(-1, 0),
                          **({"enable_gqa": True} if has_gqa else {}))
        out.backward(go)

    REGISTRY.reset_usage()
    t_reg = timed(attn_registry, args.reps)
    backend_used = sorted(REGISTRY.usage())
    t_dir = timed(attn_direct, args.reps)
    del q, k, v, go
    qp = torch.randn(args.samples, HQ, longest, HEAD_DIM, device=dev, dtype=torch.bfloat16).requires_grad_()
    kp = torch.randn(args.samples, HKV, longest, HEAD_DIM, device=dev, dtype=torch.bfloat16).requires_grad_()
    vp = torch.randn(args.samples, HKV, longest, HEAD_DIM, device=dev, dtype=torch.bfloat16).requires_grad_()
    gp = torch.randn_like(qp)

    def attn_padded():
        with _no_math_sdpa():
            torch.nn.functional.scaled_dot_product_attention(qp, kp, vp, is_causal=True, enable_gqa=True).backward(gp)

    t_pad = timed(attn_padded, max(5, args.reps // 4))
    del qp, kp, vp, gp
    result["attention_fwd_bwd_ms"] = {"registry": t_reg, "direct_varlen_attn": t_dir, "padded_sdpa": t_pad,
                                      "registry_overhead": t_reg / t_dir - 1, "backend": backend_used}

    # ---- decoder-layer stack -----------------------------------------------------------------------------
    cfg, layers, rope = build_stack(args.layers, dev)
    plan = plan_microbatches(lengths, args.budget)
    mbs = []
    for members in plan:
        ls = [lengths[i] for i in members]
        mbs.append((sum(ls), max(ls), torch.tensor([0, *torch.tensor(ls).cumsum(0).tolist()], dtype=torch.int32),
                    torch.cat([torch.arange(n) for n in ls])))
    hid = torch.randn(max(m[0] for m in mbs), HIDDEN, device=dev, dtype=torch.bfloat16)

    def packed_pass(impl):
        for total, mx, cu_c, pos_c in mbs:
            cu, pos = cu_c.to(dev, non_blocking=True), pos_c.to(dev, non_blocking=True)[None]
            h = hid[:total][None].detach().requires_grad_()
            out = run_stack(cfg, layers, rope, impl, h, pos, packed_forward_kwargs(pos, cu, mx))
            out.backward(torch.ones_like(out))
        layers.zero_grad(set_to_none=True)

    rows_per_chunk = max(1, args.budget // longest)
    pos_pad = torch.arange(longest, device=dev)[None]
    hid_pad = torch.randn(rows_per_chunk, longest, HIDDEN, device=dev, dtype=torch.bfloat16)

    def padded_pass():
        for start in range(0, args.samples, rows_per_chunk):
            rows = min(rows_per_chunk, args.samples - start)
            h = hid_pad[:rows].detach().requires_grad_()
            with _no_math_sdpa():
                out = run_stack(cfg, layers, rope, "sdpa", h, pos_pad, {})
            out.backward(torch.ones_like(out))
        layers.zero_grad(set_to_none=True)

    REGISTRY.reset_usage()
    t_packed = timed(lambda: packed_pass(name), args.reps)
    stack_backend = sorted(REGISTRY.usage())
    t_direct = timed(lambda: packed_pass("bench_direct_varlen"), args.reps)
    t_padded = timed(padded_pass, max(5, args.reps // 2))

    params = sum(p.numel() for p in layers.parameters())
    attn_flops = 3.5 * 4 * HQ * HEAD_DIM * sum(n * n / 2 for n in lengths) * args.layers  # causal; bwd ~2.5x fwd
    flops = 6 * params * real + attn_flops
    ideal = padded_tokens / real
    speedup = t_padded / t_packed
    result["stack_fwd_bwd"] = {
        "microbatches_packed": len(mbs), "rows_per_padded_chunk": rows_per_chunk, "budget": args.budget,
        "packed_ms": t_packed, "direct_varlen_ms": t_direct, "padded_ms": t_padded,
        "packed_tokens_per_s": real / t_packed * 1e3, "padded_real_tokens_per_s": real / t_padded * 1e3,
        "speedup": speedup, "ideal_speedup": ideal, "fraction_of_ideal": speedup / ideal,
        "registry_overhead": t_packed / t_direct - 1, "backend": stack_backend,
        "packed_model_tflops": flops / t_packed / 1e9,
        "packed_fraction_of_gemm_rate": flops / t_packed / 1e9 / result["limits"]["gemm_bf16_tflops"],
    }
    result["targets"] = {"fraction_of_ideal_min": 0.8, "registry_overhead_max": 0.05,
                         "met": bool(speedup / ideal >= 0.8 and t_packed / t_direct - 1 <= 0.05)}
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
