// Host entry of the sm_90a routed GEMM-MN kernels (gemm_mn_sm90.cu); no torch headers, so nvcc builds it alone.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace wide_sm90 {

// What one launch computes.
enum Op : int {
  kGemmMn = 0,      // out[m, n] = (x @ w.T)[m, n] if route[m, n // G] else 0   (rows gathered through index)
  kSwiglu = 1,      // out[m, n] = silu(x @ w.T) * (x @ w2.T) if route[m, n // G] else 0
  kDenseSwiglu = 2  // out = silu(x @ w.T) * (x @ w2.T) for every row (index, counts unused); with a mask, 0 where
                    // mask[m, n // G] is false (the TMA main loop of every row, the route applied in the epilogue)
};

enum DType : int { kBF16 = 0, kFP16 = 1 };

// x [M, K] (row stride ldx), w / w2 [N, K] (row stride ldw), out [M, N] (row stride ldo), index int32 [M, N / G]
// (reordered rows of each group, active first), counts int32 [N / G] (active rows per group), mask bool [M, N / G]
// row-major or null (the dense SwiGLU's route; null for the routed ops); all on the current device.  Requires
// K % 64 == 0, G % 128 == 0 (G % 256 == 0 for the 128 x 256 tile), N % G == 0, 16-byte aligned pointers and row
// strides.  grid_ctas: the persistent grid (the GPU's SM count); cluster_m: 1, or 2 for clusters of
// two CTAs along M that share the weight tiles by TMA multicast.  Returns a cudaError_t (0: ok,
// cudaErrorInvalidValue: a shape it does not take).
int launch(int op, int dtype, const void* x, int64_t ldx, const void* w, const void* w2, int64_t ldw, void* out,
           int64_t ldo, const int32_t* index, const int32_t* counts, const uint8_t* mask, int M, int N, int K, int G,
           int group_m, int grid_ctas, int cluster_m, cudaStream_t stream);

// The K-axis O projection in the shared token order (paper Eq. 21 over wide.kernels.token_order):
// out[perm[j], :] = sum over the K groups g in the union of j's 64-row tile (unions[j / 64], bit g) of
// a[j, g * Gk : (g + 1) * Gk] @ w[:, g * Gk : (g + 1) * Gk].T, for the sorted rows j of a [M, K] (row stride lda) whose
// skipped (row, group) blocks are zero; w [N, K] (row stride ldw), out [M, N] (row stride ldo) in token order, perm
// int32 [M], unions int32 [ceil(M / 64)].  Requires K % Gk == 0, Gk % 64 == 0, K / Gk <= 32, N % 256 == 0, 16-byte
// aligned pointers and row strides.  grid_ctas and cluster_m as launch's.  Returns a cudaError_t.
int launch_o_proj(int dtype, const void* a, int64_t lda, const void* w, int64_t ldw, void* out, int64_t ldo,
                  const int32_t* perm, const int32_t* unions, int M, int N, int K, int Gk, int group_m, int grid_ctas,
                  int cluster_m, cudaStream_t stream);

// Dynamic shared memory (bytes) one CTA of this op and G uses.
int smem_bytes(int op, int G);

}  // namespace wide_sm90
