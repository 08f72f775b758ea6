// Host check of the work order of the sm_90a GEMM kernels (run by test_sm90_build.py; no GPU needed):
// (1) with clusters of 1 and 2 CTAs along M, grids of 1 to 140 clusters, L2 bands of 1 to 8 row tiles and odd and
// even tile counts, every (row tile, N tile) runs exactly once, and the CTAs of a cluster run the same N tile in the
// same order; (2) KSteps walks exactly the K steps of the groups set, lowest group first.
// Prints "ok <cases checked>" and exits 0, or prints the first mismatch and exits 1.
#include <cstdio>
#include <vector>

#include "gemm_schedule_sm90.cuh"

using wide_sm90::KSteps;
using wide_sm90::tile_coords;

int check_tiles(int MT, int NT, int CM, int group_m, int clusters) {
  const int MC = (MT + CM - 1) / CM, tiles = MC * NT;
  const int group_c = group_m / CM > 1 ? group_m / CM : 1;
  std::vector<int> runs(size_t(MT) * NT, 0);
  for (int c = 0; c < clusters; ++c) {
    for (int t = c; t < tiles; t += clusters) {
      int mc, nt;
      tile_coords(t, MC, NT, group_c, mc, nt);
      if (mc < 0 || mc >= MC || nt < 0 || nt >= NT) {
        std::printf("MT=%d NT=%d CM=%d: tile %d maps to (%d, %d)\n", MT, NT, CM, t, mc, nt);
        return 1;
      }
      for (int r = 0; r < CM; ++r) {  // the cluster's CTAs: same (mc, nt), row tiles mc * CM + r
        if (mc * CM + r < MT) ++runs[size_t(mc * CM + r) * NT + nt];
      }
    }
  }
  for (int mt = 0; mt < MT; ++mt) {
    for (int nt = 0; nt < NT; ++nt) {
      if (runs[size_t(mt) * NT + nt] != 1) {
        std::printf("MT=%d NT=%d CM=%d group_m=%d clusters=%d: tile (%d, %d) runs %d times\n", MT, NT, CM, group_m,
                    clusters, mt, nt, runs[size_t(mt) * NT + nt]);
        return 1;
      }
    }
  }
  return 0;
}

int check_ksteps(uint32_t groups, int per) {
  std::vector<int> want;
  for (int g = 0; g < 32; ++g) {
    if (groups >> g & 1u) {
      for (int i = 0; i < per; ++i) want.push_back(g * per + i);
    }
  }
  KSteps ks(groups, per);
  for (size_t s = 0; s < want.size(); ++s, ks.next()) {
    if (ks.kt != want[s]) {
      std::printf("groups=0x%x per=%d: step %zu is %d, want %d\n", groups, per, s, ks.kt, want[s]);
      return 1;
    }
  }
  if (ks.rest != 0) {
    std::printf("groups=0x%x per=%d: groups left after the last step\n", groups, per);
    return 1;
  }
  return 0;
}

int main() {
  int cases = 0;
  for (int CM = 1; CM <= 2; ++CM) {
    for (int MT : {1, 2, 3, 5, 32, 33, 128}) {
      for (int NT : {1, 4, 7, 56}) {
        for (int group_m : {1, 2, 8}) {
          for (int clusters : {1, 2, 3, 66, 140}) {
            if (check_tiles(MT, NT, CM, group_m, clusters)) return 1;
            ++cases;
          }
        }
      }
    }
  }
  uint32_t x = 0x12345u;  // xorshift: masks of 1 to 16 groups
  for (int i = 0; i < 2000; ++i) {
    x ^= x << 13;
    x ^= x >> 17;
    x ^= x << 5;
    const int ng = 1 + i % 16;
    const uint32_t groups = ng == 32 ? x : x & ((1u << ng) - 1u);
    if (check_ksteps(groups, 1 + i % 8) || check_ksteps(groups | 1u << (ng - 1), 8)) return 1;
    cases += 2;
  }
  if (check_ksteps(0xffffffffu, 8) || check_ksteps(0u, 8)) return 1;
  std::printf("ok %d\n", cases + 2);
  return 0;
}
