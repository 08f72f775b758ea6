// Routed GEMM-MN (paper Algorithm 2) and the fused SwiGLU (Eq. 3) for sm_90a with CuTe: a persistent,
// warp-specialized kernel.  Warpgroup 0 produces: each of its 128 threads gathers BM / 16 16-byte pieces of the token
// rows of the (row tile, group) through the reorder index with cp.async (inactive rows zero-filled, not read) and
// arrives on the stage's barrier when they land; one thread loads the weight tile(s) by TMA, and the token tile too
// where its rows are consecutive token rows (a run: every token of the span executes the group).  Warpgroups 1 and 2
// consume: wgmma on half the tile's rows each, the epilogue scatters the rows back to their original positions and
// writes zeros for rows past the group's active count; a row tile wholly past it only writes zeros (level-0 skip).
// Tiles: 128 x 256 (G a multiple of 256) or 256 x 128 for gemm_mn, 128 x 128 with the gate and up weights for the
// SwiGLU.  With clusters of 2 CTAs along M, the two run adjacent row tiles of one N tile in step, and each loads half
// of every weight stage and multicasts it by TMA to both, which halves the weight traffic from L2.  When no row of a
// CTA's tile executes the group but some row of its partner's does, the CTA still loads and multicasts its half.  The
// dense fused SwiGLU (the baseline of the routed one) is the same kernel with the token tile loaded by TMA.

#include "gemm_mn_sm90.h"
#include "common_sm90.cuh"
#include "gemm_schedule_sm90.cuh"

#include <cute/tensor.hpp>  // first: the atoms below need the whole of cute

#include <cute/arch/copy_sm80.hpp>
#include <cute/atom/copy_traits_sm90_tma.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/numeric_types.h>

namespace wide_sm90 {

using namespace cute;

constexpr int kBK = 64;                // K step: one 128-byte swizzle atom of 16-bit elements
constexpr int kProducerThreads = 128;  // warpgroup 0
constexpr int kConsumerThreads = 256;  // warpgroups 1 and 2
constexpr int kThreads = kProducerThreads + kConsumerThreads;

// T: element type; BM x BN: the tile (BM / 2 rows per consumer warpgroup); NB: weights (2: the SwiGLU's gate and
// up); GATHER: rows through the reorder index (false: the dense kernel, every row active); STAGES: pipeline depth;
// CM: CTAs of a cluster along M, which run CM consecutive row tiles of one N tile together and share its weight tiles:
// each CTA loads 1 / CM of a stage's weights by TMA and multicasts it to all CM.  KSKIP: the K-axis O projection in
// the shared token order (token rows sorted, loaded by TMA; the K loop runs only the K groups some row of the
// cluster's tiles executes; rows scattered to their tokens).
template <class T, int BM_, int BN_, int NB_, bool GATHER_, int STAGES_, int CM_, bool KSKIP_ = false>
struct Config {
  using Element = T;
  static constexpr int BM = BM_;
  static constexpr int BN = BN_;
  static constexpr int NB = NB_;
  static constexpr bool GATHER = GATHER_;
  static constexpr int STAGES = STAGES_;
  static constexpr int CM = CM_;
  static constexpr bool KSKIP = KSKIP_;
  using SmemLayoutA =
      decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<T>{}, Shape<Int<BM>, Int<kBK>, Int<STAGES>>{}));
  using SmemLayoutB =
      decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<T>{}, Shape<Int<BN>, Int<kBK>, Int<STAGES>>{}));
  using TiledMma = decltype(make_tiled_mma(GMMA::ss_op_selector<T, T, float, Shape<_64, Int<BN>, Int<kBK>>>(),
                                           Layout<Shape<_2, _1, _1>>{}));
  struct Smem {
    alignas(1024) T a[cosize_v<SmemLayoutA>];
    alignas(1024) T b[NB][cosize_v<SmemLayoutB>];
    alignas(8) uint64_t full[STAGES];   // the stage's operands have landed
    alignas(8) uint64_t empty[STAGES];  // both consumer warpgroups have read the stage
  };
  static constexpr int kSmem = int(sizeof(Smem));
  static constexpr uint32_t kTxBytesA = uint32_t(BM * kBK * sizeof(T));  // a stage of A by TMA
  static constexpr uint32_t kTxBytes = uint32_t(NB * BN * kBK * sizeof(T)) + (GATHER ? 0u : kTxBytesA);
  // 16-byte pieces of A per producer thread and stage: column piece tid % 8 of rows tid / 8 + 16 i
  static constexpr int kGatherRows = BM * kBK * int(sizeof(T)) / 16 / kProducerThreads;
  static_assert(cosize_v<SmemLayoutA> == BM * kBK * STAGES, "one stage of A is BM * kBK elements");
  // setmaxnreg split: the gathering producer holds a pointer (256-row tiles: a 32-bit token row) per piece
  static constexpr int kProducerRegs = BM == 256 ? 88 : 56;
  static constexpr int kConsumerRegs = BM == 256 ? 208 : 224;
  // setmaxnreg only moves registers between the warpgroups: the split must fit what the launch gives the CTA (168 per
  // thread under __launch_bounds__(384, 1)), or the consumers' increase waits forever
  static constexpr int kLaunchRegs = 65536 / kThreads / 8 * 8;
  static_assert(kProducerThreads * kProducerRegs + kConsumerThreads * kConsumerRegs <= kThreads * kLaunchRegs,
                "register split within the launch's registers");
  static_assert(BM % 128 == 0 && kBK * sizeof(T) == 128, "tiles of whole 128-row blocks, K steps of 128 bytes");
  static_assert(kSmem <= 227 * 1024, "shared memory of one CTA");
  static_assert(CM == 1 || CM == 2, "clusters of 1 or 2 CTAs along M");
  static_assert(!(KSKIP && GATHER), "the O projection reads its sorted rows by TMA");
  using TmaLoadB = std::conditional_t<CM == 1, SM90_TMA_LOAD, SM90_TMA_LOAD_MULTICAST>;
};

