"""Plain PyTorch references for every routed op, with the same semantics as the Triton kernels.

This module is the single source of truth the kernels are tested against.  Every function computes
in the dtype of its inputs promoted to at least float32 (call it with float64 inputs to get a
float64 reference) and returns the input dtype.  It also holds the naive Appendix-A baselines
(gather-scatter along N and K, and mask-multiply dense), used only by the benchmarks.

Mask convention (project-wide): a bool ``route`` of shape ``[M, N_G]``, True = execute.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from wide.kernels._common import Reordered


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def expand_route(route: torch.Tensor, G: int) -> torch.Tensor:
    """``[..., N_G]`` bool -> ``[..., N_G * G]`` bool (each group repeated G times)."""
    return route.repeat_interleave(G, dim=-1)


def head_route(route: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Attention routing per query head: bool ``[B, T, N_G]`` -> ``[B, H_q, T]``, each head group's decision
    repeated for its ``H_q / N_G`` consecutive query heads (Eq. 2)."""
    return route.transpose(1, 2).repeat_interleave(n_heads // route.shape[-1], dim=1)


def reorder_ref(mask: torch.Tensor) -> Reordered:
    """Eq. 7 / Algorithm 1: per routing column, stable descending sort of a bool mask.

    ``mask``: bool ``[..., M, N_G]`` (columns run along dim -2).  Returns ``Reordered(index int32
    [..., M, N_G], sorted mask bool [..., M, N_G], counts int32 [..., N_G])``; active rows form the
    prefix of each column in their original order, inactive rows follow in their original order.
    """
    key = (~mask).to(torch.int8)
    _, idx = torch.sort(key, dim=-2, stable=True)
    counts = mask.sum(dim=-2, dtype=torch.int32)
    smask = torch.gather(mask, -2, idx)
    return Reordered(idx.to(torch.int32), smask, counts)


def gemm_mn_ref(x: torch.Tensor, w: torch.Tensor, route: torch.Tensor, G: int) -> torch.Tensor:
    """N-axis routing (Eq. 3, Algorithm 2): ``out[m, n] = (x @ w.T)[m, n] if route[m, n // G] else 0``.

    x ``[M, K]``, w ``[N, K]``, route bool ``[M, N // G]`` -> ``[M, N]`` in x's dtype.
    """
    acc = _acc_dtype(x.dtype)
    y = x.to(acc) @ w.to(acc).T
    y = torch.where(expand_route(route, G), y, torch.zeros((), dtype=acc, device=y.device))
    return y.to(x.dtype)


def swiglu_ref(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, route: torch.Tensor,
               G: int) -> torch.Tensor:
    """Routed SwiGLU (Eq. 3): ``silu(x Wg^T) * (x Wu^T)`` for active groups, 0 elsewhere.

    x ``[M, K]``, w_gate/w_up ``[N, K]``, route bool ``[M, N // G]`` -> ``[M, N]`` in x's dtype.
    Rounding as the model's own MLP in x's dtype: the gate and up products, the SiLU and the product
    are each rounded to x's dtype (nothing is rounded for fp32 / fp64 inputs).
    """
    acc = _acc_dtype(x.dtype)
    xa = x.to(acc)
    gate, up = xa @ w_gate.to(acc).T, xa @ w_up.to(acc).T
    if acc != x.dtype:  # bf16 / fp16: HF's rounding points (act_fn(gate_proj(x)) * up_proj(x))
        gate, up = gate.to(x.dtype).to(acc), up.to(x.dtype).to(acc)
        y = F.silu(gate).to(x.dtype).to(acc) * up
    else:
        y = F.silu(gate) * up
    y = torch.where(expand_route(route, G), y, torch.zeros((), dtype=acc, device=y.device))
    return y.to(x.dtype)


def gemm_k_ref(a: torch.Tensor, w: torch.Tensor, route: torch.Tensor, G: int) -> torch.Tensor:
    """K-axis routing (Eq. 21, Algorithm 3): ``out[m] = sum_{g active} a[m, K_g] @ w[:, K_g].T``.

    a ``[M, K]``, w ``[N, K]``, route bool ``[M, K // G]`` -> ``[M, N]`` in a's dtype.
    """
    acc = _acc_dtype(a.dtype)
    am = torch.where(expand_route(route, G), a.to(acc), torch.zeros((), dtype=acc, device=a.device))
    return (am @ w.to(acc).T).to(a.dtype)


def attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, route: torch.Tensor,
                  causal: bool = False, left_pad: torch.Tensor | None = None,
                  scale: float | None = None) -> torch.Tensor:
    """Routed attention (Eq. 2, Algorithm 4), SDPA layout.

    q ``[B, Hq, Tq, d]``, k/v ``[B, Hk, Tk, d]`` (Hq % Hk == 0, GQA), route bool ``[B, Tq, N_G]``
    with head group size ``G = Hq * d / N_G`` (a multiple of d: ``G / d`` consecutive query heads
    per group).  Query i sits at key position ``i + Tk - Tq``; causal attention sees keys
    ``j <= i + Tk - Tq``.  ``left_pad`` (int ``[B]``): keys ``j < left_pad[b]`` are masked.  A query
    row with no visible key outputs 0; an inactive (token, head group) outputs 0.
    """
    B, Hq, Tq, d = q.shape
    Hk, Tk = k.shape[1], k.shape[2]
    acc = _acc_dtype(q.dtype)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    rep = Hq // Hk
    kk = k.to(acc).repeat_interleave(rep, dim=1)
    vv = v.to(acc).repeat_interleave(rep, dim=1)
    s = (q.to(acc) @ kk.transpose(-1, -2)) * scale  # [B, Hq, Tq, Tk]
    jpos = torch.arange(Tk, device=q.device)
    ipos = torch.arange(Tq, device=q.device) + (Tk - Tq)
    valid = torch.ones(B, 1, Tq, Tk, dtype=torch.bool, device=q.device)
    if causal:
        valid = valid & (jpos[None, None, None, :] <= ipos[None, None, :, None])
    if left_pad is not None:
        valid = valid & (jpos[None, None, None, :] >= left_pad.to(q.device).view(B, 1, 1, 1))
    s = s.masked_fill(~valid, float("-inf"))
    p = torch.softmax(s, dim=-1)
    p = torch.nan_to_num(p, nan=0.0)  # rows without any visible key
    o = p @ vv
    o = torch.where(head_route(route, Hq)[..., None], o, torch.zeros((), dtype=acc, device=o.device))
    return o.to(q.dtype)


