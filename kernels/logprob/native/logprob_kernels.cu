// Native (CUDA/HIP) kernels of the log-prob definition; the pure-torch
// definition they must match is kernels/logprob/reference.py.
//
// Three steps, as in every backend: per-tile fp32 (max, sumexp[, sum e*x])
// partials with a fixed in-tile order; a merge of partials in global slot
// order; and an elementwise backward (each gradient element written once: no
// atomics). This file has no torch dependency so that hipcc and nvcc can
// compile it on their own (python -m kernels.check_targets) and g++ can run it
// on the CPU emulator of tests/kernels/test_logprob_native_source.py;
// binding.cpp wraps it for torch.
//
// Why each tile's bits are independent of the batch and of the TP degree: a
// tile is reduced by one group of 32 lanes, lane `l` takes the 16-byte vectors
// l, l+32, l+64, ... of a window that starts on a global column that is a
// multiple of the vector width, and the group reduces its lanes with a fixed
// xor tree (portability.h). Every choice in that order is a function of the
// tile's global column range and the dtype only: not of the number of rows,
// the grid, which block or shard holds the tile, or whether the row was
// loaded with vector or element loads (both paths feed the same arithmetic).
#include "portability.h"

namespace {

constexpr int LS_GROUP = 32;           // lanes that reduce one tile (a lane group, not a hardware warp)
constexpr int LS_TILES_PER_BLOCK = 4;  // consecutive slots of one row per block: 128 threads, no shared memory
constexpr int LS_PARTIALS_THREADS = LS_GROUP * LS_TILES_PER_BLOCK;
constexpr int LS_CHUNK_VECS = 5;  // vectors a lane loads before reducing them (Qwen3 bf16: 10 per lane = 2 chunks)
constexpr int LS_BWD_THREADS = 256;
constexpr int LS_BWD_VECS = 2;  // vectors per thread: a bf16 block covers 4096 columns of one row
constexpr int LS_MERGE_THREADS = 128;

struct Vec16 {  // one 16-byte vector as four indexable 32-bit words
  uint32_t w[4];
};
// Through the platform's uint4, so that the compiler emits one 128-bit access.
LS_DEVICE Vec16 load16(const void* p) {
  const uint4 q = *reinterpret_cast<const uint4*>(p);
  Vec16 v = {{q.x, q.y, q.z, q.w}};
  return v;
}
LS_DEVICE void store16(void* p, const Vec16& v) {
  uint4 q;
  q.x = v.w[0], q.y = v.w[1], q.z = v.w[2], q.w = v.w[3];
  *reinterpret_cast<uint4*>(p) = q;
}

// dtype 0: bf16, 1: fp32, 2: fp16; 16-bit types travel as raw words (element 2i in the low half of word i).
template <int DT> struct Elem;
template <> struct Elem<0> {
  typedef uint16_t T;
  static constexpr int VEC = 8;
  static constexpr uint32_t NEG_INF_WORD = 0xff80ff80u;  // -inf in every element of the word
  static LS_DEVICE uint32_t bits(T b) { return b; }
  static LS_DEVICE float widen(T b) { return ls_bf16_to_float(b); }
  static LS_DEVICE void widen_vec(const Vec16& q, float* v) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      v[2 * i] = __uint_as_float(q.w[i] << 16);  // the same bits as widen() of the low half
      v[2 * i + 1] = __uint_as_float(q.w[i] & 0xffff0000u);
    }
  }
  static LS_DEVICE uint32_t pack2(float lo, float hi) { return ls_pack_bf16x2(lo, hi); }
};
template <> struct Elem<1> {
  typedef float T;
  static constexpr int VEC = 4;
  static constexpr uint32_t NEG_INF_WORD = 0xff800000u;
  static LS_DEVICE uint32_t bits(T f) { return __float_as_uint(f); }
  static LS_DEVICE float widen(T f) { return f; }
  static LS_DEVICE void widen_vec(const Vec16& q, float* v) {
#pragma unroll
    for (int i = 0; i < 4; ++i) v[i] = __uint_as_float(q.w[i]);
  }
};
template <> struct Elem<2> {
  typedef uint16_t T;
  static constexpr int VEC = 8;
  static constexpr uint32_t NEG_INF_WORD = 0xfc00fc00u;
  static LS_DEVICE uint32_t bits(T b) { return b; }
  static LS_DEVICE float widen(T b) { return ls_half_to_float(b); }
  static LS_DEVICE void widen_vec(const Vec16& q, float* v) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      v[2 * i] = ls_half_to_float((uint16_t)(q.w[i] & 0xffffu));
      v[2 * i + 1] = ls_half_to_float((uint16_t)(q.w[i] >> 16));
    }
  }
  static LS_DEVICE uint32_t pack2(float lo, float hi) { return ls_pack_half2(lo, hi); }
};

