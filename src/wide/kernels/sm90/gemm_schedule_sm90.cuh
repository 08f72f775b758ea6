// The work order of the sm_90a GEMM kernels (gemm_mn_sm90.cu), host and device: which tile a CTA runs next, and which
// K steps a tile of the shared-order O projection runs.  A host program checks both (tests/kernels/
// sm90_gemm_schedule.cu): every output tile runs exactly once, and the K steps are exactly those of the groups set.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define WIDE_HD __host__ __device__ __forceinline__
#else
#define WIDE_HD inline
#endif

namespace wide_sm90 {

// Tile t of the persistent order over MT x NT tiles: bands of group_m row tiles, row tile fastest, so the CTAs running
// together share the weight panels of a few N tiles and the token rows of a few row tiles in L2.  With clusters of CM
// CTAs along M the order runs over cluster tiles (MT = the count of CM-row-tile blocks) and CTA r of the cluster takes
// row tile mt * CM + r.
WIDE_HD void tile_coords(int t, int MT, int NT, int group_m, int& mt, int& nt) {
  const int in_band = group_m * NT;
  const int first_m = (t / in_band) * group_m;
  const int size_m = MT - first_m < group_m ? MT - first_m : group_m;
  const int r = t % in_band;
  mt = first_m + r % size_m;
  nt = r / size_m;
}

WIDE_HD int lowest_bit(uint32_t x) {  // index of the lowest set bit of x != 0
#if defined(__CUDA_ARCH__)
  return __ffs(int(x)) - 1;
#else
  return __builtin_ctz(x);
#endif
}

// The K steps (of kBK columns) of a tile that runs the K groups set in `groups`, `per` steps each, lowest group first:
// kt is the current step; next() moves on.
struct KSteps {
  uint32_t rest;  // the groups not yet finished, the current one included
  int per, kt, kk;
  WIDE_HD KSteps(uint32_t groups, int per_)
      : rest(groups), per(per_), kt(groups ? lowest_bit(groups) * per_ : 0), kk(0) {}
  WIDE_HD void next() {
    if (++kk < per) {
      ++kt;
      return;
    }
    kk = 0;
    rest &= rest - 1;
    kt = rest ? lowest_bit(rest) * per : 0;
  }
};

}  // namespace wide_sm90
