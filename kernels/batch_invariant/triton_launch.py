"""Launchers of the batch-invariant Triton kernels: fixed tile configs per dtype, never per shape of M.

The tile sizes, warps and stages are part of the numerics: another config may select other MMA
instructions and another in-tile reduction tree, so a row's bits could change (still within
rounding). They are chosen once per dtype, valid for sm_90 (wgmma wants BLOCK_M >= 64 with a
multiple of 4 warps) and gfx942 (wave64, MFMA), and checked by `python -m kernels.check_targets`.
What is known to keep a matmul's bits is BLOCK_K and SPLIT_K, the order of its K loop: on an H200
every M/N extent, warp count and stage count tried gave bi_linear's bits (bench/decode_step_profile.py
--sweep matmul); the decode step's projections use narrower N tiles on that evidence
(fused.decode_matmul_config), which tests/kernels/batch_invariant/test_fused_decode_gpu.py checks at
every shape.

Matmul, 16-bit: 64 x 64 x 64, 4 warps, 4 stages. K is reduced in splits of SPLIT_K (reference.py),
each split's partial folded into the total in order. A decode-sized matmul (a few rows, few tiles)
runs one program per (tile, split) writing fp32 partials, then a combine pass that folds them in the
same order (split-K; split_k_plan chooses it from the program count like split-KV below, and it never
changes bits), so one row's projections still read their weights over every SM. 64 x 64 tiles: M=256
rows by N=1024 makes 64 programs where 128 x 128 tiles would make 16 serial ones; large training
matmuls pay some of cuBLAS's throughput for it (and the inline fold's select per K step). Weights of
N >= WIDE_N rows (an lm_head) have programs to spare at any M and take 128 x 128 x 64 tiles with 8
warps (3 stages on sm_90; 2 on gfx942, whose 64 KB of LDS holds no more). The choice is a function
of the weight's shape and the platform, which trainer and rollout share, never of M. fp32 uses IEEE
fp32 dots (torch's default, no TF32).
Attention: BLOCK_M = 64 query rows, BLOCK_N = KEY_BLOCK keys, 4 warps, the online softmax restarted
every SPLIT_BLOCKS key blocks. Decode runs a row's splits in one program (a large batch covers the
GPU) or one program per split and a combine pass (split-KV: a few rows still spread over every
SM). Which one is a scheduling choice of the launcher, from the batch's program count: both fold
the same partials in the same order with the same `_fold`, so a token's bits do not depend on it.
"""
from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass

import torch

from kernels.batch_invariant.errors import BatchInvariantInputError
from kernels.batch_invariant.reference import KEY_BLOCK, SPLIT_BLOCKS, SPLIT_K

INTERPRETED = os.environ.get("TRITON_INTERPRET", "") == "1"


@dataclass(frozen=True)
class MatmulConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    dot_precision: str


@dataclass(frozen=True)
class AttentionConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    dot_precision: str


_MATMUL_16BIT = MatmulConfig(64, 64, 64, num_warps=4, num_stages=4, dot_precision="ieee")
_MATMUL_FP32 = MatmulConfig(64, 64, 32, num_warps=4, num_stages=2, dot_precision="ieee")
MATMUL_CONFIGS = {torch.bfloat16: _MATMUL_16BIT, torch.float16: _MATMUL_16BIT, torch.float32: _MATMUL_FP32}
WIDE_N = 16384
WIDE_MATMUL_16BIT = {"cuda": MatmulConfig(128, 128, 64, num_warps=8, num_stages=3, dot_precision="ieee"),
                     "rocm": MatmulConfig(128, 128, 64, num_warps=8, num_stages=2, dot_precision="ieee")}


def matmul_config(dtype: torch.dtype, n: int, platform: str) -> MatmulConfig:
    """The tiles of an [M, K] x [K, n] product: a function of dtype, weight rows and platform, never of M."""
    if dtype != torch.float32 and n >= WIDE_N:
        return WIDE_MATMUL_16BIT[platform]
    return MATMUL_CONFIGS[dtype]


