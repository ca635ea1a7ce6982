// Native (CUDA/HIP) kernels of the log-prob definition; the pure-torch
// definition they must match is kernels/logprob/reference.py.
//
// Three steps, as in every backend: per-tile fp32 (max, sumexp) partials with a
// fixed in-tile order; a merge of partials in global slot order; and an
// elementwise backward (each gradient element written once: no atomics).
// This file has no torch dependency so that hipcc and nvcc can compile it on
// their own (python -m kernels.check_targets); binding.cpp wraps it for torch.
#include "portability.h"

#define LS_THREADS 256  // power of two: the reduction tree halves it

namespace {

// dtype 0: bf16 as raw uint16_t, dtype 1: fp32.
template <int DT> struct Elem;
template <> struct Elem<0> {
  typedef uint16_t T;
  static LS_DEVICE float load(const T* p, int64_t i) { return ls_bf16_to_float(p[i]); }
  static LS_DEVICE T store(float f) { return ls_float_to_bf16(f); }
};
template <> struct Elem<1> {
  typedef float T;
  static LS_DEVICE float load(const T* p, int64_t i) { return p[i]; }
  static LS_DEVICE T store(float f) { return f; }
};

// Fixed halving tree over the block in shared memory; every thread gets the result.
template <bool IS_MAX>
LS_DEVICE float block_reduce(float v, float* sh) {
  const int tid = threadIdx.x;
  sh[tid] = v;
  __syncthreads();
  for (int off = LS_THREADS / 2; off > 0; off >>= 1) {
    if (tid < off) sh[tid] = IS_MAX ? fmaxf(sh[tid], sh[tid + off]) : sh[tid] + sh[tid + off];
    __syncthreads();
  }
  float r = sh[0];
  __syncthreads();  // sh is reused by the next reduction
  return r;
}

// grid (T, S): block (row, slot) reduces slot `slot` of row `row`; outputs slot-major [S, T].
template <int DT>
__global__ void __launch_bounds__(LS_THREADS) partials_kernel(
    const typename Elem<DT>::T* __restrict__ x, const int64_t* __restrict__ targets, float* __restrict__ m_out,
    float* __restrict__ s_out, float* __restrict__ tgt_out, int64_t stride_x, int64_t local_vocab, int64_t real_hi,
    int64_t col0, int64_t vocab_start, int64_t global_vocab, int64_t n_rows, int64_t tile_w, float temperature,
    int scale) {
  __shared__ float sh[LS_THREADS];
  const int64_t row = blockIdx.x, slot = blockIdx.y;
  const typename Elem<DT>::T* xr = x + row * stride_x;
  const int64_t base = col0 + slot * tile_w;
  const int64_t lo = base > 0 ? base : 0;
  const int64_t hi = (base + tile_w) < real_hi ? (base + tile_w) : real_hi;
  float m = -INFINITY;
  for (int64_t c = lo + threadIdx.x; c < hi; c += LS_THREADS) {
    float v = Elem<DT>::load(xr, c);
    m = fmaxf(m, scale ? v / temperature : v);
  }
  m = block_reduce<true>(m, sh);
  const float shift = (m == -INFINITY) ? 0.f : m;
  float s = 0.f;
  for (int64_t c = lo + threadIdx.x; c < hi; c += LS_THREADS) {  // second read of the tile hits L1/L2
    float v = Elem<DT>::load(xr, c);
    s += expf((scale ? v / temperature : v) - shift);
  }
  s = block_reduce<false>(s, sh);
  if (threadIdx.x == 0) {
    m_out[slot * n_rows + row] = m;
    s_out[slot * n_rows + row] = s;
    if (slot == 0) {
      const int64_t t = targets[row], local = t - vocab_start;
      float v = -INFINITY;
      if (local >= 0 && local < local_vocab && t < global_vocab) {
        v = Elem<DT>::load(xr, local);
        if (scale) v = v / temperature;
      }
      tgt_out[row] = v;
    }
  }
}

// One thread per row: sequential fold over the row's N slots (identity slots add exactly 0).
__global__ void merge_kernel(const float* __restrict__ m, const float* __restrict__ s, const float* __restrict__ tgt,
                             const int64_t* __restrict__ targets, const uint8_t* __restrict__ active,
                             float* __restrict__ logp, float* __restrict__ lse, int64_t n_rows, int64_t n_slots,
                             int64_t stride_row, int64_t stride_slot, int64_t global_vocab) {
  const int64_t row = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (row >= n_rows) return;
  const float* mr = m + row * stride_row;
  const float* sr = s + row * stride_row;
  float M = -INFINITY;
  for (int64_t k = 0; k < n_slots; ++k) M = fmaxf(M, mr[k * stride_slot]);
  const float shift = (M == -INFINITY) ? 0.f : M;
  float S = 0.f;
  for (int64_t k = 0; k < n_slots; ++k) S += sr[k * stride_slot] * expf(mr[k * stride_slot] - shift);
  float l = M + logf(S);
  const int64_t t = targets[row];
  float lp = (t >= 0 && t < global_vocab) ? tgt[row] - l : NAN;
  if (active != nullptr && active[row] == 0) lp = 0.f, l = 0.f;
  logp[row] = lp;
  lse[row] = l;
}

// grid (T * col_blocks): elementwise d/dlogits of g_logp*logp + g_lse*lse.
template <int DT>
__global__ void __launch_bounds__(LS_THREADS) backward_kernel(
    const typename Elem<DT>::T* __restrict__ x, typename Elem<DT>::T* __restrict__ g,
    const int64_t* __restrict__ targets, const float* __restrict__ lse, const float* __restrict__ g_logp,
    const float* __restrict__ g_lse, const uint8_t* __restrict__ active, int64_t stride_x, int64_t stride_g,
    int64_t local_vocab, int64_t vocab_start, int64_t global_vocab, int64_t col_blocks, int64_t cols_per_block,
    float temperature, int scale) {
  const int64_t row = blockIdx.x / col_blocks, cb = blockIdx.x % col_blocks;
  const bool on = active == nullptr || active[row] != 0;
  const float l = lse[row], gl = g_logp[row], gs = g_lse[row];
  const int64_t t = targets[row];
  const int64_t hit = (t >= 0 && t < global_vocab) ? t - vocab_start : -1;
  const int64_t end = (cb + 1) * cols_per_block < local_vocab ? (cb + 1) * cols_per_block : local_vocab;
  for (int64_t c = cb * cols_per_block + threadIdx.x; c < end; c += LS_THREADS) {
    float v = Elem<DT>::load(x + row * stride_x, c);
    if (scale) v = v / temperature;
    const bool real = (vocab_start + c < global_vocab) && v != -INFINITY;
    const float p = real ? expf(v - l) : 0.f;
    float d = (gs - gl) * p;
    if (c == hit) d += gl;
    if (scale) d = d / temperature;
    g[row * stride_g + c] = Elem<DT>::store(on ? d : 0.f);
  }
}

}  // namespace