struct Args {
  const void* x;
  int64_t ldx;
  void* out;
  int64_t ldo;
  const int32_t* index;
  const int32_t* counts;
  int M, N, K, G, NG, group_m;
  const int32_t* unions;  // KSKIP: per 64 sorted rows, the bit mask of the K groups some row executes
  int Gk;                 // KSKIP: columns of A per K group (a multiple of kBK)
  const uint8_t* mask;    // dense SwiGLU: the route, bool [M, NG] row-major (its zero groups written as zeros), or null
};

constexpr int kUnionRows = 64;  // sorted rows per entry of Args::unions

// KSKIP: the K groups (bit g: group g) that some sorted row of cluster tile mc executes, from the 64-row entries;
// every CTA of the cluster runs their steps (a group none of a CTA's rows executes adds their zeros).  0 otherwise.
template <class C>
__device__ __forceinline__ uint32_t cluster_groups(const Args& args, int mc) {
  uint32_t u = 0;
  if constexpr (C::KSKIP) {
    const int r0 = mc * C::CM * C::BM, r1 = min(args.M, r0 + C::CM * C::BM);
    for (int e = r0 / kUnionRows; e * kUnionRows < r1; ++e) u |= uint32_t(__ldg(args.unions + e));
  }
  return u;
}

template <class T>
__device__ __forceinline__ float swiglu(float gate, float up) {
  // silu(gate) * up with the model MLP's rounding points: gate, up and silu(gate) rounded to T
  const float g = Io<T>::round(gate);
  const float u = Io<T>::round(up);
  return Io<T>::round(g / (1.0f + __expf(-g))) * u;
}

// Loads the weight tile (k step kt of N tile nt) into a stage: by one TMA where the cluster is one CTA, else this CTA's
// 1 / CM slice of it, multicast to every CTA of the cluster.
template <int CM, class Tma, class Src, class Dst>
__device__ __forceinline__ void load_weights(const Tma& tma, uint64_t& full, const Src& src, Dst&& dst) {
  if constexpr (CM == 1) {
    copy(tma.with(full), src, dst);
  } else {
    copy(tma.with(full, uint16_t((1u << CM) - 1)), src, dst);
  }
}

// A consumer warpgroup's release of a stage: one arrival on the stage's empty barrier of every CTA of the cluster
// (all of them read the weights its producer multicast into the stage).
template <int CM>
__device__ __forceinline__ void release(uint64_t* empty, int ctid) {
  if constexpr (CM == 1) {
    if (ctid % 128 == 0) cutlass::arch::ClusterBarrier::arrive(empty);
  } else {
    if (ctid % 128 < CM) cutlass::arch::ClusterBarrier::arrive(empty, uint32_t(ctid % 128), 1u);
  }
}

