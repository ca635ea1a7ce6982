"""The native CUDA/HIP source, run on the CPU: logprob_kernels.cu compiled by g++ against a small
emulator of the CUDA subset it uses (each block's lanes are cooperative fibers; an xor shuffle is
a barrier over the block), then driven through the real NativeBackend and the public API.

What this checks without a GPU: the kernels' indexing, tile windows, masks, online max, reduction
order, merge and gradient formula, the C launchers' dispatch and vector/element path choice, and
NativeBackend's plumbing -- against reference.py and fp64, and the bitwise claims (batch
composition, TP degree, load path). What it cannot check: the platform intrinsics (the emulator
supplies exp2 and fp16 conversions of its own) and performance; tests/kernels/logprob/test_logprob_gpu.py
runs the same claims on a GPU.
"""
from __future__ import annotations

import ctypes
import re
import shutil
import subprocess

import pytest
import torch

from kernels.logprob import emulate_tensor_parallel, registry, token_logprobs, token_logprobs_with_entropy
from kernels.logprob.contract import Platform
from kernels.logprob.native import SRC_DIR, NativeBackend
from kernels.logprob.reference import ReferenceBackend
from kernels.logprob.tiling import ShardLayout
from tests.conftest import require
from tests.kernels.logprob.logprob_oracle import (
    check_adversarial_rows, check_padded_columns_are_excluded, close, oracle,
)

# The emulator: just enough of the CUDA runtime for logprob_kernels.cu. One OS thread runs a block's
# lanes as ucontext fibers, round robin; ls_shfl_xor32 is two barriers (write, then read), and it
# checks that the partner lane reached the same shuffle, i.e. that lane groups stay converged.
SHIM = r"""
#include <ucontext.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <stdio.h>
#include <stdlib.h>
#include <vector>
#include <functional>
#define LS_CPU_EMULATION 1
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
struct dim3 { unsigned x, y, z; dim3(unsigned a = 1, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {} };
struct alignas(16) uint4 { unsigned x, y, z, w; };
static dim3 threadIdx, blockIdx;
typedef void* ls_stream_t;
typedef int ls_error_t;
#define LS_SUCCESS 0
static int ls_get_last_error() { return 0; }
static const char* ls_error_string(int) { return "emulator error"; }
static inline float __uint_as_float(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t __float_as_uint(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float ls_exp(float d) { return exp2f(d * 1.4426950408889634f); }
static inline float ls_half_to_float(uint16_t b) { _Float16 h; memcpy(&h, &b, 2); return (float)h; }
static inline uint32_t ls_pack_half2(float lo, float hi) {
  _Float16 h[2] = {(_Float16)lo, (_Float16)hi}; uint32_t u; memcpy(&u, h, 4); return u;
}

namespace emu {
struct Fiber { ucontext_t ctx; std::vector<char> stack; bool done; };
static ucontext_t scheduler;
static std::vector<Fiber> fibers;
static std::vector<unsigned long> shuffles;  // shuffles each lane has entered in this block
static std::vector<float> exchange;
static const std::function<void()>* body;
static unsigned current;
static int misaligned_shuffles;

static void lane_main() { (*body)(); fibers[current].done = true; }
static void yield() { swapcontext(&fibers[current].ctx, &scheduler); }

static void run_block(unsigned n, const std::function<void()>& fn) {
  body = &fn;
  fibers.resize(n); shuffles.assign(n, 0); exchange.assign(n, 0.f);
  for (unsigned t = 0; t < n; ++t) {
    Fiber& f = fibers[t];
    f.stack.resize(1 << 16);
    f.done = false;
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = f.stack.data();
    f.ctx.uc_stack.ss_size = f.stack.size();
    f.ctx.uc_link = &scheduler;
    makecontext(&f.ctx, lane_main, 0);
  }
  for (bool live = true; live;) {
    live = false;
    for (unsigned t = 0; t < n; ++t) {
      if (fibers[t].done) continue;
      current = t;
      threadIdx = dim3(t);
      swapcontext(&scheduler, &fibers[t].ctx);
      live = live || !fibers[t].done;
    }
  }
}

template <class... P> struct Launch {
  dim3 grid; unsigned block; void (*fn)(P...);
  template <class... A> void operator()(A... args) const {
    const std::function<void()> lane = [&] { fn(args...); };
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) { blockIdx = dim3(x, y); run_block(block, lane); }
  }
};
template <class... P> Launch<P...> launch(dim3 g, dim3 b, void (*fn)(P...)) { return Launch<P...>{g, b.x, fn}; }
}  // namespace emu

#define LS_LAUNCH(grid, block, stream, ...) emu::launch(dim3(grid), dim3(block), &__VA_ARGS__)

static inline float ls_shfl_xor32(float v, int lane_mask) {
  const unsigned t = emu::current, src = (t & ~31u) | ((t & 31u) ^ (unsigned)lane_mask);
  emu::exchange[t] = v;
  ++emu::shuffles[t];
  emu::yield();  // every lane has written
  if (src >= emu::shuffles.size() || emu::shuffles[src] != emu::shuffles[t]) ++emu::misaligned_shuffles;
  const float r = emu::exchange[src];
  emu::yield();  // every lane has read
  return r;
}
"""
TAIL = r"""
extern "C" int emu_misaligned_shuffles() { return emu::misaligned_shuffles; }
extern "C" void emu_div_by(const float* x, float t, float* out, int64_t n) {
  const float r = 1.0f / t;  // as the launchers compute it
  for (int64_t i = 0; i < n; ++i) out[i] = div_by(x[i], t, r);
}
extern "C" void emu_float_to_bf16(const float* f, uint16_t* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = ls_float_to_bf16(f[i]);
}
"""

