// Tile shapes, shared memory and MMA types of the sm_90a routed prefill attention (attention_sm90.cu), and the
// regrouping of the S accumulator into the A operand of P V; host-compilable, so the layouts are checked on a machine
// without a GPU (tests/kernels/sm90_attention_layout.cu).
#pragma once

#include <cute/tensor.hpp>

#include <cute/atom/mma_traits_sm90_gmma.hpp>

namespace wide_sm90 {

namespace attn {

using namespace cute;

constexpr int kD = 128;       // head dim
constexpr int kBM = 128;      // query rows per CTA (64 per consumer warpgroup)
constexpr int kBN = 128;      // keys per block
constexpr int kStages = 2;    // K / V ring depth
constexpr int kProducerThreads = 128;  // warp 0 streams K / V, warps 1-3 gather Q
constexpr int kGatherThreads = 96;
constexpr int kConsumerThreads = 256;
constexpr int kThreads = kProducerThreads + kConsumerThreads;
constexpr int kProducerRegs = 40;  // setmaxnreg split of the 64K registers
constexpr int kConsumerRegs = 232;
// setmaxnreg only moves registers between the warpgroups: the split fits the launch's 168 per thread
static_assert(kProducerThreads * kProducerRegs + kConsumerThreads * kConsumerRegs <=
                  (kProducerThreads + kConsumerThreads) * (65536 / (kProducerThreads + kConsumerThreads) / 8 * 8),
              "register split within the launch's registers");

template <class T>
struct Config {
  using SmemLayoutQ = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<T>{}, Shape<Int<kBM>, Int<kD>>{}));
  using SmemLayoutK =
      decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<T>{}, Shape<Int<kBN>, Int<kD>, Int<kStages>>{}));
  // V as the (d, key) B operand of P V, d contiguous: the same bytes as a K-major (key, d) tile
  using SmemLayoutVt = decltype(tile_to_shape(GMMA::Layout_MN_SW128_Atom<T>{},
                                              Shape<Int<kD>, Int<kBN>, Int<kStages>>{}, Step<_2, _1, _3>{}));
  using MmaQK = decltype(make_tiled_mma(GMMA::ss_op_selector<T, T, float, Shape<_64, Int<kBN>, Int<kD>>>(),
                                        Layout<Shape<_2, _1, _1>>{}));
  using MmaPV = decltype(make_tiled_mma(
      GMMA::rs_op_selector<T, T, float, Shape<_64, Int<kD>, Int<kBN>>, GMMA::Major::K, GMMA::Major::MN>(),
      Layout<Shape<_2, _1, _1>>{}));
  struct Smem {
    alignas(1024) T q[cosize_v<SmemLayoutQ>];
    alignas(1024) T k[cosize_v<SmemLayoutK>];
    alignas(1024) T v[cosize_v<SmemLayoutVt>];
    int32_t rows[2][kBM];  // the original rows of a tile's sorted rows (-1: inactive), two tiles in turn
    alignas(8) uint64_t q_full;
    alignas(8) uint64_t q_empty;
    alignas(8) uint64_t k_full[kStages];
    alignas(8) uint64_t v_full[kStages];
    alignas(8) uint64_t k_empty[kStages];
    alignas(8) uint64_t v_empty[kStages];
  };
  static constexpr int kSmem = int(sizeof(Smem));
  static constexpr uint32_t kBlockBytes = uint32_t(kBN * kD * sizeof(T));
  static_assert(kSmem <= 227 * 1024, "shared memory of one CTA");
};

// P in the A-operand registers of P V: the S accumulator's per-thread values (col pair, row, 8-col block) regrouped
// as (col pair, row, k half) x (16-key blocks), the same registers in the same order.
template <class AccLayout>
CUTE_HOST_DEVICE constexpr auto p_layout(AccLayout ls) {
  auto nb_stride = stride<0, 2>(ls);
  return make_layout(make_layout(layout<0, 0>(ls), layout<0, 1>(ls), make_layout(_2{}, nb_stride)), layout<1>(ls),
                     make_layout(Int<kBN / 16>{}, nb_stride * _2{}));
}

}  // namespace attn

}  // namespace wide_sm90