template <class C, class TmaA, class TmaB>
__global__ void __launch_bounds__(kThreads, 1)
    routed_kernel(const __grid_constant__ TmaA tma_a, const __grid_constant__ TmaB tma_b,
                  const __grid_constant__ TmaB tma_b2, const Args args) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using T = typename C::Element;
  using FullBarrier = cutlass::arch::ClusterTransactionBarrier;
  using EmptyBarrier = cutlass::arch::ClusterBarrier;
  constexpr int BN = C::BN;
  constexpr int STAGES = C::STAGES;
  constexpr int CM = C::CM;

  extern __shared__ __align__(1024) uint8_t smem_raw[];
  auto& sm = *reinterpret_cast<typename C::Smem*>(smem_raw);
  Tensor sA = make_tensor(make_smem_ptr(sm.a), typename C::SmemLayoutA{});           // (BM, BK, STAGES)
  Tensor sB = make_tensor(make_smem_ptr(sm.b[0]), typename C::SmemLayoutB{});        // (BN, BK, STAGES)
  Tensor sB2 = make_tensor(make_smem_ptr(sm.b[C::NB - 1]), typename C::SmemLayoutB{});

  const int tid = int(threadIdx.x);
  const int warp_group = cutlass::canonical_warp_group_idx();
  const int rank = CM == 1 ? 0 : int(cute::block_rank_in_cluster());  // this CTA's row tile among the cluster's CM
  if (tid == 0) {
    CUTE_UNROLL
    for (int s = 0; s < STAGES; ++s) {
      // gather: one arrival per producer thread (its cp.async pieces landed) plus the TMA thread's expect-tx
      FullBarrier::init(&sm.full[s], C::GATHER ? kProducerThreads + 1 : 1);
      EmptyBarrier::init(&sm.empty[s], 2 * CM);  // both consumer warpgroups of every CTA of the cluster
    }
    cutlass::arch::fence_barrier_init();
  }
  if constexpr (CM == 1) {
    __syncthreads();
  } else {
    cute::cluster_sync();  // every CTA's barriers initialized before the first multicast or remote arrival
  }

  const int M = args.M, N = args.N, K = args.K, NG = args.NG;
  constexpr int BM = C::BM;
  const int MT = (M + BM - 1) / BM, NT = N / BN, KT = K / kBK;
  // the persistent order runs cluster tiles: CM consecutive row tiles of one N tile, row tile mc * CM + rank here
  const int MC = (MT + CM - 1) / CM;
  const int tiles = MC * NT;
  const int group_c = args.group_m / CM > 1 ? args.group_m / CM : 1;
  const int first_tile = int(blockIdx.x) / CM, tile_step = int(gridDim.x) / CM;

  if (warp_group == 0) {  // producer
    cutlass::arch::warpgroup_reg_dealloc<C::kProducerRegs>();
    if (C::GATHER || tid == 0) {
      Tensor gB =
          local_tile(tma_b.get_tma_tensor(make_shape(N, K)), Shape<Int<BN>, Int<kBK>>{}, make_coord(_, _));
      Tensor gB2 =
          local_tile(tma_b2.get_tma_tensor(make_shape(N, K)), Shape<Int<BN>, Int<kBK>>{}, make_coord(_, _));
      auto [tBgB, tBsB] =
          tma_partition(tma_b, rank, Layout<Int<CM>>{}, group_modes<0, 2>(sB), group_modes<0, 2>(gB));
      auto [tBgB2, tBsB2] =
          tma_partition(tma_b2, rank, Layout<Int<CM>>{}, group_modes<0, 2>(sB2), group_modes<0, 2>(gB2));
      if (tid == 0) {
        prefetch_tma_descriptor(tma_b.get_tma_descriptor());
        if constexpr (C::NB == 2) prefetch_tma_descriptor(tma_b2.get_tma_descriptor());
        prefetch_tma_descriptor(tma_a.get_tma_descriptor());
      }
      // this thread's 16-byte pieces of a stage: column piece tid % 8 of rows tid / 8 + 16 i, at their swizzled
      // places (sA's pointer applies the 128-byte swizzle to the address, as TMA and the wgmma descriptors do); 16
      // rows further is 2 KB further, the swizzle (address bits 4-9) unchanged
      constexpr int kRows = C::kGatherRows;
      const int piece = tid % 8;
      const uint32_t soff = uint32_t(&sA(tid / 8, piece * 8, 0) - sm.a);
      const T* x = static_cast<const T*>(args.x);
      int stage = 0;
      uint32_t phase = 0;
      for (int t = first_tile; t < tiles; t += tile_step) {
        int mc, nt;
        tile_coords(t, MC, NT, group_c, mc, nt);
        const int mt = mc * CM + rank, m0 = mt * BM, g = nt * BN / args.G;
        const int cnt = C::GATHER ? __ldg(args.counts + g) : M;
        const uint32_t groups = cluster_groups<C>(args, mc);
        const int per = args.Gk / kBK;
        const int steps = C::KSKIP ? __popc(groups) * per : KT;
        // level 0: no row of the cluster's tiles executes group g (N axis) or any group (KSKIP)
        if (mc * CM * BM >= cnt || steps == 0) continue;
        // busy: some row of this CTA's tile executes group g; an idle CTA of a busy cluster still loads and
        // multicasts its slice of the weights
        const bool busy = CM == 1 || m0 < cnt;
        if constexpr (C::GATHER) {
          // a run: the tile's BM rows are BM consecutive token rows (the active list of a group is increasing, so
          // its ends tell), loaded by TMA as the dense kernel loads its tiles; the other producer threads only arrive
          const int first = __ldg(args.index + int64_t(busy ? m0 : 0) * NG + g);
          const bool run =
              m0 + BM <= cnt && __ldg(args.index + int64_t(m0 + BM - 1) * NG + g) - first == BM - 1;
          Tensor gA = local_tile(domain_offset(make_coord(first, 0), tma_a.get_tma_tensor(make_shape(M, K))),
                                 Shape<Int<BM>, Int<kBK>>{}, make_coord(0, _));  // (BM, BK, KT)
          auto [tAgA, tAsA] =
              tma_partition(tma_a, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sA), group_modes<0, 2>(gA));
          // this thread's pieces of the gathered rows: pointers advanced by one K step per stage or, for 256-row tiles
          // (twice the pieces in the producer's registers), 32-bit token rows
          constexpr bool kRowsOnly = BM == 256;
          std::conditional_t<kRowsOnly, uint32_t, const T*> src[kRows];
          uint32_t live = 0;  // bit i: row tid / 8 + 16 i is active (others zero-filled, not read)
          CUTE_UNROLL
          for (int i = 0; i < kRows; ++i) {
            const int j = m0 + tid / 8 + 16 * i;
            const bool on = j < cnt;  // loaded beside the run check, not after it
            const uint32_t row = on ? uint32_t(__ldg(args.index + int64_t(j) * NG + g)) : 0u;
            if constexpr (kRowsOnly) {
              src[i] = row;
            } else {
              src[i] = x + int64_t(row) * args.ldx + piece * 8;
            }
            live |= uint32_t(on && !run) << i;
          }
          const bool gather = busy && !run;
          const T* xk = x + piece * 8;  // this thread's column piece of the K step
          for (int kt = 0; kt < KT; ++kt, xk += kBK) {
            EmptyBarrier::wait(&sm.empty[stage], phase ^ 1);
            if (tid == 0) {
              FullBarrier::arrive_and_expect_tx(&sm.full[stage], C::kTxBytes + (run ? C::kTxBytesA : 0u));
              if (run) copy(tma_a.with(sm.full[stage]), tAgA(_, kt), tAsA(_, stage));
              load_weights<CM>(tma_b, sm.full[stage], tBgB(_, nt, kt), tBsB(_, stage));
              if constexpr (C::NB == 2) load_weights<CM>(tma_b2, sm.full[stage], tBgB2(_, nt, kt), tBsB2(_, stage));
            }
            if (gather) {
              T* base = sm.a + stage * (BM * kBK) + soff;
              CUTE_UNROLL
              for (int i = 0; i < kRows; ++i) {
                const T* from;
                if constexpr (kRowsOnly) {
                  from = xk + int64_t(src[i]) * args.ldx;
                } else {
                  from = src[i];
                  src[i] += kBK;
                }
                SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<uint128_t>::copy(*reinterpret_cast<const uint128_t*>(from),
                                                                 *reinterpret_cast<uint128_t*>(base + i * 16 * kBK),
                                                                 (live >> i) & 1u);
              }
            }
            cutlass::arch::cpasync_barrier_arrive_noinc(&sm.full[stage]);
            if (++stage == STAGES) {
              stage = 0;
              phase ^= 1;
            }
          }
        } else {
          Tensor gA = local_tile(tma_a.get_tma_tensor(make_shape(M, K)), Shape<Int<BM>, Int<kBK>>{},
                                 make_coord(_, _));
          auto [tAgA, tAsA] =
              tma_partition(tma_a, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sA), group_modes<0, 2>(gA));
          KSteps ks(groups, per);  // KSKIP: the steps of the groups, lowest first (else kt counts 0 .. KT - 1)
          for (int s = 0; s < steps; ++s) {
            const int kt = C::KSKIP ? ks.kt : s;
            EmptyBarrier::wait(&sm.empty[stage], phase ^ 1);
            FullBarrier::arrive_and_expect_tx(&sm.full[stage], busy ? C::kTxBytes : C::kTxBytes - C::kTxBytesA);
            if (busy) copy(tma_a.with(sm.full[stage]), tAgA(_, mt, kt), tAsA(_, stage));
            load_weights<CM>(tma_b, sm.full[stage], tBgB(_, nt, kt), tBsB(_, stage));
            if constexpr (C::NB == 2) load_weights<CM>(tma_b2, sm.full[stage], tBgB2(_, nt, kt), tBsB2(_, stage));
            if (++stage == STAGES) {
              stage = 0;
              phase ^= 1;
            }
            if constexpr (C::KSKIP) ks.next();
          }
        }
      }
      if constexpr (C::GATHER) cp_async_wait<0>();
    }
  } else {  // consumers
    cutlass::arch::warpgroup_reg_alloc<C::kConsumerRegs>();
    const int ctid = tid - kProducerThreads;
    typename C::TiledMma mma;
    auto thr = mma.get_thread_slice(ctid);
    Tensor tCrA = thr.make_fragment_A(thr.partition_A(sA));  // (MMA, MMA_M, MMA_K, STAGES) descriptors
    Tensor tCrB = thr.make_fragment_B(thr.partition_B(sB));
    Tensor tCrB2 = thr.make_fragment_B(thr.partition_B(sB2));
    Tensor tCcC = thr.partition_C(make_identity_tensor(Shape<Int<BM>, Int<BN>>{}));  // (row, col) of each value
    Tensor acc = partition_fragment_C(mma, Shape<Int<BM>, Int<BN>>{});
    Tensor acc2 = partition_fragment_C(mma, Shape<Int<BM>, Int<BN>>{});
    constexpr int kAtomsM = BM / 128;  // 64-row wgmma atoms per consumer warpgroup
    static_assert(decltype(size<1>(acc))::value == kAtomsM && decltype(size<2>(acc))::value == 1,
                  "BM / 128 wgmma atoms of 64 rows per consumer warpgroup, one atom wide");
    static_assert(decltype(size<0>(acc))::value == BN / 2, "values (2 columns, 2 rows, BN / 8) per thread and atom");
    // a thread's values per atom: (2 adjacent columns, rows r and r + 8, BN / 8 blocks of 8 columns)
    T* out = static_cast<T*>(args.out);
    int stage = 0;
    uint32_t phase = 0;
    for (int t = first_tile; t < tiles; t += tile_step) {
      int mc, nt;
      tile_coords(t, MC, NT, group_c, mc, nt);
      const int m0 = (mc * CM + rank) * BM, n0 = nt * BN, g = n0 / args.G;
      const int cnt = C::GATHER ? __ldg(args.counts + g) : M;
      const int steps = C::KSKIP ? __popc(cluster_groups<C>(args, mc)) * (args.Gk / kBK) : KT;
      if (m0 >= cnt || steps == 0) {
        if (CM > 1 && mc * CM * BM < cnt && steps > 0) {  // an idle CTA of a busy cluster: stages pass through unread
          for (int kt = 0; kt < steps; ++kt) {
            FullBarrier::wait(&sm.full[stage], phase);
            // every warp of the warpgroup has seen this fill before warp 0 hands the stage back (the busy loop gets
            // this from the warpgroup-wide wgmma): a warp that polled later could find the stage refilled, its
            // parity back to this fill's, and wait one phase behind for ever
            cutlass::arch::NamedBarrier::sync(kConsumerThreads / 2, uint32_t(warp_group));
            release<CM>(&sm.empty[stage], ctid);
            if (++stage == STAGES) {
              stage = 0;
              phase ^= 1;
            }
          }
        }
        // level 0: the zero epilogue, 16-byte stores to the tile's original rows; piece e = ctid +
        // kConsumerThreads * i: all of a thread's row indices are loaded before its first store, so the tile costs
        // one index-load latency, not one per piece
        constexpr int kPieces = BN * int(sizeof(T)) / 16;
        constexpr int kPer = BM * kPieces / kConsumerThreads;
        static_assert(BM * kPieces % kConsumerThreads == 0 && kConsumerThreads % kPieces == 0,
                      "whole pieces per consumer thread, one column piece per thread");
        int64_t rows[kPer];
        CUTE_UNROLL
        for (int i = 0; i < kPer; ++i) {
          const int j = m0 + (ctid + kConsumerThreads * i) / kPieces;
          rows[i] = j < M ? int64_t(__ldg(args.index + int64_t(j) * NG + g)) : int64_t(-1);
        }
        CUTE_UNROLL
        for (int i = 0; i < kPer; ++i) {
          if (rows[i] >= 0) {
            *reinterpret_cast<uint4*>(out + rows[i] * args.ldo + n0 + (ctid % kPieces) * 8) = make_uint4(0, 0, 0, 0);
          }
        }
        continue;
      }
      // the original rows of this thread's epilogue rows (r and r + 8 of each atom; -1 past M) and whether they
      // keep their values (active in the group; the dense SwiGLU: its route mask, if any), loaded before the main
      // loop so their latency hides behind it rather than delaying the stores
      int32_t orows[kAtomsM][2];
      bool keep[kAtomsM][2];
      CUTE_UNROLL
      for (int mi = 0; mi < kAtomsM; ++mi) {
        CUTE_UNROLL
        for (int r = 0; r < 2; ++r) {
          const int j = m0 + int(get<0>(tCcC(make_coord(0, r, 0), mi, 0)));
          orows[mi][r] = j >= M ? -1 : C::GATHER || C::KSKIP ? __ldg(args.index + int64_t(j) * NG + g) : j;
          keep[mi][r] = j < cnt;
          if constexpr (!C::GATHER && !C::KSKIP) {
            if (args.mask != nullptr && j < M) keep[mi][r] = __ldg(args.mask + int64_t(j) * NG + g) != 0;
          }
        }
      }
      clear(acc);
      if constexpr (C::NB == 2) clear(acc2);
      int prev = 0;
      for (int kt = 0; kt < steps; ++kt) {
        FullBarrier::wait(&sm.full[stage], phase);
        // the gathered rows were written by cp.async (generic proxy); wgmma reads through the async proxy
        if constexpr (C::GATHER) cutlass::arch::fence_view_async_shared();
        warpgroup_fence_operand(acc);
        if constexpr (C::NB == 2) warpgroup_fence_operand(acc2);
        warpgroup_arrive();
        CUTE_UNROLL
        for (int kb = 0; kb < size<2>(tCrA); ++kb) {
          gemm(mma, tCrA(_, _, kb, stage), tCrB(_, _, kb, stage), acc);
          if constexpr (C::NB == 2) gemm(mma, tCrA(_, _, kb, stage), tCrB2(_, _, kb, stage), acc2);
        }
        warpgroup_commit_batch();
        warpgroup_wait<1>();  // the previous step's wgmma retired: its stage may be refilled
        warpgroup_fence_operand(acc);
        if constexpr (C::NB == 2) warpgroup_fence_operand(acc2);
        if (kt > 0) release<CM>(&sm.empty[prev], ctid);
        prev = stage;
        if (++stage == STAGES) {
          stage = 0;
          phase ^= 1;
        }
      }
      warpgroup_wait<0>();
      warpgroup_fence_operand(acc);
      if constexpr (C::NB == 2) warpgroup_fence_operand(acc2);
      release<CM>(&sm.empty[prev], ctid);
      // epilogue: rows r and r + 8 of each atom of this thread, scattered to their original rows; zeros past the
      // active count (or where the dense SwiGLU's mask is off).  A quad (4 lanes, one row) holds 2 adjacent columns
      // of each 8-column block per lane; a 4 x 4 transpose of 32-bit words within the quad (two xor shuffles) gives
      // lane q all 8 columns of block b0 + q, one 16-byte store instead of four 4-byte ones.  The shuffles run in
      // every lane, the stores only for rows < M.
      const int q = ctid % 4;
      CUTE_UNROLL
      for (int mi = 0; mi < kAtomsM; ++mi) {
        CUTE_UNROLL
        for (int r = 0; r < 2; ++r) {
          const bool on = keep[mi][r];
          CUTE_UNROLL
          for (int b0 = 0; b0 < BN / 8; b0 += 4) {
            uint32_t w[4];  // w[k]: this lane's 2 columns of block b0 + k
            CUTE_UNROLL
            for (int k = 0; k < 4; ++k) {
              float v0 = acc(make_coord(0, r, b0 + k), mi, 0), v1 = acc(make_coord(1, r, b0 + k), mi, 0);
              if constexpr (C::NB == 2) {
                v0 = swiglu<T>(v0, acc2(make_coord(0, r, b0 + k), mi, 0));
                v1 = swiglu<T>(v1, acc2(make_coord(1, r, b0 + k), mi, 0));
              }
              w[k] = on ? Io<T>::pack_bits(v0, v1) : 0u;
            }
            // lane q and lane q ^ 1 swap the words whose block parity differs from the lane's, then lanes q and
            // q ^ 2 likewise on bit 1: lane q ends with word p of lane p's block b0 + q, in column order
            CUTE_UNROLL
            for (int i = 0; i < 2; ++i) {
              const uint32_t got = __shfl_xor_sync(0xffffffffu, (q & 1) ? w[2 * i] : w[2 * i + 1], 1);
              if (q & 1) {
                w[2 * i] = got;
              } else {
                w[2 * i + 1] = got;
              }
            }
            CUTE_UNROLL
            for (int i = 0; i < 2; ++i) {
              const uint32_t got = __shfl_xor_sync(0xffffffffu, (q & 2) ? w[i] : w[i + 2], 2);
              if (q & 2) {
                w[i] = got;
              } else {
                w[i + 2] = got;
              }
            }
            if (orows[mi][r] >= 0) {
              const int col = int(get<1>(tCcC(make_coord(0, r, b0 + q), mi, 0))) - 2 * q;  // block b0 + q's first
              T* orow = out + int64_t(orows[mi][r]) * args.ldo + n0;
              *reinterpret_cast<uint4*>(orow + col) = make_uint4(w[0], w[1], w[2], w[3]);
            }
          }
        }
      }
    }
  }
  if constexpr (CM > 1) {
    cute::cluster_sync();  // no CTA leaves while the others may still multicast into it or arrive on its barriers
  }
