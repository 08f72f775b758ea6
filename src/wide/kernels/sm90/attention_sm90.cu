// Routed prefill attention (paper Eq. 2, Algorithm 4) for sm_90a with CuTe, head dim 128.
//
// A tile is 128 sorted query rows of one (b, query head): the rows of the head's group g taken from the reorder index,
// active rows first and, within them, in ascending original position.  A CTA takes one tile, or every gridDim-th tile
// of the list (persistent), late row tiles (the heavy ones under causal masking) first.  A tile wholly past the
// group's active count only writes zeros.  Otherwise warpgroup 0 produces: warps 1-3 stage the tile's row indices in
// shared memory and gather its Q rows with cp.async (inactive rows zero-filled, not read) into a 128-byte-swizzled
// tile once the previous tile's last S has read Q; one thread of warp 0 streams the K and V blocks of the tile's key
// range by TMA into a two-stage ring (K and V with their own barriers).  Warpgroups 1 and 2 consume, 64 query rows
// each: S = Q K^T (wgmma, both operands in shared memory), the online softmax in registers, O += P V (wgmma with P
// from registers).  S of block n is issued with P V of block n + 1, so the softmax of one block runs while the tensor
// cores multiply the other; optionally the two warpgroups take turns issuing (ping-pong).  Key blocks are visited
// from the last to the first: with causal masking the diagonal band (masked element-wise) comes first, then unmasked
// blocks, and a left-padding boundary last.  The last active row of a tile has its largest position, so no key after
// it is read.  The epilogue divides by the softmax sum and scatters the rows to their original positions; inactive
// rows and rows with no visible key get 0.

#include "attention_sm90.h"
#include "attention_sm90_config.cuh"
#include "common_sm90.cuh"

#include <cute/tensor.hpp>  // first: the atoms below need the whole of cute

#include <cute/arch/copy_sm80.hpp>
#include <cute/atom/copy_traits_sm90_tma.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/numeric_types.h>

#include <cmath>