// ---- C launchers (the only symbols binding.cpp and check_targets rely on). Return 0 or an error string. ----

extern "C" const char* lockstep_logprob_partials(int dtype, const void* x, const int64_t* targets, float* m_out,
                                                 float* s_out, float* tgt_out, int64_t n_rows, int64_t n_slots,
                                                 int64_t stride_x, int64_t local_vocab, int64_t real_hi, int64_t col0,
                                                 int64_t vocab_start, int64_t global_vocab, int64_t tile_w,
                                                 float temperature, int scale, void* stream) {
  if (n_rows == 0) return 0;
  dim3 grid((unsigned)n_rows, (unsigned)n_slots);
  ls_stream_t st = (ls_stream_t)stream;
  if (dtype == 0)
    partials_kernel<0><<<grid, LS_THREADS, 0, st>>>((const uint16_t*)x, targets, m_out, s_out, tgt_out, stride_x,
                                                     local_vocab, real_hi, col0, vocab_start, global_vocab, n_rows,
                                                     tile_w, temperature, scale);
  else if (dtype == 1)
    partials_kernel<1><<<grid, LS_THREADS, 0, st>>>((const float*)x, targets, m_out, s_out, tgt_out, stride_x,
                                                     local_vocab, real_hi, col0, vocab_start, global_vocab, n_rows,
                                                     tile_w, temperature, scale);
  else
    return "unsupported dtype code";
  ls_error_t e = ls_get_last_error();
  return e == LS_SUCCESS ? 0 : ls_error_string(e);
}

extern "C" const char* lockstep_logprob_merge(const float* m, const float* s, const float* tgt, const int64_t* targets,
                                              const uint8_t* active, float* logp, float* lse, int64_t n_rows,
                                              int64_t n_slots, int64_t stride_row, int64_t stride_slot,
                                              int64_t global_vocab, void* stream) {
  if (n_rows == 0) return 0;
  const int threads = 128;
  merge_kernel<<<(unsigned)((n_rows + threads - 1) / threads), threads, 0, (ls_stream_t)stream>>>(
      m, s, tgt, targets, active, logp, lse, n_rows, n_slots, stride_row, stride_slot, global_vocab);
  ls_error_t e = ls_get_last_error();
  return e == LS_SUCCESS ? 0 : ls_error_string(e);
}

extern "C" const char* lockstep_logprob_backward(int dtype, const void* x, void* g, const int64_t* targets,
                                                 const float* lse, const float* g_logp, const float* g_lse,
                                                 const uint8_t* active, int64_t n_rows, int64_t stride_x,
                                                 int64_t stride_g, int64_t local_vocab, int64_t vocab_start,
                                                 int64_t global_vocab, float temperature, int scale, void* stream) {
  if (n_rows == 0) return 0;
  const int64_t cols_per_block = 4 * LS_THREADS;
  const int64_t col_blocks = (local_vocab + cols_per_block - 1) / cols_per_block;
  ls_stream_t st = (ls_stream_t)stream;
  const unsigned blocks = (unsigned)(n_rows * col_blocks);
  if (dtype == 0)
    backward_kernel<0><<<blocks, LS_THREADS, 0, st>>>((const uint16_t*)x, (uint16_t*)g, targets, lse, g_logp, g_lse,
                                                       active, stride_x, stride_g, local_vocab, vocab_start,
                                                       global_vocab, col_blocks, cols_per_block, temperature, scale);
  else if (dtype == 1)
    backward_kernel<1><<<blocks, LS_THREADS, 0, st>>>((const float*)x, (float*)g, targets, lse, g_logp, g_lse, active,
                                                       stride_x, stride_g, local_vocab, vocab_start, global_vocab,
                                                       col_blocks, cols_per_block, temperature, scale);
  else
    return "unsupported dtype code";
  ls_error_t e = ls_get_last_error();
  return e == LS_SUCCESS ? 0 : ls_error_string(e);
}