// Narrowing for the gradient store. The element store uses the pair conversion too, so that the
// vector and element paths round every value through the same instruction.
template <int DT> LS_DEVICE typename Elem<DT>::T narrow(float f) {
  return (uint16_t)(Elem<DT>::pack2(f, 0.f) & 0xffffu);
}
template <> LS_DEVICE float narrow<1>(float f) { return f; }
template <int DT> LS_DEVICE Vec16 narrow_vec(const float* d) {
  Vec16 q;
#pragma unroll
  for (int i = 0; i < 4; ++i) q.w[i] = Elem<DT>::pack2(d[2 * i], d[2 * i + 1]);
  return q;
}
template <> LS_DEVICE Vec16 narrow_vec<1>(const float* d) {
  Vec16 q;
#pragma unroll
  for (int i = 0; i < 4; ++i) q.w[i] = __float_as_uint(d[i]);
  return q;
}

// x / t with the bits of the IEEE division (tests/kernels/test_logprob_native_source.py checks
// every significand of x for several t), without a reciprocal instruction per element: the
// exponential already takes the special-function unit once per element, and a division
// (reciprocal + refinement) would double that. One Markstein correction from r, the correctly
// rounded 1/t (computed once, on the host, in fp32): q = x*r is within an ulp, x - q*t is exact in
// an fma, and q + (x - q*t)*r rounds to x/t. Infinite q (x = +-inf or overflow) is kept: the
// correction would turn it into NaN.
LS_DEVICE float div_by(float x, float t, float r) {
  const float q = x * r;
  const float c = fmaf(fmaf(-q, t, x), r, q);
  return fabsf(q) == INFINITY ? q : c;
}

// Raw words of columns [c, c + VEC) of a row, FILL (a word of two 16-bit, or one 32-bit, filler
// elements) outside [lo, hi) (whole vectors past hi). VEC_LOADS: one 16-byte load; the launcher
// checked that rows, strides and the shard width are 16-byte multiples, so c (a multiple of VEC)
// is aligned and c < hi <= local_vocab keeps the whole vector inside the row; an edge inside the
// vector is the caller's to mask. Otherwise element loads that never touch a column outside
// [lo, hi), packed into the same words. The forward reads a tile with -inf as filler, the
// backward a row (hi = 0 for an inactive row) with 0.
template <int DT, bool VEC_LOADS>
LS_DEVICE Vec16 fetch_words(const typename Elem<DT>::T* xr, int c, int lo, int hi, uint32_t fill) {
  Vec16 q;
  if (VEC_LOADS) {
    if (c < hi) {
      q = load16(xr + c);
    } else {
#pragma unroll
      for (int i = 0; i < 4; ++i) q.w[i] = fill;
    }
  } else {
    constexpr int PER_WORD = (int)(4 / sizeof(typename Elem<DT>::T));
    constexpr int BITS = 32 / PER_WORD;
    const uint32_t one_fill = fill >> (32 - BITS);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      uint32_t word = 0;
#pragma unroll
      for (int p = 0; p < PER_WORD; ++p) {
        const int col = c + i * PER_WORD + p;
        uint32_t b = one_fill;
        if (col >= lo && col < hi) b = Elem<DT>::bits(xr[col]);
        word |= b << (p * BITS);
      }
      q.w[i] = word;
    }
  }
  return q;
}

