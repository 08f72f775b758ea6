"""Residual add and RMSNorm in one kernel, rounding as Hugging Face's ``LlamaRMSNorm`` (fp32 statistics, the normalised
value rounded to the model dtype, then times the weight): two of a decode step's many small unrouted kernels fewer.
"""

from __future__ import annotations

import math

import torch

from wide.kernels import reference
from wide.kernels._common import (
    FLOAT_DTYPES,
    HAS_TRITON,
    check_same_device,
    check_tensor,
    fail,
    next_pow2,
    use_triton,
    warps,
)

if HAS_TRITON:
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
    """``h' = h + add`` (rounded to h's dtype), then ``weight * rmsnorm(h')``.

    h ``[..., D]`` bf16/fp16/fp32; add None or h's shape and dtype; weight ``[D]`` (h's dtype for the kernel, else the
    reference runs); eps the norm's epsilon.  Returns ``(h', y)`` in h's dtype (``h'`` is h when add is None).

    Raises:
        KernelArgumentError: tensors of the wrong kind, shapes that do not fit, different devices, or a bad eps.
    """
    check_tensor("h", h, None, FLOAT_DTYPES)
    check_tensor("weight", weight, 1)
    if h.dim() == 0 or weight.shape[0] != h.shape[-1]:
        fail(f"add_rmsnorm: weight {tuple(weight.shape)} must be [D] for h {tuple(h.shape)} = [..., D]")
    if add is not None:
        check_tensor("add", add)
        if add.shape != h.shape or add.dtype != h.dtype:
            fail(f"add_rmsnorm: add is {add.dtype} {tuple(add.shape)}; h is {h.dtype} {tuple(h.shape)}")
    check_same_device(h=h, add=add, weight=weight)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps < 0:
        fail(f"add_rmsnorm: eps={eps!r} must be a finite number >= 0")
    if not use_triton(h) or weight.dtype != h.dtype:
        return reference.add_rmsnorm_ref(h, add, weight, eps)
    D = h.shape[-1]
    h = h.contiguous()
    hout = h if add is None else torch.empty_like(h)
    y = torch.empty_like(h)
    _add_rmsnorm_kernel[(h.numel() // max(1, D),)](h, h if add is None else add.contiguous(), hout, y, weight, D,
                                                   float(eps), HAS_ADD=add is not None, BLOCK=next_pow2(D),
                                                   **warps(8 if D >= 4096 else 4))
    return hout, y