_P, _I, _I64, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
ATOL_GRAD = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    gxx = shutil.which("g++")
    require(gxx is not None, "g++ is not installed")
    d = tmp_path_factory.mktemp("native_emu")
    # The emulator's fp16 conversions are C++ _Float16 (GCC >= 12 on x86-64, aarch64): probe for it, so
    # that an older compiler skips here while a kernel that fails to compile still fails below.
    probe = d / "probe.cpp"
    probe.write_text("_Float16 h = (_Float16)1.5f; float f = (float)h;\n")
    has_f16 = subprocess.run([gxx, "-std=c++20", "-c", str(probe), "-o", str(d / "probe.o")],
                             capture_output=True).returncode == 0
    require(has_f16, "g++ with C++20 and _Float16 (GCC >= 12) is needed for the CPU emulator")
    src = d / "emu.cpp"
    src.write_text(SHIM + f'#include "{SRC_DIR / "logprob_kernels.cu"}"\n' + TAIL)
    so = d / "libemu.so"
    proc = subprocess.run([gxx, "-std=c++20", "-O1", "-fPIC", "-shared", f"-I{SRC_DIR}", str(src), "-o", str(so)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lib = ctypes.CDLL(str(so))
    lib.lockstep_logprob_vector_loads.restype = _I
    lib.lockstep_logprob_vector_loads.argtypes = [_I, _P, _I64, _I64, _I64]
    lib.lockstep_logprob_partials.restype = ctypes.c_char_p
    lib.lockstep_logprob_partials.argtypes = [_I, _P, _P, _P, _P, _P, _P] + [_I64] * 9 + [_F, _I, _P]
    lib.lockstep_logprob_merge.restype = ctypes.c_char_p
    lib.lockstep_logprob_merge.argtypes = [_P] * 9 + [_I64] * 5 + [_P]
    lib.lockstep_logprob_backward.restype = ctypes.c_char_p
    lib.lockstep_logprob_backward.argtypes = [_I, _P, _P] + [_P] * 7 + [_I64] * 9 + [_F, _I, _P]
    lib.emu_misaligned_shuffles.restype = _I
    lib.emu_div_by.argtypes = [_P, _F, _P, _I64]
    lib.emu_float_to_bf16.argtypes = [_P, _P, _I64]
    return lib


def _ptr(t):
    return None if t is None else t.data_ptr()


def _code(x):
    return {torch.bfloat16: 0, torch.float32: 1, torch.float16: 2}[x.dtype]


class EmulatedExt:
    """binding.cpp's four functions over the emulator: same arguments, same outputs, CPU tensors."""

    def __init__(self, lib):
        self.lib = lib

    def _ok(self, err):
        assert err is None, err.decode()
        assert self.lib.emu_misaligned_shuffles() == 0, "a lane shuffled with a lane at another shuffle"

    def vector_loads(self, x, vocab_start):
        return bool(self.lib.lockstep_logprob_vector_loads(_code(x), x.data_ptr(), x.stride(0), x.shape[1],
                                                           vocab_start))

    def partials(self, x, targets, n_slots, real_hi, col0, vocab_start, global_vocab, tile_w, temperature, ent):
        assert x.dim() == 2 and x.stride(1) == 1
        targets = targets.contiguous()
        T, n = x.shape[0], 3 if ent else 2
        buf = torch.full((n * n_slots * T + T,), float("nan"))  # NaN: a slot the kernel skips shows up
        parts = buf[: n * n_slots * T].view(n, n_slots, T)
        tgt = buf[n * n_slots * T:]
        self._ok(self.lib.lockstep_logprob_partials(
            _code(x), x.data_ptr(), targets.data_ptr(), _ptr(parts[0]), _ptr(parts[1]), _ptr(parts[2]) if ent else None,
            _ptr(tgt), T, n_slots, x.stride(0), x.shape[1], real_hi, col0, vocab_start, global_vocab, tile_w,
            temperature, int(temperature != 1.0), None))
        return [parts[0], parts[1]] + ([parts[2]] if ent else []) + [tgt]

    def merge(self, m, s, w, tgt, targets, active, global_vocab):
        assert m.stride() == s.stride() and (w is None or w.stride() == m.stride())
        T = m.shape[0]
        out = torch.full(((3 if w is not None else 2) * T,), float("nan"))
        ent = out[2 * T:] if w is not None else None
        self._ok(self.lib.lockstep_logprob_merge(
            _ptr(m), _ptr(s), _ptr(w), _ptr(tgt.contiguous()), _ptr(targets.contiguous()), _ptr(active), _ptr(out),
            _ptr(out[T:]), _ptr(ent), T, m.shape[1], m.stride(0), m.stride(1), global_vocab, None))
        return [out[:T], out[T : 2 * T]] + ([ent] if w is not None else [])

    def backward(self, x, targets, lse, mean_x, g_logp, g_lse, g_ent, active, vocab_start, global_vocab, temperature):
        g = torch.full(x.shape, float("nan"), dtype=x.dtype)  # NaN: an element the kernel skips shows up
        self._ok(self.lib.lockstep_logprob_backward(
            _code(x), x.data_ptr(), g.data_ptr(), _ptr(targets.contiguous()), _ptr(lse.contiguous()),
            _ptr(None if mean_x is None else mean_x.contiguous()), _ptr(g_logp), _ptr(g_lse), _ptr(g_ent),
            _ptr(active), x.shape[0], x.stride(0), g.stride(0),
            *(0 if t is None else t.stride(0) for t in (g_logp, g_lse, g_ent)),
            x.shape[1], vocab_start, global_vocab, temperature, int(temperature != 1.0), None))
        return g


@pytest.fixture(scope="module")
def native(lib):
    return NativeBackend(EmulatedExt(lib))


@pytest.fixture
def native_on_cpu(native, monkeypatch):
    """Register the emulated backend for the CPU platform, so the public API dispatches to it."""
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    registry.register_backend(registry.BackendEntry(
        "native", {Platform.CPU: registry.Capability(dtypes=frozenset(DTYPES))}, lambda p: native))
    yield native


def _inputs(T, V, dtype, seed, scale=4.0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(T, V, generator=g) * scale).to(dtype)
    return logits, torch.randint(0, V, (T,), generator=g)


# ---- accuracy against fp64 and the reference backend, through the public API ----

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tau", [1.0, 0.7])
def test_forward_backward_with_entropy_and_mask_vs_fp64(native_on_cpu, dtype, tau):
    """Qwen3's vocab (tiles of 2374: several chunks per lane), -inf columns, a masked row."""
    T, V = 3, 151936
    logits, targets = _inputs(T, V, dtype, seed=1)
    logits[1, ::3] = float("-inf")
    targets[1] = 4  # a live column of the -inf row
    mask = torch.tensor([True, True, False])
    x = logits.clone().requires_grad_()
    logp, lse, ent = token_logprobs_with_entropy(x, targets, temperature=tau, backend="native", mask=mask)
    xd, r_logp, r_lse, r_ent = oracle(logits, targets, tau)
    on = mask
    close(logp[on], r_logp[on], 5e-5)
    close(lse[on], r_lse[on], 5e-5)
    close(ent[on], r_ent[on], 5e-5)
    assert logp[2] == 0 and lse[2] == 0 and ent[2] == 0
    up = torch.tensor([[1.5, -0.5, 2.0], [0.25, 0.75, 1.0], [-1.0, 0.5, 3.0]])
    ((logp * up[0]).sum() + (lse * up[1]).sum() + (ent * up[2]).sum()).backward()
    (((r_logp * up[0]) + (r_lse * up[1]) + (r_ent * up[2])) * mask).sum().backward()
    close(x.grad, xd.grad, ATOL_GRAD[dtype])
    assert torch.all(x.grad[2] == 0) and torch.all(x.grad[1, ::3] == 0)
    ref = token_logprobs_with_entropy(logits, targets, temperature=tau, backend="reference", mask=mask)
    close(logp, ref[0], 5e-6)
    close(lse, ref[1], 5e-6)
    close(ent, ref[2], 2e-5)  # lse - W/S cancels two ~20-sized terms: a few of their ulps


@pytest.mark.parametrize("dtype", DTYPES)
def test_gpt2_vocab_takes_the_element_path_and_stays_accurate(native_on_cpu, native, dtype):
    """V=50257: rows of 50257 elements are not 16-byte multiples, so loads are element-wise; the last
    tile is short (739 of 786 columns)."""
    logits, targets = _inputs(3, 50257, dtype, seed=2)
    targets[:2] = torch.tensor([0, 50256])
    assert not native._ext.vector_loads(logits, 0)
    x = logits.clone().requires_grad_()
    logp, lse = token_logprobs(x, targets, backend="native")
    (logp.sum() + 0.5 * lse.sum()).backward()  # the `.sum()` case: g_logp arrives with stride 0
    xd, r_logp, r_lse, _ = oracle(logits, targets, 1.0)
    close(logp, r_logp, 5e-5)
    close(lse, r_lse, 5e-5)
    (r_logp.sum() + 0.5 * r_lse.sum()).backward()
    close(x.grad, xd.grad, ATOL_GRAD[dtype])


def test_padding_columns_and_out_of_range_targets(native_on_cpu):
    check_padded_columns_are_excluded("native")


def test_adversarial_rows(native_on_cpu):
    check_adversarial_rows("native")


# ---- bitwise claims ----

@pytest.mark.parametrize("dtype", DTYPES)
def test_batch_composition_changes_no_bit(native_on_cpu, dtype):
    logits, targets = _inputs(8, 4096, dtype, seed=5)
    mask = torch.tensor([True] * 6 + [False, True])

    def run(rows):
        x = logits[rows].clone().requires_grad_()
        logp, lse, ent = token_logprobs_with_entropy(x, targets[rows], temperature=0.9, backend="native",
                                                     mask=mask[rows])
        (logp * 1.25 + lse * 0.5 - ent).sum().backward()
        return logp.detach(), lse.detach(), ent.detach(), x.grad

    full = run(torch.arange(8))
    perm = torch.randperm(8, generator=torch.Generator().manual_seed(6))
    for a, b in zip(full, run(perm)):
        assert torch.equal(a[perm], b), "row permutation changed bits"
    pieces = [run(torch.arange(a, b)) for a, b in ((0, 1), (1, 5), (5, 8))]
    for i, whole in enumerate(full):
        assert torch.equal(torch.cat([p[i] for p in pieces]), whole), "sub-batching changed bits"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gvs, padded", [(151936, 151936), (50257, 50304), (385, 392)])
def test_tp_degree_changes_no_bit(native_on_cpu, native, dtype, gvs, padded):
    """385 padded to 392: tiles of 7, shards of 196/98/49 columns on tile bounds but not on 8-column
    bounds, so shards start mid-vector: the window must follow global columns to keep the order."""
    logits, _ = _inputs(2 if padded > 1000 else 6, padded, dtype, seed=7)
    targets = torch.tensor([gvs - 1, gvs // 3, 0, 50, 200, 300])[: logits.shape[0]]
    one = emulate_tensor_parallel(logits, targets, tp=1, backend="native", global_vocab_size=gvs, temperature=0.8)
    full_layout = ShardLayout(gvs, 0, padded)
    g_logp, g_lse = torch.full_like(one[1], 1.25), torch.full_like(one[1], 0.5)
    full_grad = native.backward(logits, targets, one[1], None, g_logp, g_lse, None, None, full_layout, 0.8)
    whole = native.partials(logits, targets, full_layout, 0.8, True)
    n = whole[0].shape[1]
    for tp in (2, 4, 8):
        got = emulate_tensor_parallel(logits, targets, tp=tp, backend="native", global_vocab_size=gvs,
                                      temperature=0.8)
        assert torch.equal(got[0], one[0]) and torch.equal(got[1], one[1]), f"TP={tp}"
        Vl = padded // tp
        # Stronger than the merged outputs (which can round a partial's last bit away): every tile's
        # (max, sumexp, sum e*x) has the same bits whichever shard computed it.
        shard_parts = [native.partials(logits[:, r * Vl:(r + 1) * Vl], targets, ShardLayout(gvs, r * Vl, Vl, r, tp),
                                       0.8, True) for r in range(tp)]
        for i, name in enumerate(("max", "sumexp", "sum e*x")):
            assert torch.equal(torch.cat([p[i] for p in shard_parts], 1)[:, :n], whole[i]), f"TP={tp} {name}"
        shards = [native.backward(logits[:, r * Vl:(r + 1) * Vl], targets, got[1], None, g_logp, g_lse, None, None,
                                  ShardLayout(gvs, r * Vl, Vl, r, tp), 0.8) for r in range(tp)]
        assert torch.equal(torch.cat(shards, 1), full_grad), f"TP={tp} gradient"


def test_fixed_topology_shards_that_cut_tiles(native_on_cpu):
    """TP 3 over 1002 columns (shards of 334 cut tiles of 16): pieces of tiles on both sides of a shard
    bound (negative slot offset), element loads; correct and reproducible."""
    logits, _ = _inputs(3, 1002, torch.float32, seed=14)
    targets = torch.tensor([0, 333, 999])  # 333: last column of rank 0, inside a cut tile
    kw = dict(tp=3, backend="native", global_vocab_size=1000, determinism="fixed_topology", temperature=0.9)
    logp, lse = emulate_tensor_parallel(logits, targets, **kw)
    _, r_logp, r_lse, _ = oracle(logits, targets, 0.9, gvs=1000)
    close(logp, r_logp, 2e-5)
    close(lse, r_lse, 2e-5)
    again = emulate_tensor_parallel(logits, targets, **kw)
    assert torch.equal(logp, again[0]) and torch.equal(lse, again[1])


def _shift_view(logits, offset):
    """The same values as `logits`, in rows whose start is `offset` elements past a 16-byte bound."""
    T, V = logits.shape
    big = torch.zeros(T, V + 8, dtype=logits.dtype)
    big[:, offset : offset + V] = logits
    return big[:, offset : offset + V]


@pytest.mark.parametrize("dtype", DTYPES)
def test_element_loads_give_the_bits_of_vector_loads(native, dtype):
    """A view whose rows start off a 16-byte bound runs the element path: the same bits, forward
    (partials) and backward, because both paths feed the same arithmetic."""
    logits, targets = _inputs(3, 151936, dtype, seed=8)
    moved = _shift_view(logits, 1)
    assert native._ext.vector_loads(logits, 0) and not native._ext.vector_loads(moved, 0)
    layout = ShardLayout(151936, 0, 151936)
    for tau, ent in ((1.0, True), (0.7, False)):
        a = native.partials(logits, targets, layout, tau, ent)
        b = native.partials(moved, targets, layout, tau, ent)
        for p, q in zip(a, b):
            assert (p is None and q is None) or torch.equal(p, q), f"partials differ (tau={tau}, entropy={ent})"
    lse = torch.logsumexp(logits.float(), -1)
    args = (targets, lse, lse - 1.0, torch.full((3,), 0.5), None, torch.full((3,), 2.0), None, layout, 0.7)
    assert torch.equal(native.backward(logits, *args), native.backward(moved, *args))


@pytest.mark.parametrize("dtype", DTYPES)
def test_tile_max_and_target_logit_are_the_reference_bits(native, dtype):
    """Max and target logit involve no rounding but x / temperature, which the kernels compute from a
    reciprocal and one correction: it must give the IEEE quotient's bits, for any temperature."""
    logits, targets = _inputs(4, 50304, dtype, seed=12, scale=30.0)
    logits[0, :100] = float("-inf")
    targets[0], targets[1] = 50, 50300  # a -inf column; a padding column (no target logit: -inf)
    layout = ShardLayout(50257, 0, 50304)
    ref = ReferenceBackend()
    for tau in (1.0, 0.7, 0.3, 1.7, 0.123456):
        for ent in (False, True):
            m, _, _, tgt = native.partials(logits, targets, layout, tau, ent)
            r_m, _, _, r_tgt = ref.partials(logits, targets, layout, tau, ent)
            assert torch.equal(m, r_m) and torch.equal(tgt, r_tgt), f"tau={tau} entropy={ent}"


# ---- the backward on its own: every gradient input combination against the reference ----

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tau", [1.0, 0.6])
def test_backward_matches_reference_for_every_gradient_combination(native, dtype, tau):
    T, V = 5, 1000  # 1000 % 8 == 0: vector path, with a partial last block of columns
    logits, targets = _inputs(T, V, dtype, seed=9)
    logits[2, 10:20] = float("-inf")
    targets[3] = 995  # a padding column: out of range, so no one-hot term anywhere
    layout = ShardLayout(990, 0, V)  # the last 10 columns are padding
    lse = torch.logsumexp(logits.float()[:, :990] / tau, -1)
    mean_x = lse - 2.0
    g = torch.Generator().manual_seed(10)
    g_logp, g_lse, g_ent = (torch.randn(T, generator=g) for _ in range(3))
    active = torch.tensor([True, False, True, True, True])
    ref = ReferenceBackend()
    for gl, gs, ge, act in (
        (g_logp, g_lse, g_ent, active),
        (g_logp, None, None, None),
        (torch.ones(1).expand(T), None, g_ent, None),  # `.sum()` of logp: row stride 0
        (None, g_lse, None, active),
        (None, None, g_ent, None),
    ):
        got = native.backward(logits, targets, lse, mean_x, gl, gs, ge, act, layout, tau)
        z = torch.zeros(T)
        want = ref.backward(logits, targets, lse, mean_x, z if gl is None else gl.contiguous(),
                            z if gs is None else gs, ge, act, layout, tau)
        # fp32: rounding of the fp32 arithmetic; 16-bit: at most one ulp of the output dtype apart.
        rtol = {torch.float32: 1e-5, torch.float16: 2 ** -10, torch.bfloat16: 2 ** -7}[dtype]
        torch.testing.assert_close(got.double(), want.double(), rtol=rtol, atol=1e-7)
        assert torch.all(got[:, 990:] == 0) and torch.all(got[2, 10:20] == 0)
        if act is not None:
            assert torch.all(got[1] == 0)


def test_temperature_division_has_the_bits_of_ieee_division(lib):
    """div_by (reciprocal + one fma correction) against x / t for every significand of x in one binade
    (the quotient's rounding depends on significands only, away from overflow and underflow), plus
    random magnitudes and the special values the kernels meet (-inf logits, zeros)."""
    every = (torch.arange(1 << 23, dtype=torch.int32) | (127 << 23)).view(torch.float32)
    g = torch.Generator().manual_seed(13)
    rand = torch.randn(1 << 20, generator=g) * 10 ** torch.randint(-20, 20, (1 << 20,), generator=g)
    x = torch.cat([every, -every, rand, torch.tensor([0.0, float("-inf"), float("inf"), 3e38, -1e-30])])
    for t in (0.7, 0.6, 0.9, 0.3, 1.7, 0.123456, 2.0, 0.999999):
        t32 = torch.tensor(t, dtype=torch.float32)
        out = torch.empty_like(x)
        lib.emu_div_by(x.data_ptr(), t32.item(), out.data_ptr(), x.numel())
        assert torch.equal(out, x / t32), f"t={t}: {(out != x / t32).sum().item()} quotients differ"


def test_bf16_rounding_is_round_to_nearest_even_like_torch(lib):
    """The integer bf16 narrowing in portability.h (used where the hardware has no bf16 convert)."""
    g = torch.Generator().manual_seed(11)
    f = torch.cat([torch.randn(100000, generator=g) * 10 ** torch.randint(-30, 30, (100000,), generator=g),
                   torch.tensor([0.0, -0.0, float("inf"), float("-inf"), 3.3895314e38, 1e-40, -1e-45])])
    ties = (torch.randint(0, 1 << 16, (1000,), generator=g, dtype=torch.int32) << 16) | 0x8000  # exact halfway
    f = torch.cat([f, ties.view(torch.float32)])
    f = f[torch.isfinite(f) | torch.isinf(f)]
    out = torch.empty(f.shape, dtype=torch.int16)
    lib.emu_float_to_bf16(f.data_ptr(), out.data_ptr(), f.numel())
    assert torch.equal(out, f.to(torch.bfloat16).view(torch.int16))


# ---- source-level properties that no CPU run can exercise ----

def _kernel_source() -> str:
    return (SRC_DIR / "logprob_kernels.cu").read_text()


def test_no_atomics_and_shuffles_only_inside_32_lane_groups():
    """Every gradient element is written once (no atomics anywhere), and the only cross-lane
    primitive is ls_shfl_xor32, whose offsets start at LS_GROUP / 2 = 16 (< 32): correct on
    32-lane warps and, unchanged, on 64-lane wavefronts."""
    src = re.sub(r"//[^\n]*", "", _kernel_source())
    assert "atomic" not in src.lower()
    assert not re.search(r"__shfl|__syncthreads|__shared__|warpSize", src)
    assert re.search(r"constexpr int LS_GROUP = 32;", src)
    offsets = re.findall(r"for \(int off = ([^;]+);", src)
    assert offsets and all(o.strip() == "LS_GROUP / 2" for o in offsets)


def test_registry_declares_every_dtype_and_entropy_for_native():
    entry = registry.registered_backends()["native"]
    for platform in (Platform.CUDA, Platform.ROCM):
        cap = entry.capabilities[platform]
        assert cap.dtypes == frozenset(DTYPES) and cap.entropy and cap.tensor_parallel
    assert Platform.CPU not in entry.capabilities
    assert NativeBackend.accepts_none_grads
