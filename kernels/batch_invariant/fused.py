"""Fused batch-invariant ops of a decode step: the bits of the unfused ops in fewer kernels.

    from kernels.batch_invariant.fused import add_rms_norm, grouped_linear, gate_up, qk_norm_rope_store

Each op is defined by its unfused composition (`impl="reference"`, or any input the fused kernel does
not take): the public batch-invariant ops (bi_linear, bi_rms_norm, with the same `impl`) and torch's
elementwise ops, exactly as a Hugging Face decoder layer patched by `make_batch_invariant` runs them.
`impl="triton"` (the default on CUDA) runs fused_kernels.py, whose bits equal that composition on the
GPU (tests/kernels/batch_invariant/test_fused_decode_gpu.py) and within the interpreter
(tests/kernels/batch_invariant/test_fused_decode.py).

Inference only (no autograd): the decoder calls them under no_grad.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
import torch.nn.functional as F

from kernels.batch_invariant.ops import BatchInvariantInputError, Impl, _resolve, bi_linear, bi_rms_norm

SIXTEEN_BIT = (torch.bfloat16, torch.float16)


def decode_matmul_config(dtype: torch.dtype, n: int, platform: str):
    """Tiles of the decode step's projections: 64 x 32 tiles with bi_linear's BLOCK_K on CUDA for 16-bit weights
    below WIDE_N rows (twice the programs of 64 x 64 at a few hundred rows, 15-20% faster on an H200), else
    bi_linear's own config.

    A tile's K loop is the arithmetic of an output (BLOCK_K steps from k = 0, one MMA chain); the M and N
    extent of a tile only decide which outputs a program computes. The GPU tests compare these tiles with
    bi_linear's bit for bit at every projection shape of the Qwen3 models the engine serves."""
    launch = _launch()
    if platform == "cuda" and dtype in SIXTEEN_BIT and n < launch.WIDE_N:
        base = launch.matmul_config(dtype, n, platform)
        return launch.MatmulConfig(base.block_m, 32, base.block_k, num_warps=4, num_stages=4,
                                   dot_precision=base.dot_precision)
    return launch.matmul_config(dtype, n, platform)


def _launch():
    from kernels.batch_invariant import triton_launch

    return triton_launch


def _kernels():
    from kernels.batch_invariant import fused_kernels

    return fused_kernels


def _no_grad_inputs(op: str, *tensors: torch.Tensor | None) -> None:
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        raise BatchInvariantInputError(f"{op} is inference-only: its inputs must not require grad")


def _rows(x: torch.Tensor) -> torch.Tensor:
    return _launch()._last_dim_contiguous(x.reshape(-1, x.shape[-1]))


# ---- residual add + RMSNorm -----------------------------------------------------------------------
def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, *,
                 impl: Impl = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """(s, bi_rms_norm(s, weight, eps)) with s = residual + x in x's dtype (s = x when residual is None).

    A decoder layer's `hidden = residual + hidden; residual = hidden; hidden = norm(hidden)` in one kernel."""
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise BatchInvariantInputError(f"residual must match x ({tuple(x.shape)}, {x.dtype}); got "
                                       f"{tuple(residual.shape)}, {residual.dtype}")
    if weight.dtype != x.dtype or weight.shape != (x.shape[-1],):
        raise BatchInvariantInputError(f"weight must be [{x.shape[-1]}] in {x.dtype}; got {tuple(weight.shape)} "
                                       f"{weight.dtype}")
    _no_grad_inputs("add_rms_norm", x, residual, weight)
    chosen = _resolve(impl, x.device, "add_rms_norm")
    h = x.shape[-1]
    if chosen == "reference" or h > _launch().MAX_RMS_HIDDEN:
        s = x if residual is None else residual + x
        return s, bi_rms_norm(s, weight, eps, impl=chosen)
    rows = _rows(x)
    res = None if residual is None else _rows(residual)
    s = rows if res is None else torch.empty_like(rows)
    out = torch.empty_like(rows)
    if rows.shape[0] and h:
        launch = _launch()
        with launch._device_scope(x):
            _kernels().add_rms_norm_kernel[(rows.shape[0],)](
                rows, rows if res is None else res, weight, s, out, rows.stride(0),
                rows.stride(0) if res is None else res.stride(0), s.stride(0), out.stride(0), h, float(eps),
                BLOCK_H=launch.triton_next_pow2(h), HAS_RESIDUAL=res is not None,
                INTERPRETED=launch.INTERPRETED, num_warps=launch.rms_norm_warps(h))
    return s.reshape(x.shape), out.reshape(x.shape)