namespace wide_sm90 {

namespace attn {

using namespace cute;

__device__ __forceinline__ float ex2(float x) {  // 2^x; ex2.approx(-inf) = +0
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// PINGPONG: the two consumer warpgroups take turns issuing their wgmma (a named barrier each), so the softmax of one
// runs while the other's matrix products occupy the tensor cores.
template <class T, bool CAUSAL, bool PINGPONG, class TmaK, class TmaV>
__global__ void __launch_bounds__(kThreads, 1)
    attention_kernel(const __grid_constant__ TmaK tma_k, const __grid_constant__ TmaV tma_v,
                     const AttentionArgs a) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using C = Config<T>;
  using FullBarrier = cutlass::arch::ClusterTransactionBarrier;
  using EmptyBarrier = cutlass::arch::ClusterBarrier;
  constexpr float kInf = INFINITY;

  const int tid = int(threadIdx.x);
  const int MT = (a.Tq + kBM - 1) / kBM, BH = a.B * a.Hq;
  const int tiles = MT * BH;

  extern __shared__ __align__(1024) uint8_t smem_raw[];
  auto& sm = *reinterpret_cast<typename C::Smem*>(smem_raw);
  Tensor sQ = make_tensor(make_smem_ptr(sm.q), typename C::SmemLayoutQ{});    // (BM, D)
  Tensor sK = make_tensor(make_smem_ptr(sm.k), typename C::SmemLayoutK{});    // (BN, D, STAGES)
  Tensor sVt = make_tensor(make_smem_ptr(sm.v), typename C::SmemLayoutVt{});  // (D, BN, STAGES)

  if (tid == 0) {
    FullBarrier::init(&sm.q_full, kGatherThreads);  // one arrival per gathering thread, when its pieces land
    EmptyBarrier::init(&sm.q_empty, 2);               // one arrival per consumer warpgroup
    CUTE_UNROLL
    for (int s = 0; s < kStages; ++s) {
      FullBarrier::init(&sm.k_full[s], 1);
      FullBarrier::init(&sm.v_full[s], 1);
      EmptyBarrier::init(&sm.k_empty[s], 2);
      EmptyBarrier::init(&sm.v_empty[s], 2);
    }
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();

  // Tile t: row tile MT - 1 - t / BH (late, heavy under causal masking, first) of (b, h) = t % BH.  The tile's key
  // blocks [n_min, n_max) run from the left padding to the last active row's position; a tile with m0 >= cnt has no
  // active row.
  struct Tile {
    int b, h, g, hk, m0, cnt, first_pos, lo, n_min, n_max;
    const int32_t* col;  // sorted row j of the group: col[j * NG]
  };
  const int delta = a.Tk - a.Tq;
  auto tile_of = [&](int t) {
    Tile x;
    const int bh = t % BH;
    x.b = bh / a.Hq;
    x.h = bh % a.Hq;
    x.g = x.h / (a.Hq / a.NG);
    x.hk = x.h / (a.Hq / a.Hk);
    x.m0 = (MT - 1 - t / BH) * kBM;
    x.cnt = __ldg(a.counts + x.b * a.NG + x.g);
    x.col = a.index + int64_t(x.b) * a.Tq * a.NG + x.g;
    if (x.m0 < x.cnt) {
      x.lo = a.left_pad ? min(max(__ldg(a.left_pad + x.b), 0), a.Tk) : 0;
      x.first_pos = __ldg(x.col + int64_t(x.m0) * a.NG) + delta;
      const int last_pos = __ldg(x.col + int64_t(min(x.m0 + kBM, x.cnt) - 1) * a.NG) + delta;
      const int hi = CAUSAL ? min(a.Tk, last_pos + 1) : a.Tk;
      x.n_min = x.lo / kBN;
      x.n_max = (hi + kBN - 1) / kBN;
    }
    return x;
  };

  if (cutlass::canonical_warp_group_idx() == 0) {  // producer
    cutlass::arch::warpgroup_reg_dealloc<kProducerRegs>();
    if (tid == 0) {  // K / V of every block of every tile, by TMA
      prefetch_tma_descriptor(tma_k.get_tma_descriptor());
      prefetch_tma_descriptor(tma_v.get_tma_descriptor());
      Tensor mK = tma_k.get_tma_tensor(make_shape(a.Tk, int(kD), a.Hk, a.B));
      Tensor mV = tma_v.get_tma_tensor(make_shape(int(kD), a.Tk, a.Hk, a.B));
      int stage = 0;
      uint32_t phase = 0;
      for (int t = int(blockIdx.x); t < tiles; t += int(gridDim.x)) {
        const Tile x = tile_of(t);
        if (x.m0 >= x.cnt) continue;  // the consumers write its zeros
        Tensor gK = local_tile(mK(_, _, x.hk, x.b), Shape<Int<kBN>, Int<kD>>{}, make_coord(_, 0));  // (BN, D, n)
        auto [tKgK, tKsK] =
            tma_partition(tma_k, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sK), group_modes<0, 2>(gK));
        Tensor gV = local_tile(mV(_, _, x.hk, x.b), Shape<Int<kD>, Int<kBN>>{}, make_coord(0, _));  // (D, BN, n)
        auto [tVgV, tVsV] =
            tma_partition(tma_v, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sVt), group_modes<0, 2>(gV));
        for (int n = x.n_max - 1; n >= x.n_min; --n) {
          EmptyBarrier::wait(&sm.k_empty[stage], phase ^ 1);
          FullBarrier::arrive_and_expect_tx(&sm.k_full[stage], C::kBlockBytes);
          copy(tma_k.with(sm.k_full[stage]), tKgK(_, n), tKsK(_, stage));
          EmptyBarrier::wait(&sm.v_empty[stage], phase ^ 1);
          FullBarrier::arrive_and_expect_tx(&sm.v_full[stage], C::kBlockBytes);
          copy(tma_v.with(sm.v_full[stage]), tVgV(_, n), tVsV(_, stage));
          if (++stage == kStages) {
            stage = 0;
            phase ^= 1;
          }
        }
      }
    } else if (tid >= 32) {  // Q: the tile's row indices staged in shared memory, then 16-byte pieces by cp.async
      constexpr int kPieces = kD * int(sizeof(T)) / 16;  // per row
      const int gtid = tid - 32;
      uint32_t q_phase = 0;
      int buf = 0;
      for (int t = int(blockIdx.x); t < tiles; t += int(gridDim.x)) {
        const Tile x = tile_of(t);
        if (x.m0 >= x.cnt || x.n_max <= x.n_min) continue;  // no key block: Q is not read, no Q barrier
        for (int r = gtid; r < kBM; r += kGatherThreads) {
          const int j = x.m0 + r;
          sm.rows[buf][r] = j < x.cnt ? __ldg(x.col + int64_t(j) * a.NG) : -1;
        }
        cutlass::arch::NamedBarrier::sync(kGatherThreads, 2);  // ids 0 and 1: the consumers' ping-pong
        EmptyBarrier::wait(&sm.q_empty, q_phase ^ 1);            // the previous tile's last S has read Q
        q_phase ^= 1;
        const T* q = static_cast<const T*>(a.q) + x.b * a.sqb + x.h * a.sqh;
        for (int e = gtid; e < kBM * kPieces; e += kGatherThreads) {  // consecutive threads: one row's pieces
          const int r = e / kPieces, piece = e % kPieces, row = sm.rows[buf][r];
          SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<uint128_t>::copy(
              *reinterpret_cast<const uint128_t*>(q + int64_t(row >= 0 ? row : 0) * a.sqt + piece * 8),
              *reinterpret_cast<uint128_t*>(&sQ(r, piece * 8)), row >= 0);
        }
        cutlass::arch::cpasync_barrier_arrive_noinc(&sm.q_full);
        buf ^= 1;
      }
      cp_async_wait<0>();
    }
  } else {  // consumers
    cutlass::arch::warpgroup_reg_alloc<kConsumerRegs>();
    const int ctid = tid - kProducerThreads;
    typename C::MmaQK mma_qk;
    typename C::MmaPV mma_pv;
    auto thr_qk = mma_qk.get_thread_slice(ctid);
    auto thr_pv = mma_pv.get_thread_slice(ctid);
    Tensor tSrQ = thr_qk.make_fragment_A(thr_qk.partition_A(sQ));   // (MMA, 1, D / 16) descriptors
    Tensor tSrK = thr_qk.make_fragment_B(thr_qk.partition_B(sK));   // (MMA, 1, D / 16, STAGES)
    Tensor tOrV = thr_pv.make_fragment_B(thr_pv.partition_B(sVt));  // (MMA, 1, BN / 16, STAGES)
    Tensor tScS = thr_qk.partition_C(make_identity_tensor(Shape<Int<kBM>, Int<kBN>>{}));  // (row, key) per value
    Tensor tOcO = thr_pv.partition_C(make_identity_tensor(Shape<Int<kBM>, Int<kD>>{}));   // (row, d) per value
    Tensor acc_s = partition_fragment_C(mma_qk, Shape<Int<kBM>, Int<kBN>>{});  // ((2 cols, 2 rows, BN / 8), 1, 1)
    Tensor acc_o = partition_fragment_C(mma_pv, Shape<Int<kBM>, Int<kD>>{});   // ((2 cols, 2 rows, D / 8), 1, 1)
    static_assert(decltype(size<1>(acc_s))::value == 1 && decltype(size<2>(acc_s))::value == 1 &&
                      decltype(size<0>(acc_s))::value == kBN / 2 && decltype(size<0>(acc_o))::value == kD / 2,
                  "one 64-row wgmma atom per consumer warpgroup");
    Tensor tSrP = make_tensor(acc_s.data(), p_layout(acc_s.layout()));  // view of S as P (A operand of P V)
    Tensor tOrP = make_tensor_like<T>(tSrP);
    static_assert(decltype(size(tOrP))::value == decltype(size(acc_s))::value, "P holds every value of S");

    const float scale_log2 = a.scale * float(M_LOG2E);
    // the tile's state: this thread's two rows (r, r + 8 of its warp's 16), their original row, position, whether
    // active, running max and sum; the tile's left padding and first active position
    int qpos[2], orow[2], lo = 0, first_pos = 0;
    float row_max[2], row_sum[2];

    // masks S of key block n (MASK), updates the running max and sum, turns S into P; returns the rescale of O
    auto softmax = [&](int n, auto mask_tag, float (&alpha)[2]) {
      constexpr bool MASK = decltype(mask_tag)::value;
      const int k0 = n * kBN;
      CUTE_UNROLL
      for (int r = 0; r < 2; ++r) {
        float mx = row_max[r];
        CUTE_UNROLL
        for (int nb = 0; nb < kBN / 8; ++nb) {
          CUTE_UNROLL
          for (int c = 0; c < 2; ++c) {
            float& s = acc_s(make_coord(c, r, nb), 0, 0);
            if constexpr (MASK) {
              const int key = k0 + int(get<1>(tScS(make_coord(c, r, nb), 0, 0)));
              const bool vis = key >= lo && key < a.Tk && (!CAUSAL || key <= qpos[r]);
              s = vis ? s : -kInf;
            }
            mx = fmaxf(mx, s);
          }
        }
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));  // the 4 threads of a row
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float base = mx == -kInf ? 0.0f : mx * scale_log2;  // a row with no visible key yet: P = 0
        alpha[r] = ex2(row_max[r] * scale_log2 - base);
        row_max[r] = mx;
        float sum = 0.0f;
        CUTE_UNROLL
        for (int nb = 0; nb < kBN / 8; ++nb) {
          CUTE_UNROLL
          for (int c = 0; c < 2; ++c) {
            float& s = acc_s(make_coord(c, r, nb), 0, 0);
            s = ex2(fmaf(s, scale_log2, -base));
            sum += s;
          }
        }
        row_sum[r] = row_sum[r] * alpha[r] + sum;  // this thread's columns; the 4 threads add up at the end
      }
    };
    // the element-wise mask only where block n holds a key some active row must not see
    auto softmax_block = [&](int n, float (&alpha)[2]) {
      const int k0 = n * kBN;
      if (k0 < lo || k0 + kBN > a.Tk || (CAUSAL && k0 + kBN - 1 > first_pos)) {
        softmax(n, cute::true_type{}, alpha);
      } else {
        softmax(n, cute::false_type{}, alpha);
      }
    };
    auto issue_qk = [&](int stage) {
      warpgroup_fence_operand(acc_s);
      warpgroup_arrive();
      mma_qk.accumulate_ = GMMA::ScaleOut::Zero;
      CUTE_UNROLL
      for (int kb = 0; kb < size<2>(tSrQ); ++kb) {
        gemm(mma_qk, tSrQ(_, _, kb), tSrK(_, _, kb, stage), acc_s);
        mma_qk.accumulate_ = GMMA::ScaleOut::One;
      }
      warpgroup_commit_batch();
      warpgroup_fence_operand(acc_s);
    };
    auto issue_pv = [&](int stage) {
      warpgroup_fence_operand(acc_o);
      warpgroup_fence_operand(tOrP);
      warpgroup_arrive();
      CUTE_UNROLL
      for (int kb = 0; kb < size<2>(tOrP); ++kb) gemm(mma_pv, tOrP(_, _, kb), tOrV(_, _, kb, stage), acc_o);
      warpgroup_commit_batch();
      warpgroup_fence_operand(acc_o);
      warpgroup_fence_operand(tOrP);
    };
    auto to_p = [&]() {
      CUTE_UNROLL
      for (int i = 0; i < size(tSrP); ++i) tOrP(i) = static_cast<T>(tSrP(i));
    };
    auto rescale_o = [&](const float (&alpha)[2]) {
      CUTE_UNROLL
      for (int r = 0; r < 2; ++r) {
        CUTE_UNROLL
        for (int nb = 0; nb < kD / 8; ++nb) {
          acc_o(make_coord(0, r, nb), 0, 0) *= alpha[r];
          acc_o(make_coord(1, r, nb), 0, 0) *= alpha[r];
        }
      }
    };
    const bool lead = ctid % 128 == 0;  // arrives on the empty barriers for its warpgroup
    const int cw = ctid / 128;           // consumer warpgroup 0 or 1
    if (PINGPONG && cw == 0) cutlass::arch::NamedBarrier::arrive(kConsumerThreads, 0);  // warpgroup 0 goes first
    using Pair = typename Io<T>::Pair;
    int stage = 0;
    uint32_t phase = 0, q_phase = 0;

