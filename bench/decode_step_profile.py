"""Where one true_on_policy decode step's time goes: the captured step per forward path, kernel by kernel.

    python3 bench/decode_step_profile.py --out decode_profile.json           # one H200: under a minute
    python3 bench/decode_step_profile.py --sweep attention,matmul --out p.json   # + tile/warp/stage sweeps

Synthetic and short (no scheduler, no sampling): a random-init Qwen3 shape in bf16, a paged KV pool of
random values, `--rows` live rows (padded to the CUDA-graph bucket as the decoder pads them) whose context
lengths are drawn uniformly from [1, 2 x --context - 1] (the longtail bench's steps of >= 128 rows had 185
rows of 685 mean context). For each forward path of the decoder (`hf`: the stock Hugging Face forward on the
batch-invariant ops; `fused`: services.rollout.embedded.fused_step) it reports

- the captured step's replay time (the decoder's graph: forward and lm_head), median of CUDA-event timings;
- the kernels of one step from torch.profiler over graph replays: count, device time, grouped by kind;
- the step's roofline fraction: weights plus the rows' K/V bytes over the replay time at the measured
  device-to-device copy bandwidth (the bench's definition, without sampling and host time).

`--matmul auto,legacy` (a comma list) runs the whole profile once per matmul mode in one process and reports each
mode's step time, roofline and ratio to the first mode, and whether the logits of the schedules that must agree
(auto, split, one_program: one K order, split-K or not) are bitwise equal:
- auto: the launcher's choice of schedule (split-K for decode-sized matmuls, triton_launch.use_split_k);
- split / one_program: split-K wherever K has two splits / never (same bits as auto, other times);
- legacy: the order before split-K (one accumulator over all of K, one program per tile), today's baseline.

`--sweep attention,matmul` also times, on the decode shapes, each batch-invariant matmul tile config and each attention
warps/stages choice, and says whether its bits equal the shipped config's (bits decide what may ship).
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.rollout import hbm_copy_gb_per_s  # noqa: E402
from bench.rollout_longtail import LONGTAIL_SHAPES, kv_bytes_per_token  # noqa: E402

KINDS = (  # (kind, substrings of kernel names), first match wins
    ("attention", ("bi_attention_kernel", "bi_decode_split_kernel", "bi_decode_combine_kernel")),
    ("matmul_combine", ("bi_matmul_combine_kernel", "gate_up_combine_kernel")),  # split-K's second pass
    ("matmul", ("bi_matmul_kernel", "grouped_matmul_kernel", "gate_up_kernel")),
    ("rms_norm", ("bi_rms_norm_kernel", "add_rms_norm_kernel", "head_rms_norm_kernel")),
    ("rope_kv_write", ("rope_store_kernel",)),
    ("kv_write", ("index_put", "indexing", "scatter")),
    ("embedding", ("embedding", "index_select", "indexSelect")),
    ("copy", ("copy", "Copy", "cat", "Cat")),
    ("elementwise", ("elementwise", "Elementwise", "vectorized", "reduce")),
)


def kind_of(name: str) -> str:
    for kind, keys in KINDS:
        if any(k in name for k in keys):
            return kind
    return "other"


def build(shape: str, rows: int, context: int, seed: int):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from services.rollout.embedded.decoder import Decoder, DecoderOptions, _bucket
    from services.rollout.embedded.kv_cache import PAGE_TOKENS, PagedKVPool

    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 2 * context, (rows,), generator=g, dtype=torch.int32)
    longest = int(lengths.max())
    cfg = Qwen3Config(max_position_embeddings=longest + 64, rope_theta=1e6, rms_norm_eps=1e-6, **LONGTAIL_SHAPES[shape])
    torch.manual_seed(seed)
    with torch.device("cuda"):
        model = Qwen3ForCausalLM(cfg).to(torch.bfloat16).eval().requires_grad_(False)
    decoders = {}
    for path in ("hf", "fused"):
        d = Decoder(model, DecoderOptions(numerics="true_on_policy", max_batch_size=256, cuda_graphs=True,
                                          max_context_tokens=longest + 64, fused_step=path == "fused"))
        assert d.decode_forward == path, (path, d.decode_forward)
        decoders[path] = d
    need = [-(-int(n) // PAGE_TOKENS) for n in lengths]
    pool = PagedKVPool(pages=sum(need) + 1, device=torch.device("cuda"), **decoders["hf"]._shape)
    pool._storage.normal_(generator=torch.Generator(device="cuda").manual_seed(seed))
    bucket = _bucket(rows, 256)
    width = decoders["hf"].table_width
    tables = torch.zeros((bucket, width), dtype=torch.int32)
    first = 1
    for b, n in enumerate(need):
        tables[b, :n] = torch.arange(first, first + n, dtype=torch.int32)
        first += n
    lens = torch.ones(bucket, dtype=torch.int32)
    lens[:rows] = lengths
    positions = (lens.to(torch.int64) - 1)[:, None]
    ids = torch.randint(0, cfg.vocab_size, (bucket, 1), generator=g)
    ids[rows:] = 0
    inputs = tuple(t.cuda() for t in (ids, positions, lens, tables))
    for d in decoders.values():
        d._pool = pool
    info = {"shape": shape, "rows": rows, "bucket": bucket, "mean_context": round(float(lengths.float().mean()), 1),
            "kv_tokens": int(lengths.sum()),
            "weight_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
            "pool_gb": round(pool.nbytes() / 1e9, 2)}
    return model, decoders, inputs, info, bucket


def replay_ms(graph, reps: int) -> list[float]:
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return times


def kernel_table(fn, steps: int) -> dict:
    """Per kernel name over `steps` calls of fn: count and device microseconds per step, and per kind."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    by_name = defaultdict(lambda: [0, 0.0])
    for evt in prof.events():
        if evt.device_type != torch.autograd.DeviceType.CUDA:
            continue
        dur = evt.time_range.end - evt.time_range.start
        by_name[evt.name][0] += 1
        by_name[evt.name][1] += dur
    names = sorted(by_name.items(), key=lambda kv: -kv[1][1])
    table = [{"kernel": name[:90], "kind": kind_of(name), "per_step": round(c / steps, 2),
              "us_per_step": round(t / steps, 1)} for name, (c, t) in names]
    kinds = defaultdict(lambda: [0.0, 0.0])
    for row in table:
        kinds[row["kind"]][0] += row["per_step"]
        kinds[row["kind"]][1] += row["us_per_step"]
    return {"kernels_per_step": round(sum(r["per_step"] for r in table), 1),
            "kernel_us_per_step": round(sum(r["us_per_step"] for r in table), 1),
            "by_kind": {k: {"kernels": round(c, 1), "us": round(t, 1)} for k, (c, t) in
                        sorted(kinds.items(), key=lambda kv: -kv[1][1])},
            "top": table[:25]}


