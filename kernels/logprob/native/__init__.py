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

from kernels.logprob.contract import Platform
from kernels.logprob.registry import BackendUnavailable
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
    name = "native"

    def __init__(self, ext) -> None:
        self._ext = ext

    def partials(self, logits, targets, layout: ShardLayout, temperature: float, with_entropy: bool):
        if with_entropy:
            raise NotImplementedError("native backend has no entropy output (the registry refuses such contracts)")
        real_hi = min(layout.local_vocab_size, layout.global_vocab_size - layout.vocab_start)
        m, s, tgt = self._ext.partials(
            logits, targets, layout.slots_per_rank, real_hi, layout.slot_col_offset, layout.vocab_start,
            layout.global_vocab_size, layout.tile_width, float(temperature),
        )
        return m.t(), s.t(), None, tgt

    def merge(self, m, s, w, tgt, targets, global_vocab_size: int, active):
        if s.stride() != m.stride():
            m, s = m.contiguous(), s.contiguous()
        logp, lse = self._ext.merge(m, s, tgt, targets, active, global_vocab_size)
        return logp, lse, None

    def backward(self, logits, targets, lse, mean_x, g_logp, g_lse, g_ent, active, layout, temperature):
        return self._ext.backward(
            logits, targets, lse, g_logp, g_lse, active, layout.vocab_start, layout.global_vocab_size, float(temperature)
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
