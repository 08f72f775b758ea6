"""Fused routed SwiGLU (paper Eq. 3 with the GEMM-MN pipeline of Algorithm 2).

``out = silu(x Wg^T) * (x Wu^T)`` for active groups, 0 elsewhere, computed in one pass that reads
each gathered tile of ``x`` once for both weights (two accumulators in one program).
"""

from __future__ import annotations

import torch

from wide.kernels import reference
from wide.kernels._common import Reordered, check_out, check_reordered, fail, small_or_fallback
from wide.kernels.gemm_mn import _validate, launch_gemm_mn


def swiglu(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, route: torch.Tensor, G: int, *,
           reordered: Reordered | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Routed fused SwiGLU: ``out[m, n] = silu((x Wg^T)[m, n]) * (x Wu^T)[m, n]`` if ``route[m, n // G]``.

    Args:
        x: ``[M, K]`` activations (bf16/fp16/fp32).
        w_gate, w_up: ``[N, K]`` gate and up weights, same dtype/device as x.
        route: bool ``[M, N // G]`` (the FFN routing mask of Eq. 3), True = execute.
        G: group size along the intermediate dimension N, a multiple of 16 dividing N
            (the paper's FFN choice: a power of two 16..512).
        reordered: optional shared :func:`wide.kernels.reorder` result of ``route``.
        out: optional preallocated contiguous ``[M, N]`` output (x's dtype).

    Returns:
        ``[M, N]`` in x's dtype (fp32 accumulation and activation), 0 for inactive groups.

    M <= 4 uses :func:`wide.kernels.decode.gemv_swiglu`.  CPU without ``TRITON_INTERPRET=1`` falls
    back to :func:`reference.swiglu_ref`.

    Raises:
        ValueError: shapes, dtypes or devices of x/w_gate/w_up/route disagree, or G is illegal.
    """
    M, N, K = _validate(x, w_gate, route, G, "w_gate")
    if isinstance(w_up, torch.Tensor) and w_up.shape != w_gate.shape:
        fail(f"w_up shape {tuple(w_up.shape)} must equal w_gate shape {tuple(w_gate.shape)}")
    _validate(x, w_up, route, G, "w_up")
    check_out(out, (M, N), x.dtype, x.device, x=x, w_gate=w_gate, w_up=w_up, route=route)
    if reordered is not None:  # checked on every path, so that code that runs on the CPU runs on a GPU too
        reordered = check_reordered(reordered, (M, N // G), route.device)
    from wide.kernels.decode import gemv_swiglu

    done = small_or_fallback(x, M, N, out, lambda: reference.swiglu_ref(x, w_gate, w_up, route, G),
                             lambda: gemv_swiglu(x, w_gate, w_up, route, G, out=out))
    if done is not None:
        return done
    return launch_gemm_mn(x, w_gate, w_up, route, G, reordered, out, swiglu=True)
