"""Proof of portability without the hardware: compile every kernel for MI300 and H100/H200 here.

    python -m kernels.check_targets [--skip-native] [--skip-triton] [--jobs N]

Prints one JSON object and exits non-zero if anything failed:
  * every Triton kernel (kernels/logprob, kernels/batch_invariant, kernels/digest), in the specializations
    the launchers use, compiled ahead of time for GPUTarget("hip", "gfx942", 64) (hsaco) and
    GPUTarget("cuda", 90, 32) (cubin) by the installed triton wheel, no GPU needed;
  * the native source compiled with hipcc (HIP_PLATFORM=amd, gfx90a and gfx940:
    Debian's hipcc 5.2 clang predates gfx942) and with nvcc for sm_90 when nvcc
    is present. hipcc is required (CI installs it); a missing nvcc is reported
    as absent, not as a failure.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

# The AOT compile needs real @triton.jit functions, not the CPU interpreter's.
os.environ.pop("TRITON_INTERPRET", None)

TRITON_TARGETS = (("hip", "gfx942", 64), ("cuda", 90, 32))
HIP_ARCHS = ("gfx90a", "gfx940")
NVCC_ARCHS = ("sm_90",)
QWEN3_VOCAB = 151936


def _triton_specs():
    """(kernel, signature, constexprs, num_warps, label) for each specialization the launchers produce."""
    import torch

    from kernels.logprob import triton_kernels as k
    from kernels.logprob.tiling import tile_width
    from kernels.logprob.triton_backend import BACKWARD_BLOCK, MERGE_BLOCK_T, PartialsConfig

    specs = []
    ptr = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32"}
    partial_sig = ["x_ptr", "targets_ptr", "m_ptr", "s_ptr", "w_ptr", "tgt_ptr", "stride_x", "local_vocab",
                   "real_hi", "col0", "vocab_start", "global_vocab", "n_rows", "n_slots", "temperature",
                   "cnt_ptr", "active_ptr", "logp_ptr", "lse_ptr", "ent_ptr"]
    # Qwen3's vocab in each dtype, and a vocab wide enough (> 64 x 8192) to take the chunked path.
    for vocab, dtype, ent, scale in ((QWEN3_VOCAB, torch.bfloat16, False, False),
                                     (QWEN3_VOCAB, torch.float32, True, True),
                                     (1 << 20, torch.bfloat16, True, True)):
        cfg = PartialsConfig.for_tile(tile_width(vocab), dtype, 64)
        const = dict(TILE_W=cfg.tile_w, CHUNK=cfg.chunk, ALIGN=cfg.align, NUM_CHUNKS=cfg.num_chunks,
                     SPP=cfg.slots_per_program, WITH_ENT=ent, SCALE=scale)
        # Unfused: the five fused-only pointers are placeholders (the launcher passes fp32 scratch).
        types = [ptr[dtype], "*i64", "*fp32", "*fp32", "*fp32", "*fp32"] + ["i32"] * 8 + ["fp32"] + ["*fp32"] * 5
        specs.append((k.logprob_partials_kernel, dict(zip(partial_sig, types)), const, cfg.num_warps,
                      f"partials V={vocab} {str(dtype)[6:]} ent={ent} scale={scale} chunks={cfg.num_chunks}"))
        # Fused TP-1 forward (last program of a row merges): counter i32, mask i1 (or i64 targets).
        fused_types = types[:15] + ["*i32", "*i1" if ent else "*i64", "*fp32", "*fp32", "*fp32"]
        specs.append((k.logprob_partials_kernel, dict(zip(partial_sig, fused_types)),
                      {**const, "FUSED": True, "N_SLOTS": 64, "HAS_MASK": ent}, cfg.num_warps,
                      f"fused V={vocab} {str(dtype)[6:]} ent={ent} scale={scale} mask={ent}"))
    merge_sig = ["m_ptr", "s_ptr", "w_ptr", "tgt_ptr", "targets_ptr", "active_ptr", "logp_ptr", "lse_ptr", "ent_ptr",
                 "n_rows", "stride_row", "stride_slot", "global_vocab"]
    for ent, mask in ((True, True),):
        types = ["*fp32"] * 4 + ["*i64", "*i1"] + ["*fp32"] * 3 + ["i32"] * 4
        const = dict(N_SLOTS=64, BLOCK_T=MERGE_BLOCK_T, WITH_ENT=ent, HAS_MASK=mask)
        specs.append((k.logprob_merge_kernel, dict(zip(merge_sig, types)), const, 4, f"merge ent={ent} mask={mask}"))
    bwd_sig = ["x_ptr", "g_ptr", "targets_ptr", "lse_ptr", "mean_ptr", "glogp_ptr", "glse_ptr", "gent_ptr",
               "active_ptr", "stride_x", "stride_g", "local_vocab", "vocab_start", "global_vocab", "temperature",
               "stride_glogp"]
    for dtype, ent, mask, scale in ((torch.bfloat16, False, False, False), (torch.float16, True, True, True)):
        types = [ptr[dtype], ptr[dtype], "*i64"] + ["*fp32"] * 5 + ["*i1"] + ["i32"] * 5 + ["fp32", "i32"]
        # bf16: the `.sum()` case (no lse gradient, logp gradient of stride 0).
        const = dict(BLOCK=BACKWARD_BLOCK, WITH_ENT=ent, HAS_MASK=mask, SCALE=scale, HAS_GLSE=ent)
        specs.append((k.logprob_backward_kernel, dict(zip(bwd_sig, types)), const, 4,
                      f"backward {str(dtype)[6:]} ent={ent} mask={mask} scale={scale}"))
    return specs + _sampler_specs()


def _sampler_specs():
    """The rollout decoder's Gumbel-max sampling kernel on Qwen3's vocab (bf16 logits; fp32 when truncated)."""
    from kernels.sampling import triton_kernels as st
    from kernels.sampling.stream import FMIX_C1, FMIX_C2, TOKEN_MULT

    specs = []
    for ptr in ("*bf16", "*fp32"):
        sig = {"logits_ptr": ptr, "stride_row": "i32", "keys_ptr": "*i64", "out_ptr": "*i64", "temperature": "fp32"}
        const = dict(VOCAB=QWEN3_VOCAB, C1=FMIX_C1, C2=FMIX_C2, MULT=TOKEN_MULT, BLOCK=st.BLOCK_V)
        specs.append((st._gumbel_argmax_kernel, sig, const, 4, f"gumbel_argmax V={QWEN3_VOCAB} {ptr[1:]}"))
    return specs


def _batch_invariant_specs():
    """(kernel, signature, constexprs, options, label, 16-divisible args, platform) of kernels/batch_invariant.

    At Qwen3 shapes; platform 'cuda' or 'rocm' for a config chosen per platform (compiled for that
    target only), None for one shared by both.

    The launchers' fixed configs per dtype (triton_launch.py); every pointer 16-byte aligned and
    every size and stride the JIT sees divisible by 16 at those shapes marked so; the per-call
    row count left plain; unit strides constant, as the JIT makes them.
    """
    import torch

    from kernels.batch_invariant import KEY_BLOCK
    from kernels.batch_invariant import triton_kernels as k
    from kernels.batch_invariant.reference import SPLIT_BLOCKS
    from kernels.batch_invariant.triton_launch import (
        ATTENTION_CONFIGS,
        COMBINE_BLOCK,
        matmul_config,
        matmul_split_steps,
        rms_norm_warps,
    )

    ptr = {torch.bfloat16: "*bf16", torch.float32: "*fp32"}
    specs = []
    # The unit strides: the JIT compiles an int argument equal to 1 as the constant 1.
    mm_sig = ["x_ptr", "w_ptr", "b_ptr", "out_ptr", "M", "N", "K", "stride_xm", "stride_wn", "stride_om",
              "stride_ws_split"]
    # (dtype, bias, N, partial): the projections' tiles (one program per tile, and the split-K schedule's
    # first pass writing fp32 partials), and the lm_head's wide ones.
    for dtype, bias, n, partial in ((torch.bfloat16, False, 3072, False), (torch.bfloat16, True, 1024, False),
                                    (torch.float32, False, 1024, False), (torch.bfloat16, False, QWEN3_VOCAB, False),
                                    (torch.bfloat16, False, 3072, True)):
        for platform in ("cuda", "rocm"):
            cfg = matmul_config(dtype, n, platform)
            types = [ptr[dtype]] * 3 + ["*fp32" if partial else ptr[dtype]] + ["i32"] * 7
            const = dict(stride_xk=1, stride_wk=1, stride_on=1, HAS_BIAS=bias, BLOCK_M=cfg.block_m,
                         BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_STEPS=matmul_split_steps(cfg),
                         PARTIAL=partial, DOT_PRECISION=cfg.dot_precision, INTERPRETED=False)
            div16 = ("x_ptr", "w_ptr", "b_ptr", "out_ptr", "N", "K", "stride_xm", "stride_wn", "stride_om",
                     "stride_ws_split")
            specs.append((k.bi_matmul_kernel, dict(zip(mm_sig, types)), const,
                          {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages},
                          f"bi_matmul {str(dtype)[6:]} bias={bias} N={n} partial={partial} "
                          f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k} s{cfg.num_stages}", div16, platform))
    combine_sig = ["ws_ptr", "b_ptr", "out_ptr", "M", "N", "n_splits", "stride_ws_split", "stride_ws_m", "stride_om"]
    specs.append((k.bi_matmul_combine_kernel, dict(zip(combine_sig, ["*fp32", "*bf16", "*bf16"] + ["i32"] * 6)),
                  dict(HAS_BIAS=True, BLOCK_C=COMBINE_BLOCK), {"num_warps": 4}, "bi_matmul_combine bf16 bias",
                  ("ws_ptr", "b_ptr", "out_ptr", "N", "stride_ws_split", "stride_ws_m", "stride_om"), None))
    rms_sig = ["x_ptr", "w_ptr", "out_ptr", "stride_x", "stride_o", "H", "eps"]
    for dtype, hidden in ((torch.bfloat16, 1024), (torch.float32, 1024), (torch.bfloat16, 5120)):
        block = 1 << (hidden - 1).bit_length()
        specs.append((k.bi_rms_norm_kernel, dict(zip(rms_sig, [ptr[dtype]] * 3 + ["i32"] * 3 + ["fp32"])),
                      dict(BLOCK_H=block), {"num_warps": rms_norm_warps(hidden)},
                      f"bi_rms_norm {str(dtype)[6:]} H={hidden}", ("x_ptr", "w_ptr", "out_ptr", "stride_x", "stride_o", "H"),
                      None))
    attn_sig = ["q_ptr", "k_ptr", "v_ptr", "o_ptr", "seq_ptr", "start_ptr", "table_ptr", "stride_qt", "stride_qh",
                "stride_ot", "stride_oh", "stride_kb", "stride_kh", "stride_kn", "stride_tb", "cap", "qk_scale"]
    # Qwen3-0.6B: 16 query heads over 8 kv heads of 128 (GQA group 2), bf16 (fp32 compiles the same
    # code with IEEE dots and takes ~25 s more here; the interpreted tests run it). Packed and dense
    # decode, and both over the paged pool (a page is KEY_BLOCK slots of [Hkv, KEY_BLOCK, D]).
    for dtype, decode, paged in ((torch.bfloat16, False, False), (torch.bfloat16, True, False),
                                 (torch.bfloat16, True, True), (torch.bfloat16, False, True)):
        cfg = ATTENTION_CONFIGS[dtype]
        types = [ptr[dtype]] * 4 + ["*i32"] * 3 + ["i32"] * 10 + ["fp32"]
        const = dict(GROUP=2, HEAD_DIM=128, BLOCK_D=128, BLOCK_M=cfg.block_m, BLOCK_N=KEY_BLOCK,
                     SPLIT_BLOCKS=SPLIT_BLOCKS, DECODE=decode, PAGED=paged, DOT_PRECISION=cfg.dot_precision,
                     INTERPRETED=False)
        div16 = ("q_ptr", "k_ptr", "v_ptr", "o_ptr", "seq_ptr", "stride_qt", "stride_qh", "stride_ot", "stride_oh",
                 "stride_kh", "stride_kn") + (("stride_kb",) if decode or paged else ())
        kind = ("paged " if paged else "") + ("decode" if decode else "prefill" if paged else "packed")
        specs.append((k.bi_attention_kernel, dict(zip(attn_sig, types)), const,
                      {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages},
                      f"bi_attention {kind} {str(dtype)[6:]} D=128 group=2", div16, None))
    # Split-KV decode over the paged pool (the decoder's path for a few rows): its two passes, 8 kv heads, 4k keys.
    cfg = ATTENTION_CONFIGS[torch.bfloat16]
    shared = dict(GROUP=2, HEAD_DIM=128, BLOCK_D=128, BLOCK_M=cfg.block_m, BLOCK_N=KEY_BLOCK,
                  SPLIT_BLOCKS=SPLIT_BLOCKS)
    slots = 4096 // (SPLIT_BLOCKS * KEY_BLOCK)
    split_sig = ["q_ptr", "k_ptr", "v_ptr", "seq_ptr", "table_ptr", "m_ptr", "l_ptr", "acc_ptr", "stride_qt",
                 "stride_qh", "stride_kb", "stride_kh", "stride_kn", "stride_tb", "cap", "qk_scale"]
    specs.append((k.bi_decode_split_kernel,
                  dict(zip(split_sig, ["*bf16"] * 3 + ["*i32"] * 2 + ["*fp32"] * 3 + ["i32"] * 7 + ["fp32"])),
                  dict(shared, N_KV=8, SLOTS=slots, TILES=1, PAGED=True, DOT_PRECISION=cfg.dot_precision,
                       INTERPRETED=False),
                  {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages},
                  "bi_decode_split paged bf16 D=128 group=2",
                  ("q_ptr", "k_ptr", "v_ptr", "seq_ptr", "m_ptr", "l_ptr", "acc_ptr", "stride_qt", "stride_qh",
                   "stride_kb", "stride_kh", "stride_kn"), None))
    combine_sig = ["seq_ptr", "m_ptr", "l_ptr", "acc_ptr", "o_ptr", "stride_ot", "stride_oh", "cap"]
    specs.append((k.bi_decode_combine_kernel,
                  dict(zip(combine_sig, ["*i32"] + ["*fp32"] * 3 + ["*bf16"] + ["i32"] * 3)),
                  dict(shared, N_KV=8, SLOTS=slots), {"num_warps": cfg.num_warps},
                  "bi_decode_combine bf16 D=128 group=2",
                  ("seq_ptr", "m_ptr", "l_ptr", "acc_ptr", "o_ptr", "stride_ot", "stride_oh"), None))
    return specs + _moe_specs()


def _moe_specs():
    """The batch-invariant grouped expert GEMM (kernels/moe/grouped_triton.py) at the Qwen3-30B-A3B expert
    shape: gate_up (N 1536, K 2048) and down (N 2048, K 768), bf16, with bi_linear's tiles per platform."""
    import torch

    from kernels.batch_invariant.triton_launch import matmul_config, matmul_split_steps
    from kernels.moe.grouped_triton import bi_grouped_matmul_kernel

    sig = ["x_ptr", "w_ptr", "out_ptr", "tile_expert_ptr", "tile_start_ptr", "tile_end_ptr", "M", "N", "K",
           "stride_xm", "stride_we", "stride_wn", "stride_om"]
    types = ["*bf16"] * 3 + ["*i32"] * 3 + ["i32"] * 7
    specs = []
    for n, k in ((1536, 2048), (2048, 768)):
        for platform in ("cuda", "rocm"):
            cfg = matmul_config(torch.bfloat16, n, platform)
            const = dict(stride_xk=1, stride_wk=1, stride_on=1, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                         BLOCK_K=cfg.block_k, SPLIT_STEPS=matmul_split_steps(cfg), DOT_PRECISION=cfg.dot_precision,
                         INTERPRETED=False)
            div16 = ("x_ptr", "w_ptr", "out_ptr", "tile_expert_ptr", "tile_start_ptr", "tile_end_ptr", "N", "K",
                     "stride_xm", "stride_we", "stride_wn", "stride_om")
            specs.append((bi_grouped_matmul_kernel, dict(zip(sig, types)), const,
                          {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages},
                          f"bi_grouped_matmul bf16 N={n} K={k} {cfg.block_m}x{cfg.block_n}x{cfg.block_k}", div16,
                          platform))
    return specs


