"""Residual add and RMSNorm in one kernel, rounding as Hugging Face's ``LlamaRMSNorm`` (fp32 statistics, the normalised
value rounded to the model dtype, then times the weight): two of a decode step's many small unrouted kernels fewer.
"""

import torch

from wide.kernels import _common as common
from wide.kernels import reference

if common.HAS_TRITON:
    import triton
    import triton.language as tl

    from wide.kernels._common import round_to

    @triton.jit
    def _add_rmsnorm_kernel(h_ptr, add_ptr, hout_ptr, y_ptr, w_ptr, D, eps,
                            HAS_ADD: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        m = offs < D
        h = tl.load(h_ptr + row * D + offs, mask=m, other=0.0)
        if HAS_ADD:
            a = tl.load(add_ptr + row * D + offs, mask=m, other=0.0)
            h = round_to(h.to(tl.float32) + a.to(tl.float32), h_ptr.dtype.element_ty).to(h_ptr.dtype.element_ty)
            tl.store(hout_ptr + row * D + offs, h, mask=m)
        hf = h.to(tl.float32)
        var = tl.sum(hf * hf, axis=0) / D
        n = round_to(hf * (1.0 / tl.sqrt(var + eps)), h_ptr.dtype.element_ty)
        w = tl.load(w_ptr + offs, mask=m, other=0.0)
        y = round_to(w.to(tl.float32) * n, y_ptr.dtype.element_ty).to(y_ptr.dtype.element_ty)
        tl.store(y_ptr + row * D + offs, y, mask=m)


def add_rmsnorm(h: torch.Tensor, add: torch.Tensor | None, weight: torch.Tensor, eps: float):
    """``h' = h + add`` rounded to h's dtype, then ``weight * rmsnorm(h')`` (h ``[..., D]`` float, add None or like h,
    weight ``[D]``); returns ``(h', y)``.  The engine's fused norm: arguments are trusted."""
    if not common.use_triton(h) or weight.dtype != h.dtype:
        return reference.add_rmsnorm_ref(h, add, weight, eps)
    D = h.shape[-1]
    h = h.contiguous()
    hout = h if add is None else torch.empty_like(h)
    y = torch.empty_like(h)
    _add_rmsnorm_kernel[(h.numel() // max(1, D),)](h, h if add is None else add.contiguous(), hout, y, weight, D,
                                                   float(eps), HAS_ADD=add is not None, BLOCK=common.next_pow2(D),
                                                   **common.warps(8 if D >= 4096 else 4))
    return hout, y
