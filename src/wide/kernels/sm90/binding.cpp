// Torch binding of the sm_90a kernels (routed GEMM-MN / SwiGLU, the shared-order O projection, routed prefill
// attention): tensors in, one launch
// on the current stream.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include "attention_sm90.h"
#include "gemm_mn_sm90.h"

namespace {

const void* ptr(const c10::optional<at::Tensor>& t) { return t.has_value() ? t->data_ptr() : nullptr; }

// op: 0 gemm_mn, 1 routed SwiGLU, 2 dense SwiGLU.  x [M, K], w (w2) [N, K] with one row stride, out [M, N], index
// int32 [M, N / G] and counts int32 [N / G] (unused by op 2), mask bool [M, N / G] contiguous or none (op 2 only: its
// false groups written as zeros); the caller checked shapes, dtypes and devices.
// cluster_m: 1, or 2 (pairs of CTAs along M sharing the weight tiles by TMA multicast).
void run(int64_t op, const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& w2,
         const c10::optional<at::Tensor>& index, const c10::optional<at::Tensor>& counts,
         const c10::optional<at::Tensor>& mask, at::Tensor& out, int64_t G, int64_t group_m, int64_t grid_ctas,
         int64_t cluster_m) {
  TORCH_CHECK(x.is_cuda() && x.dim() == 2 && w.dim() == 2 && out.dim() == 2, "wide sm90: 2-D CUDA tensors expected");
  TORCH_CHECK(x.stride(1) == 1 && w.stride(1) == 1 && out.stride(1) == 1, "wide sm90: unit column strides expected");
  TORCH_CHECK(!w2.has_value() || w2->stride(0) == w.stride(0), "wide sm90: w2 must have w's row stride");
  const auto st = x.scalar_type();
  TORCH_CHECK(st == at::kBFloat16 || st == at::kHalf, "wide sm90: bfloat16 or float16 expected");
  const c10::cuda::CUDAGuard guard(x.device());
  const int32_t* idx = index.has_value() ? index->data_ptr<int32_t>() : nullptr;
  const int32_t* cnt = counts.has_value() ? counts->data_ptr<int32_t>() : nullptr;
  TORCH_CHECK(!mask.has_value() || (op == 2 && mask->scalar_type() == at::kBool && mask->is_contiguous() &&
                                     mask->device() == x.device() && mask->dim() == 2 &&
                                     mask->size(0) == x.size(0) && G > 0 && mask->size(1) * G == w.size(0)),
              "wide sm90: a mask only for the dense SwiGLU, contiguous bool [M, N / G] on x's device");
  const uint8_t* msk = mask.has_value() ? reinterpret_cast<const uint8_t*>(mask->data_ptr<bool>()) : nullptr;
  const int rc = wide_sm90::launch(int(op), st == at::kBFloat16 ? wide_sm90::kBF16 : wide_sm90::kFP16, x.data_ptr(),
                                   x.stride(0), w.data_ptr(), ptr(w2), w.stride(0), out.data_ptr(), out.stride(0), idx,
                                   cnt, msk, int(x.size(0)), int(w.size(0)), int(x.size(1)), int(G), int(group_m),
                                   int(grid_ctas), int(cluster_m),
                                   c10::cuda::getCurrentCUDAStream(x.device().index()).stream());
  TORCH_CHECK(rc == 0, "wide sm90 kernel launch failed: ", cudaGetErrorString(cudaError_t(rc)));
}

// The O projection in the shared token order: a [M, K] sorted rows, w [N, K], out [M, N] in token order (unit column
// strides), perm int32 [M] and unions int32 [ceil(M / 64)] (contiguous), Gk columns per K group; the caller checked
// shapes, dtypes and devices.
void o_proj(const at::Tensor& a, const at::Tensor& w, const at::Tensor& perm, const at::Tensor& unions, at::Tensor& out,
            int64_t Gk, int64_t group_m, int64_t grid_ctas, int64_t cluster_m) {
  TORCH_CHECK(a.is_cuda() && a.dim() == 2 && w.dim() == 2 && out.dim() == 2, "wide sm90: 2-D CUDA tensors expected");
  TORCH_CHECK(a.stride(1) == 1 && w.stride(1) == 1 && out.stride(1) == 1, "wide sm90: unit column strides expected");
  TORCH_CHECK(perm.is_contiguous() && unions.is_contiguous(), "wide sm90: contiguous perm and unions expected");
  const auto st = a.scalar_type();
  TORCH_CHECK(st == at::kBFloat16 || st == at::kHalf, "wide sm90: bfloat16 or float16 expected");
  const c10::cuda::CUDAGuard guard(a.device());
  const int rc = wide_sm90::launch_o_proj(
      st == at::kBFloat16 ? wide_sm90::kBF16 : wide_sm90::kFP16, a.data_ptr(), a.stride(0), w.data_ptr(), w.stride(0),
      out.data_ptr(), out.stride(0), perm.data_ptr<int32_t>(), unions.data_ptr<int32_t>(), int(a.size(0)),
      int(w.size(0)), int(a.size(1)), int(Gk), int(group_m), int(grid_ctas), int(cluster_m),
      c10::cuda::getCurrentCUDAStream(a.device().index()).stream());
  TORCH_CHECK(rc == 0, "wide sm90 O projection launch failed: ", cudaGetErrorString(cudaError_t(rc)));
}

// q [B, Hq, Tq, d], k / v [B, Hk, Tk, d] (unit stride on d), index int32 [B, Tq, N_G] and counts int32 [B, N_G]
// (contiguous), left_pad int32 [B] (contiguous) or none, out [B, Hq, Tq, d]; the caller checked shapes, dtypes and
// devices.  grid_ctas: a persistent grid of that many CTAs, or 0 for one CTA per 128-row tile.
void attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& index,
               const at::Tensor& counts, const c10::optional<at::Tensor>& left_pad, at::Tensor& out, bool causal,
               double scale, bool pingpong, int64_t grid_ctas) {
  TORCH_CHECK(q.is_cuda() && q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && out.dim() == 4 && index.dim() == 3,
              "wide sm90: 4-D CUDA q, k, v, out and a 3-D index expected");
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1 && out.stride(3) == 1,
              "wide sm90: unit stride on the head dimension expected");
  TORCH_CHECK(index.is_contiguous() && counts.is_contiguous() && (!left_pad.has_value() || left_pad->is_contiguous()),
              "wide sm90: contiguous index, counts and left_pad expected");
  const auto st = q.scalar_type();
  TORCH_CHECK(st == at::kBFloat16 || st == at::kHalf, "wide sm90: bfloat16 or float16 expected");
  const c10::cuda::CUDAGuard guard(q.device());
  wide_sm90::AttentionArgs a{};
  a.q = q.data_ptr();
  a.k = k.data_ptr();
  a.v = v.data_ptr();
  a.out = out.data_ptr();
  a.sqb = q.stride(0), a.sqh = q.stride(1), a.sqt = q.stride(2);
  a.skb = k.stride(0), a.skh = k.stride(1), a.skt = k.stride(2);
  a.svb = v.stride(0), a.svh = v.stride(1), a.svt = v.stride(2);
  a.sob = out.stride(0), a.soh = out.stride(1), a.sot = out.stride(2);
  a.index = index.data_ptr<int32_t>();
  a.counts = counts.data_ptr<int32_t>();
  a.left_pad = left_pad.has_value() ? left_pad->data_ptr<int32_t>() : nullptr;
  a.B = int(q.size(0)), a.Hq = int(q.size(1)), a.Tq = int(q.size(2)), a.D = int(q.size(3));
  a.Hk = int(k.size(1)), a.Tk = int(k.size(2)), a.NG = int(index.size(2));
  a.scale = float(scale);
  a.causal = causal ? 1 : 0;
  a.pingpong = pingpong ? 1 : 0;
  a.grid_ctas = int(grid_ctas);
  const int rc = wide_sm90::launch_attention(st == at::kBFloat16 ? wide_sm90::kBF16 : wide_sm90::kFP16, a,
                                             c10::cuda::getCurrentCUDAStream(q.device().index()).stream());
  TORCH_CHECK(rc == 0, "wide sm90 attention launch failed: ", cudaGetErrorString(cudaError_t(rc)));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("run", &run, "routed GEMM-MN / SwiGLU / dense SwiGLU on sm_90a");
  m.def("o_proj", &o_proj, "K-axis O projection in the shared token order on sm_90a");
  m.def("smem_bytes", &wide_sm90::smem_bytes, "dynamic shared memory of one CTA (op, G)");
  m.def("attention", &attention, "routed prefill attention on sm_90a (d = 128)");
}
