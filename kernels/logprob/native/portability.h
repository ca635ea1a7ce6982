// One source for CUDA and HIP. Why this header is small on purpose:
//  * bf16 travels as raw 16-bit words (uint16_t) and is widened by a shift, so
//    neither cuda_bf16.h nor hip_bf16.h is needed (Debian's hipcc 5.2 lacks
//    __hip_bfloat16 altogether);
//  * no warp-size assumption: reductions go through shared memory over the
//    whole block with a fixed halving tree, correct for 32-lane warps and
//    64-lane MI300 wavefronts alike, and in a fixed order on both.
#pragma once
#include <stdint.h>

#if defined(__HIP_PLATFORM_AMD__) || defined(__HIPCC__)
#include <hip/hip_runtime.h>
typedef hipStream_t ls_stream_t;
typedef hipError_t ls_error_t;
#define LS_SUCCESS hipSuccess
#define ls_get_last_error hipGetLastError
#define ls_error_string hipGetErrorString
#else
#include <cuda_runtime.h>
typedef cudaStream_t ls_stream_t;
typedef cudaError_t ls_error_t;
#define LS_SUCCESS cudaSuccess
#define ls_get_last_error cudaGetLastError
#define ls_error_string cudaGetErrorString
#endif

#define LS_DEVICE __device__ __forceinline__

// bf16 <-> fp32 by bits. Widening is exact; narrowing rounds to nearest even
// like torch's .to(torch.bfloat16), and keeps NaN a (quiet) NaN.
LS_DEVICE float ls_bf16_to_float(uint16_t bits) { return __uint_as_float(((uint32_t)bits) << 16); }

LS_DEVICE uint16_t ls_float_to_bf16(float f) {
  uint32_t u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}
