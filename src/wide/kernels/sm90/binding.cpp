// Torch binding of the sm_90a routed GEMM-MN kernels: tensors in, one launch on the current stream.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include "gemm_mn_sm90.h"

namespace {

const void* ptr(const c10::optional<at::Tensor>& t) { return t.has_value() ? t->data_ptr() : nullptr; }

// op: 0 gemm_mn, 1 routed SwiGLU, 2 dense SwiGLU.  x [M, K], w (w2) [N, K] with one row stride, out [M, N], index
// int32 [M, N / G] and counts int32 [N / G] (unused by op 2); the caller checked shapes, dtypes and devices.
void run(int64_t op, const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& w2,
         const c10::optional<at::Tensor>& index, const c10::optional<at::Tensor>& counts, at::Tensor& out, int64_t G,
         int64_t group_m, int64_t grid_ctas) {
  TORCH_CHECK(x.is_cuda() && x.dim() == 2 && w.dim() == 2 && out.dim() == 2, "wide sm90: 2-D CUDA tensors expected");
  TORCH_CHECK(x.stride(1) == 1 && w.stride(1) == 1 && out.stride(1) == 1, "wide sm90: unit column strides expected");
  TORCH_CHECK(!w2.has_value() || w2->stride(0) == w.stride(0), "wide sm90: w2 must have w's row stride");
  const auto st = x.scalar_type();
  TORCH_CHECK(st == at::kBFloat16 || st == at::kHalf, "wide sm90: bfloat16 or float16 expected");
  const c10::cuda::CUDAGuard guard(x.device());
  const int32_t* idx = index.has_value() ? index->data_ptr<int32_t>() : nullptr;
  const int32_t* cnt = counts.has_value() ? counts->data_ptr<int32_t>() : nullptr;
  const int rc = wide_sm90::launch(int(op), st == at::kBFloat16 ? wide_sm90::kBF16 : wide_sm90::kFP16, x.data_ptr(),
                                   x.stride(0), w.data_ptr(), ptr(w2), w.stride(0), out.data_ptr(), out.stride(0), idx,
                                   cnt, int(x.size(0)), int(w.size(0)), int(x.size(1)), int(G), int(group_m),
                                   int(grid_ctas), c10::cuda::getCurrentCUDAStream(x.device().index()).stream());
  TORCH_CHECK(rc == 0, "wide sm90 kernel launch failed: ", cudaGetErrorString(cudaError_t(rc)));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("run", &run, "routed GEMM-MN / SwiGLU / dense SwiGLU on sm_90a");
  m.def("smem_bytes", &wide_sm90::smem_bytes, "dynamic shared memory of one CTA (op, G)");
}