def _digest_specs():
    """The IPC handover's block SHA-256 at the weights digest's 4 MiB blocks (kernels/digest)."""
    from kernels.digest.sha256_blocks import LANES, sha256_blocks_kernel

    sig = {"words_ptr": "*i32", "starts_ptr": "*i64", "k_ptr": "*i32", "out_ptr": "*i32", "n_lanes": "i32"}
    const = dict(CHUNKS=65536, LENGTH_BITS=4 * 1024 * 1024 * 8, LANES_=LANES)
    # As the JIT specializes a launch: every pointer 16-byte aligned (fresh or bucket allocations), n_lanes not.
    pointers = ("words_ptr", "starts_ptr", "k_ptr", "out_ptr")
    return [(sha256_blocks_kernel, sig, const, {"num_warps": 1}, "sha256_blocks 4 MiB", pointers, None)]


def _all_triton_specs() -> list[tuple]:
    """(kernel, signature, constexprs, options, label, 16-divisible args, platform) of every Triton kernel."""
    specs = []
    for fn, sig, const, num_warps, label in _triton_specs():
        # As the JIT specializes a Qwen3 call: the logits and gradient pointers 16-byte aligned and
        # the layout's sizes and strides divisible by 16; the kernels mark the other pointers and
        # the per-call integers do_not_specialize* (the JIT leaves them without attributes).
        div16 = tuple(n for n, t in sig.items()
                      if n in ("x_ptr", "g_ptr") or (t == "i32" and n not in fn.do_not_specialize))
        specs.append((fn, sig, const, {"num_warps": num_warps}, label, div16, None))
    return specs + _batch_invariant_specs() + _digest_specs()