#endif
}

// Clusters of the kernel's launch configuration that fit on the device at once (cached per device).
template <auto Kernel>
int max_active_clusters(const cudaLaunchConfig_t& cfg) {
  static int cached[64] = {};
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return 0;
  if (dev < 64 && cached[dev] > 0) return cached[dev];
  int n = 0;
  if (cudaOccupancyMaxActiveClusters(&n, reinterpret_cast<const void*>(Kernel), &cfg) != cudaSuccess) {
    (void)cudaGetLastError();  // not left for the next launch check to report: the grid is then not capped
    return 0;
  }
  if (dev < 64) cached[dev] = n;
  return n;
}

template <class C>
int run(const Args& args, const void* w, const void* w2, int64_t ldw, int grid_ctas, cudaStream_t stream) {
  using T = typename C::Element;
  const int tiles = ((args.M + C::BM * C::CM - 1) / (C::BM * C::CM)) * (args.N / C::BN);  // cluster tiles
  if (tiles == 0) return 0;
  auto weight = [&](const void* p) {
    return make_tensor(make_gmem_ptr(static_cast<const T*>(p)), make_shape(args.N, args.K), make_stride(ldw, _1{}));
  };
  auto slice_b = typename C::SmemLayoutB{}(_, _, 0);
  using TmaB = typename C::TmaLoadB;
  auto tma_b = make_tma_atom(TmaB{}, weight(w), slice_b, Shape<Int<C::BN>, Int<kBK>>{}, Int<C::CM>{});
  auto tma_b2 = make_tma_atom(TmaB{}, weight(C::NB == 2 ? w2 : w), slice_b, Shape<Int<C::BN>, Int<kBK>>{},
                              Int<C::CM>{});
  auto go = [&](auto tma_a) {
    constexpr auto kernel = &routed_kernel<C, decltype(tma_a), decltype(tma_b)>;
    if (const int err = raise_smem_limit<kernel>(C::kSmem)) return err;
    cudaLaunchAttribute attr[1] = {};
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = unsigned(C::CM);
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    cudaLaunchConfig_t cfg = {};
    cfg.blockDim = dim3(kThreads);
    cfg.dynamicSmemBytes = size_t(C::kSmem);
    cfg.stream = stream;
    cfg.attrs = attr;
    cfg.numAttrs = C::CM > 1 ? 1 : 0;
    int clusters = grid_ctas / C::CM;
    if constexpr (C::CM > 1) {
      cfg.gridDim = dim3(unsigned(C::CM * (clusters > 0 ? clusters : 1)));
      const int fit = max_active_clusters<kernel>(cfg);
      if (fit > 0 && fit < clusters) clusters = fit;
    }
    clusters = clusters < tiles ? clusters : tiles;
    cfg.gridDim = dim3(unsigned(C::CM * (clusters > 0 ? clusters : 1)));
    const int err = int(cudaLaunchKernelEx(&cfg, kernel, tma_a, tma_b, tma_b2, args));
    if (err) (void)cudaGetLastError();  // returned here, not left for an unrelated op's launch check to report
    return err;
  };
  // the token tile by TMA: every tile of the dense kernel, the runs of consecutive rows of the gathering one
  auto x = make_tensor(make_gmem_ptr(static_cast<const T*>(args.x)), make_shape(args.M, args.K),
                       make_stride(args.ldx, _1{}));
  return go(make_tma_atom(SM90_TMA_LOAD{}, x, typename C::SmemLayoutA{}(_, _, 0), Shape<Int<C::BM>, Int<kBK>>{}));
}

