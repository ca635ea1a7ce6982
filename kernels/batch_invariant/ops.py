"""The batch-invariant ops: argument checks, explicit dispatch by device, autograd.

`impl="auto"` runs the Triton kernels on CUDA/ROCm tensors and the pure-torch implementation
(reference.py, itself batch-invariant) on CPU tensors. `impl="reference"` forces the pure-torch
code on any device; `impl="triton"` forces the kernels, which on CPU tensors needs Triton's
interpreter (TRITON_INTERPRET=1, as the CPU tests run). Nothing falls back: an unsupported
dtype, device or shape raises `BatchInvariantInputError` naming the argument.

Only forwards are batch-invariant. bi_linear, bi_rms_norm and packed_attention are
differentiable through torch.autograd.Function whose backward is ordinary torch math
(matmuls; RMSNorm and attention recomputed with plain torch and differentiated), so training
pays fast kernels in backward and the recompute's bits never reach a log-prob.
"""
from __future__ import annotations

import os
from typing import Literal

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from kernels.batch_invariant import reference
from kernels.batch_invariant.errors import BatchInvariantInputError

Impl = Literal["auto", "reference", "triton"]
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# ---- checks ---------------------------------------------------------------------------------------
def _check_float(name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise BatchInvariantInputError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in SUPPORTED_DTYPES:
        raise BatchInvariantInputError(
            f"{name} has dtype {t.dtype}; batch-invariant ops compute in {[str(d) for d in SUPPORTED_DTYPES]}")


def _check_same(what: str, names: tuple[str, ...], values: tuple) -> None:
    if len(set(values)) != 1:
        pairs = ", ".join(f"{n}={v}" for n, v in zip(names, values))
        raise BatchInvariantInputError(f"{'/'.join(names)} must share one {what}; got {pairs}")


def _resolve(impl: str, device: torch.device, op: str) -> str:
    if impl not in ("auto", "reference", "triton"):
        raise BatchInvariantInputError(f"impl must be 'auto', 'reference' or 'triton', got {impl!r}")
    if device.type not in ("cpu", "cuda"):
        raise BatchInvariantInputError(
            f"{op}: tensors on {device.type!r}; batch-invariant ops run on cpu and cuda/rocm devices")
    if impl == "auto":
        return "reference" if device.type == "cpu" else "triton"
    if impl == "triton" and device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise BatchInvariantInputError(
            f"{op}: impl='triton' on CPU tensors needs Triton's interpreter (TRITON_INTERPRET=1 before "
            "triton is imported); use impl='auto' or 'reference' on CPU")
    return impl


def _triton():
    from kernels.batch_invariant import triton_launch

    return triton_launch


# ---- linear ---------------------------------------------------------------------------------------
def _check_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    _check_float("x", x)
    _check_float("weight", weight)
    if x.dim() < 1:
        raise BatchInvariantInputError("x must have at least one dimension [..., K]")
    if weight.dim() != 2:
        raise BatchInvariantInputError(f"weight must be [N, K], got shape {tuple(weight.shape)}")
    if x.shape[-1] != weight.shape[1]:
        raise BatchInvariantInputError(
            f"x's last dim ({x.shape[-1]}) must equal weight's K (weight shape {tuple(weight.shape)})")
    tensors = (("x", x), ("weight", weight)) + ((("bias", bias),) if bias is not None else ())
    if bias is not None:
        _check_float("bias", bias)
        if bias.shape != (weight.shape[0],):
            raise BatchInvariantInputError(f"bias must be [N]=[{weight.shape[0]}], got {tuple(bias.shape)}")
    names = tuple(n for n, _ in tensors)
    _check_same("dtype", names, tuple(t.dtype for _, t in tensors))
    _check_same("device", names, tuple(t.device for _, t in tensors))


def _linear_forward(x, weight, bias, impl: str) -> torch.Tensor:
    if impl == "reference":
        return reference.linear(x, weight, bias)
    return _triton().linear(x, weight, bias)


class _LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, impl):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _linear_forward(x, weight, bias, impl)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        g = grad_out.reshape(-1, weight.shape[0])
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = (g @ weight).reshape(x.shape)
        if ctx.needs_input_grad[1]:
            grad_w = g.t() @ x.reshape(-1, weight.shape[1])
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = g.float().sum(0).to(weight.dtype)
        return grad_x, grad_w, grad_b, None


