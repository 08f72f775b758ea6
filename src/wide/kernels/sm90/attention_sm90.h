// Host entry of the sm_90a routed prefill attention (attention_sm90.cu); no torch headers, so nvcc builds it alone.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "gemm_mn_sm90.h"  // DType

namespace wide_sm90 {

// One routed attention launch (paper Eq. 2, Algorithm 4) in SDPA's layout.  Strides are in elements; the last
// dimension (d) of q, k, v and out has unit stride.
struct AttentionArgs {
  const void* q;  // [B, Hq, Tq, d]
  const void* k;  // [B, Hk, Tk, d]
  const void* v;  // [B, Hk, Tk, d]
  void* out;      // [B, Hq, Tq, d]
  int64_t sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, sob, soh, sot;
  const int32_t* index;     // [B, Tq, N_G]: original query row of each sorted row of a (b, group), active rows first
  const int32_t* counts;    // [B, N_G]: active rows of each (b, group)
  const int32_t* left_pad;  // [B] or null: keys j < left_pad[b] masked (clamped to [0, Tk])
  int B, Hq, Hk, Tq, Tk, NG, D;
  float scale;  // softmax scale (multiplies q . k)
  int causal;     // query i sits at key position i + Tk - Tq and sees keys j <= that position
  int pingpong;   // the two consumer warpgroups take turns issuing their matrix products
  int grid_ctas;  // CTAs of the launch, each taking every grid_ctas-th tile (persistent); 0: one CTA per tile
};

// Launches on stream.  Requires d == 128, bf16 (dtype kBF16) or fp16 (kFP16), scale > 0, Hq % Hk == 0,
// Hq % N_G == 0, 1 <= Tq <= Tk, 16-byte aligned q / k / v / out pointers and strides that are multiples of 8
// elements.  Returns a cudaError_t (cudaErrorInvalidValue: arguments it does not take).
int launch_attention(int dtype, const AttentionArgs& args, cudaStream_t stream);

}  // namespace wide_sm90