// The words of fetch_words as (scaled) fp32: the same arithmetic for both load paths.
template <int DT, bool VEC_LOADS, bool SCALE>
LS_DEVICE void widen_tile_vector(const Vec16& q, int c, int lo, int hi, float temperature, float inv_temperature,
                                 float* v) {
  constexpr int VEC = Elem<DT>::VEC;
  Elem<DT>::widen_vec(q, v);
  if (VEC_LOADS && c < hi && (c < lo || c + VEC > hi)) {  // a tile edge inside this vector: 2 per tile
#pragma unroll
    for (int k = 0; k < VEC; ++k)
      if (c + k < lo || c + k >= hi) v[k] = -INFINITY;
  }
  if (SCALE) {
#pragma unroll
    for (int k = 0; k < VEC; ++k) v[k] = div_by(v[k], temperature, inv_temperature);  // the definition's x / T
  }
}

// The shift of a running max m: 0 for an empty max (m = -inf), so that exp2 of -inf - shift stays 0.
LS_DEVICE float shift_of(float m) { return m == -INFINITY ? 0.f : m; }

// exp(x - shift): one subtraction, then e^d as exp2(d * log2e) (portability.h), per element.
// Not exp2(fma(x, log2e, -shift * log2e)), one op cheaper: the rounding residual of shift * log2e
// is an absolute error in the exponent, larger than 1 once |shift| > ~1e7, while x - shift is exact
// (0) for the max element and relatively accurate for every other.
LS_DEVICE float exp_shifted(float x, float shift) { return ls_exp(x - shift); }

// Grid (T, ceil(S / 4)): lane group g of block (row, b) reduces slot 4b + g of the row and stores its
// (max, sumexp[, sum e*x]) slot-major [S, T]. Slot 0's group also stores the row's target logit
// (-inf when another shard holds it).
//
// Each lane: chunks of LS_CHUNK_VECS vectors, all loads of a chunk first (they overlap), then an
// online update: the chunk's max, one rescale of the running sums by exp(old - new) per chunk, and
// the chunk's exponentials exp(x - max) summed in a fixed order. Then the group: max by xor tree;
// each lane rescales its sums to the group max; sums by xor tree. Every lane runs the same number
// of chunks (a function of the tile width), so the group stays converged at the shuffles; lanes or
// groups without columns just reduce -inf.
template <int DT, bool VEC_LOADS, bool WITH_ENT, bool SCALE>
__global__ void __launch_bounds__(LS_PARTIALS_THREADS) partials_kernel(
    const typename Elem<DT>::T* __restrict__ x, const int64_t* __restrict__ targets, float* __restrict__ m_out,
    float* __restrict__ s_out, float* __restrict__ w_out, float* __restrict__ tgt_out, int64_t n_rows, int n_slots,
    int64_t stride_x, int local_vocab, int real_hi, int col0, int64_t vocab_start, int64_t global_vocab, int tile_w,
    float temperature, float inv_temperature) {
  constexpr int VEC = Elem<DT>::VEC;
  const int lane = threadIdx.x % LS_GROUP;
  const int64_t row = blockIdx.x;
  const int slot = blockIdx.y * LS_TILES_PER_BLOCK + threadIdx.x / LS_GROUP;
  const bool live = slot < n_slots;  // the last block of a row may hold fewer slots: the rest runs empty
  const int base = col0 + slot * tile_w;  // local column of the tile's first column (may be < 0 on a shard)
  const int lo = base > 0 ? base : 0;
  int hi = base + tile_w < real_hi ? base + tile_w : real_hi;
  if (!live || hi < lo) hi = lo;
  // The window starts on a global column that is a multiple of VEC: the lane and position of each
  // column depend on the column alone (not on the shard start or the load path).
  const int start = lo - (int)((lo + vocab_start) % VEC);
  // Vectors any tile's window can span, per lane: the same for every tile of this vocab.
  const int lane_iters = ((tile_w + 2 * VEC - 2) / VEC + LS_GROUP - 1) / LS_GROUP;
  const typename Elem<DT>::T* xr = x + row * stride_x;

  float m_run = -INFINITY, s = 0.f, w = 0.f;
  for (int j0 = 0; j0 < lane_iters; j0 += LS_CHUNK_VECS) {
    Vec16 q[LS_CHUNK_VECS];
#pragma unroll
    for (int u = 0; u < LS_CHUNK_VECS; ++u)
      q[u] = fetch_words<DT, VEC_LOADS>(xr, start + (lane + (j0 + u) * LS_GROUP) * VEC, lo, hi, Elem<DT>::NEG_INF_WORD);
    float v[LS_CHUNK_VECS][VEC];
#pragma unroll
    for (int u = 0; u < LS_CHUNK_VECS; ++u)
      widen_tile_vector<DT, VEC_LOADS, SCALE>(q[u], start + (lane + (j0 + u) * LS_GROUP) * VEC, lo, hi, temperature,
                                              inv_temperature, v[u]);
    float cmax = -INFINITY;
#pragma unroll
    for (int u = 0; u < LS_CHUNK_VECS; ++u)
#pragma unroll
      for (int k = 0; k < VEC; ++k) cmax = fmaxf(cmax, v[u][k]);
    const float m_new = fmaxf(m_run, cmax);
    const float shift = shift_of(m_new);
    const float alpha = m_run == -INFINITY ? 0.f : exp_shifted(m_run, shift);  // exactly 1 if the max held
    float cs = 0.f, cw = 0.f;
#pragma unroll
    for (int u = 0; u < LS_CHUNK_VECS; ++u) {
      if (j0 + u < lane_iters) {  // uniform over the group; vectors past it are all -inf (would add 0)
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
          const float e = exp_shifted(v[u][k], shift);
          cs += e;
          if (WITH_ENT) cw = fmaf(e, v[u][k] == -INFINITY ? 0.f : v[u][k], cw);  // -inf columns add 0, not NaN
        }
      }
    }
    s = fmaf(s, alpha, cs);
    if (WITH_ENT) w = fmaf(w, alpha, cw);
    m_run = m_new;
  }

  float M = m_run;
