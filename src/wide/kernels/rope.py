"""RoPE of Q and K and the K / V write into the static cache slots in one kernel (``q*cos + rotate_half(q)*sin`` with
each product and sum rounded to the model dtype, as ``apply_rotary_pos_emb`` rounds them).
"""

import torch

from wide.kernels import _common as common
from wide.kernels import reference

if common.HAS_TRITON:
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


def _token_stride(t: torch.Tensor) -> int:
    """Elements between consecutive tokens ``b * T + t`` of a ``[B, T, H, d]`` view with contiguous heads."""
    return t.stride(0) if t.shape[1] == 1 else t.stride(1)


def rope_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               cache_k: torch.Tensor, cache_v: torch.Tensor, slots: torch.Tensor, want_k: bool):
    """RoPE of q ``[B, T, Hq, d]`` and k ``[B, T, Hk, d]`` (views, contiguous heads, evenly strided tokens) with cos /
    sin ``[B, T, d]``, and the rotated K and V written into ``cache_k`` / ``cache_v`` ``[B_c >= B, Hk, T_max, d]`` at
    ``slots`` (int64 ``[B, T]``).  Returns ``(q_rot [B, T, Hq, d], k_rot or None)``.  The engine's fused RoPE:
    arguments are trusted."""
    B, T, Hq, d = q.shape
    Hk = k.shape[2]
    if not common.use_triton(q) or cos.dtype != q.dtype:
        return reference.rope_cache_ref(q, k, v, cos, sin, cache_k, cache_v, slots, want_k)
    sq, sk, sv = _token_stride(q), _token_stride(k), _token_stride(v)
    cos, sin, slots = cos.contiguous(), sin.contiguous(), slots.contiguous()
    qo = torch.empty((B, T, Hq, d), dtype=q.dtype, device=q.device)
    ko = torch.empty((B, T, Hk, d), dtype=q.dtype, device=q.device) if want_k else qo
    NT = B * T
    BT = max(2, min(8 if common.interpret_mode() else 32, common.next_pow2(NT)))  # a block of tokens per program
    _rope_cache_kernel[(triton.cdiv(NT, BT), Hq + 2 * Hk)](
        q, k, v, cos, sin, qo, ko, cache_k, cache_v, slots, NT, T, Hq, Hk, sq, sk, sv, cache_k.stride(0),
        cache_k.stride(1), cache_k.stride(2), cache_v.stride(0), cache_v.stride(1), cache_v.stride(2), HALF=d // 2,
        BT=BT, WRITE_K=want_k,
        # no FMA contraction: a fused bf16 product and sum would round once, not twice as apply_rotary_pos_emb does
        **({} if common.interpret_mode() else {"num_warps": max(1, min(4, BT * d // 512)), "enable_fp_fusion": False}))
    return qo, (ko if want_k else None)