template <class T, int CM>
using GemmN128 = Config<T, 256, 128, 1, true, 4, CM>;  // 256 x 128: G a multiple of 128 only
template <class T, int CM>
using GemmN256 = Config<T, 128, 256, 1, true, 4, CM>;
template <class T, int CM>
using Swiglu = Config<T, 128, 128, 2, true, 4, CM>;  // gate and up: 128 x 256 of MMA per K step
template <class T, int CM>
using DenseSwiglu = Config<T, 128, 128, 2, false, 4, CM>;
template <class T, int CM>
using OProj = Config<T, 128, 256, 1, false, 4, CM, true>;  // sorted rows by TMA, K groups skipped per cluster tile

template <class T, int CM>
int dispatch(int op, const Args& a, const void* w, const void* w2, int64_t ldw, int grid_ctas, cudaStream_t s) {
  if (op == kGemmMn) {
    return a.G % 256 == 0 ? run<GemmN256<T, CM>>(a, w, w2, ldw, grid_ctas, s)
                          : run<GemmN128<T, CM>>(a, w, w2, ldw, grid_ctas, s);
  }
  if (op == kSwiglu) return run<Swiglu<T, CM>>(a, w, w2, ldw, grid_ctas, s);
  return run<DenseSwiglu<T, CM>>(a, w, w2, ldw, grid_ctas, s);
}