#pragma unroll
  for (int off = LS_GROUP / 2; off > 0; off >>= 1) M = fmaxf(M, ls_shfl_xor32(M, off));
  const float to_group = m_run == -INFINITY ? 0.f : exp_shifted(m_run, shift_of(M));
  s *= to_group;
  w *= to_group;
#pragma unroll
  for (int off = LS_GROUP / 2; off > 0; off >>= 1) {
    s += ls_shfl_xor32(s, off);
    if (WITH_ENT) w += ls_shfl_xor32(w, off);
  }
  if (live && lane == 0) {
    const int64_t out = (int64_t)slot * n_rows + row;
    m_out[out] = M;
    s_out[out] = s;
    if (WITH_ENT) w_out[out] = w;
    if (slot == 0) {
      const int64_t t = targets[row], local = t - vocab_start;
      float v = -INFINITY;
      if (local >= 0 && local < local_vocab && t < global_vocab) {
        v = Elem<DT>::widen(xr[local]);
        if (SCALE) v = div_by(v, temperature, inv_temperature);  // the bits of that column inside its tile
      }
      tgt_out[row] = v;
    }
  }
}

// One thread per row: sequential fold over the row's N slots in slot order (identity slots
// (-inf, 0) add exactly 0). lse = M + log S; entropy = lse - W / S; inactive rows get 0.
template <bool WITH_ENT>
__global__ void __launch_bounds__(LS_MERGE_THREADS) merge_kernel(
    const float* __restrict__ m, const float* __restrict__ s, const float* __restrict__ w,
    const float* __restrict__ tgt, const int64_t* __restrict__ targets, const uint8_t* __restrict__ active,
    float* __restrict__ logp, float* __restrict__ lse, float* __restrict__ ent, int64_t n_rows, int64_t n_slots,
    int64_t stride_row, int64_t stride_slot, int64_t global_vocab) {
  const int64_t row = (int64_t)blockIdx.x * LS_MERGE_THREADS + threadIdx.x;
  if (row >= n_rows) return;
  const int64_t r = row * stride_row;
  float M = -INFINITY;
  for (int64_t k = 0; k < n_slots; ++k) M = fmaxf(M, m[r + k * stride_slot]);
  const float shift = M == -INFINITY ? 0.f : M;
  float S = 0.f, W = 0.f;
  for (int64_t k = 0; k < n_slots; ++k) {
    const float scale = expf(m[r + k * stride_slot] - shift);
    S = fmaf(s[r + k * stride_slot], scale, S);
    if (WITH_ENT) W = fmaf(w[r + k * stride_slot], scale, W);
  }
  float l = M + logf(S);
  const int64_t t = targets[row];
  float lp = (t >= 0 && t < global_vocab) ? tgt[row] - l : NAN;
  float e = l - W / S;
  if (active != nullptr && active[row] == 0) lp = l = e = 0.f;
  logp[row] = lp;
  lse[row] = l;
  if (WITH_ENT) ent[row] = e;
}