# ----------------------------------------------------------------------------------------------
# Naive Appendix-A baselines (benchmarks only).  They take per-token group indices I [M, R]
# (every token selects exactly R groups), as in the paper's listings.
# ----------------------------------------------------------------------------------------------


def naive_gather_scatter_n(A: torch.Tensor, B: torch.Tensor, I_N: torch.Tensor, G: int) -> torch.Tensor:
    """Appendix A, naive N-axis gather-scatter (Eq. 15): materialises ``B_sub [M, R*G, K]``.

    A ``[M, K]``, B ``[N, K]`` (float, one dtype), I_N int64 ``[M, R]`` (the R active N groups of each row) ->
    ``[M, N]`` in A's dtype, 0 outside the selected groups."""
    M = A.shape[0]
    N = B.shape[0]
    R = I_N.shape[1]
    offset = torch.arange(G, device=A.device)
    J_N = (I_N[..., None] * G + offset).reshape(M, R * G)
    B_sub = B[J_N, :]
    C_sub = torch.einsum("mk,mnk->mn", A, B_sub)
    C = torch.zeros(M, N, device=A.device, dtype=A.dtype)
    C.scatter_(dim=1, index=J_N, src=C_sub)
    return C


def naive_gather_scatter_k(A: torch.Tensor, B: torch.Tensor, I_K: torch.Tensor, G: int) -> torch.Tensor:
    """Appendix A, naive K-axis gather-scatter (Eq. 18): materialises ``B_sub [M, N, R*G]``.

    A ``[M, K]``, B ``[N, K]`` (float, one dtype), I_K int64 ``[M, R]`` (the R active K groups of each row) ->
    ``[M, N]`` in A's dtype: the sum over the selected groups only."""
    M = A.shape[0]
    R = I_K.shape[1]
    offset = torch.arange(G, device=A.device)
    J_K = (I_K[..., None] * G + offset).reshape(M, R * G)
    A_sub = torch.gather(A, dim=1, index=J_K)
    B_sub = B[:, J_K].permute(1, 0, 2)
    return torch.einsum("mk,mnk->mn", A_sub, B_sub)


def naive_mask_multiply_n(A: torch.Tensor, B: torch.Tensor, route: torch.Tensor, G: int) -> torch.Tensor:
    """Mask-multiply dense N-axis baseline (Appendix A): dense GEMM, then zero the inactive groups.

    A ``[M, K]``, B ``[N, K]``, route bool ``[M, N // G]`` -> ``[M, N]`` in A's dtype (as :func:`gemm_mn_ref`)."""
    return (A @ B.T) * expand_route(route, G).to(A.dtype)


def naive_mask_multiply_k(A: torch.Tensor, B: torch.Tensor, route: torch.Tensor, G: int) -> torch.Tensor:
    """Mask-multiply dense K-axis baseline (Appendix A): zero the inactive input groups, then dense GEMM.

    A ``[M, K]``, B ``[N, K]``, route bool ``[M, K // G]`` -> ``[M, N]`` in A's dtype (as :func:`gemm_k_ref`)."""
    return (A * expand_route(route, G).to(A.dtype)) @ B.T