template <class T>
int dispatch(int op, const Args& a, const void* w, const void* w2, int64_t ldw, int grid_ctas, int cluster_m,
             cudaStream_t s) {
  return cluster_m == 2 ? dispatch<T, 2>(op, a, w, w2, ldw, grid_ctas, s)
                        : dispatch<T, 1>(op, a, w, w2, ldw, grid_ctas, s);
}

int launch_o_proj(int dtype, const void* a, int64_t lda, const void* w, int64_t ldw, void* out, int64_t ldo,
                  const int32_t* perm, const int32_t* unions, int M, int N, int K, int Gk, int group_m, int grid_ctas,
                  int cluster_m, cudaStream_t stream) {
  const auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  if ((dtype != kBF16 && dtype != kFP16) || M < 0 || K <= 0 || Gk <= 0 || Gk % kBK || K % Gk || K / Gk > 32 ||
      N <= 0 || N % 256 || group_m < 1 || grid_ctas < 1 || (cluster_m != 1 && cluster_m != 2) || lda % 8 ||
      ldw % 8 || ldo % 8 || !aligned(a) || !aligned(w) || !aligned(out) || perm == nullptr || unions == nullptr) {
    return int(cudaErrorInvalidValue);
  }
  // one "group" along N (G = N), the permutation as a one-column index
  const Args args{a, lda, out, ldo, perm, nullptr, M, N, K, N, 1, group_m, unions, Gk, nullptr};
  if (dtype == kBF16) {
    return cluster_m == 2 ? run<OProj<cutlass::bfloat16_t, 2>>(args, w, nullptr, ldw, grid_ctas, stream)
                          : run<OProj<cutlass::bfloat16_t, 1>>(args, w, nullptr, ldw, grid_ctas, stream);
  }
  return cluster_m == 2 ? run<OProj<cutlass::half_t, 2>>(args, w, nullptr, ldw, grid_ctas, stream)
                        : run<OProj<cutlass::half_t, 1>>(args, w, nullptr, ldw, grid_ctas, stream);
}