// d/dx of g_logp*logp + g_lse*lse [+ g_ent*entropy] for one element x (already / temperature):
// (g_lse - g_logp) * p + [target] * g_logp [+ g_ent * p * (mean_x - x)], / temperature when scaled.
// p = exp(x - lse), computed as the forward's exponentials.
template <bool WITH_ENT, bool SCALE>
LS_DEVICE float grad_element(float x, bool in_vocab, bool is_target, float coef, float gl, float lse, float mean,
                             float ge, float temperature, float inv_temperature) {
  const bool real = in_vocab && x != -INFINITY;
  const float p = real ? exp_shifted(x, lse) : 0.f;
  float d = coef * p;
  if (WITH_ENT) d = fmaf(ge, p * (real ? mean - x : 0.f), d);
  if (is_target) d += gl;
  if (SCALE) d = div_by(d, temperature, inv_temperature);
  return d;
}

// Grid (T, col_blocks): block (row, cb) writes columns [cb * COLS, (cb + 1) * COLS) of the
// row once each. VEC_IO: 16-byte loads and stores (launcher checked alignment of both tensors and
// a shard width that is a multiple of VEC); otherwise element loads and stores. Both paths run
// grad_element on the same values, so they give the same bits.
template <int DT, bool VEC_IO, bool WITH_ENT, bool SCALE>
__global__ void __launch_bounds__(LS_BWD_THREADS) backward_kernel(
    const typename Elem<DT>::T* __restrict__ x, typename Elem<DT>::T* __restrict__ g,
    const int64_t* __restrict__ targets, const float* __restrict__ lse, const float* __restrict__ mean_x,
    const float* __restrict__ g_logp, const float* __restrict__ g_lse, const float* __restrict__ g_ent,
    const uint8_t* __restrict__ active, int64_t stride_x, int64_t stride_g, int64_t stride_glogp,
    int64_t stride_glse, int64_t stride_gent, int local_vocab, int real_hi, int64_t vocab_start,
    int64_t global_vocab, float temperature, float inv_temperature) {
  constexpr int VEC = Elem<DT>::VEC;
  constexpr int COLS = LS_BWD_THREADS * LS_BWD_VECS * VEC;
  const int64_t row = blockIdx.x;
  const int cb = blockIdx.y;
  const typename Elem<DT>::T* xr = x + row * stride_x;
  typename Elem<DT>::T* gr = g + row * stride_g;
  const bool on = active == nullptr || active[row] != 0;
  // Absent upstream gradients (nullptr) are 0; g_logp may have row stride 0 (an expanded scalar).
  const float gl = g_logp != nullptr ? g_logp[row * stride_glogp] : 0.f;
  const float coef = (g_lse != nullptr ? g_lse[row * stride_glse] : 0.f) - gl;
  const float row_lse = lse[row];
  const float mean = WITH_ENT ? mean_x[row] : 0.f;
  const float ge = WITH_ENT ? g_ent[row * stride_gent] : 0.f;
  const int64_t t = targets[row], local = t - vocab_start;
  const int hit = (t >= 0 && t < global_vocab && local >= 0 && local < local_vocab) ? (int)local : -1;
  // Loads of all vectors first (they overlap), then the arithmetic, then the stores.
  Vec16 q[LS_BWD_VECS];
#pragma unroll
  for (int u = 0; u < LS_BWD_VECS; ++u) {
    const int c = cb * COLS + (u * LS_BWD_THREADS + (int)threadIdx.x) * VEC;
    q[u] = fetch_words<DT, VEC_IO>(xr, c, 0, on ? local_vocab : 0, 0u);
  }
#pragma unroll
  for (int u = 0; u < LS_BWD_VECS; ++u) {
    const int c = cb * COLS + (u * LS_BWD_THREADS + (int)threadIdx.x) * VEC;
    if (c < local_vocab) {
      float v[VEC], d[VEC];
      Elem<DT>::widen_vec(q[u], v);
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        const float xs = SCALE ? div_by(v[k], temperature, inv_temperature) : v[k];
        d[k] = on ? grad_element<WITH_ENT, SCALE>(xs, c + k < real_hi, c + k == hit, coef, gl, row_lse, mean, ge,
                                                  temperature, inv_temperature)
                  : 0.f;
      }
      if (VEC_IO) {
        store16(gr + c, narrow_vec<DT>(d));
      } else {
#pragma unroll
        for (int k = 0; k < VEC; ++k)
          if (c + k < local_vocab) gr[c + k] = narrow<DT>(d[k]);
      }
    }
  }
}