def profile_paths(decoders, inputs, bucket, info, copy_gbps, reps: int) -> dict:
    out = {}
    kv = kv_bytes_per_token(info["shape"]) * info["kv_tokens"]
    step_bytes = info["weight_bytes"] + kv
    for path, d in decoders.items():
        graph = d._step_fn(bucket)
        for buf, src in zip((graph.ids, graph.positions, graph.lengths, graph.tables), inputs):
            buf.copy_(src)
        replay_ms(graph, 5)
        times = replay_ms(graph, reps)
        ms = statistics.median(times)
        out[path] = {"replay_ms": round(ms, 3), "replay_ms_spread": [round(min(times), 3), round(max(times), 3)],
                     "forward_roofline_fraction": round(step_bytes / (copy_gbps * 1e9) / (ms / 1e3), 4),
                     "graph": kernel_table(graph.graph.replay, 5),
                     "eager": kernel_table(lambda d=d, graph=graph: d._decode_logits(
                         graph.ids, graph.positions, graph.lengths, graph.tables), 3)}
        logits = graph.logits.clone()
        out[path]["logits"] = logits
    fused = out["fused"].pop("logits")
    same = torch.equal(out["hf"].pop("logits").view(torch.int16), fused.view(torch.int16))
    return {"step_bytes": step_bytes, "kv_bytes": kv, "paths": out, "fused_logits_equal_hf_bitwise": same,
            "fused_logits": fused}