def bi_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
              impl: Impl = "auto") -> torch.Tensor:
    """x [..., K] @ weight[N, K].T + bias, accumulated in fp32 in an order independent of the rows; x.dtype out."""
    _check_linear(x, weight, bias)
    chosen = _resolve(impl, x.device, "bi_linear")
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias)):
        return _LinearFn.apply(x, weight, bias, chosen)
    return _linear_forward(x, weight, bias, chosen)


# ---- RMSNorm --------------------------------------------------------------------------------------
def _torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def _rms_forward(x, weight, eps, impl: str) -> torch.Tensor:
    if impl == "reference":
        return reference.rms_norm(x, weight, eps)
    return _triton().rms_norm(x, weight, eps)


class _RmsNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, impl):
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        return _rms_forward(x, weight, eps, impl)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        with torch.enable_grad():
            xd = x.detach().requires_grad_(ctx.needs_input_grad[0])
            wd = weight.detach().requires_grad_(ctx.needs_input_grad[1])
            out = _torch_rms_norm(xd, wd, ctx.eps)
            wanted = [t for t in (xd, wd) if t.requires_grad]
            grads = iter(torch.autograd.grad(out, wanted, grad_out))
        return (next(grads) if xd.requires_grad else None), (next(grads) if wd.requires_grad else None), None, None


def bi_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, impl: Impl = "auto") -> torch.Tensor:
    """HF Qwen3RMSNorm / LlamaRMSNorm, one row at a time: weight * (x.float() * rsqrt(mean(x^2) + eps)).to(x.dtype)."""
    _check_float("x", x)
    _check_float("weight", weight)
    if x.dim() < 1 or weight.shape != (x.shape[-1],):
        raise BatchInvariantInputError(
            f"weight must be [H] with H = x's last dim; got x {tuple(x.shape)}, weight {tuple(weight.shape)}")
    _check_same("device", ("x", "weight"), (x.device, weight.device))
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
        raise BatchInvariantInputError(f"eps must be a float >= 0, got {eps!r}")
    chosen = _resolve(impl, x.device, "bi_rms_norm")
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _RmsNormFn.apply(x, weight, float(eps), chosen)
    return _rms_forward(x, weight, float(eps), chosen)


# ---- attention ------------------------------------------------------------------------------------
def _check_scale(scale) -> float:
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0:
        raise BatchInvariantInputError(f"scale must be a float > 0, got {scale!r}")
    return float(scale)


def _check_heads(q_name: str, q: torch.Tensor, kv_name: str, kv: torch.Tensor, head_axis: int) -> None:
    n_heads, n_kv = q.shape[1], kv.shape[head_axis]
    if n_kv < 1 or n_heads % n_kv:
        raise BatchInvariantInputError(
            f"{q_name}'s heads ({n_heads}) must be a multiple of {kv_name}'s kv heads ({n_kv})")
    if q.shape[-1] != kv.shape[-1]:
        raise BatchInvariantInputError(
            f"{q_name} and {kv_name} must share head_dim; got {q.shape[-1]} and {kv.shape[-1]}")


def _check_packed(q, k, v, cu_seqlens, max_seqlen) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_float(name, t)
        if t.dim() != 3:
            raise BatchInvariantInputError(f"{name} must be [T, heads, head_dim], got shape {tuple(t.shape)}")
    if not (q.shape[0] == k.shape[0] == v.shape[0]):
        raise BatchInvariantInputError(f"q/k/v must share T; got {q.shape[0]}, {k.shape[0]}, {v.shape[0]}")
    if k.shape != v.shape:
        raise BatchInvariantInputError(f"k and v must have one shape; got {tuple(k.shape)} and {tuple(v.shape)}")
    _check_heads("q", q, "k", k, 1)
    _check_same("dtype", ("q", "k", "v"), (q.dtype, k.dtype, v.dtype))
    _check_same("device", ("q", "k", "v", "cu_seqlens"), (q.device, k.device, v.device, cu_seqlens.device))
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.dtype != torch.int32:
        raise BatchInvariantInputError(
            f"cu_seqlens must be 1-D int32 [S+1] with S >= 1; got {cu_seqlens.dtype} {tuple(cu_seqlens.shape)}")
    if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int) or max_seqlen < 1:
        raise BatchInvariantInputError(f"max_seqlen must be a Python int >= 1, got {max_seqlen!r}")


