"""Native CUDA/HIP backend: logprob_kernels.cu (one source, portability.h) built as a torch extension.

Built on first use with torch.utils.cpp_extension (nvcc on CUDA; on ROCm torch
hipifies the same source for hipcc) into a cache keyed by the source hash, so
an edited kernel is never served from a stale build. A failed build makes the
backend unavailable with the compiler's message: an explicit request raises it,
`auto` lists it among the rejected candidates.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch

from kernels.logprob.contract import BackendUnavailable, Platform
from kernels.logprob.tiling import ShardLayout

SRC_DIR = Path(__file__).resolve().parent
SOURCES = ("portability.h", "logprob_kernels.cu", "binding.cpp")


def source_hash() -> str:
    h = hashlib.sha256()
    for name in SOURCES:
        h.update((SRC_DIR / name).read_bytes())
    return h.hexdigest()[:16]


def _build(platform: Platform):
    from torch.utils import cpp_extension

    name = f"lockstep_logprob_native_{source_hash()}"
    build_dir = Path(os.environ.get("LOCKSTEP_EXT_CACHE", Path.home() / ".cache" / "lockstep" / "ext")) / name
    build_dir.mkdir(parents=True, exist_ok=True)
    flags = ["-O3"] if platform is Platform.ROCM else ["-O3", "-lineinfo"]
    return cpp_extension.load(
        name=name,
        sources=[str(SRC_DIR / "binding.cpp"), str(SRC_DIR / "logprob_kernels.cu")],
        extra_cuda_cflags=flags,
        extra_include_paths=[str(SRC_DIR)],
        build_directory=str(build_dir),
        verbose=False,
    )


class NativeBackend:
    """The three steps of the definition on the native kernels (see logprob_kernels.cu for the design)."""

    name = "native"
    # The autograd Function may pass g_logp / g_lse / g_ent as None (no gradient flows there) and
    # g_logp with any row stride (0 for an expanded scalar): the kernels read them as they come.
    accepts_none_grads = True

    def __init__(self, ext) -> None:
        self._ext = ext

    def partials(self, logits, targets, layout: ShardLayout, temperature: float, with_entropy: bool):
        real_hi = min(layout.local_vocab_size, layout.global_vocab_size - layout.vocab_start)
        out = self._ext.partials(
            logits, targets, layout.slots_per_rank, real_hi, layout.slot_col_offset, layout.vocab_start,
            layout.global_vocab_size, layout.tile_width, float(temperature), bool(with_entropy),
        )
        # Stored slot-major [S, T] (the merge reads each slot coalesced); returned as [T, S] views.
        if with_entropy:
            m, s, w, tgt = out
            return m.t(), s.t(), w.t(), tgt
        m, s, tgt = out
        return m.t(), s.t(), None, tgt

    def merge(self, m, s, w, tgt, targets, global_vocab_size: int, active):
        if s.stride() != m.stride() or (w is not None and w.stride() != m.stride()):
            m, s, w = m.contiguous(), s.contiguous(), (w.contiguous() if w is not None else None)
        out = self._ext.merge(m, s, w, tgt, targets, active, global_vocab_size)
        return out[0], out[1], (out[2] if w is not None else None)

    def backward(self, logits, targets, lse, mean_x, g_logp, g_lse, g_ent, active, layout, temperature):
        return self._ext.backward(
            logits, targets, lse, mean_x, g_logp, g_lse, g_ent, active, layout.vocab_start,
            layout.global_vocab_size, float(temperature),
        )


def load_native_backend(platform: Platform) -> NativeBackend:
    if platform is Platform.CPU:
        raise BackendUnavailable("the native backend has no CPU build")
    if not torch.cuda.is_available():
        raise BackendUnavailable("no CUDA/ROCm device visible to torch")
    try:
        ext = _build(platform)
    except Exception as e:  # compiler output is the useful part of the message
        raise BackendUnavailable(f"building the native extension failed: {str(e)[-2000:]}") from None
    return NativeBackend(ext)
