"""PyTorch references of the kernel ops: the tests' float64 references (call them with float64 inputs) and the ops'
fallback where no Triton kernel runs.  They compute in at least float32 and return the input dtype; the RMSNorm,
RoPE and activation references round where the model's modules round.  Masks: bool, True = execute.
"""

import math

import torch
import torch.nn.functional as F

from wide.kernels._common import Reordered


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def expand_route(route: torch.Tensor, G: int) -> torch.Tensor:
    """``[..., N_G]`` bool -> ``[..., N_G * G]`` bool (each group repeated G times)."""
    return route.repeat_interleave(G, dim=-1)


def head_route(route: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Attention routing per query head: bool ``[B, T, N_G]`` -> ``[B, H_q, T]`` (Eq. 2)."""
    return route.transpose(1, 2).repeat_interleave(n_heads // route.shape[-1], dim=1)


def reorder_ref(mask: torch.Tensor) -> Reordered:
    """Eq. 7 / Algorithm 1: stable sort of every column of bool ``[..., M, N_G]``, active rows first."""
    _, idx = torch.sort((~mask).to(torch.int8), dim=-2, stable=True)
    return Reordered(idx.to(torch.int32), torch.gather(mask, -2, idx), mask.sum(dim=-2, dtype=torch.int32))


def gemm_mn_ref(x: torch.Tensor, w: torch.Tensor, route: torch.Tensor, G: int) -> torch.Tensor:
    """Eq. 3, Algorithm 2: ``(x @ w.T)[m, n]`` where ``route[m, n // G]``, else 0.  x ``[M, K]``, w ``[N, K]``."""
    acc = _acc(x.dtype)
    y = x.to(acc) @ w.to(acc).T
    return torch.where(expand_route(route, G), y, torch.zeros((), dtype=acc, device=y.device)).to(x.dtype)


def swiglu_ref(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, route: torch.Tensor,
               G: int) -> torch.Tensor:
    """Routed SwiGLU (Eq. 3): ``silu(x Wg^T) * (x Wu^T)`` for active groups, else 0, rounded as the model's MLP."""
    acc = _acc(x.dtype)
    xa = x.to(acc)
    gate, up = xa @ w_gate.to(acc).T, xa @ w_up.to(acc).T
    if acc != x.dtype:
        gate, up = gate.to(x.dtype).to(acc), up.to(x.dtype).to(acc)
        y = F.silu(gate).to(x.dtype).to(acc) * up
    else:
        y = F.silu(gate) * up
    return torch.where(expand_route(route, G), y, torch.zeros((), dtype=acc, device=y.device)).to(x.dtype)


def gemm_k_ref(a: torch.Tensor, w: torch.Tensor, route: torch.Tensor, G: int) -> torch.Tensor:
    """Eq. 21, Algorithm 3: ``out[m] = sum over active g of a[m, K_g] @ w[:, K_g].T``.  a ``[M, K]``, w ``[N, K]``."""
    acc = _acc(a.dtype)
    am = torch.where(expand_route(route, G), a.to(acc), torch.zeros((), dtype=acc, device=a.device))
    return (am @ w.to(acc).T).to(a.dtype)


def token_order_ref(mask: torch.Tensor, tile: int = 64) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Shared token order of bool ``[M, N_G]``: ``(perm, keys, union)`` int32, ``perm`` the stable argsort of the
    Gray-code rank of each row's bits ``sum_g mask[m, g] << g``, ``keys`` the sorted bits, ``union`` their OR per
    ``tile`` sorted rows."""
    bits = (mask.to(torch.int64) << torch.arange(mask.shape[-1], device=mask.device)).sum(-1)
    rank = bits.clone()
    for s in (1, 2, 4, 8):
        rank ^= rank >> s
    perm = torch.sort(rank, stable=True).indices
    keys = bits[perm]
    pad = torch.zeros((-keys.numel() % tile,), dtype=keys.dtype, device=keys.device)
    tiles = torch.cat([keys, pad]).view(-1, tile)
    union = torch.zeros(tiles.shape[0], dtype=torch.int64, device=mask.device)
    for j in range(tile):
        union |= tiles[:, j]
    return perm.to(torch.int32), keys.to(torch.int32), union.to(torch.int32)


def o_proj_ref(a: torch.Tensor, w: torch.Tensor, route: torch.Tensor, G: int,
               perm: torch.Tensor | None = None) -> torch.Tensor:
    """The K-axis op in a shared token order (Eq. 21): :func:`gemm_k_ref` of ``a`` (``perm`` given: ``a``'s row j is
    token ``perm[j]``), in token order."""
    if perm is not None:
        a = torch.empty_like(a).index_copy_(0, perm.to(torch.int64), a)
    return gemm_k_ref(a, w, route, G)


def attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, route: torch.Tensor, causal: bool = False,
                  left_pad: torch.Tensor | None = None, scale: float | None = None) -> torch.Tensor:
    """Routed attention (Eq. 2, Algorithm 4), the semantics of :func:`wide.kernels.routed_attention`."""
    B, Hq, Tq, d = q.shape
    Tk = k.shape[2]
    acc = _acc(q.dtype)
    rep = Hq // k.shape[1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    s = (q.to(acc) @ k.to(acc).repeat_interleave(rep, dim=1).transpose(-1, -2)) * scale
    jpos = torch.arange(Tk, device=q.device)
    valid = torch.ones(B, 1, Tq, Tk, dtype=torch.bool, device=q.device)
    if causal:
        valid = valid & (jpos[None, None, None, :] <= (torch.arange(Tq, device=q.device) + Tk - Tq)[:, None])
    if left_pad is not None:
        valid = valid & (jpos[None, None, None, :] >= left_pad.to(q.device).view(B, 1, 1, 1))
    p = torch.nan_to_num(torch.softmax(s.masked_fill(~valid, float("-inf")), dim=-1), nan=0.0)
    o = p @ v.to(acc).repeat_interleave(rep, dim=1)
    o = torch.where(head_route(route, Hq)[..., None], o, torch.zeros((), dtype=acc, device=o.device))
    return o.to(q.dtype)


def router_ref(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor,
               b2: torch.Tensor) -> torch.Tensor:
    """Router mask (Eq. 4-5): ``logit_0 >= logit_1`` of ``(x W1^T + b1) W2^T + b2`` viewed ``[..., N_G, 2]``."""
    acc = torch.promote_types(x.dtype, w1.dtype)
    h = F.linear(F.linear(x.to(acc), w1.to(acc), b1.to(acc)), w2.to(acc), b2.to(acc))
    lg = h.view(*x.shape[:-1], w2.shape[0] // 2, 2)
    return lg[..., 0] >= lg[..., 1]


def add_rmsnorm_ref(h: torch.Tensor, add: torch.Tensor | None, weight: torch.Tensor, eps: float):
    """``h' = h + add`` (model dtype), ``(h', weight * (h' * rsqrt(mean(h'^2) + eps)).to(dtype))``: LlamaRMSNorm."""
    if add is not None:
        h = h + add
    hf = h.to(_acc(h.dtype))
    return h, weight * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype)


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_cache_ref(q, k, v, cos, sin, cache_k, cache_v, slots, want_k: bool):
    """``apply_rotary_pos_emb`` of q and k, the rotated K and V scattered into the cache at ``slots``; as rope_cache."""
    c, s = cos.unsqueeze(2), sin.unsqueeze(2)
    qr = (q * c) + (_rotate_half(q) * s)
    kr = (k * c) + (_rotate_half(k) * s)
    B, T, Hk, d = k.shape
    idx = slots.view(B, 1, T, 1).expand(B, Hk, T, d)
    cache_k[:B].scatter_(2, idx, kr.transpose(1, 2))
    cache_v[:B].scatter_(2, idx, v.transpose(1, 2))
    return qr.contiguous(), (kr.contiguous() if want_k else None)


def masked_swiglu_act_ref(g: torch.Tensor, u: torch.Tensor, route: torch.Tensor, G: int) -> torch.Tensor:
    """``silu(g) * u`` in the model dtype where ``route[m, n // G]``, else 0 (Eq. 3 after dense gate / up GEMMs)."""
    y = F.silu(g) * u
    return torch.where(expand_route(route, G), y, torch.zeros((), dtype=y.dtype, device=y.device))


def zero_skipped_heads_ref(a: torch.Tensor, route: torch.Tensor) -> torch.Tensor:
    """``a [B, H_q, T, d]`` with the heads of every skipped (token, head group) set to 0, in place."""
    return a.masked_fill_(~head_route(route, a.shape[1]).unsqueeze(-1), 0)