// Runtime (dtype, 3 flags) -> a template instantiation L<DT, A, B, C>::run, in C++11 (hipcc 5.2's
// default dialect: no generic lambdas, no if constexpr).
template <class Args, template <int, bool, bool, bool> class L, int DT, bool A, bool B>
void run_flags(bool c, const Args& args) {
  if (c) L<DT, A, B, true>::run(args);
  else L<DT, A, B, false>::run(args);
}
template <class Args, template <int, bool, bool, bool> class L, int DT, bool A>
void run_flags(bool b, bool c, const Args& args) {
  if (b) run_flags<Args, L, DT, A, true>(c, args);
  else run_flags<Args, L, DT, A, false>(c, args);
}
template <class Args, template <int, bool, bool, bool> class L, int DT>
void run_flags(bool a, bool b, bool c, const Args& args) {
  if (a) run_flags<Args, L, DT, true>(b, c, args);
  else run_flags<Args, L, DT, false>(b, c, args);
}
template <class Args, template <int, bool, bool, bool> class L>
bool run_dtype(int dtype, bool a, bool b, bool c, const Args& args) {
  switch (dtype) {
    case 0: run_flags<Args, L, 0>(a, b, c, args); return true;
    case 1: run_flags<Args, L, 1>(a, b, c, args); return true;
    case 2: run_flags<Args, L, 2>(a, b, c, args); return true;
    default: return false;
  }
}

struct PartialsArgs {
  const void* x;
  const int64_t* targets;
  float *m_out, *s_out, *w_out, *tgt_out;
  int64_t n_rows, stride_x, vocab_start, global_vocab;
  int n_slots, local_vocab, real_hi, col0, tile_w;
  float temperature, inv_temperature;
  dim3 grid;
  ls_stream_t stream;
};
template <int DT, bool VEC_LOADS, bool WITH_ENT, bool SCALE> struct PartialsLaunch {
  static void run(const PartialsArgs& a) {
    LS_LAUNCH(a.grid, LS_PARTIALS_THREADS, a.stream, partials_kernel<DT, VEC_LOADS, WITH_ENT, SCALE>)(
        static_cast<const typename Elem<DT>::T*>(a.x), a.targets, a.m_out, a.s_out, a.w_out, a.tgt_out, a.n_rows,
        a.n_slots, a.stride_x, a.local_vocab, a.real_hi, a.col0, a.vocab_start, a.global_vocab, a.tile_w,
        a.temperature, a.inv_temperature);
  }
};