    for (int t = int(blockIdx.x); t < tiles; t += int(gridDim.x)) {
      const Tile x = tile_of(t);
      if (x.m0 >= x.cnt) {  // no row of the tile is active: 16-byte zeros to its original rows, indices loaded first
        T* out = static_cast<T*>(a.out) + x.b * a.sob + x.h * a.soh;
        constexpr int kPieces = kD * int(sizeof(T)) / 16;   // per row
        constexpr int kStep = kConsumerThreads / kPieces;   // rows per pass
        constexpr int kPer = kBM / kStep;
        static_assert(kConsumerThreads % kPieces == 0 && kBM % kStep == 0, "whole rows, one column piece per thread");
        int64_t rows[kPer];
        CUTE_UNROLL
        for (int i = 0; i < kPer; ++i) {
          const int j = x.m0 + ctid / kPieces + kStep * i;
          rows[i] = j < a.Tq ? int64_t(__ldg(x.col + int64_t(j) * a.NG)) : int64_t(-1);
        }
        CUTE_UNROLL
        for (int i = 0; i < kPer; ++i) {
          if (rows[i] >= 0) {
            *reinterpret_cast<uint4*>(out + rows[i] * a.sot + (ctid % kPieces) * 8) = make_uint4(0, 0, 0, 0);
          }
        }
        continue;
      }
      lo = x.lo;
      first_pos = x.first_pos;
      CUTE_UNROLL
      for (int r = 0; r < 2; ++r) {
        const int j = x.m0 + int(get<0>(tScS(make_coord(0, r, 0), 0, 0)));
        orow[r] = j < a.Tq ? __ldg(x.col + int64_t(j) * a.NG) : -1;
        qpos[r] = j < x.cnt ? orow[r] + delta : a.Tk;  // a.Tk: inactive, no causal limit (its output is 0)
        row_max[r] = -kInf;
        row_sum[r] = 0.0f;
      }
      clear(acc_o);
      const int n_min = x.n_min;
      if (x.n_max > n_min) {  // no key block: no Q, no Q barrier (the gather skips it too)
        FullBarrier::wait(&sm.q_full, q_phase);
        q_phase ^= 1;
        cutlass::arch::fence_view_async_shared();  // Q was written by cp.async (generic proxy); wgmma reads it async
        float alpha[2];
        int n = x.n_max - 1;
        FullBarrier::wait(&sm.k_full[stage], phase);
        issue_qk(stage);
        warpgroup_wait<0>();
        warpgroup_fence_operand(acc_s);
        if (lead) {
          EmptyBarrier::arrive(&sm.k_empty[stage]);
          if (n == n_min) EmptyBarrier::arrive(&sm.q_empty);  // the tile's last S has read Q
        }
        softmax_block(n, alpha);
        to_p();
        for (--n; n >= n_min; --n) {
          const int v_stage = stage;  // P V of block n + 1 with S of block n
          const uint32_t v_phase = phase;
          if (++stage == kStages) {
            stage = 0;
            phase ^= 1;
          }
          FullBarrier::wait(&sm.k_full[stage], phase);
          if constexpr (PINGPONG) cutlass::arch::NamedBarrier::sync(kConsumerThreads, cw);  // this warpgroup's turn
          issue_qk(stage);
          FullBarrier::wait(&sm.v_full[v_stage], v_phase);
          issue_pv(v_stage);
          if constexpr (PINGPONG) cutlass::arch::NamedBarrier::arrive(kConsumerThreads, 1 - cw);  // the other's turn
          warpgroup_wait<1>();  // S done; P V may still run
          warpgroup_fence_operand(acc_s);
          if (lead) {
            EmptyBarrier::arrive(&sm.k_empty[stage]);
            if (n == n_min) EmptyBarrier::arrive(&sm.q_empty);
          }
          softmax_block(n, alpha);
          warpgroup_wait<0>();
          warpgroup_fence_operand(acc_o);
          if (lead) EmptyBarrier::arrive(&sm.v_empty[v_stage]);
          to_p();
          rescale_o(alpha);
        }
        FullBarrier::wait(&sm.v_full[stage], phase);
        issue_pv(stage);
        warpgroup_wait<0>();
        warpgroup_fence_operand(acc_o);
        if (lead) EmptyBarrier::arrive(&sm.v_empty[stage]);
        if (++stage == kStages) {  // the next tile's first block
          stage = 0;
          phase ^= 1;
        }
      }

      // epilogue: O / sum to the original rows; 0 for inactive rows and rows with no visible key
      CUTE_UNROLL
      for (int r = 0; r < 2; ++r) {
        float sum = row_sum[r];
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        const bool keep = qpos[r] < a.Tk && sum > 0.0f;  // active, with a visible key
        const float inv = keep ? 1.0f / sum : 0.0f;
        if (orow[r] >= 0) {
          const int bh = t % BH;  // recomputed here: no register holds the output pointer through the tile
          T* o = static_cast<T*>(a.out) + bh / a.Hq * a.sob + bh % a.Hq * a.soh + int64_t(orow[r]) * a.sot;
          CUTE_UNROLL
          for (int nb = 0; nb < kD / 8; ++nb) {
            // selected, not multiplied: a non-finite value under an inactive row still gives exactly 0
            *reinterpret_cast<Pair*>(o + int(get<1>(tOcO(make_coord(0, r, nb), 0, 0)))) =
                keep ? Io<T>::pack(acc_o(make_coord(0, r, nb), 0, 0) * inv, acc_o(make_coord(1, r, nb), 0, 0) * inv)
                     : Io<T>::pack(0.0f, 0.0f);
          }
        }
      }
    }
  }
