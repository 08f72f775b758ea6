"""The SwiGLU activation of the routed FFN after dense gate / up GEMMs (paper Eq. 3 with cuBLAS for the N-axis ops):
``silu(g) * u`` where the route executes, exact 0 elsewhere, in one pass that reads no byte of a skipped group.
"""

from __future__ import annotations

import torch

from wide.kernels import reference
from wide.kernels._common import (
    FLOAT_DTYPES,
    HAS_TRITON,
    check_same_device,
    check_tensor,
    fail,
    interpret_mode,
    pow2_part,
    use_triton,
    warps,
)

if HAS_TRITON:
    import triton
    import triton.language as tl

    from wide.kernels._common import round_to

    @triton.jit
    def _masked_swiglu_kernel(g_ptr, u_ptr, route_ptr, out_ptr, M, N, NG, G,
                              BN: tl.constexpr, BM: tl.constexpr):
        # one [BM, BN] tile inside one group (BN divides G): silu(g) * u with the MLP's rounding points, 0 where
        # the route skips the group.  The route is one byte per row, broadcast over the tile's columns.
        offs_m = (tl.program_id(0) * BM + tl.arange(0, BM)).to(tl.int64)
        n0 = tl.program_id(1) * BN
        offs_n = n0 + tl.arange(0, BN)
        mm_ = offs_m < M
        keep = tl.load(route_ptr + offs_m * NG + n0 // G, mask=mm_, other=0) != 0  # [BM]
        ptr = offs_m[:, None] * N + offs_n[None, :]
        lm = (keep & mm_)[:, None]
        g = tl.load(g_ptr + ptr, mask=lm, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + ptr, mask=lm, other=0.0).to(tl.float32)
        DT = out_ptr.dtype.element_ty
        a = round_to(g / (1.0 + tl.exp(-g)), DT)
        y = round_to(a * u, DT)
        tl.store(out_ptr + ptr, tl.where(keep[:, None], y, 0.0).to(DT), mask=mm_[:, None])


def masked_swiglu_act(g: torch.Tensor, u: torch.Tensor, route: torch.Tensor, G: int) -> torch.Tensor:
    """``silu(g) * u`` where ``route[m, n // G]``, else 0, with the MLP's rounding (SiLU and product each rounded to
    the dtype), so ``down_proj`` may run as a dense GEMM.

    g, u ``[M, N]`` bf16/fp16/fp32 of one dtype; route bool ``[M, N // G]``; G a positive int dividing N.  Returns
    ``[M, N]`` in g's dtype.

    Raises:
        KernelArgumentError: tensors of the wrong kind, shapes, dtypes or G that do not fit, or different devices.
    """
    for name, t in (("g", g), ("u", u), ("route", route)):
        check_tensor(name, t)
    check_tensor("g", g, 2, FLOAT_DTYPES)
    if g.shape != u.shape or g.dtype != u.dtype:
        fail(f"masked_swiglu_act: g {tuple(g.shape)} {g.dtype} and u {tuple(u.shape)} {u.dtype} must be equal 2-D "
             "shapes and dtypes")
    M, N = g.shape
    if isinstance(G, bool) or not isinstance(G, int) or G < 1 or N % G:
        fail(f"masked_swiglu_act: G={G!r} must be a positive int dividing N={N}")
    if route.dtype != torch.bool or tuple(route.shape) != (M, N // G):
        fail(f"masked_swiglu_act: route must be bool [M, N // G] = [{M}, {N // G}]; got {route.dtype} "
             f"{tuple(route.shape)}")
    check_same_device(g=g, u=u, route=route)
    if not use_triton(g):
        return reference.masked_swiglu_act_ref(g, u, route, G)
    g, u, route = g.contiguous(), u.contiguous(), route.contiguous()
    out = torch.empty_like(g)
    BN = min(pow2_part(G), 16 if interpret_mode() else 256)  # divides G: a tile lies in one group
    BM = max(1, (256 if interpret_mode() else 4096) // BN)
    _masked_swiglu_kernel[(triton.cdiv(M, BM), N // BN)](g, u, route, out, M, N, N // G, G, BN=BN, BM=BM, **warps(4))
    return out