class _CheckedLayouts:
    """The last few cu_seqlens whose values were checked, by identity and version counter.

    Every layer of a forward passes the same cu_seqlens tensor, so the host read happens once per
    forward; a strong reference keeps an id from being reused while it is remembered.
    """

    def __init__(self, size: int = 8) -> None:
        self._size = size
        self._entries: list[tuple[tuple, torch.Tensor]] = []

    def check(self, cu_seqlens: torch.Tensor, total: int, max_seqlen: int) -> None:
        key = (id(cu_seqlens), cu_seqlens._version, total, max_seqlen)
        if any(k == key for k, _ in self._entries):
            return
        if cu_seqlens.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            # A host read would break graph capture; the eager warm-up call of a captured graph checks them.
            return
        _check_cu_values(cu_seqlens, total, max_seqlen)
        self._entries.append((key, cu_seqlens))
        del self._entries[: -self._size]


_checked_layouts = _CheckedLayouts()


def _check_cu_values(cu_seqlens: torch.Tensor, total: int, max_seqlen: int) -> None:
    cu = cu_seqlens.detach().to("cpu", torch.int64)
    lengths = cu[1:] - cu[:-1]
    if int(cu[0]) != 0 or int(cu[-1]) != total:
        raise BatchInvariantInputError(f"cu_seqlens must run from 0 to T={total}; got {int(cu[0])}..{int(cu[-1])}")
    if bool((lengths < 1).any()):
        raise BatchInvariantInputError("cu_seqlens must be strictly increasing (no empty sequences)")
    if int(lengths.max()) > max_seqlen:
        raise BatchInvariantInputError(
            f"max_seqlen={max_seqlen} is less than the longest sequence ({int(lengths.max())}): keys would be skipped")


def _packed_forward(q, k, v, cu_seqlens, max_seqlen, scale, impl: str) -> torch.Tensor:
    if impl == "reference":
        return reference.packed_attention(q, k, v, cu_seqlens, scale)
    return _triton().packed_attention(q, k, v, cu_seqlens, max_seqlen, scale)


def _sdpa_packed(q, k, v, cu_seqlens, scale) -> torch.Tensor:
    """Plain torch causal attention per sequence: the backward's recompute, differentiated by autograd.

    On GPUs SDPA may use only the flash kernels (whose backward takes its deterministic path under
    torch.use_deterministic_algorithms(True)) or the math path: the memory-efficient and cuDNN
    backwards are not deterministic. KV heads are repeated for the flash kernels (autograd sums
    their gradients back in a fixed order).
    """
    gqa = q.shape[1] != k.shape[1]
    on_gpu = q.device.type == "cuda"
    if gqa and on_gpu:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        gqa = False
    backends = ([SDPBackend.FLASH_ATTENTION, SDPBackend.MATH] if on_gpu and not torch.version.hip
                else [SDPBackend.MATH])
    bounds = cu_seqlens.tolist()
    outs = []
    with sdpa_kernel(backends):
        for start, end in zip(bounds[:-1], bounds[1:]):
            qi, ki, vi = (t[start:end].transpose(0, 1).unsqueeze(0) for t in (q, k, v))
            o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=end - start > 1, scale=scale, enable_gqa=gqa)
            outs.append(o[0].transpose(0, 1))
    return torch.cat(outs, dim=0)


def _varlen_packed(q, k, v, cu_seqlens, max_seqlen, scale) -> torch.Tensor:
    """The whole buffer in one FlashAttention-2 varlen call (torch's own kernels, CUDA only): the
    backward's recompute where it exists. A per-sequence loop costs one SDPA forward and backward
    per sequence and layer, which at RL batch sizes (hundreds of sequences) dominates the step."""
    from kernels.attention.contract import PackedLayout
    from kernels.attention.torch_varlen import attention

    return attention(q, k, v, PackedLayout(cu_seqlens, max_seqlen), scale, None,
                     torch.are_deterministic_algorithms_enabled())


def _backward_recompute(device: torch.device) -> str:
    """Which kernel recomputes attention for the backward: decided by the platform, never by a failure."""
    if device.type == "cuda" and not torch.version.hip:
        from kernels.attention.torch_varlen import unavailable_reason

        if unavailable_reason("cuda") is None:
            return "varlen"
    return "sdpa"