def matmul_split_steps(cfg: MatmulConfig) -> int:
    """BLOCK_K steps per split of the K reduction (SPLIT_K / BLOCK_K). The benchmark's `--matmul legacy` replaces
    this with 0 (one accumulator over all of K, the order before split-K) to time today's code beside it."""
    if SPLIT_K % cfg.block_k:
        raise BatchInvariantInputError(f"SPLIT_K {SPLIT_K} is not a multiple of BLOCK_K {cfg.block_k}")
    return SPLIT_K // cfg.block_k


SPLIT_K_MIN_PROGRAMS_PER_SM = 2
"""A matmul takes the split-K schedule while one program per tile would give fewer than this many programs per
SM (and it has rows <= SPLIT_K_MAX_ROWS and more than one split). Qwen3-0.6B's decode projections at 1 row make
32-128 programs of 64 x 32 on an H200's 132 SMs; split in 256s of K they make 4-12 times as many."""

SPLIT_K_MAX_ROWS = 32
"""Rows up to which split-K may pay: its fp32 partials are written and read once, rows / 64 of the weight bytes
at SPLIT_K = 256 (2 x rows x N x K/256 x 4 bytes against N x K x 2), so at 32 rows they add half the weight
traffic. Both constants decide the time, never the bits (bench/decode_step_profile.py --matmul auto,split,...)."""


def use_split_k(programs: int, rows: int, device: torch.device) -> bool:
    """Whether a matmul of `rows` rows whose one-program schedule has `programs` programs runs split-K.
    A function of shapes and the device, never of values; interpreted runs (CPU) never do unless asked."""
    if device.type != "cuda":
        return False
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return rows <= SPLIT_K_MAX_ROWS and programs < SPLIT_K_MIN_PROGRAMS_PER_SM * sms


@dataclass(frozen=True)
class SplitK:
    """How one matmul launch runs: `steps` BLOCK_K steps per split (0: no splits, the legacy order), `splits`
    of K's, and whether one program per (tile, split) writes partials for a combine pass (`partial`)."""
    steps: int
    splits: int
    partial: bool

    def workspace(self, rows: int, cols: int, device: torch.device) -> torch.Tensor:
        """fp32 partials [splits, rows, cols] (every element a program of split s covers is written)."""
        return torch.empty((self.splits, rows, cols), dtype=torch.float32, device=device)


def split_k_plan(cfg: MatmulConfig, k: int, rows: int, programs: int, device: torch.device,
                 split_k: bool | None) -> SplitK:
    """The schedule of a matmul: split_k None lets use_split_k decide (only where K has more than one split),
    True/False force it (tests: the bits must not move)."""
    steps = matmul_split_steps(cfg)
    splits = max(1, triton_cdiv(triton_cdiv(k, cfg.block_k), steps)) if steps else 1
    if split_k is None:
        split_k = steps > 0 and splits > 1 and use_split_k(programs, rows, device)
    elif split_k and not steps:
        raise BatchInvariantInputError("split_k=True needs K splits (matmul_split_steps is 0: the legacy order)")
    return SplitK(steps, splits, bool(split_k))