#endif
}

template <class T, bool CAUSAL, bool PINGPONG>
int run(const AttentionArgs& a, cudaStream_t stream) {
  using C = Config<T>;
  auto mK = make_tensor(make_gmem_ptr(static_cast<const T*>(a.k)), make_shape(a.Tk, int(kD), a.Hk, a.B),
                        make_stride(a.skt, _1{}, a.skh, a.skb));
  auto mV = make_tensor(make_gmem_ptr(static_cast<const T*>(a.v)), make_shape(int(kD), a.Tk, a.Hk, a.B),
                        make_stride(_1{}, a.svt, a.svh, a.svb));
  auto tma_k = make_tma_atom(SM90_TMA_LOAD{}, mK, typename C::SmemLayoutK{}(_, _, 0), Shape<Int<kBN>, Int<kD>>{});
  auto tma_v = make_tma_atom(SM90_TMA_LOAD{}, mV, typename C::SmemLayoutVt{}(_, _, 0), Shape<Int<kD>, Int<kBN>>{});
  constexpr auto kernel = &attention_kernel<T, CAUSAL, PINGPONG, decltype(tma_k), decltype(tma_v)>;
  if (const int err = raise_smem_limit<kernel>(C::kSmem)) return err;
  const int64_t tiles = int64_t(a.B) * a.Hq * ((a.Tq + kBM - 1) / kBM);
  if (tiles == 0) return 0;
  const dim3 grid(unsigned(a.grid_ctas > 0 && a.grid_ctas < tiles ? a.grid_ctas : tiles));
  kernel<<<grid, kThreads, C::kSmem, stream>>>(tma_k, tma_v, a);
  return int(cudaGetLastError());
}

