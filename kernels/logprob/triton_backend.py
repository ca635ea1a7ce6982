"""Launchers for the Triton kernels (triton_kernels.py) behind the backend interface.

Imported lazily by the registry. On CPU the Triton backend exists only as the
interpreter (TRITON_INTERPRET=1, which Triton reads when the kernels are
decorated, i.e. at import): for correctness tests, never for speed.

Launches go through triton_launch.KernelLauncher: on NVIDIA a kernel compiled
for a launch key is re-launched directly, without the JIT binding ~25
arguments per call (H200 host: bench/results/logprob_host_h200.json).
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

from kernels.logprob.contract import BackendUnavailable, Platform
from kernels.logprob.tiling import ShardLayout
from kernels.logprob.triton_launch import KernelLauncher, compiled_launch_supported



def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


@dataclass(frozen=True)
class PartialsConfig:
    """Launch shape of the partials kernel: a function of (tile width, dtype, alignment) only, never of T."""

    tile_w: int
    align: int
    """Load-window alignment in elements (16 bytes; 1 when the rows are not 16-byte aligned)."""
    chunk: int
    """Columns per chunk of the online (max, sumexp) loop."""
    num_chunks: int
    slots_per_program: int
    """Tiles one program reduces side by side ([SPP, CHUNK] block)."""
    num_warps: int

    @staticmethod
    def for_tile(tile_w: int, dtype: torch.dtype, slots: int, aligned: bool = True) -> "PartialsConfig":
        # Cached: a pure function of its arguments and of the module defaults, which the
        # benchmark's sweep changes (so they are part of the key).
        return _partials_config(tile_w, dtype, slots, aligned, SLOTS_PER_PROGRAM, PARTIALS_CHUNK,
                                PARTIALS_NUM_WARPS)

    @staticmethod
    def _build(tile_w: int, dtype: torch.dtype, slots: int, aligned: bool) -> "PartialsConfig":
        """`slots` (the layout's slots per rank) matters only in the interpreter (see INTERPRETED)."""
        align = 16 // torch.empty((), dtype=dtype).element_size() if aligned else 1
        span = tile_w + align - 1  # the aligned window may start up to align-1 columns early
        chunk = min(_next_pow2(span), PARTIALS_CHUNK)
        # The CPU interpreter pays ~10 ms per program, so there one program takes all
        # slots of a row; on a GPU one tile per program keeps T x 64 programs in flight.
        spp = _next_pow2(slots) if INTERPRETED else SLOTS_PER_PROGRAM
        return PartialsConfig(tile_w, align, chunk, -(-span // chunk), spp, PARTIALS_NUM_WARPS)


@functools.lru_cache(maxsize=256)
def _partials_config(tile_w, dtype, slots, aligned, _spp, _chunk, _warps) -> PartialsConfig:
    return PartialsConfig._build(tile_w, dtype, slots, aligned)


SLOTS_PER_PROGRAM = 1
PARTIALS_CHUNK = 512  # H200 sweep at T=16384: 1 warp x 512 -> 93% of the HBM floor; 256 ties, 1024 76%
PARTIALS_NUM_WARPS = 1  # one warp per tile: reductions stay in-warp (2 warps 67%, 4 warps 52%)
INTERPRETED = os.environ.get("TRITON_INTERPRET", "") == "1"  # as Triton saw it when the kernels were decorated
BACKWARD_BLOCK = 4096
BACKWARD_NUM_WARPS = 4
MERGE_BLOCK_T = 128
FUSED_FORWARD = False
"""TP 1 forward as one launch (partials kernel with FUSED: the last program of a row merges it).
Bitwise equal to partials + merge (tests check it; so did the H200 run), but OFF: on the H200 it
was slower -- do_bench 0.271 vs 0.172 ms at T=2048, 2.11 vs 1.27 ms at T=16384 (the barrier and
counter atomic in every one of the T x 64 programs, and the merge code in the kernel, cost more
than the merge launch they save). Kept, tested, so the benchmark can re-measure it."""


class TritonBackend:
    name = "triton"

    def __init__(self, kernels, reuse_compiled: bool = False) -> None:
        self._k = kernels
        # Arguments go to the launchers positionally, in each kernel's signature order (constexprs too).
        self._partials = KernelLauncher(kernels.logprob_partials_kernel, reuse_compiled)
        self._merge = KernelLauncher(kernels.logprob_merge_kernel, reuse_compiled)
        self._backward = KernelLauncher(kernels.logprob_backward_kernel, reuse_compiled)

    def _launch_partials(self, logits, targets, layout, temperature, with_entropy, fused=None):
        """Partials into one slot-major scratch [2|3, S, T] + [T]: one allocation, not four."""
        T = logits.shape[0]
        S = layout.slots_per_rank
        esize = logits.element_size()
        # 16-byte vector loads need 16-byte aligned rows and a row length that the rounded-up
        # load bound cannot overrun; otherwise the same kernel runs with scalar loads.
        ptr16 = logits.data_ptr() % 16 == 0
        aligned = ptr16 and (logits.stride(0) * esize) % 16 == 0 and (layout.local_vocab_size * esize) % 16 == 0
        cfg = PartialsConfig.for_tile(layout.tile_width, logits.dtype, S, aligned)
        # Slot-major [S, T] so the merge reads each slot coalesced; returned as [T, S] views.
        # One split (one call) rather than view + index per part: host time is the T=2048 bottleneck.
        planes = (S * T, S * T, S * T, T) if with_entropy else (S * T, S * T, T)
        parts = torch.empty(sum(planes), device=logits.device, dtype=torch.float32).split_with_sizes(planes)
        m, s, tgt = parts[0], parts[1], parts[-1]
        w = parts[2] if with_entropy else s
        real_hi = min(layout.local_vocab_size, layout.global_vocab_size - layout.vocab_start)
        if T > 0:
            if fused is None:
                extra, fused_const = (tgt, tgt, tgt, tgt, tgt), (False, 1, False)
            else:
                cnt, active, logp, lse, ent = fused
                extra = (cnt, active if active is not None else targets, logp, lse, ent if ent is not None else lse)
                fused_const = (True, S, active is not None)
            scale = temperature != 1.0
            stride = logits.stride(0)
            self._partials.launch(
                # What the JIT specializes on besides the row count (see triton_kernels.py): the
                # layout fixes every other size; the row stride and the pointer are the caller's.
                (logits.dtype, ptr16, stride % 16 == 0, stride == 1, layout, cfg, with_entropy, scale, fused_const),
                (T, triton_cdiv(S, cfg.slots_per_program), 1),
                (logits, targets, m, s, w, tgt,
                 stride, layout.local_vocab_size, real_hi, layout.slot_col_offset, layout.vocab_start,
                 layout.global_vocab_size, T, S, float(temperature), *extra,
                 # TILE_W, CHUNK, ALIGN, NUM_CHUNKS, SPP, WITH_ENT, SCALE, FUSED, N_SLOTS, HAS_MASK
                 cfg.tile_w, cfg.chunk, cfg.align, cfg.num_chunks, cfg.slots_per_program, with_entropy, scale,
                 *fused_const),
                cfg.num_warps,
            )
        return m, s, (w if with_entropy else None), tgt

    def partials(self, logits, targets, layout: ShardLayout, temperature: float, with_entropy: bool):
        m, s, w, tgt = self._launch_partials(logits, targets, layout, temperature, with_entropy)
        S, T = layout.slots_per_rank, logits.shape[0]
        return m.view(S, T).t(), s.view(S, T).t(), (w.view(S, T).t() if w is not None else None), tgt

    def local_forward(self, logits, targets, layout: ShardLayout, temperature: float, with_entropy: bool, active):
        """TP 1: (logp, lse, ent|None), bitwise equal to merge(partials(...)) -- the path TP > 1 takes.

        The common case's short path: the slot-major scratch goes straight to the merge kernel
        (no transposed views, stride checks or copies), so the host issues the two launches with
        as little Python between them as possible -- at T=2048 the host, not the GPU, is the
        bottleneck of an isolated call. FUSED_FORWARD switches to the one-launch kernel
        (slower on the H200, kept measurable)."""
        if FUSED_FORWARD:
            return self.fused_forward(logits, targets, layout, temperature, with_entropy, active)
        m, s, w, tgt = self._launch_partials(logits, targets, layout, temperature, with_entropy)
        return self._launch_merge(m, s, w, tgt, targets, layout.global_vocab_size, active,
                                  n_slots=layout.slots_per_rank, stride_row=1, stride_slot=logits.shape[0])

    def fused_forward(self, logits, targets, layout: ShardLayout, temperature: float, with_entropy: bool, active):
        """TP 1 only: (logp, lse, ent|None) in one launch, bitwise equal to merge(partials(...))."""
        if layout.tp_world_size != 1:
            raise ValueError("fused_forward needs every tile of the row in one launch (TP 1)")
        T = logits.shape[0]
        logp, lse, ent = _outputs(T, logits.device, with_entropy)
        cnt = torch.zeros((T,), device=logits.device, dtype=torch.int32)  # arrivals per row
        self._launch_partials(logits, targets, layout, temperature, with_entropy, (cnt, active, logp, lse, ent))
        return logp, lse, ent

    def merge(self, m, s, w, tgt, targets, global_vocab_size: int, active):
        if s.stride() != m.stride() or (w is not None and w.stride() != m.stride()):
            s, w, m = s.contiguous(), (w.contiguous() if w is not None else None), m.contiguous()
        return self._launch_merge(m, s, w, tgt, targets, global_vocab_size, active, m.shape[1], m.stride(0), m.stride(1))

    def _launch_merge(self, m, s, w, tgt, targets, global_vocab_size, active, n_slots, stride_row, stride_slot):
        """m, s, w: n_slots partials per row, at base + row * stride_row + slot * stride_slot."""
        T = tgt.shape[0]
        logp, lse, ent = _outputs(T, tgt.device, w is not None)
        if T > 0:
            const = (n_slots, MERGE_BLOCK_T, w is not None, active is not None)  # N_SLOTS, BLOCK_T, WITH_ENT, HAS_MASK
            self._merge.launch(
                const, (triton_cdiv(T, MERGE_BLOCK_T), 1, 1),
                (m, s, w if w is not None else s, tgt, targets, active if active is not None else targets,
                 logp, lse, ent if ent is not None else lse,
                 T, stride_row, stride_slot, global_vocab_size, *const),
                4,
            )
        return logp, lse, ent

    # The autograd Function may pass g_lse / g_ent as None (no gradient flows there) and g_logp
    # with any row stride (0 for an expanded scalar): no zeros or copy kernels per step.
    accepts_none_grads = True

    def backward(self, logits, targets, lse, mean_x, g_logp, g_lse, g_ent, active, layout, temperature):
        T, V = logits.shape
        if g_logp is None:
            g_logp = torch.zeros((1,), device=logits.device, dtype=torch.float32).expand(T)
        grad = torch.empty((T, V), device=logits.device, dtype=logits.dtype)
        block = min(BACKWARD_BLOCK, _next_pow2(V))
        if T > 0:
            stride = logits.stride(0)
            # BLOCK, WITH_ENT, HAS_MASK, SCALE, HAS_GLSE
            const = (block, g_ent is not None and mean_x is not None, active is not None, temperature != 1.0,
                     g_lse is not None)
            self._backward.launch(
                (logits.dtype, logits.data_ptr() % 16 == 0, stride % 16 == 0, stride == 1, grad.data_ptr() % 16 == 0,
                 layout, BACKWARD_NUM_WARPS, *const),
                (T, triton_cdiv(V, block), 1),
                (logits, grad, targets, lse, mean_x if mean_x is not None else lse, g_logp,
                 g_lse if g_lse is not None else lse, g_ent if g_ent is not None else lse,
                 active if active is not None else targets,
                 stride, grad.stride(0), V, layout.vocab_start, layout.global_vocab_size,
                 float(temperature), g_logp.stride(0), *const),
                BACKWARD_NUM_WARPS,
            )
        return grad


def _outputs(T: int, device, with_entropy: bool):
    """logp, lse[, ent] fp32 [T] as rows of one allocation (ent None without entropy)."""
    outs = torch.empty((3 if with_entropy else 2, T), device=device, dtype=torch.float32).unbind(0)
    return outs[0], outs[1], (outs[2] if with_entropy else None)


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def load_triton_backend(platform: Platform) -> TritonBackend:
    interpret = INTERPRETED
    if platform is Platform.CPU and not interpret:
        raise BackendUnavailable(
            "Triton runs on CPU only in its interpreter: set TRITON_INTERPRET=1 before the first import"
        )
    if platform is not Platform.CPU and interpret:
        raise BackendUnavailable("TRITON_INTERPRET=1 is set: kernels would run in the CPU interpreter, not on the GPU")
    try:
        from kernels.logprob import triton_kernels
    except ImportError as e:
        raise BackendUnavailable(f"triton is not importable ({e}); install it: pip install triton==3.6.0") from None
    from triton.runtime.interpreter import InterpretedFunction

    if isinstance(triton_kernels.logprob_partials_kernel, InterpretedFunction) != interpret:
        raise BackendUnavailable(
            "TRITON_INTERPRET changed after the Triton kernels were imported; set it before the first import"
        )
    return TritonBackend(triton_kernels, reuse_compiled=compiled_launch_supported(platform is Platform.CUDA, interpret))