def combine_split_k(ws: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> None:
    """Second pass of a split-K matmul: out = the partials of ws [splits, M, N] summed in split order (+ bias)."""
    splits, m, n = ws.shape
    with _device_scope(out):
        _kernels().bi_matmul_combine_kernel[(triton_cdiv(n, COMBINE_BLOCK), m)](
            ws, bias if bias is not None else ws, out, m, n, splits, ws.stride(0), ws.stride(1), out.stride(0),
            HAS_BIAS=bias is not None, BLOCK_C=COMBINE_BLOCK, num_warps=4)


COMBINE_BLOCK = 512
"""Columns per program of a split-K combine (elementwise over the outputs: no reduction order depends on it)."""


def _platform() -> str:
    return "rocm" if torch.version.hip else "cuda"

_ATTN_16BIT = AttentionConfig(64, KEY_BLOCK, num_warps=4, num_stages=2, dot_precision="ieee")
ATTENTION_CONFIGS = {torch.bfloat16: _ATTN_16BIT, torch.float16: _ATTN_16BIT,
                     torch.float32: AttentionConfig(64, KEY_BLOCK, num_warps=4, num_stages=1, dot_precision="ieee")}
MAX_HEAD_DIM = 256
MAX_RMS_HIDDEN = 65536


def rms_norm_warps(hidden: int) -> int:
    """Warps of the one-row RMSNorm program: a function of the hidden size only (it fixes the sum's tree)."""
    return 4 if hidden <= 2048 else 8 if hidden <= 8192 else 16


def _kernels():
    from kernels.batch_invariant import triton_kernels

    return triton_kernels


def _device_scope(t: torch.Tensor):
    if t.device.type == "cuda":
        return torch.cuda.device(t.device)
    if not INTERPRETED:
        raise BatchInvariantInputError(f"Triton kernels run on CPU tensors only in the interpreter (TRITON_INTERPRET=1); "
                         f"got a {t.device} tensor")
    return contextlib.nullcontext()


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    """A contiguous last dim on a 16-byte aligned address.

    The JIT compiles a variant per pointer alignment and per integer equal to 1 (a unit stride);
    a slice at an odd offset would otherwise select another (unpipelined) variant for some
    batches and not others. Copying such inputs keeps one variant per model shape.
    """
    if t.stride(-1) != 1 or t.data_ptr() % 16:
        return t.contiguous() if t.stride(-1) != 1 else t.clone()
    return t


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *,
           split_k: bool | None = None) -> torch.Tensor:
    """bi_linear's kernel. split_k: None lets split_k_plan choose the schedule; True/False force it (the bits
    must not move; the tests check that they do not)."""
    k = x.shape[-1]
    n = weight.shape[0]
    rows = _last_dim_contiguous(x.reshape(-1, k))
    weight = _last_dim_contiguous(weight)
    bias = None if bias is None else _last_dim_contiguous(bias)
    m = rows.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out.reshape(*x.shape[:-1], n)
    if k == 0:
        out.copy_(bias.expand(m, n) if bias is not None else torch.zeros_like(out))
        return out.reshape(*x.shape[:-1], n)
    cfg = matmul_config(x.dtype, n, _platform())
    grid = (triton_cdiv(n, cfg.block_n), triton_cdiv(m, cfg.block_m))
    plan = split_k_plan(cfg, k, m, grid[0] * grid[1], x.device, split_k)
    dest = plan.workspace(m, n, x.device) if plan.partial else out
    with _device_scope(x):
        _kernels().bi_matmul_kernel[grid + ((plan.splits,) if plan.partial else ())](
            rows, weight, bias if bias is not None else weight, dest, m, n, k,
            rows.stride(0), rows.stride(1), weight.stride(0), weight.stride(1), dest.stride(-2), dest.stride(-1),
            dest.stride(0) if plan.partial else 0,
            HAS_BIAS=bias is not None, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
            SPLIT_STEPS=plan.steps, PARTIAL=plan.partial, DOT_PRECISION=cfg.dot_precision, INTERPRETED=INTERPRETED,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if plan.partial:
        combine_split_k(dest, bias, out)
    return out.reshape(*x.shape[:-1], n)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.shape[-1]
    if h > MAX_RMS_HIDDEN:
        raise BatchInvariantInputError(f"bi_rms_norm: hidden size {h} exceeds the one-row kernel's limit {MAX_RMS_HIDDEN}")
    rows = _last_dim_contiguous(x.reshape(-1, h))
    weight = _last_dim_contiguous(weight)
    out = torch.empty(rows.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if rows.shape[0] and h:
        with _device_scope(x):
            _kernels().bi_rms_norm_kernel[(rows.shape[0],)](
                rows, weight, out, rows.stride(0), out.stride(0), h, eps,
                BLOCK_H=triton_next_pow2(h), num_warps=rms_norm_warps(h))
    return out.reshape(x.shape)


def head_block(d: int) -> int:
    """The head dim the kernel computes in: a power of two >= 16 (tl.dot's minimum), zero-padded."""
    if not 1 <= d <= MAX_HEAD_DIM:
        raise BatchInvariantInputError(f"batch-invariant attention kernels take head_dim in [1, {MAX_HEAD_DIM}], got {d}")
    return max(16, triton_next_pow2(d))


def _kv_pair(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """k and v with one set of strides and a contiguous head dim (the kernel takes one stride set)."""
    k, v = _last_dim_contiguous(k), _last_dim_contiguous(v)
    if k.stride() != v.stride() or k.stride(0) == 1 or k.stride(1) == 1:
        k, v = k.contiguous(), v.contiguous()
    return k, v


def packed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
                     scale: float) -> torch.Tensor:
    t, n_heads, d = q.shape
    block_d = head_block(d)
    q = _last_dim_contiguous(q)
    k, v = _kv_pair(k, v)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    cfg = ATTENTION_CONFIGS[q.dtype]
    n_seqs = cu_seqlens.numel() - 1
    grid = (triton_cdiv(max_seqlen, cfg.block_m), n_seqs, n_heads)
    with _device_scope(q):
        _kernels().bi_attention_kernel[grid](
            q, k, v, out, cu_seqlens, cu_seqlens, cu_seqlens, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            0, k.stride(1), k.stride(0), 0, t, scale * math.log2(math.e),
            GROUP=n_heads // k.shape[1], HEAD_DIM=d, BLOCK_D=block_d, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
            SPLIT_BLOCKS=SPLIT_BLOCKS, DECODE=False, PAGED=False, DOT_PRECISION=cfg.dot_precision, INTERPRETED=INTERPRETED,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out


SPLIT_KV_MIN_PROGRAMS_PER_SM = 16
"""Decode takes the split-KV path while one program per (row, kv head, row tile) would give fewer programs than
this many per SM: a function of the batch's shape and the device, never of a row's contents. On an H200 at the
Qwen3-0.6B shape (8 kv heads, context 2000) the split path was the faster at every batch measured, 128 rows
(1024 programs, 7.8 per SM) included: attention 9.1 ms a step split against 10.9 ms in one program each
(bench/results/decode_step_profile_split_kv_h200.json)."""


def use_split_kv(programs: int, device: torch.device) -> bool:
    """Whether decode spreads a row's splits over programs. Interpreted runs (CPU) never do unless asked."""
    if device.type != "cuda":
        return False
    return programs < SPLIT_KV_MIN_PROGRAMS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count


def _decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor, table: torch.Tensor,
            strides: tuple[int, int, int, int], cap: int, scale: float, paged: bool,
            split_kv: bool | None) -> torch.Tensor:
    """One decode launch (dense caches or a paged pool); strides = (per cache row or page, per kv head, per slot,
    per block-table row)."""
    b, n_heads, d = q.shape
    n_kv = k.shape[1]
    group = n_heads // n_kv
    block_d = head_block(d)
    cfg = ATTENTION_CONFIGS[q.dtype]
    tiles = triton_cdiv(group, cfg.block_m)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    split = use_split_kv(tiles * b * n_kv, q.device) if split_kv is None else split_kv
    common = dict(GROUP=group, HEAD_DIM=d, BLOCK_D=block_d, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                  SPLIT_BLOCKS=SPLIT_BLOCKS)
    qk_scale = scale * math.log2(math.e)
    with _device_scope(q):
        if not split:
            _kernels().bi_attention_kernel[(tiles, b, n_kv)](
                q, k, v, out, lengths, lengths, table, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
                *strides, cap, qk_scale, DECODE=True, PAGED=paged, DOT_PRECISION=cfg.dot_precision,
                INTERPRETED=INTERPRETED, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **common)
            return out
        slots = triton_cdiv(cap, SPLIT_BLOCKS * cfg.block_n)
        m_ws = torch.empty((b, n_kv, slots, group), dtype=torch.float32, device=q.device)
        l_ws = torch.empty_like(m_ws)
        acc_ws = torch.empty((b, n_kv, slots, group, d), dtype=torch.float32, device=q.device)
        _kernels().bi_decode_split_kernel[(slots * tiles, b, n_kv)](
            q, k, v, lengths, table, m_ws, l_ws, acc_ws, q.stride(0), q.stride(1), *strides, cap, qk_scale,
            N_KV=n_kv, SLOTS=slots, TILES=tiles, PAGED=paged, DOT_PRECISION=cfg.dot_precision,
            INTERPRETED=INTERPRETED, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **common)
        _kernels().bi_decode_combine_kernel[(tiles, b, n_kv)](
            lengths, m_ws, l_ws, acc_ws, out, out.stride(0), out.stride(1), cap, N_KV=n_kv, SLOTS=slots,
            num_warps=cfg.num_warps, **common)
    return out


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, lengths: torch.Tensor,
                     scale: float, *, split_kv: bool | None = None) -> torch.Tensor:
    """split_kv: None lets use_split_kv decide; True/False force a schedule (tests: the bits must not move)."""
    q = _last_dim_contiguous(q)
    k_cache, v_cache = _kv_pair(k_cache, v_cache)
    strides = (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), 0)
    return _decode(q, k_cache, v_cache, lengths, lengths, strides, k_cache.shape[2], scale, False, split_kv)