def _triton_work() -> list[tuple[int, tuple]]:
    """(spec index, target) of every compile: each spec for each target its platform allows."""
    work = []
    for index, spec in enumerate(_all_triton_specs()):
        platform = spec[6]
        for backend, arch, warp in TRITON_TARGETS:
            if platform is None or platform == {"hip": "rocm", "cuda": "cuda"}[backend]:
                work.append((index, (backend, arch, warp)))
    return work


def _compile_one(index: int, target: tuple) -> dict:
    """Compile spec `index` for `target` ahead of time; an entry of the report (ok or the error)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn, sig, const, options, label, div16, _ = _all_triton_specs()[index]
    backend, arch, warp = target
    full_sig = dict(sig)
    full_sig.update({name: "constexpr" for name in const})
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in div16}
    entry = {"kind": "triton", "kernel": fn.__name__, "spec": label, "target": f"{backend}:{arch}:w{warp}"}
    t0 = time.perf_counter()
    try:
        src = ASTSource(fn, full_sig, constexprs=const, attrs=attrs)
        compiled = triton.compile(src, target=GPUTarget(backend, arch, warp), options=dict(options))
        binary = "hsaco" if backend == "hip" else "cubin"
        blob = compiled.asm.get(binary)
        if not blob:
            raise RuntimeError(f"no {binary} produced")
        entry.update(ok=True, binary=binary, bytes=len(blob), shared=getattr(compiled.metadata, "shared", None))
    except Exception as e:
        entry.update(ok=False, error=f"{type(e).__name__}: {str(e)[-800:]}")
    entry["seconds"] = round(time.perf_counter() - t0, 2)
    return entry


def check_triton(jobs: int = 1) -> list[dict]:
    """Every compile of _triton_work(), in that order; `jobs` > 1 compiles in that many spawned processes
    (each compile is independent and single-threaded, so a 2-core host halves the wall time)."""
    work = _triton_work()
    if jobs <= 1:
        return [_compile_one(index, target) for index, target in work]
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        return list(pool.map(_compile_one, *zip(*work)))


def _find_nvcc() -> str | None:
    found = shutil.which("nvcc")
    if found:
        return found
    for cand in sorted(glob.glob("/usr/local/cuda*/bin/nvcc"), reverse=True):
        if os.access(cand, os.X_OK):
            return cand
    return None


def start_native(tmp: str) -> list[tuple[dict, subprocess.Popen | None, str]]:
    """Launch every native compile as a background process (they overlap the Triton compiles)."""
    from kernels.logprob.native import SRC_DIR

    src = str(SRC_DIR / "logprob_kernels.cu")
    started = []
    hipcc = shutil.which("hipcc")
    for arch in HIP_ARCHS:
        entry = {"kind": "native", "compiler": "hipcc", "target": arch}
        if hipcc is None:
            entry.update(ok=False, error="hipcc not found (apt-get install hipcc)")
            started.append((entry, None, ""))
            continue
        out = os.path.join(tmp, f"lp_{arch}.o")
        env = dict(os.environ, HIP_PLATFORM="amd")
        cmd = [hipcc, "-x", "hip", f"--offload-arch={arch}", "-O3", "-c", src, "-o", out]
        started.append((entry, subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                                text=True), out))
    nvcc = _find_nvcc()
    for arch in NVCC_ARCHS:
        entry = {"kind": "native", "compiler": "nvcc", "target": arch}
        if nvcc is None:
            entry.update(ok=None, absent=True)
            started.append((entry, None, ""))
            continue
        out = os.path.join(tmp, f"lp_{arch}.o")
        cmd = [nvcc, f"-arch={arch}", "-O3", "-c", src, "-o", out]
        started.append((entry, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True), out))
    return started


def finish_native(started, t0: float) -> list[dict]:
    results = []
    for entry, proc, out in started:
        if proc is not None:
            log, _ = proc.communicate(timeout=600)
            ok = proc.returncode == 0 and os.path.exists(out)
            entry["seconds_since_start"] = round(time.perf_counter() - t0, 2)
            if ok and entry["compiler"] == "hipcc":
                # A host-only object would also "compile": require the offload bundle for this arch.
                triple = f"amdgcn-amd-amdhsa--{entry['target']}".encode()
                if triple not in open(out, "rb").read():
                    ok, log = False, f"object has no device code for {entry['target']} (no {triple.decode()} bundle)"
            entry["ok"] = ok
            if ok:
                entry["bytes"] = os.path.getsize(out)
            else:
                entry["error"] = (log or "")[-1500:]
        results.append(entry)
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--skip-native", action="store_true", help="only the Triton AOT compiles (CI must not use it)")
    ap.add_argument("--skip-triton", action="store_true", help="only the native compiles")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                    help="Triton compiles at once, each in its own process (default: one per CPU)")
    args = ap.parse_args(argv)
    import triton

    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        started = [] if args.skip_native else start_native(tmp)
        results = [] if args.skip_triton else check_triton(args.jobs)
        results += finish_native(started, t0)
    failed = [r for r in results if r.get("ok") is False]
    report = {
        "triton_version": triton.__version__,
        "checked": len(results),
        "failed": len(failed),
        "ok": not failed and bool(results),
        "results": results,
    }
    print(json.dumps(report, indent=1))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