# ---- q/k RMSNorm + rotary + paged K/V write --------------------------------------------------------
def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """Hugging Face's rotate_half: [-x2, x1] of the two halves of the last dim."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def qk_norm_rope_store(qkv: torch.Tensor, n_heads: int, n_kv: int, q_norm: torch.Tensor | None,
                       k_norm: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                       k_pool: torch.Tensor, v_pool: torch.Tensor, pages: torch.Tensor, slots: torch.Tensor, *,
                       impl: Impl = "auto") -> torch.Tensor:
    """A decode step's attention inputs: q [B, n_heads, D] normalised and rotated; k normalised, rotated and
    written with v into pool slot `slots[b]` of page `pages[b]` (pools [pages, n_kv, slots, D]).

    qkv [B, (n_heads + 2 n_kv) D]: each row's q, k and v heads (grouped_linear's output); q_norm/k_norm:
    per-head RMSNorm weights [D] (None: no norm, as in Llama and Qwen2); cos/sin [B, D] in qkv's dtype."""
    b, width = qkv.shape
    d = width // (n_heads + 2 * n_kv)
    if d * (n_heads + 2 * n_kv) != width or d % 2:
        raise BatchInvariantInputError(f"qkv's width {width} is not (n_heads + 2 n_kv) x an even head_dim "
                                       f"(n_heads={n_heads}, n_kv={n_kv})")
    if (q_norm is None) != (k_norm is None):
        raise BatchInvariantInputError("q_norm and k_norm: give both or neither")
    if cos.shape != (b, d) or sin.shape != (b, d) or cos.dtype != qkv.dtype or sin.dtype != qkv.dtype:
        raise BatchInvariantInputError(f"cos/sin must be [{b}, {d}] in {qkv.dtype}; got {tuple(cos.shape)} "
                                       f"{cos.dtype}, {tuple(sin.shape)} {sin.dtype}")
    if k_pool.dim() != 4 or k_pool.shape[1] != n_kv or k_pool.shape[3] != d or k_pool.stride() != v_pool.stride():
        raise BatchInvariantInputError(f"k_pool/v_pool must be [pages, {n_kv}, slots, {d}] with one stride set; got "
                                       f"{tuple(k_pool.shape)}")
    if k_pool.dtype != qkv.dtype or v_pool.dtype != qkv.dtype:
        raise BatchInvariantInputError(f"pools must be in qkv's dtype {qkv.dtype}")
    if pages.shape != (b,) or slots.shape != (b,):
        raise BatchInvariantInputError(f"pages and slots must be [{b}]; got {tuple(pages.shape)}, {tuple(slots.shape)}")
    _no_grad_inputs("qk_norm_rope_store", qkv, q_norm, k_norm, k_pool, v_pool)
    chosen = _resolve(impl, qkv.device, "qk_norm_rope_store")
    if chosen == "reference" or qkv.dtype not in SIXTEEN_BIT or k_pool.stride(-1) != 1:
        return _qk_norm_rope_store_unfused(qkv, n_heads, n_kv, d, q_norm, k_norm, eps, cos, sin, k_pool, v_pool,
                                           pages, slots, chosen)
    launch, kernels = _launch(), _kernels()
    rows = launch._last_dim_contiguous(qkv)
    cos, sin = cos.contiguous(), sin.contiguous()
    q = torch.empty((b, n_heads, d), dtype=qkv.dtype, device=qkv.device)
    if b:
        with launch._device_scope(qkv):
            qk = rows
            if q_norm is not None:
                qk = torch.empty((b, (n_heads + n_kv) * d), dtype=qkv.dtype, device=qkv.device)
                kernels.head_rms_norm_kernel[(b, n_heads + n_kv)](
                    rows, q_norm, k_norm, qk, rows.stride(0), qk.stride(0), n_heads, d, float(eps),
                    BLOCK_D=launch.triton_next_pow2(d), num_warps=launch.rms_norm_warps(d))
            v = rows[:, (n_heads + n_kv) * d:]
            kernels.rope_store_kernel[(b, n_heads + n_kv)](
                qk, v, cos, sin, q, k_pool, v_pool, pages, slots, qk.stride(0), v.stride(0), cos.stride(0),
                q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), k_pool.stride(2), n_heads, d,
                BLOCK_D=launch.triton_next_pow2(d), INTERPRETED=launch.INTERPRETED, num_warps=launch.rms_norm_warps(d),
                enable_fp_fusion=False)
    return q