# ---- sweeps ------------------------------------------------------------------------------------------------
MATMUL_SHAPES = {"q": (2048, 1024), "k_v": (1024, 1024), "o": (1024, 2048), "gate_up": (3072, 1024),
                 "down": (1024, 3072)}
MATMUL_CANDIDATES = [  # (block_m, block_n, block_k, warps, stages); block_k stays 64: it is the K order
    (64, 64, 64, 4, 4), (64, 64, 64, 4, 2), (64, 64, 64, 4, 3), (64, 64, 64, 4, 6), (64, 32, 64, 4, 4),
    (64, 32, 64, 4, 6), (64, 32, 64, 2, 4), (64, 128, 64, 4, 4), (64, 128, 64, 8, 3), (64, 64, 64, 8, 4),
    (128, 64, 64, 8, 3), (128, 32, 64, 8, 4), (32, 64, 64, 4, 4), (16, 64, 64, 4, 4),
]


def sweep_matmul(rows_list) -> list[dict]:
    import triton

    from kernels.batch_invariant import triton_kernels
    from kernels.batch_invariant.reference import SPLIT_K

    results = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for m in rows_list:
        for name, (n, k) in MATMUL_SHAPES.items():
            xs = [torch.randn(m, k, device="cuda", generator=g).bfloat16() for _ in range(2)]
            w = (torch.randn(n, k, device="cuda", generator=g) / k ** 0.5).bfloat16()
            base = None
            for bm, bn, bk, warps, stages in MATMUL_CANDIDATES:
                outs = [torch.empty(m, n, device="cuda", dtype=torch.bfloat16) for _ in xs]

                def launch(x, out, bm=bm, bn=bn, bk=bk, warps=warps, stages=stages):
                    triton_kernels.bi_matmul_kernel[(triton.cdiv(n, bn), triton.cdiv(m, bm))](
                        x, w, w, out, m, n, k, x.stride(0), x.stride(1), w.stride(0), w.stride(1), out.stride(0),
                        out.stride(1), 0, HAS_BIAS=False, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                        SPLIT_STEPS=SPLIT_K // bk, PARTIAL=False, DOT_PRECISION="ieee", INTERPRETED=False,
                        num_warps=warps, num_stages=stages)
                try:
                    for x, out in zip(xs, outs):
                        launch(x, out)
                    us = 1e3 * triton.testing.do_bench_cudagraph(lambda: launch(xs[0], outs[0]), rep=30,
                                                                 return_mode="median")
                except Exception as exc:  # noqa: BLE001 - a config the compiler refuses is a result
                    results.append({"m": m, "shape": name, "config": [bm, bn, bk, warps, stages],
                                    "error": str(exc)[:120]})
                    continue
                if base is None:
                    base = outs
                same = all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(outs, base))
                results.append({"m": m, "shape": name, "config": [bm, bn, bk, warps, stages], "us": round(us, 2),
                                "bits_equal_shipped": same})
    return results


