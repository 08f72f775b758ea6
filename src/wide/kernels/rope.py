"""RoPE of Q and K and the K / V write into the static cache slots in one kernel (``q*cos + rotate_half(q)*sin`` with
each product and sum rounded to the model dtype, as ``apply_rotary_pos_emb`` rounds them).
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
    next_pow2,
    use_triton,
)

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _rope_cache_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, qo_ptr, ko_ptr, ck_ptr, cv_ptr, slot_ptr,
                           NT, T, Hq, Hk, sqm, skm, svm, sck_b, sck_h, sck_t, scv_b, scv_h, scv_t,
                           HALF: tl.constexpr, BT: tl.constexpr, WRITE_K: tl.constexpr):
        # grid (token blocks of BT, Hq + 2 Hk heads): a program moves one head of BT tokens as [BT, HALF] tiles
        bt = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)  # tokens b*T + t
        tm = bt < NT
        head = tl.program_id(1)
        b = bt // T
        offs = tl.arange(0, HALF)[None, :]
        m2 = tm[:, None]
        slot = tl.load(slot_ptr + bt, mask=tm, other=0)[:, None]
        if head < Hq + Hk:
            if head < Hq:
                src = q_ptr + bt[:, None] * sqm + head * (2 * HALF)
            else:
                src = k_ptr + bt[:, None] * skm + (head - Hq) * (2 * HALF)
            x1 = tl.load(src + offs, mask=m2)
            x2 = tl.load(src + HALF + offs, mask=m2)
            cs = bt[:, None] * (2 * HALF) + offs
            c1 = tl.load(cos_ptr + cs, mask=m2)
            c2 = tl.load(cos_ptr + cs + HALF, mask=m2)
            s1 = tl.load(sin_ptr + cs, mask=m2)
            s2 = tl.load(sin_ptr + cs + HALF, mask=m2)
            dt = x1.dtype
            # apply_rotary_pos_emb: (x * cos) + (rotate_half(x) * sin), each op rounded to the model dtype
            o1 = ((x1.to(tl.float32) * c1.to(tl.float32)).to(dt).to(tl.float32)
                  + (-x2.to(tl.float32) * s1.to(tl.float32)).to(dt).to(tl.float32)).to(dt)
            o2 = ((x2.to(tl.float32) * c2.to(tl.float32)).to(dt).to(tl.float32)
                  + (x1.to(tl.float32) * s2.to(tl.float32)).to(dt).to(tl.float32)).to(dt)
            if head < Hq:
                dst = qo_ptr + bt[:, None] * (Hq * 2 * HALF) + head * (2 * HALF) + offs
                tl.store(dst, o1, mask=m2)
                tl.store(dst + HALF, o2, mask=m2)
            else:
                hk = head - Hq
                dst = ck_ptr + b[:, None] * sck_b + hk * sck_h + slot * sck_t + offs
                tl.store(dst, o1, mask=m2)
                tl.store(dst + HALF, o2, mask=m2)
                if WRITE_K:
                    dk = ko_ptr + bt[:, None] * (Hk * 2 * HALF) + hk * (2 * HALF) + offs
                    tl.store(dk, o1, mask=m2)
                    tl.store(dk + HALF, o2, mask=m2)
        else:
            hv = head - Hq - Hk
            vsrc = v_ptr + bt[:, None] * svm + hv * (2 * HALF) + offs
            vdst = cv_ptr + b[:, None] * scv_b + hv * scv_h + slot * scv_t + offs
            tl.store(vdst, tl.load(vsrc, mask=m2), mask=m2)
            tl.store(vdst + HALF, tl.load(vsrc + HALF, mask=m2), mask=m2)


def _token_stride(t: torch.Tensor, name: str) -> int:
    """Elements between consecutive tokens ``b * T + t`` of a ``[B, T, H, d]`` view whose heads are contiguous."""
    B, T, H, d = t.shape
    if t.stride(3) != 1 or (t.stride(2) != d and H > 1) or (T > 1 and B > 1 and t.stride(0) != T * t.stride(1)):
        fail(f"rope_cache: {name} must be a [B, T, H, d] view with contiguous heads and evenly strided tokens; got "
             f"strides {t.stride()}")
    return t.stride(0) if T == 1 else t.stride(1)


def rope_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               cache_k: torch.Tensor, cache_v: torch.Tensor, slots: torch.Tensor, want_k: bool):
    """RoPE of q and k, and the rotated K and the V written into ``cache_k`` / ``cache_v`` at ``slots``.

    q ``[B, T, Hq, d]``, k / v ``[B, T, Hk, d]`` (views of the projection outputs: contiguous heads), cos / sin
    ``[B, T, d]`` (q's dtype for the kernel, else the reference runs), cache_k / cache_v one layer of the static cache
    ``[B_c >= B, Hk, T_max, d]``, slots int64 ``[B, T]``.  Returns ``(q_rot [B, T, Hq, d] contiguous, k_rot or None)``.

    Raises:
        KernelArgumentError: tensors of the wrong kind, shapes or layouts that do not fit, or different devices.
    """
    for name, t in (("q", q), ("k", k), ("v", v), ("cache_k", cache_k), ("cache_v", cache_v)):
        check_tensor(name, t, 4, FLOAT_DTYPES)
    check_tensor("slots", slots, 2, (torch.int64,))
    B, T, Hq, d = q.shape
    Hk = k.shape[2]
    if (k.shape != v.shape or k.shape[:2] != (B, T) or k.shape[3] != d or d % 2 or cos.shape != (B, T, d)
            or sin.shape != cos.shape or slots.shape != (B, T) or cache_k.shape != cache_v.shape
            or cache_k.shape[0] < B or cache_k.shape[1] != Hk or cache_k.shape[3] != d):
        fail(f"rope_cache: shapes do not fit: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, cos / sin "
             f"{tuple(cos.shape)} / {tuple(sin.shape)}, cache {tuple(cache_k.shape)}, slots {tuple(slots.shape)}")
    check_same_device(q=q, k=k, v=v, cos=cos, sin=sin, cache_k=cache_k, cache_v=cache_v, slots=slots)
    if not use_triton(q) or cos.dtype != q.dtype:
        return reference.rope_cache_ref(q, k, v, cos, sin, cache_k, cache_v, slots, want_k)
    sq, sk, sv = _token_stride(q, "q"), _token_stride(k, "k"), _token_stride(v, "v")
    cos, sin, slots = cos.contiguous(), sin.contiguous(), slots.contiguous()
    qo = torch.empty((B, T, Hq, d), dtype=q.dtype, device=q.device)
    ko = torch.empty((B, T, Hk, d), dtype=q.dtype, device=q.device) if want_k else qo
    NT = B * T
    BT = max(2, min(8 if interpret_mode() else 32, next_pow2(NT)))  # a block of tokens per program
    _rope_cache_kernel[(triton.cdiv(NT, BT), Hq + 2 * Hk)](
        q, k, v, cos, sin, qo, ko, cache_k, cache_v, slots, NT, T, Hq, Hk, sq, sk, sv, cache_k.stride(0),
        cache_k.stride(1), cache_k.stride(2), cache_v.stride(0), cache_v.stride(1), cache_v.stride(2), HALF=d // 2,
        BT=BT, WRITE_K=want_k,
        # no FMA contraction: a fused bf16 product and sum would round once, not twice as apply_rotary_pos_emb does
        **({} if interpret_mode() else {"num_warps": max(1, min(4, BT * d // 512)), "enable_fp_fusion": False}))
    return qo, (ko if want_k else None)