int smem_bytes(int op, int G) {
  using bf16 = cutlass::bfloat16_t;
  if (op == kGemmMn) return G % 256 == 0 ? GemmN256<bf16, 1>::kSmem : GemmN128<bf16, 1>::kSmem;
  return op == kSwiglu ? Swiglu<bf16, 1>::kSmem : DenseSwiglu<bf16, 1>::kSmem;
}

int launch(int op, int dtype, const void* x, int64_t ldx, const void* w, const void* w2, int64_t ldw, void* out,
           int64_t ldo, const int32_t* index, const int32_t* counts, const uint8_t* mask, int M, int N, int K, int G,
           int group_m, int grid_ctas, int cluster_m, cudaStream_t stream) {
  const bool gather = op != kDenseSwiglu;
  const auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  if (op < kGemmMn || op > kDenseSwiglu || (dtype != kBF16 && dtype != kFP16) || M < 0 || K <= 0 || K % kBK ||
      G <= 0 || G % 128 || N % G || N <= 0 || group_m < 1 || grid_ctas < 1 || (cluster_m != 1 && cluster_m != 2) ||
      ldx % 8 || ldw % 8 || ldo % 8 ||
      !aligned(x) || !aligned(w) || !aligned(out) || (op != kGemmMn && (w2 == nullptr || !aligned(w2))) ||
      (gather && (index == nullptr || counts == nullptr))) {
    return int(cudaErrorInvalidValue);
  }
  // the dense SwiGLU reads G and N / G only for its route mask
  const bool grouped = gather || mask != nullptr;
  const Args args{x,       ldx, out, ldo, index, counts, M, N, K, grouped ? G : N, grouped ? N / G : 1, group_m,
                  nullptr, 0,   gather ? nullptr : mask};
  return dtype == kBF16 ? dispatch<cutlass::bfloat16_t>(op, args, w, w2, ldw, grid_ctas, cluster_m, stream)
                        : dispatch<cutlass::half_t>(op, args, w, w2, ldw, grid_ctas, cluster_m, stream);
}

}  // namespace wide_sm90