def _pool_pair(k_pool: torch.Tensor, v_pool: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The pools as the kernel reads them: one stride set, slots of a page contiguous in the head dim."""
    if k_pool.stride() != v_pool.stride() or k_pool.stride(-1) != 1:
        raise BatchInvariantInputError("k_pool/v_pool must share strides with a contiguous head dim (pools are "
                                       "allocated once and never copied per call)")
    return k_pool, v_pool


def paged_decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor,
                           lengths: torch.Tensor, scale: float, *, split_kv: bool | None = None) -> torch.Tensor:
    q = _last_dim_contiguous(q)
    k_pool, v_pool = _pool_pair(k_pool, v_pool)
    strides = (k_pool.stride(0), k_pool.stride(1), k_pool.stride(2), block_tables.stride(0))
    return _decode(q, k_pool, v_pool, lengths, block_tables, strides, block_tables.shape[1] * KEY_BLOCK, scale,
                   True, split_kv)


def paged_prefill_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor,
                            cu_seqlens: torch.Tensor, starts: torch.Tensor, max_seqlen: int,
                            scale: float) -> torch.Tensor:
    t, n_heads, d = q.shape
    block_d = head_block(d)
    q = _last_dim_contiguous(q)
    k_pool, v_pool = _pool_pair(k_pool, v_pool)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    cfg = ATTENTION_CONFIGS[q.dtype]
    grid = (triton_cdiv(max_seqlen, cfg.block_m), cu_seqlens.numel() - 1, n_heads)
    with _device_scope(q):
        _kernels().bi_attention_kernel[grid](
            q, k_pool, v_pool, out, cu_seqlens, starts, block_tables, q.stride(0), q.stride(1), out.stride(0),
            out.stride(1), k_pool.stride(0), k_pool.stride(1), k_pool.stride(2), block_tables.stride(0), 0,
            scale * math.log2(math.e),
            GROUP=n_heads // k_pool.shape[1], HEAD_DIM=d, BLOCK_D=block_d, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
            SPLIT_BLOCKS=SPLIT_BLOCKS, DECODE=False, PAGED=True, DOT_PRECISION=cfg.dot_precision, INTERPRETED=INTERPRETED,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def triton_next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())