def _qk_norm_rope_store_unfused(qkv, n_heads, n_kv, d, q_norm, k_norm, eps, cos, sin, k_pool, v_pool, pages, slots,
                                impl) -> torch.Tensor:
    """The Hugging Face attention block's own ops: per-head RMSNorm, apply_rotary_pos_emb, the pool write."""
    b = qkv.shape[0]
    q = qkv[:, :n_heads * d].reshape(b, n_heads, d)
    k = qkv[:, n_heads * d:(n_heads + n_kv) * d].reshape(b, n_kv, d)
    v = qkv[:, (n_heads + n_kv) * d:].reshape(b, n_kv, d)
    if q_norm is not None:
        q, k = bi_rms_norm(q, q_norm, eps, impl=impl), bi_rms_norm(k, k_norm, eps, impl=impl)
    c, s = cos[:, None], sin[:, None]
    q = (q * c) + (rotate_half(q) * s)
    k = (k * c) + (rotate_half(k) * s)
    with unique_index_writes():
        k_pool[pages, :, slots] = k
        v_pool[pages, :, slots] = v
    return q.contiguous()


@contextlib.contextmanager
def unique_index_writes() -> Iterator[None]:
    """Deterministic algorithms off around a KV-pool write: every (page, slot) of a real token is unique
    (padded rows all write the scratch slot, whose contents nothing reads), so the plain index_put_ kernel is
    deterministic where it matters, and its sort-based deterministic variant would not capture in a CUDA
    graph. The paged pool's own writes (services/rollout/embedded/kv_cache.py) use it too."""
    enabled = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    if enabled:
        torch.use_deterministic_algorithms(False)
    try:
        yield
    finally:
        if enabled:
            torch.use_deterministic_algorithms(True, warn_only=warn_only)


# ---- grouped projections -------------------------------------------------------------------------
def _matmul_config(x: torch.Tensor, weights: Sequence[torch.Tensor]):
    launch = _launch()
    configs = {decode_matmul_config(x.dtype, w.shape[0], launch._platform()) for w in weights}
    return configs.pop() if len(configs) == 1 else None


def grouped_linear(x: torch.Tensor, weights: Sequence[torch.Tensor], biases: Sequence[torch.Tensor | None] | None = None,
                   *, impl: Impl = "auto", split_k: bool | None = None) -> torch.Tensor:
    """[bi_linear(x, w_i, b_i) for each i] concatenated on the last dim, in one launch (1 to 3 weights of one K),
    on the decode tiles (decode_matmul_config). split_k: the schedule (triton_launch.split_k_plan), forced
    or (None) chosen from the program count; the bits do not depend on it."""
    weights = list(weights)
    biases = list(biases) if biases is not None else [None] * len(weights)
    if not 1 <= len(weights) <= 3 or len(biases) != len(weights):
        raise BatchInvariantInputError(f"grouped_linear takes 1 to 3 weights with as many biases; got "
                                       f"{len(weights)} and {len(biases)}")
    if len({b is None for b in biases}) != 1:
        raise BatchInvariantInputError("grouped_linear: give every weight a bias or none")
    _no_grad_inputs("grouped_linear", x, *weights, *biases)
    chosen = _resolve(impl, x.device, "grouped_linear")
    config = _matmul_config(x, weights) if chosen == "triton" else None
    if config is None or any(w.dim() != 2 or w.shape[1] != x.shape[-1] or w.dtype != x.dtype for w in weights):
        return torch.cat([bi_linear(x, w, bias, impl=chosen) for w, bias in zip(weights, biases)], dim=-1)
    launch = _launch()
    k = x.shape[-1]
    rows = _rows(x)
    ws = [launch._last_dim_contiguous(w) for w in weights]
    if len({w.stride(1) for w in ws}) != 1:
        ws = [w.contiguous() for w in ws]
    bs = [None if b is None else launch._last_dim_contiguous(b) for b in biases]
    ns = [w.shape[0] for w in ws] + [0] * (3 - len(ws))
    ws += [ws[0]] * (3 - len(ws))
    bs = [b if b is not None else ws[0] for b in bs] + [ws[0]] * (3 - len(bs))
    m, n = rows.shape[0], sum(ns)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m and n and k:
        grid = (sum(launch.triton_cdiv(n_i, config.block_n) for n_i in ns), launch.triton_cdiv(m, config.block_m))
        plan = launch.split_k_plan(config, k, m, grid[0] * grid[1], x.device, split_k)
        dest = plan.workspace(m, n, x.device) if plan.partial else out
        with launch._device_scope(x):
            _kernels().grouped_matmul_kernel[grid + ((plan.splits,) if plan.partial else ())](
                rows, *ws, *bs, dest, m, *ns, k, rows.stride(0), rows.stride(1), ws[0].stride(0), ws[1].stride(0),
                ws[2].stride(0), ws[0].stride(1), dest.stride(-2), dest.stride(-1),
                dest.stride(0) if plan.partial else 0, HAS_BIAS=biases[0] is not None,
                BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, SPLIT_STEPS=plan.steps,
                PARTIAL=plan.partial, DOT_PRECISION=config.dot_precision, INTERPRETED=launch.INTERPRETED,
                num_warps=config.num_warps, num_stages=config.num_stages)
        if plan.partial:
            bias = None if biases[0] is None else torch.cat([launch._last_dim_contiguous(b) for b in biases])
            launch.combine_split_k(dest, bias, out)
    elif m and n:
        return torch.cat([bi_linear(x, w, bias, impl=chosen) for w, bias in zip(weights, biases)], dim=-1)
    return out.reshape(*x.shape[:-1], n)