class _PackedAttentionFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, max_seqlen, scale, impl):
        ctx.save_for_backward(q, k, v, cu_seqlens)
        ctx.scale, ctx.max_seqlen = scale, max_seqlen
        return _packed_forward(q, k, v, cu_seqlens, max_seqlen, scale, impl)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, cu_seqlens = ctx.saved_tensors
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_(need) for t, need in zip((q, k, v), ctx.needs_input_grad[:3])]
            if _backward_recompute(q.device) == "varlen":
                out = _varlen_packed(*leaves, cu_seqlens, ctx.max_seqlen, ctx.scale)
            else:
                out = _sdpa_packed(*leaves, cu_seqlens, ctx.scale)
            wanted = [t for t in leaves if t.requires_grad]
            grads = iter(torch.autograd.grad(out, wanted, grad_out))
        return (*(next(grads) if t.requires_grad else None for t in leaves), None, None, None, None)


def packed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
                     scale: float, *, impl: Impl = "auto") -> torch.Tensor:
    """Causal attention within each sequence of a packed buffer, keys reduced in KEY_BLOCK blocks.

    q [T, H, D], k/v [T, Hkv, D] (H % Hkv == 0), cu_seqlens int32 [S+1]; returns [T, H, D] in q's dtype.
    max_seqlen may be an upper bound of the longest sequence (the Triton grid is sized by it).
    cu_seqlens' values are checked on the host once per tensor (not per layer, not under graph capture).
    """
    _check_packed(q, k, v, cu_seqlens, max_seqlen)
    scale = _check_scale(scale)
    _checked_layouts.check(cu_seqlens, q.shape[0], max_seqlen)
    chosen = _resolve(impl, q.device, "packed_attention")
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        return _PackedAttentionFn.apply(q, k, v, cu_seqlens, max_seqlen, scale, chosen)
    return _packed_forward(q, k, v, cu_seqlens, max_seqlen, scale, chosen)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, lengths: torch.Tensor,
                     scale: float, *, impl: Impl = "auto") -> torch.Tensor:
    """One query per row: row b (position lengths[b]-1) attends keys [0, lengths[b]) of cache row b.

    q [B, H, D], k_cache/v_cache [B, Hkv, Lcap, D], lengths int32 [B] in [1, Lcap]; returns [B, H, D].
    Cache entries at or beyond lengths[b] are never read into the result (they may hold NaN).
    On GPUs the lengths are not read on the host (decode steps run under CUDA graph capture): a
    length outside [1, Lcap] is the caller's bug there (the kernel still never reads beyond Lcap);
    on CPU it is refused.
    Inference only: raises if any input requires grad.
    """
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        _check_float(name, t)
    if q.dim() != 3:
        raise BatchInvariantInputError(f"q must be [B, H, D], got shape {tuple(q.shape)}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dim() != 4 or t.shape[0] != q.shape[0]:
            raise BatchInvariantInputError(f"{name} must be [B={q.shape[0]}, Hkv, Lcap, D], got {tuple(t.shape)}")
    if k_cache.shape != v_cache.shape:
        raise BatchInvariantInputError(
            f"k_cache and v_cache must have one shape; got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    _check_heads("q", q, "k_cache", k_cache, 1)
    _check_same("dtype", ("q", "k_cache", "v_cache"), (q.dtype, k_cache.dtype, v_cache.dtype))
    _check_same("device", ("q", "k_cache", "v_cache", "lengths"), (q.device, k_cache.device, v_cache.device,
                                                                    lengths.device))
    if lengths.dim() != 1 or lengths.shape[0] != q.shape[0] or lengths.dtype != torch.int32:
        raise BatchInvariantInputError(
            f"lengths must be int32 [B={q.shape[0]}], got {lengths.dtype} {tuple(lengths.shape)}")
    scale = _check_scale(scale)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k_cache, v_cache)):
        raise BatchInvariantInputError("decode_attention is inference-only: q/k_cache/v_cache must not require grad")
    chosen = _resolve(impl, q.device, "decode_attention")
    if q.shape[0] == 0:
        return torch.empty_like(q)
    if chosen == "reference":
        if q.device.type == "cpu":
            lens = lengths.to(torch.int64)
            if bool(((lens < 1) | (lens > k_cache.shape[2])).any()):
                raise BatchInvariantInputError(
                    f"lengths must lie in [1, Lcap={k_cache.shape[2]}], got {lengths.tolist()[:16]}")
        return reference.decode_attention(q, k_cache, v_cache, lengths, scale)
    return _triton().decode_attention(q, k_cache, v_cache, lengths, scale)
