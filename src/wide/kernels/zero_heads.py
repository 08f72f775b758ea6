"""Zeroing the attention output of skipped head groups in place (Algorithm 4's output for a skipped group, when SDPA
computed every head): one pass whose stores are masked to the skipped groups, so at s = 0 it only reads the routes.
"""

import torch

from wide.kernels import _common as common
from wide.kernels import reference

if common.HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _zero_skipped_heads_kernel(y_ptr, route_ptr, T, NG, sb, sh, st, sd,
                                   HPG: tl.constexpr, DH: tl.constexpr, BC: tl.constexpr, BT: tl.constexpr):
        # [BT] tokens of sequence b: for each head group, zero its HPG heads x DH channels where the route skips
        # it.  Stores are masked by "skipped", so a kept group moves no bytes (at s = 0 the pass only reads routes).
        b = tl.program_id(1).to(tl.int64)
        offs_t = tl.program_id(0) * BT + tl.arange(0, BT)
        tm = offs_t < T
        offs_c = tl.arange(0, BC)  # channel c of the group: head c // DH, dim c % DH
        cm = offs_c < HPG * DH
        col = (offs_c // DH).to(tl.int64) * sh + (offs_c % DH).to(tl.int64) * sd
        row = b * sb + offs_t.to(tl.int64) * st
        for g in range(0, NG):
            keep = tl.load(route_ptr + (b * T + offs_t) * NG + g, mask=tm, other=1) != 0
            skip = tm & (keep == 0)
            ptr = y_ptr + row[:, None] + g * HPG * sh + col[None, :]
            tl.store(ptr, tl.zeros((BT, BC), dtype=y_ptr.dtype.element_ty), mask=skip[:, None] & cm[None, :])


def zero_skipped_heads_(a: torch.Tensor, route: torch.Tensor) -> torch.Tensor:
    """Set to 0, in place, the heads of every (token, head group) ``route`` skips: a ``[B, H_q, T, d]`` float (any
    strides, no grad), route bool ``[B, T, N_G]`` with N_G dividing H_q.  Returns ``a``.  Raises KernelArgumentError:
    tensors of the wrong kind or shape, an a that requires grad, or different devices.
    """
    common.check_tensor("a", a)
    common.check_tensor("route", route)
    if a.requires_grad:
        common.fail("zero_skipped_heads_: a requires grad; it is written in place (inference only: call it under "
                    "torch.no_grad() on a tensor that does not require grad)")
    if a.dim() != 4 or a.dtype not in common.FLOAT_DTYPES:
        common.fail(f"zero_skipped_heads_: a must be a 4-D [B, H_q, T, d] bf16/fp16/fp32 tensor; got {a.dtype} "
                    f"{tuple(a.shape)}")
    B, H, T, D = a.shape
    if route.dtype != torch.bool or route.dim() != 3 or tuple(route.shape[:2]) != (B, T) or route.shape[2] < 1 \
            or H % route.shape[2]:
        common.fail(f"zero_skipped_heads_: route must be bool [B, T, N_G] = [{B}, {T}, N_G] with N_G dividing "
                    f"H_q={H}; got {route.dtype} {tuple(route.shape)}")
    common.check_same_device(a=a, route=route)
    if not common.use_triton(a):
        return reference.zero_skipped_heads_ref(a, route)
    NG = route.shape[2]
    BC = common.next_pow2(H // NG * D)
    BT = 2 if common.interpret_mode() else max(1, min(16, 8192 // BC))
    _zero_skipped_heads_kernel[(triton.cdiv(T, BT), B)](a, route.contiguous(), T, NG, *a.stride(), HPG=H // NG,
                                                        DH=D, BC=BC, BT=BT, **common.warps(4))
    return a
