// Element helpers shared by the sm_90a kernels: bf16 / fp16 rounding and packed pairs for 4-byte stores.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cutlass/numeric_types.h>

namespace wide_sm90 {

template <class T>
struct Io;

template <>
struct Io<cutlass::bfloat16_t> {
  using Pair = __nv_bfloat162;
  static __device__ __forceinline__ float round(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }
  static __device__ __forceinline__ Pair pack(float a, float b) { return __floats2bfloat162_rn(a, b); }
};

template <>
struct Io<cutlass::half_t> {
  using Pair = __half2;
  static __device__ __forceinline__ float round(float v) { return __half2float(__float2half_rn(v)); }
  static __device__ __forceinline__ Pair pack(float a, float b) { return __floats2half2_rn(a, b); }
};

}  // namespace wide_sm90
