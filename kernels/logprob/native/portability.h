// One source for CUDA, HIP and a CPU emulator. Why this header stays small:
//  * every platform difference the kernels see is one of the few ls_* names
//    below; logprob_kernels.cu uses nothing platform specific besides them;
//  * bf16 travels as raw 16-bit words and is widened by a shift, so no bf16
//    header is needed on HIP (Debian's hipcc 5.2 lacks __hip_bfloat16 altogether);
//  * no warp-size assumption: the only cross-lane primitive is ls_shfl_xor32,
//    an xor shuffle inside a group of 32 lanes (offsets < 32). On a 32-lane
//    NVIDIA warp the group is the warp; on a 64-lane AMD wavefront lane ^ off
//    keeps bit 5 of the lane id, so each half of the wavefront reduces on its
//    own, exactly as a 32-lane warp would. The same tree, in the same order,
//    runs on both; shared memory is not needed at all.
//  * LS_CPU_EMULATION: tests/kernels/test_logprob_native_source.py runs these
//    kernels on the CPU (lanes as cooperative fibers); its shim, included
//    first, supplies the runtime names and the primitives of the first block.
#pragma once
#include <stdint.h>

#if defined(LS_CPU_EMULATION)
// Supplied by the emulator: ls_stream_t, ls_error_t, LS_SUCCESS, ls_get_last_error, ls_error_string,
// LS_LAUNCH, ls_shfl_xor32, ls_exp, ls_half_to_float, ls_pack_half2, and the CUDA builtins used here.
#define LS_DEVICE __device__ __forceinline__
#elif defined(__HIP_PLATFORM_AMD__) || defined(__HIPCC__)
#include <hip/hip_runtime.h>
#include <hip/hip_fp16.h>
typedef hipStream_t ls_stream_t;
typedef hipError_t ls_error_t;
#define LS_SUCCESS hipSuccess
#define ls_get_last_error hipGetLastError
#define ls_error_string hipGetErrorString
#define LS_DEVICE __device__ __forceinline__
// Kernel last, so that template arguments with commas need no extra parentheses.
#define LS_LAUNCH(grid, block, stream, ...) __VA_ARGS__<<<(grid), (block), 0, (stream)>>>

// width 32: the source lane stays inside this lane's 32-lane group on a 64-lane wavefront too.
LS_DEVICE float ls_shfl_xor32(float v, int lane_mask) { return __shfl_xor(v, lane_mask, 32); }
// e^d as v_exp_f32(d * log2e) (__expf, ocml's native exp); exp2f would add a denormal-range fixup
// (a compare and two selects per element). Results below 2^-126 flush to zero: see the CUDA one.
LS_DEVICE float ls_exp(float d) { return __expf(d); }
LS_DEVICE float ls_half_to_float(uint16_t bits) { return __half2float(__ushort_as_half(bits)); }
// Round to nearest even (a _Float16 conversion); `lo` goes to the lower address.
LS_DEVICE uint32_t ls_pack_half2(float lo, float hi) {
  __half2 h = __floats2half2_rn(lo, hi);
  uint32_t u;
  __builtin_memcpy(&u, &h, 4);
  return u;
}
#else
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
typedef cudaStream_t ls_stream_t;
typedef cudaError_t ls_error_t;
#define LS_SUCCESS cudaSuccess
#define ls_get_last_error cudaGetLastError
#define ls_error_string cudaGetErrorString
#define LS_DEVICE __device__ __forceinline__
#define LS_LAUNCH(grid, block, stream, ...) __VA_ARGS__<<<(grid), (block), 0, (stream)>>>

// The full mask is right because every caller runs with all 32 lanes of the warp converged.
LS_DEVICE float ls_shfl_xor32(float v, int lane_mask) { return __shfl_xor_sync(0xffffffffu, v, lane_mask, 32); }
// e^d as one multiply and one MUFU.EX2 (exp2f would add a denormal-range fixup around it, expf a
// range reduction). Flushing results below 2^-126 to zero drops terms < 1e-38 relative to the
// row's largest one (d <= 0 always): no effect at fp32 resolution.
LS_DEVICE float ls_exp(float d) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(d * 1.4426950408889634f));
  return y;
}
LS_DEVICE float ls_half_to_float(uint16_t bits) { return __half2float(__ushort_as_half(bits)); }
LS_DEVICE uint32_t ls_pack_half2(float lo, float hi) {
  __half2 h = __floats2half2_rn(lo, hi);  // .x (lower address) = lo, round to nearest even
  uint32_t u;
  __builtin_memcpy(&u, &h, 4);
  return u;
}
#endif

// bf16 <-> fp32 by bits. Widening is exact; narrowing rounds to nearest even
// like torch's .to(torch.bfloat16), and keeps NaN a (quiet) NaN.
LS_DEVICE float ls_bf16_to_float(uint16_t bits) { return __uint_as_float(((uint32_t)bits) << 16); }

LS_DEVICE uint16_t ls_float_to_bf16(float f) {
  uint32_t u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

// Two fp32 -> packed bf16x2 (`lo` at the lower address), round to nearest even.
LS_DEVICE uint32_t ls_pack_bf16x2(float lo, float hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  // One cvt.rn.bf16x2.f32 for both; the same bits as the integer rounding below (NaN payloads aside).
  __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  uint32_t u;
  __builtin_memcpy(&u, &h, 4);
  return u;
#else
  return (uint32_t)ls_float_to_bf16(lo) | ((uint32_t)ls_float_to_bf16(hi) << 16);
#endif
}