def sweep_attention(decoder, inputs, bucket) -> list[dict]:
    import triton

    from kernels.batch_invariant import triton_kernels

    pool = decoder._pool
    _, positions, lens, tables = inputs
    cfg = decoder.model.config
    heads, n_kv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    g = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(bucket, heads, d, device="cuda", generator=g).bfloat16()
    k_pool, v_pool = pool.keys[0], pool.values[0]
    results, base = [], None
    for bm, warps, stages, maxnreg in ((64, 4, 2, None), (64, 4, 3, None), (64, 4, 2, 128), (64, 4, 2, 168),
                                       (64, 4, 3, 128), (64, 4, 2, 96), (64, 8, 2, 128), (16, 4, 2, None)):
        out = torch.empty_like(q)
        extra = {} if maxnreg is None else {"maxnreg": maxnreg}

        def launch(bm=bm, warps=warps, stages=stages, out=out, extra=extra):
            triton_kernels.bi_attention_kernel[(triton.cdiv(heads // n_kv, bm), bucket, n_kv)](
                q, k_pool, v_pool, out, lens, lens, tables, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
                k_pool.stride(0), k_pool.stride(1), k_pool.stride(2), tables.stride(0), tables.shape[1] * 64,
                d ** -0.5 * math.log2(math.e), GROUP=heads // n_kv, HEAD_DIM=d, BLOCK_D=d, BLOCK_M=bm, BLOCK_N=64,
                DECODE=True, PAGED=True, DOT_PRECISION="ieee", INTERPRETED=False, num_warps=warps,
                num_stages=stages, **extra)
        try:
            launch()
            us = 1e3 * triton.testing.do_bench_cudagraph(launch, rep=30, return_mode="median")
        except Exception as exc:  # noqa: BLE001
            results.append({"config": [bm, warps, stages, maxnreg], "error": str(exc)[:120]})
            continue
        if base is None:
            base = out.clone()
        results.append({"config": [bm, warps, stages, maxnreg], "us_per_layer": round(us, 2),
                        "bits_equal_shipped": torch.equal(out.view(torch.int16), base.view(torch.int16))})
    return results


def attention_probe(rows: int, context: int, seed: int) -> None:
    from kernels.batch_invariant import paged_decode_attention

    cfg = LONGTAIL_SHAPES["qwen3-0.6b"]
    heads, n_kv, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 2 * context, (rows,), generator=g, dtype=torch.int32)
    need = [-(-int(n) // 64) for n in lengths]
    pool = torch.randn(2, sum(need) + 1, n_kv, 64, d, device="cuda").bfloat16()
    tables = torch.zeros((rows, max(need)), dtype=torch.int32)
    first = 1
    for b, n in enumerate(need):
        tables[b, :n] = torch.arange(first, first + n, dtype=torch.int32)
        first += n
    q = torch.randn(rows, heads, d, device="cuda").bfloat16()
    for _ in range(2):
        paged_decode_attention(q, pool[0], pool[1], tables.cuda(), lengths.cuda(), d ** -0.5)
    torch.cuda.synchronize()
    print("probe", rows, "rows", round(float(lengths.float().mean()), 1), "mean context")


MATMUL_MODES = ("auto", "split", "one_program", "legacy")


def set_matmul_mode(mode: str) -> None:
    """Point the launchers at one matmul mode (module attributes they look up per call); 'auto' restores them."""
    from kernels.batch_invariant import triton_launch

    originals = set_matmul_mode.__dict__.setdefault(
        "originals", (triton_launch.use_split_k, triton_launch.matmul_split_steps))
    use_split_k, split_steps = originals
    triton_launch.use_split_k = {"auto": use_split_k, "split": lambda programs, rows, device: True}.get(
        mode, lambda programs, rows, device: False)
    triton_launch.matmul_split_steps = (lambda cfg: 0) if mode == "legacy" else split_steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen3-0.6b", choices=sorted(LONGTAIL_SHAPES))
    ap.add_argument("--rows", type=int, default=185)
    ap.add_argument("--context", type=int, default=685, help="mean context length of a row")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sweep", default="", help="comma-separated: attention, matmul")
    ap.add_argument("--attention-probe", action="store_true",
                    help="only run one layer's paged decode attention twice (for ncu --launch-skip 1)")
    ap.add_argument("--split-kv", default="auto", choices=("auto", "always", "never"),
                    help="decode attention's schedule: the launcher's choice, or forced either way (the bits do not "
                    "change; the time does)")
    ap.add_argument("--matmul", default="auto",
                    help=f"comma list of matmul modes, each profiled in turn ({', '.join(MATMUL_MODES)}); "
                    "ratios against the first")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    modes = args.matmul.split(",")
    if any(m not in MATMUL_MODES for m in modes) or len(set(modes)) != len(modes):
        ap.error(f"--matmul: distinct modes among {MATMUL_MODES}, got {args.matmul!r}")
    t0 = time.perf_counter()
    if args.split_kv != "auto":
        from kernels.batch_invariant import triton_launch

        forced = args.split_kv == "always"
        triton_launch.use_split_kv = lambda programs, device: forced
    if args.attention_probe:
        attention_probe(args.rows, args.context, args.seed)
        return
    copy = hbm_copy_gb_per_s("cuda")
    from services.rollout.embedded.decoder_attention import decoder_attention

    result, by_mode, logits = None, {}, {}
    for mode in modes:
        set_matmul_mode(mode)
        with torch.no_grad():
            model, decoders, inputs, info, bucket = build(args.shape, args.rows, args.context, args.seed)
            with decoder_attention(model):
                profile = profile_paths(decoders, inputs, bucket, info, copy, args.reps)
                logits[mode] = profile.pop("fused_logits")
                if result is None:
                    result = {"benchmark": "decode_step_profile", "gpu": torch.cuda.get_device_name(),
                              "split_kv": args.split_kv, "matmul": mode,
                              "torch": torch.__version__, "hbm_copy_gb_per_s": round(copy, 1), **info, **profile}
                    if "attention" in args.sweep:
                        result["sweep_attention"] = sweep_attention(decoders["hf"], inputs, bucket)
                    if "matmul" in args.sweep:
                        result["sweep_matmul"] = sweep_matmul((256, 64))
        by_mode[mode] = {path: {"replay_ms": r["replay_ms"],
                                "forward_roofline_fraction": r["forward_roofline_fraction"],
                                "matmul_us": r["graph"]["by_kind"].get("matmul", {}).get("us"),
                                "matmul_combine_us": r["graph"]["by_kind"].get("matmul_combine", {}).get("us")}
                         for path, r in profile["paths"].items()}
        del model, decoders
        torch.cuda.empty_cache()
    set_matmul_mode("auto")
    first = modes[0]
    for mode, paths in by_mode.items():
        for path, r in paths.items():
            r["step_ratio_to_" + first] = round(by_mode[first][path]["replay_ms"] / r["replay_ms"], 3)
    same_order = [m for m in modes if m != "legacy"]
    result["matmul_modes"] = by_mode
    result["logits_equal_across_schedules"] = all(
        torch.equal(logits[m].view(torch.int16), logits[same_order[0]].view(torch.int16)) for m in same_order)
    result["seconds"] = round(time.perf_counter() - t0, 1)
    text = json.dumps(result, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    for path, r in result["paths"].items():
        print(f"{path}: replay {r['replay_ms']} ms, forward roofline {r['forward_roofline_fraction']}")
        for how in ("graph", "eager"):
            t = r[how]
            print(f"  {how}: {t['kernels_per_step']} kernels, {t['kernel_us_per_step']} us of kernels")
            for kind, v in t["by_kind"].items():
                print(f"   {kind:24s} {v['kernels']:7.1f} kernels {v['us']:9.1f} us")
    print("fused logits == hf logits bitwise:", result["fused_logits_equal_hf_bitwise"])
    for mode, paths in by_mode.items():
        print("matmul", mode, json.dumps(paths))
    print("logits equal across matmul schedules:", result["logits_equal_across_schedules"])
    for row in result.get("sweep_attention", []):
        print("attn", row)
    for row in result.get("sweep_matmul", []):
        print("mm", row)


if __name__ == "__main__":
    main()
