"""The SwiGLU activation of the routed FFN after dense gate / up GEMMs (paper Eq. 3 with cuBLAS for the N-axis ops):
``silu(g) * u`` where the route executes, exact 0 elsewhere, in one pass that reads no byte of a skipped group.
"""

import torch

from wide.kernels import _common as common
from wide.kernels import reference

if common.HAS_TRITON:
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
    """``silu(g) * u`` where ``route[m, n // G]``, else exactly 0, rounded as the model's MLP (Eq. 3 after dense gate /
    up GEMMs).  g, u ``[M, N]`` of one float dtype, route bool ``[M, N // G]``, G dividing N.  Raises
    KernelArgumentError: tensors, shapes, dtypes or G that do not fit, or different devices.
    """
    for name, t in (("g", g), ("u", u), ("route", route)):
        common.check_tensor(name, t)
    if g.dim() != 2 or g.shape != u.shape or g.dtype != u.dtype or g.dtype not in common.FLOAT_DTYPES:
        common.fail(f"masked_swiglu_act: g and u must be bf16/fp16/fp32 [M, N] of equal shapes and dtypes; got "
                    f"{g.dtype} {tuple(g.shape)} and {u.dtype} {tuple(u.shape)}")
    M, N = g.shape
    if isinstance(G, bool) or not isinstance(G, int) or G < 1 or N % G:
        common.fail(f"masked_swiglu_act: G={G!r} must be a positive int dividing N={N}")
    if route.dtype != torch.bool or tuple(route.shape) != (M, N // G):
        common.fail(f"masked_swiglu_act: route must be bool [M, N // G] = [{M}, {N // G}]; got {route.dtype} "
                    f"{tuple(route.shape)}")
    common.check_same_device(g=g, u=u, route=route)
    if not common.use_triton(g):
        return reference.masked_swiglu_act_ref(g, u, route, G)
    g, u, route = g.contiguous(), u.contiguous(), route.contiguous()
    out = torch.empty_like(g)
    BN = min(common.pow2_part(G), 16 if common.interpret_mode() else 256)  # divides G: a tile lies in one group
    BM = max(1, (256 if common.interpret_mode() else 4096) // BN)
    _masked_swiglu_kernel[(triton.cdiv(M, BM), N // BN)](g, u, route, out, M, N, N // G, G, BN=BN, BM=BM,
                                                          **common.warps(4))
    return out
