// Helpers shared by the sm_90a kernels: bf16 / fp16 rounding, packed pairs (and their 32-bit words) for stores, the
// launch's shared memory limit.
#pragma once

#include <cstdint>
#include <cstring>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cutlass/numeric_types.h>

namespace wide_sm90 {

template <class T>
struct Io;

template <>
struct Io<cutlass::bfloat16_t> {
  using Pair = __nv_bfloat162;
  static __device__ __forceinline__ float round(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }
  static __device__ __forceinline__ Pair pack(float a, float b) { return __floats2bfloat162_rn(a, b); }
  static __device__ __forceinline__ uint32_t pack_bits(float a, float b) {
    const Pair p = pack(a, b);
    uint32_t u;
    memcpy(&u, &p, sizeof(u));
    return u;
  }
};

template <>
struct Io<cutlass::half_t> {
  using Pair = __half2;
  static __device__ __forceinline__ float round(float v) { return __half2float(__float2half_rn(v)); }
  static __device__ __forceinline__ Pair pack(float a, float b) { return __floats2half2_rn(a, b); }
  static __device__ __forceinline__ uint32_t pack_bits(float a, float b) {
    const Pair p = pack(a, b);
    uint32_t u;
    memcpy(&u, &p, sizeof(u));
    return u;
  }
};

// Raises Kernel's dynamic shared memory limit to bytes, once per device; returns a cudaError_t (0: done).
template <auto Kernel>
int raise_smem_limit(int bytes) {
  static bool raised[64] = {};
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err == cudaSuccess && (dev >= 64 || !raised[dev])) {
    err = cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
    if (err == cudaSuccess && dev < 64) raised[dev] = true;
    if (err != cudaSuccess) (void)cudaGetLastError();  // returned to the caller, not left set
  }
  return int(err);
}

}  // namespace wide_sm90
