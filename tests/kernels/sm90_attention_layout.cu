// Host check of the layouts of the sm_90a routed prefill attention (run by test_sm90_build.py; no GPU needed): for
// every consumer thread, (1) the S accumulator value (c, r, nb) sits at row 16 warp + lane / 4 + 8 r and key column
// 8 nb + 2 (lane % 4) + c, the rows the softmax and the masks assume; (2) the O accumulator has the same rows; (3) P,
// S's registers regrouped by p_layout, holds at every position of the A operand of P V exactly the (row, key) the
// MMA reads there.  Prints "ok <values checked>" and exits 0, or prints the first mismatches and exits 1.
#include <cstdio>

#include "attention_sm90_config.cuh"

using namespace cute;
using namespace wide_sm90::attn;

template <class T>
int check() {
  typename Config<T>::MmaQK mma_qk;
  typename Config<T>::MmaPV mma_pv;
  int bad = 0, checked = 0;
  for (int tid = 0; tid < kConsumerThreads; ++tid) {
    auto thr_qk = mma_qk.get_thread_slice(tid);
    auto thr_pv = mma_pv.get_thread_slice(tid);
    Tensor tScS = thr_qk.partition_C(make_identity_tensor(Shape<Int<kBM>, Int<kBN>>{}));
    Tensor tOcO = thr_pv.partition_C(make_identity_tensor(Shape<Int<kBM>, Int<kD>>{}));
    Tensor tOcP = thr_pv.partition_A(make_identity_tensor(Shape<Int<kBM>, Int<kBN>>{}));
    Tensor acc_s = partition_fragment_C(mma_qk, Shape<Int<kBM>, Int<kBN>>{});
    for (int i = 0; i < size(acc_s); ++i) acc_s(i) = float(get<0>(tScS(i)) * 1000 + get<1>(tScS(i)));
    Tensor tSrP = make_tensor(acc_s.data(), p_layout(acc_s.layout()));
    if (size(tSrP) != size(tOcP)) {
      std::printf("P has %d values, the A operand %d\n", int(size(tSrP)), int(size(tOcP)));
      return 1;
    }
    for (int j = 0; j < size(tSrP); ++j, ++checked) {
      const float want = float(get<0>(tOcP(j)) * 1000 + get<1>(tOcP(j)));
      if (tSrP(j) != want && bad++ < 5) {
        std::printf("thread %d, P value %d: (row, key) code %g, want %g\n", tid, j, tSrP(j), want);
      }
    }
    const int lane = tid % 32, warp = tid / 32;
    for (int r = 0; r < 2; ++r) {
      ++checked;
      if (get<0>(tOcO(make_coord(0, r, 0), 0, 0)) != warp * 16 + lane / 4 + 8 * r && bad++ < 5) {
        std::printf("thread %d: O row %d is %d\n", tid, r, int(get<0>(tOcO(make_coord(0, r, 0), 0, 0))));
      }
      for (int nb = 0; nb < kBN / 8; ++nb) {
        for (int c = 0; c < 2; ++c, ++checked) {
          const int row = get<0>(tScS(make_coord(c, r, nb), 0, 0)), col = get<1>(tScS(make_coord(c, r, nb), 0, 0));
          if ((row != warp * 16 + lane / 4 + 8 * r || col != 8 * nb + 2 * (lane % 4) + c) && bad++ < 5) {
            std::printf("thread %d: S value (%d, %d, %d) at (%d, %d)\n", tid, c, r, nb, row, col);
          }
        }
      }
    }
  }
  if (bad) return 1;
  std::printf("ok %d\n", checked);
  return 0;
}

int main() { return check<cutlass::bfloat16_t>() | check<cutlass::half_t>(); }