struct BackwardArgs {
  const void* x;
  void* g;
  const int64_t* targets;
  const float *lse, *mean_x, *g_logp, *g_lse, *g_ent;
  const uint8_t* active;
  int64_t stride_x, stride_g, stride_glogp, stride_glse, stride_gent, vocab_start, global_vocab;
  int local_vocab, real_hi;
  float temperature, inv_temperature;
  dim3 grid;
  ls_stream_t stream;
};
template <int DT, bool VEC_IO, bool WITH_ENT, bool SCALE> struct BackwardLaunch {
  static void run(const BackwardArgs& a) {
    typedef typename Elem<DT>::T T;
    LS_LAUNCH(a.grid, LS_BWD_THREADS, a.stream, backward_kernel<DT, VEC_IO, WITH_ENT, SCALE>)(
        static_cast<const T*>(a.x), static_cast<T*>(a.g), a.targets, a.lse, a.mean_x, a.g_logp, a.g_lse, a.g_ent,
        a.active, a.stride_x, a.stride_g, a.stride_glogp, a.stride_glse, a.stride_gent, a.local_vocab, a.real_hi,
        a.vocab_start, a.global_vocab, a.temperature, a.inv_temperature);
  }
};

int elem_size(int dtype) { return dtype == 1 ? 4 : 2; }

const char* launch_status() {
  ls_error_t e = ls_get_last_error();
  return e == LS_SUCCESS ? 0 : ls_error_string(e);
}

const int64_t kMaxInt = 2147483647;

}  // namespace

// ---- C launchers (the only symbols binding.cpp, check_targets and the emulator rely on). ----
// Each returns 0 or an error string. dtype: 0 bf16, 1 fp32, 2 fp16. Pointers marked "or null" are optional.

// 1 when rows of x can be read as 16-byte vectors: base pointer, row stride and shard width (hence
// its start) are 16-byte multiples. A function of the tensor's placement, never of its row count.
extern "C" int lockstep_logprob_vector_loads(int dtype, const void* x, int64_t stride_x, int64_t local_vocab,
                                             int64_t vocab_start) {
  const int64_t es = elem_size(dtype);
  return (uintptr_t)x % 16 == 0 && (stride_x * es) % 16 == 0 && (local_vocab * es) % 16 == 0 &&
         (vocab_start * es) % 16 == 0;
}

// Partials of every (row, slot): m, s, w (or null: no entropy) slot-major [n_slots, n_rows], tgt [n_rows].
// Slot j covers local columns [col0 + j*tile_w, +tile_w) clipped to [0, real_hi).
extern "C" const char* lockstep_logprob_partials(int dtype, const void* x, const int64_t* targets, float* m_out,
                                                 float* s_out, float* w_out, float* tgt_out, int64_t n_rows,
                                                 int64_t n_slots, int64_t stride_x, int64_t local_vocab,
                                                 int64_t real_hi, int64_t col0, int64_t vocab_start,
                                                 int64_t global_vocab, int64_t tile_w, float temperature, int scale,
                                                 void* stream) {
  if (n_rows == 0) return 0;
  // Column arithmetic is 32-bit inside the kernel.
  if (local_vocab + 2 * tile_w > kMaxInt || -col0 > kMaxInt || n_slots * tile_w > kMaxInt)
    return "vocab shard too wide for 32-bit column indices";
  if (n_rows > kMaxInt || n_slots > 65535 * LS_TILES_PER_BLOCK) return "too many rows or slots for one launch";
  const dim3 grid((unsigned)n_rows, (unsigned)((n_slots + LS_TILES_PER_BLOCK - 1) / LS_TILES_PER_BLOCK));
  const PartialsArgs args = {x, targets, m_out, s_out, w_out, tgt_out, n_rows, stride_x, vocab_start,
                             global_vocab, (int)n_slots, (int)local_vocab, (int)real_hi, (int)col0, (int)tile_w,
                             temperature, 1.0f / temperature, grid, (ls_stream_t)stream};
  const bool vec = lockstep_logprob_vector_loads(dtype, x, stride_x, local_vocab, vocab_start) != 0;
  const bool known = run_dtype<PartialsArgs, PartialsLaunch>(dtype, vec, w_out != nullptr, scale != 0, args);
  return known ? launch_status() : "unsupported dtype code";
}