def gate_up(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, *, silu_mul: bool = True,
            impl: Impl = "auto", split_k: bool | None = None) -> torch.Tensor:
    """silu(bi_linear(x, gate)) * bi_linear(x, up) (a SwiGLU MLP's input to down_proj), or with silu_mul=False
    both projections concatenated [.., 2N]; one launch (two with split-K; split_k as grouped_linear's)."""
    if gate.shape != up.shape or gate.dim() != 2 or gate.shape[1] != x.shape[-1]:
        raise BatchInvariantInputError(f"gate and up must both be [N, {x.shape[-1]}]; got {tuple(gate.shape)} and "
                                       f"{tuple(up.shape)}")
    _no_grad_inputs("gate_up", x, gate, up)
    chosen = _resolve(impl, x.device, "gate_up")
    config = _matmul_config(x, [gate]) if chosen == "triton" else None
    fused = (config is not None and gate.dtype == x.dtype == up.dtype and x.shape[-1] > 0
             and (x.dtype in SIXTEEN_BIT or not silu_mul))
    if not fused:
        g, u = bi_linear(x, gate, impl=chosen), bi_linear(x, up, impl=chosen)
        return F.silu(g) * u if silu_mul else torch.cat([g, u], dim=-1)
    launch = _launch()
    rows = _rows(x)
    wg, wu = launch._last_dim_contiguous(gate), launch._last_dim_contiguous(up)
    if wg.stride(1) != wu.stride(1):
        wg, wu = wg.contiguous(), wu.contiguous()
    m, n, k = rows.shape[0], gate.shape[0], x.shape[-1]
    out = torch.empty(m, n if silu_mul else 2 * n, dtype=x.dtype, device=x.device)
    if m and n:
        grid = (launch.triton_cdiv(n, config.block_n), launch.triton_cdiv(m, config.block_m))
        plan = launch.split_k_plan(config, k, m, grid[0] * grid[1], x.device, split_k)
        dest = plan.workspace(m, 2 * n, x.device) if plan.partial else out
        kernels = _kernels()
        with launch._device_scope(x):
            kernels.gate_up_kernel[grid + ((plan.splits,) if plan.partial else ())](
                rows, wg, wu, dest, m, n, k, rows.stride(0), rows.stride(1), wg.stride(0), wu.stride(0), wg.stride(1),
                dest.stride(-2), dest.stride(-1), dest.stride(0) if plan.partial else 0, SILU_MUL=silu_mul,
                BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, SPLIT_STEPS=plan.steps,
                PARTIAL=plan.partial, DOT_PRECISION=config.dot_precision, INTERPRETED=launch.INTERPRETED,
                num_warps=config.num_warps, num_stages=config.num_stages)
            if plan.partial:
                kernels.gate_up_combine_kernel[(launch.triton_cdiv(n, launch.COMBINE_BLOCK), m)](
                    dest, out, m, n, plan.splits, dest.stride(0), dest.stride(1), out.stride(0), SILU_MUL=silu_mul,
                    BLOCK_C=launch.COMBINE_BLOCK, INTERPRETED=launch.INTERPRETED, num_warps=4)
    return out.reshape(*x.shape[:-1], out.shape[-1])