template <class T>
int dispatch(const AttentionArgs& a, cudaStream_t stream) {
  if (a.causal) return a.pingpong ? run<T, true, true>(a, stream) : run<T, true, false>(a, stream);
  return a.pingpong ? run<T, false, true>(a, stream) : run<T, false, false>(a, stream);
}

}  // namespace attn

int launch_attention(int dtype, const AttentionArgs& a, cudaStream_t stream) {
  const auto aligned = [](const void* p, int bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; };
  // the softmax takes the row max of the unscaled scores: a positive scale only
  const bool ok = (dtype == kBF16 || dtype == kFP16) && a.D == attn::kD && a.B >= 1 && a.Hq >= 1 && a.Hk >= 1 &&
                  a.scale > 0.0f &&
                  a.Hq % a.Hk == 0 && a.NG >= 1 && a.Hq % a.NG == 0 && a.Tq >= 1 && a.Tk >= a.Tq &&
                  int64_t(a.B) * a.Hq * ((a.Tq + attn::kBM - 1) / attn::kBM) <= 0x7fffffff && a.grid_ctas >= 0 &&
                  aligned(a.q, 16) && aligned(a.k, 16) && aligned(a.v, 16) && aligned(a.out, 16) && a.sqt % 8 == 0 &&
                  a.sqh % 8 == 0 && a.sqb % 8 == 0 && a.skt % 8 == 0 && a.skh % 8 == 0 && a.skb % 8 == 0 &&
                  a.svt % 8 == 0 && a.svh % 8 == 0 && a.svb % 8 == 0 && a.sot % 8 == 0 && a.soh % 8 == 0 &&
                  a.sob % 8 == 0 && a.index != nullptr && a.counts != nullptr;
  if (!ok) return int(cudaErrorInvalidValue);
  return dtype == kBF16 ? attn::dispatch<cutlass::bfloat16_t>(a, stream) : attn::dispatch<cutlass::half_t>(a, stream);
}

}  // namespace wide_sm90