// Merge partials [n_rows, n_slots] (strided) -> logp, lse, ent (or null with w null) [n_rows].
extern "C" const char* lockstep_logprob_merge(const float* m, const float* s, const float* w, const float* tgt,
                                              const int64_t* targets, const uint8_t* active, float* logp, float* lse,
                                              float* ent, int64_t n_rows, int64_t n_slots, int64_t stride_row,
                                              int64_t stride_slot, int64_t global_vocab, void* stream) {
  if (n_rows == 0) return 0;
  if ((w == nullptr) != (ent == nullptr)) return "w and ent must be given together";
  const unsigned blocks = (unsigned)((n_rows + LS_MERGE_THREADS - 1) / LS_MERGE_THREADS);
  ls_stream_t st = (ls_stream_t)stream;
  if (w != nullptr)
    LS_LAUNCH(blocks, LS_MERGE_THREADS, st, merge_kernel<true>)(m, s, w, tgt, targets, active, logp, lse, ent, n_rows,
                                                                n_slots, stride_row, stride_slot, global_vocab);
  else
    LS_LAUNCH(blocks, LS_MERGE_THREADS, st, merge_kernel<false>)(m, s, w, tgt, targets, active, logp, lse, ent,
                                                                 n_rows, n_slots, stride_row, stride_slot,
                                                                 global_vocab);
  return launch_status();
}

// Gradient [n_rows, local_vocab] in the logits dtype. g_logp, g_lse (or null: 0) are read with a row
// stride (0 allowed); the entropy term runs when both g_ent and mean_x are given; active or null.
extern "C" const char* lockstep_logprob_backward(int dtype, const void* x, void* g, const int64_t* targets,
                                                 const float* lse, const float* mean_x, const float* g_logp,
                                                 const float* g_lse, const float* g_ent, const uint8_t* active,
                                                 int64_t n_rows, int64_t stride_x, int64_t stride_g,
                                                 int64_t stride_glogp, int64_t stride_glse, int64_t stride_gent,
                                                 int64_t local_vocab, int64_t vocab_start, int64_t global_vocab,
                                                 float temperature, int scale, void* stream) {
  if (n_rows == 0 || local_vocab == 0) return 0;
  if (local_vocab > kMaxInt - 4096) return "vocab shard too wide for 32-bit column indices";
  const int64_t vec_w = 16 / elem_size(dtype);
  const int64_t cols = (int64_t)LS_BWD_THREADS * LS_BWD_VECS * vec_w;
  const int64_t col_blocks = (local_vocab + cols - 1) / cols;
  if (n_rows > kMaxInt || col_blocks > 65535) return "too many rows or columns for one launch";
  const int64_t in_vocab = global_vocab - vocab_start;  // local columns past it are padding
  const int real_hi = (int)(in_vocab < 0 ? 0 : (in_vocab < local_vocab ? in_vocab : local_vocab));
  const bool vec = lockstep_logprob_vector_loads(dtype, x, stride_x, local_vocab, vocab_start) &&
                   lockstep_logprob_vector_loads(dtype, g, stride_g, local_vocab, vocab_start);
  const BackwardArgs args = {x, g, targets, lse, mean_x, g_logp, g_lse, g_ent, active, stride_x, stride_g,
                             stride_glogp, stride_glse, stride_gent, vocab_start, global_vocab, (int)local_vocab,
                             real_hi, temperature, 1.0f / temperature, dim3((unsigned)n_rows, (unsigned)col_blocks),
                             (ls_stream_t)stream};
  const bool with_ent = g_ent != nullptr && mean_x != nullptr;
  const bool known = run_dtype<BackwardArgs, BackwardLaunch>(dtype, vec, with_ent, scale != 0, args);
  return known ? launch_status() : "unsupported dtype code";
}
