"""Fused Triton kernels for the engine's *unrouted* ops, so that a decode step is not dominated by tiny kernels.

A Llama decode step in plain PyTorch launches ~45 small kernels per layer outside the GEMMs (RMSNorm: 8,
RoPE: ~10, residual adds, cache scatters, layout copies).  Under a CUDA graph each still costs ~2 µs, which at
batch 1 is comparable to the weight-streaming time the routing saves (paper §4.4's Amdahl analysis: the
non-accelerated part is 29.1 % of decode latency).  Three kernels replace them:

* :func:`add_rmsnorm` — optional residual add + RMSNorm, rounding exactly like the Hugging Face module
  (fp32 statistics, normalised value rounded to the model dtype, then times the weight);
* :func:`rope_cache` — RoPE of Q and K (``q*cos + rotate_half(q)*sin`` with the same per-op rounding as
  ``apply_rotary_pos_emb``) and the K/V write into the static cache slots, in one pass;
* :func:`router_mask` — a WIDE router (Eq. 4, two fp32 GEMMs) and its argmax (Eq. 5), for a few rows
  (decode) or many (prefill).

Two more serve the engine's dense forms of routed ops (cuBLAS / SDPA where the routed kernel would be slower):
:func:`masked_swiglu_act` (the SwiGLU activation with skipped FFN groups written as zeros) and
:func:`zero_skipped_heads_` (skipped head groups of an SDPA output set to zero in place).

Each has a PyTorch reference (``*_ref``) with the same semantics, used on CPU without ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

from wide.kernels._common import (
    HAS_TRITON,
    check_tensor,
    interpret_mode,
    next_pow2,
    pow2_part,
    tile_counters,
    use_triton,
)

if HAS_TRITON:
    import triton
    import triton.language as tl

    from wide.kernels._common import mm, mma, round_to  # noqa: F401

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

    @triton.jit
    def _row_class_logits(w2_ptr, b2_ptr, h1, offs_r, offs_n, nm, R: tl.constexpr):
        # one row's two fp32 class logits per group (execute, skip) from its hidden h1 [R]: W2 is [2 N, R], rows
        # interleaved (execute, skip) per group, b2 [2 N]; groups offs_n, valid where nm
        w_e = tl.load(w2_ptr + (2 * offs_n)[:, None] * R + offs_r[None, :], mask=nm[:, None], other=0.0)
        w_s = tl.load(w2_ptr + (2 * offs_n + 1)[:, None] * R + offs_r[None, :], mask=nm[:, None], other=0.0)
        le = tl.sum(w_e * h1[None, :], axis=1) + tl.load(b2_ptr + 2 * offs_n, mask=nm, other=0.0)
        ls = tl.sum(w_s * h1[None, :], axis=1) + tl.load(b2_ptr + 2 * offs_n + 1, mask=nm, other=0.0)
        return le, ls

    @triton.jit
    def _router_rows_kernel(x_ptr, w1_ptr, b1_ptr, w2_ptr, b2_ptr, out_ptr, D, N, stride_xm,
                            R: tl.constexpr, BD: tl.constexpr, NP: tl.constexpr):
        # the former one-program-per-row router, kept for comparison (decode_probe): one CTA streams all of W1
        row = tl.program_id(0).to(tl.int64)
        offs_r = tl.arange(0, R)
        offs_d = tl.arange(0, BD)
        acc = tl.zeros((R, BD), dtype=tl.float32)
        for d0 in range(0, D, BD):
            dm = (d0 + offs_d) < D
            x = tl.load(x_ptr + row * stride_xm + d0 + offs_d, mask=dm, other=0.0).to(tl.float32)
            w = tl.load(w1_ptr + offs_r[:, None] * D + (d0 + offs_d)[None, :], mask=dm[None, :], other=0.0)
            acc += w * x[None, :]
        h1 = tl.sum(acc, axis=1) + tl.load(b1_ptr + offs_r)  # [R]
        offs_n = tl.arange(0, NP)
        nm = offs_n < N
        le, ls = _row_class_logits(w2_ptr, b2_ptr, h1, offs_r, offs_n, nm, R)
        tl.store(out_ptr + row * N + offs_n, le >= ls, mask=nm)

    @triton.jit
    def _router_finish_kernel(y_ptr, b1_ptr, w2_ptr, b2_ptr, out_ptr, logit_ptr, N,
                              R: tl.constexpr, NP: tl.constexpr, WRITE_LOGITS: tl.constexpr):
        # one program per row: h = (y_hi + y_mid) + y_lo + b1 from the fp32 [rows, 3R] product of x with W1's three
        # bf16 pieces (see _w1_split3), then the two class logits per group with W2, b2 and the argmax
        row = tl.program_id(0).to(tl.int64)
        offs_r = tl.arange(0, R)
        yp = y_ptr + row * (3 * R) + offs_r
        h1 = (tl.load(yp) + tl.load(yp + R)) + tl.load(yp + 2 * R) + tl.load(b1_ptr + offs_r)
        offs_n = tl.arange(0, NP)
        nm = offs_n < N
        le, ls = _row_class_logits(w2_ptr, b2_ptr, h1, offs_r, offs_n, nm, R)
        tl.store(out_ptr + row * N + offs_n, le >= ls, mask=nm)
        if WRITE_LOGITS:
            lp = logit_ptr + (row * N + offs_n) * 2
            tl.store(lp, le, mask=nm)
            tl.store(lp + 1, ls, mask=nm)

    @triton.jit
    def _store_route(out_ptr, logit_ptr, offs_m, offs_n, om, le, ls, N, WRITE_LOGITS: tl.constexpr):
        # the argmax decisions (execute where logit_0 >= logit_1) of rows offs_m x groups offs_n, and with
        # WRITE_LOGITS both fp32 class logits, interleaved as [rows, N, 2]
        tl.store(out_ptr + offs_m[:, None] * N + offs_n[None, :], le >= ls, mask=om)
        if WRITE_LOGITS:
            lp = logit_ptr + (offs_m[:, None] * N + offs_n[None, :]) * 2
            tl.store(lp, le, mask=om)
            tl.store(lp + 1, ls, mask=om)

    @triton.jit
    def _router_kernel(x_ptr, add_ptr, w1_ptr, b1_ptr, w2_ptr, b2_ptr, out_ptr, part_ptr, cnt_ptr, logit_ptr,
                       rows, D, N, stride_xm, stride_am,
                       R: tl.constexpr, RP: tl.constexpr, BDP: tl.constexpr, BDI: tl.constexpr,
                       NP: tl.constexpr, PP: tl.constexpr, ONE_STEP: tl.constexpr, WRITE_LOGITS: tl.constexpr,
                       HAS_ADD: tl.constexpr, DOT: tl.constexpr = False, PC: tl.constexpr = 8,
                       NC: tl.constexpr = 16):
        # HAS_ADD: the router reads x + add rounded to x's dtype (the residual add of add_rmsnorm, so the
        # router can run concurrently with that norm on another stream and still see the same input)
        # Stage 1 (every program): partial h_p = x[:, D_p] @ W1[:, D_p]^T over this program's BDP columns of D,
        # so W1 is streamed by many CTAs at once.  Stage 2 (the program that arrives last, found with an
        # atomic counter): h = sum_p h_p + b1 in a fixed order, the two class logits per group, argmax.
        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        offs_m = tl.arange(0, RP)
        mrow = offs_m < rows
        offs_r = tl.arange(0, R)
        offs_d = tl.arange(0, BDI)
        acc = tl.zeros((RP, R), dtype=tl.float32)
        for i in tl.static_range(BDP // BDI):
            dd = pid * BDP + i * BDI + offs_d
            dm = dd < D
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + dd[None, :], mask=mrow[:, None] & dm[None, :],
                        other=0.0)
            if HAS_ADD:
                a = tl.load(add_ptr + offs_m[:, None] * stride_am + dd[None, :], mask=mrow[:, None] & dm[None, :],
                            other=0.0)
                x = round_to(x.to(tl.float32) + a.to(tl.float32), x_ptr.dtype.element_ty)
            x = x.to(tl.float32)  # [RP, BDI]
            w = tl.load(w1_ptr + offs_r[:, None] * D + dd[None, :], mask=dm[None, :], other=0.0)  # [R, BDI]
            acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
        tl.store(part_ptr + pid * (RP * R) + offs_m[:, None] * R + offs_r[None, :], acc)
        # all threads' partial stores happen-before the (gpu-scope, release) arrival of this CTA
        tl.debug_barrier()
        arrived = tl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu")
        if arrived == nprog - 1:
            offs_p = tl.arange(0, PP)
            pm = offs_p < nprog
            offs_n = tl.arange(0, NP)
            nm = offs_n < N
            b1 = tl.load(b1_ptr + offs_r)
            if DOT:
                # every row at once with fp32 dots (ieee: no TF32), RP >= 16 and R >= 16: h [RP, R] = the sum of
                # the programs' partials in chunks of PC programs (a fixed order), then the class logits of NC
                # groups at a time as [RP, R] x [R, NC] dots, so no [RP, NP, R] product lives in registers
                h = tl.zeros((RP, R), dtype=tl.float32)
                for c in tl.static_range(PP // PC):
                    offs_c = c * PC + tl.arange(0, PC)
                    hp = tl.load(part_ptr + offs_c[:, None, None] * (RP * R) + offs_m[None, :, None] * R
                                 + offs_r[None, None, :], mask=(offs_c < nprog)[:, None, None], other=0.0,
                                 cache_modifier=".cg")  # [PC, RP, R], L2 (written by the other CTAs)
                    h += tl.sum(hp, axis=0)
                h = h + b1[None, :]
                for c in tl.static_range(NP // NC):
                    offs_g = c * NC + tl.arange(0, NC)
                    gm = offs_g < N
                    w_e = tl.load(w2_ptr + (2 * offs_g)[None, :] * R + offs_r[:, None], mask=gm[None, :], other=0.0)
                    w_s = tl.load(w2_ptr + (2 * offs_g + 1)[None, :] * R + offs_r[:, None], mask=gm[None, :],
                                  other=0.0)  # [R, NC]
                    le = tl.dot(h, w_e, input_precision="ieee") + tl.load(b2_ptr + 2 * offs_g, mask=gm,
                                                                          other=0.0)[None, :]
                    ls = tl.dot(h, w_s, input_precision="ieee") + tl.load(b2_ptr + 2 * offs_g + 1, mask=gm,
                                                                          other=0.0)[None, :]
                    _store_route(out_ptr, logit_ptr, offs_m, offs_g, mrow[:, None] & gm[None, :], le, ls, N,
                                 WRITE_LOGITS)
            else:
                # class 0 (execute) and class 1 (skip) logits of group n are rows 2n and 2n+1 of W2
                w_e = tl.load(w2_ptr + (2 * offs_n)[:, None] * R + offs_r[None, :], mask=nm[:, None], other=0.0)
                w_s = tl.load(w2_ptr + (2 * offs_n + 1)[:, None] * R + offs_r[None, :], mask=nm[:, None], other=0.0)
                b_e = tl.load(b2_ptr + 2 * offs_n, mask=nm, other=0.0)
                b_s = tl.load(b2_ptr + 2 * offs_n + 1, mask=nm, other=0.0)
                if ONE_STEP:
                    # every row at once (up to 4 rows): h [RP, R] = the sum over the programs' partials (fixed order),
                    # then both class logits of every group
                    hp = tl.load(part_ptr + offs_p[:, None, None] * (RP * R) + offs_m[None, :, None] * R
                                 + offs_r[None, None, :], mask=pm[:, None, None], other=0.0,
                                 cache_modifier=".cg")  # [PP, RP, R], L2 (written by the other CTAs)
                    h = tl.sum(hp, axis=0) + b1[None, :]  # [RP, R]
                    le = tl.sum(h[:, None, :] * w_e[None, :, :], axis=2) + b_e[None, :]  # [RP, NP]
                    ls = tl.sum(h[:, None, :] * w_s[None, :, :], axis=2) + b_s[None, :]
                    _store_route(out_ptr, logit_ptr, offs_m, offs_n, mrow[:, None] & nm[None, :], le, ls, N,
                                 WRITE_LOGITS)
                else:
                    for m in range(0, rows):  # one row at a time
                        hp = tl.load(part_ptr + offs_p[:, None] * (RP * R) + m * R + offs_r[None, :], mask=pm[:, None],
                                     other=0.0, cache_modifier=".cg")  # [PP, R], L2 (written by the other CTAs)
                        h = tl.sum(hp, axis=0) + b1
                        le = tl.sum(w_e * h[None, :], axis=1) + b_e
                        ls = tl.sum(w_s * h[None, :], axis=1) + b_s
                        tl.store(out_ptr + m * N + offs_n, le >= ls, mask=nm)
                        if WRITE_LOGITS:
                            tl.store(logit_ptr + (m * N + offs_n) * 2, le, mask=nm)
                            tl.store(logit_ptr + (m * N + offs_n) * 2 + 1, ls, mask=nm)
            tl.atomic_xchg(cnt_ptr, 0, sem="relaxed", scope="gpu")  # ready for the next launch (graph replay)


    @triton.jit
    def _router_tile_kernel(x_ptr, w1_ptr, b1_ptr, w2_ptr, b2_ptr, out_ptr, logit_ptr, part_ptr, cnt_ptr, rows, D, N,
                            stride_xm, DS, R: tl.constexpr, BM: tl.constexpr, BD: tl.constexpr, NP: tl.constexpr,
                            WRITE_LOGITS: tl.constexpr, SPLIT3: tl.constexpr, SPLITD: tl.constexpr):
        # Many rows (prefill): program (i, p) owns BM rows and D columns [p * DS, (p + 1) * DS) of x W1^T; with
        # SPLITD = 1 it streams all of W1 (L2-resident).  h = x W1^T + b1 and the two class logits h W2^T + b2,
        # then argmax.  W1 is either fp32 [r, D] (fp32 dots, ``ieee``: no TF32) or, with SPLIT3 (bf16 x), its
        # three bf16 pieces [hi; mid; lo] ([3r, D], :func:`_w1_split3`) on tensor cores: products of bf16 values
        # are exact in fp32, the three fp32 accumulators are summed (hi + mid) + lo as :func:`_router_split3`
        # does.  With SPLITD > 1 (a few hundred rows: BM-row tiles alone leave most SMs idle) each program
        # stores its fp32 partial [BM, r] and the program of a row tile that arrives last (atomic counter per
        # tile, reset by that program) sums the SPLITD partials in split order and finishes the tile.
        pid = tl.program_id(0)
        sp = tl.program_id(1)
        offs_m = pid * BM + tl.arange(0, BM)
        mrow = offs_m < rows
        offs_m64 = offs_m.to(tl.int64)
        offs_r = tl.arange(0, R)
        offs_d = tl.arange(0, BD)
        acc = tl.zeros((BM, R), dtype=tl.float32)
        acc_mid = tl.zeros((BM, R), dtype=tl.float32)
        acc_lo = tl.zeros((BM, R), dtype=tl.float32)
        for d0 in range(sp * DS, tl.minimum(D, sp * DS + DS), BD):
            dd = d0 + offs_d
            dm = dd < D
            x = tl.load(x_ptr + offs_m64[:, None] * stride_xm + dd[None, :], mask=mrow[:, None] & dm[None, :],
                        other=0.0)  # [BM, BD]
            w_ptrs = w1_ptr + offs_r[None, :] * D + dd[:, None]  # [BD, R]
            if SPLIT3:
                acc = mma(x, tl.load(w_ptrs, mask=dm[:, None], other=0.0), acc)
                acc_mid = mma(x, tl.load(w_ptrs + R * D, mask=dm[:, None], other=0.0), acc_mid)
                acc_lo = mma(x, tl.load(w_ptrs + 2 * R * D, mask=dm[:, None], other=0.0), acc_lo)
            else:
                acc = mma(x.to(tl.float32), tl.load(w_ptrs, mask=dm[:, None], other=0.0), acc)
        if SPLIT3:
            acc = (acc + acc_mid) + acc_lo
        if SPLITD == 1:
            _router_tile_finish(acc, offs_m64, mrow, b1_ptr, w2_ptr, b2_ptr, out_ptr, logit_ptr, N, R, NP,
                                WRITE_LOGITS)
        else:
            slot = offs_m64[:, None] * R + offs_r[None, :]  # part [SPLITD, tiles * BM, R]
            size = tl.num_programs(0).to(tl.int64) * (BM * R)
            tl.store(part_ptr + sp * size + slot, acc)
            # all threads' partial stores happen-before the (gpu-scope, release) arrival of this CTA
            tl.debug_barrier()
            arrived = tl.atomic_add(cnt_ptr + pid, 1, sem="acq_rel", scope="gpu")
            if arrived == SPLITD - 1:
                tot = tl.zeros((BM, R), dtype=tl.float32)
                for q in tl.static_range(SPLITD):
                    tot += tl.load(part_ptr + q * size + slot, cache_modifier=".cg")  # L2: other CTAs wrote it
                _router_tile_finish(tot, offs_m64, mrow, b1_ptr, w2_ptr, b2_ptr, out_ptr, logit_ptr, N, R, NP,
                                    WRITE_LOGITS)
                tl.atomic_xchg(cnt_ptr + pid, 0, sem="relaxed", scope="gpu")  # ready for the next launch

    @triton.jit
    def _router_tile_finish(acc, offs_m64, mrow, b1_ptr, w2_ptr, b2_ptr, out_ptr, logit_ptr, N, R: tl.constexpr,
                            NP: tl.constexpr, WRITE_LOGITS: tl.constexpr):
        # h = acc + b1 ([BM, R] fp32), the two class logits per group (fp32 dots) and the argmax of a row tile
        offs_r = tl.arange(0, R)
        h = acc + tl.load(b1_ptr + offs_r)[None, :]
        offs_n = tl.arange(0, NP)
        nm = offs_n < N
        # class 0 (execute) and class 1 (skip) logits of group n are rows 2n and 2n+1 of W2 [2N, R]
        w_e = tl.load(w2_ptr + (2 * offs_n)[None, :] * R + offs_r[:, None], mask=nm[None, :], other=0.0)  # [R, NP]
        w_s = tl.load(w2_ptr + (2 * offs_n + 1)[None, :] * R + offs_r[:, None], mask=nm[None, :], other=0.0)
        le = mm(h, w_e) + tl.load(b2_ptr + 2 * offs_n, mask=nm, other=0.0)[None, :]
        ls = mm(h, w_s) + tl.load(b2_ptr + 2 * offs_n + 1, mask=nm, other=0.0)[None, :]
        om = mrow[:, None] & nm[None, :]
        tl.store(out_ptr + offs_m64[:, None] * N + offs_n[None, :], le >= ls, mask=om)
        if WRITE_LOGITS:
            lp = logit_ptr + (offs_m64[:, None] * N + offs_n[None, :]) * 2
            tl.store(lp, le, mask=om)
            tl.store(lp + 1, ls, mask=om)

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


# ----------------------------------------------------------------------------------------------
# RMSNorm (+ residual add)
# ----------------------------------------------------------------------------------------------


def add_rmsnorm_ref(h: torch.Tensor, add: torch.Tensor | None, weight: torch.Tensor, eps: float):
    """Reference: ``h' = h + add`` (model dtype), ``y = weight * (h' * rsqrt(mean(h'^2) + eps)).to(dtype)``."""
    if add is not None:
        h = h + add
    hf = h.float()
    n = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype)
    return h, weight * n


def add_rmsnorm(h: torch.Tensor, add: torch.Tensor | None, weight: torch.Tensor, eps: float):
    """Optional residual add, then RMSNorm, in one kernel (the Hugging Face ``LlamaRMSNorm`` rounding).

    Args:
        h: residual stream ``[..., D]`` (contiguous), bf16/fp16/fp32.
        add: optional ``[..., D]`` (same dtype) added to ``h`` first (the previous sublayer's output).
        weight: ``[D]`` norm weight, same dtype as ``h``.
        eps: the norm's epsilon.

    Returns:
        ``(h + add, rmsnorm(h + add))``, both ``[..., D]`` in h's dtype (the first is ``h`` itself when
        ``add`` is None).
    """
    if not use_triton(h) or weight.dtype != h.dtype:
        return add_rmsnorm_ref(h, add, weight, eps)
    D = h.shape[-1]
    h = h.contiguous()
    rows = h.numel() // D
    hout = torch.empty_like(h) if add is not None else h
    y = torch.empty_like(h)
    _add_rmsnorm_kernel[(rows,)](h, add.contiguous() if add is not None else h, hout, y, weight, D, float(eps),
                                 HAS_ADD=add is not None, BLOCK=next_pow2(D),
                                 **({} if interpret_mode() else {"num_warps": 8 if D >= 4096 else 4}))
    return hout, y


# ----------------------------------------------------------------------------------------------
# RoPE + KV-cache write
# ----------------------------------------------------------------------------------------------


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_cache_ref(q, k, v, cos, sin, cache_k, cache_v, slots, want_k: bool):
    """Reference of :func:`rope_cache` (``apply_rotary_pos_emb`` then scatter into the cache slots)."""
    c, s = cos.unsqueeze(2), sin.unsqueeze(2)  # [B, T, 1, d]
    qr = (q * c) + (_rotate_half(q) * s)
    kr = (k * c) + (_rotate_half(k) * s)
    B, T, Hk, d = k.shape
    idx = slots.view(B, 1, T, 1).expand(B, Hk, T, d)
    cache_k[:B].scatter_(2, idx, kr.transpose(1, 2))
    cache_v[:B].scatter_(2, idx, v.transpose(1, 2))
    return qr.contiguous(), (kr.contiguous() if want_k else None)


def rope_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               cache_k: torch.Tensor, cache_v: torch.Tensor, slots: torch.Tensor, want_k: bool):
    """RoPE of Q and K and the K/V cache write in one kernel.

    Args:
        q: ``[B, T, Hq, d]``, k/v: ``[B, T, Hk, d]`` (views of the projection outputs: last two dims contiguous).
        cos, sin: ``[B, T, d]`` from the model's rotary module (model dtype).
        cache_k, cache_v: one layer of a :class:`~wide.inference.cache.StaticKVCache`, ``[B_c, Hk, T_max, d]``,
            ``B_c >= B``.
        slots: int64 ``[B, T]`` cache slot of every token.
        want_k: also return the rotated K (prefill attention reads it).

    Returns:
        ``(q_rot [B, T, Hq, d] contiguous, k_rot [B, T, Hk, d] or None)``; the cache rows ``0..B-1`` get the
        rotated K and the V at ``slots``.
    """
    if not use_triton(q) or cos.dtype != q.dtype:
        return rope_cache_ref(q, k, v, cos, sin, cache_k, cache_v, slots, want_k)
    B, T, Hq, d = q.shape
    Hk = k.shape[2]
    def token_stride(t):  # elements between consecutive tokens b * T + t (a size-1 dim's stride is arbitrary)
        assert t.stride(3) == 1 and (t.stride(2) == d or t.shape[2] == 1), "heads must be contiguous [.., H, d]"
        if T == 1:
            return t.stride(0)
        assert B == 1 or t.stride(0) == T * t.stride(1), "tokens must be evenly strided over [B, T]"
        return t.stride(1)

    cos, sin = cos.contiguous(), sin.contiguous()
    qo = torch.empty((B, T, Hq, d), dtype=q.dtype, device=q.device)
    ko = torch.empty((B, T, Hk, d), dtype=q.dtype, device=q.device) if want_k else qo
    slots = slots.contiguous()
    NT = B * T
    # a block of tokens per program: one token per program (the former kernel) ran prefill at 16k tokens at
    # about a quarter of the H200's bandwidth (786k programs of 256 bytes each)
    BT = max(2, min(8 if interpret_mode() else 32, next_pow2(NT)))
    warps = max(1, min(4, BT * d // 512))
    _rope_cache_kernel[(triton.cdiv(NT, BT), Hq + 2 * Hk)](
        q, k, v, cos, sin, qo, ko, cache_k, cache_v, slots, NT, T, Hq, Hk, token_stride(q), token_stride(k),
        token_stride(v), cache_k.stride(0), cache_k.stride(1), cache_k.stride(2), cache_v.stride(0),
        cache_v.stride(1), cache_v.stride(2), HALF=d // 2, BT=BT, WRITE_K=want_k,
        # no FMA contraction: with it the GPU compiler fuses the bf16 product and sum into one fma.rn.bf16 (one
        # rounding instead of apply_rotary_pos_emb's two), so the kernel was not bitwise the model's RoPE
        **({} if interpret_mode() else {"num_warps": warps, "enable_fp_fusion": False}))
    return qo, (ko if want_k else None)


# ----------------------------------------------------------------------------------------------
# router (few rows)
# ----------------------------------------------------------------------------------------------

ROUTER_MAX_ROWS = 32

_ROUTER_WS: dict = {}  # (device, stream, P, RP, R) -> (fp32 partials [P, RP, R], int32 arrival counter [1])


def _router_workspace(device: torch.device, P: int, RP: int, R: int):
    """Partials and the self-resetting arrival counter of :func:`_router_kernel`, one pair per stream.

    The counter is zeroed once here and returned to 0 by the last program of every launch, so no
    memset runs per call (CUDA-graph replays included).  Kernels on one stream run one after the other,
    so one pair per (device, stream, shape) is enough."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (str(device), stream, P, RP, R)
    ws = _ROUTER_WS.get(key)
    if ws is None:
        ws = (torch.empty((P, RP, R), dtype=torch.float32, device=device),
              torch.zeros((1,), dtype=torch.int32, device=device))
        _ROUTER_WS[key] = ws
    return ws


def _router_dot(rows: int, R: int) -> bool:
    """Whether the few-row router's last program finishes the rows with fp32 dots (``DOT``; rows padded to
    16) instead of one row at a time: from 9 rows up with a rank of at least 16 (a dot's smallest size).

    Measured on the H200 (``benchmarks/e2e/decode_probe_h200-router.md``, D = 4096, rank 16, graph replays,
    us, row loop -> dots): attention router (N_G = 8) 10.0 -> 16.2 at 8 rows, 16.9 -> 16.3 at 16, 29.4 -> 29.8
    at 32; FFN router (N_G = 112) 10.6 -> 13.1, 18.4 -> 13.2, 29.2 -> 19.5.  Decode at batch 16 with dots
    (``e2e_h200-quick11``): 0.897x -> 0.943x of dense at s = 0, 0.993x -> 1.049x at s = 0.5."""
    return rows > 8 and R >= 16


def _router_plan(rows: int, D: int, R: int, dot: bool = False, programs: int | None = None):
    """(RP, BDP, BDI, P): padded rows, D columns per program, D columns per inner step, programs.

    ``programs``: about how many programs share W1's D axis (default 64: ~4 KB of fp32 W1 each at D = 4096,
    r = 16).  The last program reads ``P x RP x r`` fp32 partials, 4x more at 16 padded rows than at 4;
    :func:`_router_few` times 32 and 64 programs per shape."""
    RP = max(16 if dot else 2, next_pow2(rows))
    target = programs or (4 if interpret_mode() else 64)
    BDP = max(16, next_pow2(-(-D // target)))
    BDI = max(1, min(BDP, 4096 // (R * RP)))  # keeps the [RP, R, BDI] product at <= 4096 fp32 values
    return RP, BDP, BDI, -(-D // BDP)


def _router_one_step(RP: int, NP: int, R: int) -> bool:
    """Whether the few-row router's last program finishes all ``RP`` (padded) rows in one vectorised step, else
    one row at a time.  From the H200 decode traces of Llama-3.1-8B shapes (norm + router beside it, us;
    ``e2e_h200-quick7_trace.json``: row loop, ``e2e_h200-quick8_trace.json``: one step for up to 4 rows):
    attention router (N_G = 8) 4.2 -> 4.6 at 1 row, 7.2 -> 5.1 at 4 rows; FFN router (N_G = 112) 4.1 -> 5.2 at
    1 row, 6.8 -> 6.8 at 4 rows; at 16 rows vectorised steps of 8 rows made the whole decode step 0.55 ms slower
    (``e2e_h200-quick8``, batch 16).  So one step only for 3-4 rows with a small ``[RP, NP, R]`` product."""
    return RP == 4 and RP * NP * R <= 4096


def _router_launch(router, x2: torch.Tensor, logits: torch.Tensor | None = None,
                   add2: torch.Tensor | None = None, dot: bool | None = None,
                   programs: int | None = None) -> torch.Tensor:
    rows, D = x2.shape
    R = router.w1.out_features
    N = router.n_groups
    dot = _router_dot(rows, R) if dot is None else bool(dot)
    if dot and R < 16:
        raise ValueError(f"router kernel: the dot variant needs a rank >= 16, got {R}")
    RP, BDP, BDI, P = _router_plan(rows, D, R, dot, programs)
    NP = max(16, next_pow2(N))
    part, cnt = _router_workspace(x2.device, P, RP, R)
    out = torch.empty((rows, N), dtype=torch.bool, device=x2.device)
    w1, b1 = router.w1.weight.contiguous(), router.w1.bias.contiguous()
    w2, b2 = router.w2.weight.contiguous(), router.w2.bias.contiguous()
    _router_kernel[(P,)](x2, add2 if add2 is not None else x2, w1, b1, w2, b2, out, part, cnt,
                         logits if logits is not None else part, rows, D, N, x2.stride(0),
                         (add2 if add2 is not None else x2).stride(0), R=R, RP=RP, BDP=BDP, BDI=BDI,
                         NP=NP, PP=max(2, next_pow2(P)), ONE_STEP=_router_one_step(RP, NP, R),
                         WRITE_LOGITS=logits is not None,
                         HAS_ADD=add2 is not None, DOT=dot, PC=min(8, max(2, next_pow2(P))), NC=min(NP, 64),
                         **({} if interpret_mode() else {"num_warps": 4}))
    return out


def _router_mm_launch(router, x2: torch.Tensor, add2: torch.Tensor | None = None,
                      logits: torch.Tensor | None = None) -> torch.Tensor:
    """Few-row router in two launches (bf16 rows): ``x W1^T`` as one fp32-output GEMM against the three bf16
    pieces of W1 (:func:`_w1_split3`: exact products, fp32 accumulation), then one program per row sums the pieces
    ``(hi + mid) + lo``, adds ``b1`` and computes the class logits and the argmax (:func:`_router_finish_kernel`).
    With ``add2`` the residual ``x + add`` is formed first, rounded to bf16 as :func:`add_rmsnorm` does.

    Args:
        router: a :class:`wide.routing.Router` with fp32 weights and a power-of-two rank.
        x2: bf16 ``[rows, D]`` rows (stride 1 along D).
        add2: optional bf16 ``[rows, D]`` pending residual add.
        logits: optional fp32 ``[rows, N_G, 2]`` that receives both class logits.

    Returns:
        bool ``[rows, N_G]``, True = execute (Eq. 4-5).

    Raises:
        ValueError: rows that are not bf16 (the GEMM is exact only for bf16 operands).
    """
    if x2.dtype != torch.bfloat16 or (add2 is not None and add2.dtype != torch.bfloat16):
        raise ValueError(f"router mm path: needs bf16 rows, got {x2.dtype}")
    rows = x2.shape[0]
    R, N = router.w1.out_features, router.n_groups
    x = x2 if add2 is None else torch.add(x2, add2)
    y = _mm_f32(x, _w1_split3(router).t()).contiguous()  # [rows, 3R] fp32
    out = torch.empty((rows, N), dtype=torch.bool, device=x2.device)
    _router_finish_kernel[(rows,)](y, router.w1.bias.contiguous(), router.w2.weight.contiguous(),
                                   router.w2.bias.contiguous(), out, logits if logits is not None else y, N, R=R,
                                   NP=max(16, next_pow2(N)), WRITE_LOGITS=logits is not None,
                                   **({} if interpret_mode() else {"num_warps": 4}))
    return out


def _router_few(router, x2: torch.Tensor, add2: torch.Tensor | None = None) -> torch.Tensor:
    """Few-row (decode) router: :func:`_router_launch` with the finish of the fixed rule (:func:`_router_dot`)
    over 64 or 32 programs along D, the faster timed once per shape on the GPU inside a CUDA graph
    (:func:`pick_config` with ``graph=True``, cached).  The first candidate (64 programs) runs where nothing is
    timed (the CPU interpreter, ``WIDE_AUTOTUNE=0``, a first capture).

    Why these two: the last program reads ``P x RP x r`` fp32 partials (64 KB at 16 padded rows, 64 programs,
    rank 16).  On the H200 (``benchmarks/e2e/decode_probe_h200-router2.md``, D = 4096, rank 16, us) 32 programs
    ran the attention router (N_G = 8) in 16.0 vs 16.6 at 16 rows and 22.3 vs 29.9 at 32, but the FFN router
    (N_G = 112) in 17.2 vs 13.5 and 24.8 vs 19.5; 16 programs and the other finish were slower at every point,
    so they are not timed (each candidate is one more compile on a process's first run).  For bf16 rows a third
    candidate is the two-launch form :func:`_router_mm_launch` (a cuBLAS GEMM on tensor cores, then one small
    kernel; plus the residual add when ``add2`` is given), which has no arrival counter and no serial sum of
    partials (not yet timed on the GPU when written: the tuner decides)."""
    from wide.kernels._common import pick_config

    rows, D = x2.shape
    R = router.w1.out_features
    dot = _router_dot(rows, R)
    cands = [dict(dot=dot, programs=None), dict(dot=dot, programs=32)]  # None: 64 (4 under the interpreter)
    if x2.dtype == torch.bfloat16 and (add2 is None or add2.dtype == torch.bfloat16):
        cands.append(dict(impl="mm"))
    res = {}

    def run(cfg):
        if cfg.get("impl") == "mm":
            res["out"] = _router_mm_launch(router, x2, add2)
        else:
            res["out"] = _router_launch(router, x2, add2=add2, dot=cfg["dot"], programs=cfg["programs"])

    key = (rows, D, R, router.n_groups, str(x2.dtype), add2 is not None)
    cfg = pick_config("router_few", key, x2.device, cands, run, graph=True)
    run(cfg)
    return res["out"]


def _router_ok(router, x: torch.Tensor) -> bool:
    """Whether a kernel computes this router: the few-row kernel (rows <= ROUTER_MAX_ROWS, power-of-two
    rank) or the tile kernel (more rows, power-of-two rank >= 16, the smallest fp32 dot)."""
    rows = x.numel() // x.shape[-1]
    r = router.w1.out_features
    ok = (use_triton(x) and r >= 1 and not r & (r - 1)
          and router.w1.weight.dtype == torch.float32 and router.w2.weight.dtype == torch.float32)
    return ok and (rows <= ROUTER_MAX_ROWS or r >= 16)


def _router_tile_launch(router, x2: torch.Tensor, logits: torch.Tensor | None = None, BM: int = 64,
                        num_warps: int = 4, split3: bool = False, splitd: int = 1) -> torch.Tensor:
    """The many-row tile kernel: ``BM`` rows per program; ``split3`` (bf16 x only) runs ``x W1^T`` on tensor
    cores against the three bf16 pieces of W1 (:func:`_w1_split3`) instead of as an fp32 dot; ``splitd > 1``
    also splits D over that many programs per row tile (fp32 partials summed in split order by the tile's last
    program)."""
    rows, D = x2.shape
    N = router.n_groups
    R = router.w1.out_features
    out = torch.empty((rows, N), dtype=torch.bool, device=x2.device)
    BM = 16 if interpret_mode() else BM
    BD = 32 if interpret_mode() else 64
    if split3 and x2.dtype != torch.bfloat16:
        raise ValueError(f"router tile kernel: split3 needs bf16 rows, got {x2.dtype}")
    splitd = max(1, min(int(splitd), triton.cdiv(D, BD)))
    DS = triton.cdiv(triton.cdiv(D, splitd), BD) * BD  # D columns per split, a multiple of BD
    splitd = triton.cdiv(D, DS)  # every split has columns
    tiles = triton.cdiv(rows, BM)
    w1 = _w1_split3(router) if split3 else router.w1.weight.contiguous()
    b1 = router.w1.bias.contiguous()
    w2, b2 = router.w2.weight.contiguous(), router.w2.bias.contiguous()
    if splitd > 1:
        part = torch.empty((splitd, tiles * BM, R), dtype=torch.float32, device=x2.device)
        cnt = tile_counters(x2.device, tiles)
    else:
        part = cnt = b2  # unused
    _router_tile_kernel[(tiles, splitd)](
        x2, w1, b1, w2, b2, out, logits if logits is not None else b2, part, cnt, rows, D, N, x2.stride(0), DS,
        R=R, BM=BM, BD=BD, NP=max(16, next_pow2(N)), WRITE_LOGITS=logits is not None, SPLIT3=split3,
        SPLITD=splitd, **({} if interpret_mode() else {"num_warps": num_warps}))
    return out


_W1_SPLIT = weakref.WeakKeyDictionary()  # router -> ((version, data_ptr), bf16 [3r, D])


def _w1_split3(router) -> torch.Tensor:
    """W1 (fp32) as three bf16 pieces ``[hi; mid; lo]`` (``[3r, D]``) whose sum is W1 exactly: bf16 keeps fp32's
    exponent range and 8 of its 24 significand bits, so three pieces hold all of them.  Cached per router and
    rebuilt when the weight changes."""
    w = router.w1.weight
    tag = (w._version, w.data_ptr())
    hit = _W1_SPLIT.get(router)
    if hit is None or hit[0] != tag:
        with torch.no_grad():
            hi = w.to(torch.bfloat16)
            r1 = w - hi.float()
            mid = r1.to(torch.bfloat16)
            lo = (r1 - mid.float()).to(torch.bfloat16)
            hit = (tag, torch.cat([hi, mid, lo]).contiguous())
        _W1_SPLIT[router] = hit
    return hit[1]


def _mm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` of bf16 operands with an fp32 result from fp32 accumulation (products of bf16 values are exact
    in fp32): cuBLAS with ``out_dtype`` on CUDA; the same arithmetic in fp32 elsewhere."""
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


def _router_split3(router, x2: torch.Tensor) -> torch.Tensor:
    """Many-row router on tensor cores: ``x W1^T`` as one bf16 GEMM against the three-piece split of W1
    (:func:`_w1_split3`, fp32 result) summed ``(hi + mid) + lo``, then ``+ b1``, the fp32 ``W2`` GEMM and the
    argmax.  x must be bf16 (exact in the GEMM); the result equals the fp32 router up to summation order."""
    r = router.w1.out_features
    y = _mm_f32(x2, _w1_split3(router).t())  # [rows, 3r] fp32
    h = (y[:, :r] + y[:, r:2 * r]) + y[:, 2 * r:] + router.w1.bias
    lg = torch.addmm(router.w2.bias, h, router.w2.weight.t()).view(x2.shape[0], router.n_groups, 2)
    return lg[..., 0] >= lg[..., 1]


def _router_many(router, x2: torch.Tensor) -> torch.Tensor:
    """Many-row (prefill) router: the fastest of the tile kernel (fp32 dots, or for bf16 input tensor-core dots
    against the split W1; two tile shapes, four up to 8192 rows), the split-W1 cuBLAS GEMM (bf16 input) and the
    module itself, timed once per shape on the GPU (:func:`pick_config`, cached)."""
    from wide.kernels._common import m_bucket, pick_config
    from wide.routing import argmax_mask

    rows, D = x2.shape
    # (BM, num_warps); up to a few thousand rows, 64-row tiles alone leave most SMs idle
    bms = [(64, 4), (128, 8)] + ([(16, 4), (32, 4)] if rows <= 8192 else [])
    if x2.dtype == torch.bfloat16 and x2.is_cuda:
        # the fp32-dot tile kernel is left out for bf16 rows: on the H200 it ran 2-8x slower than the tensor-core
        # one at every tile shape and row count probed (benchmarks/e2e/prefill_probe_h200.md)
        cands = [dict(impl="tile3", BM=bm, num_warps=w) for bm, w in bms] + [dict(impl="split3")]
        if rows <= 4096:  # 8-32 row tiles of 64 rows at 512-2048 rows: split D too (~20 us a router unsplit)
            cands += [dict(impl="tile3", BM=bm, num_warps=4, splitd=sd) for bm, sd in ((64, 4), (64, 8), (32, 8))]
    else:
        cands = [dict(impl="tile", BM=bm, num_warps=w) for bm, w in bms]
    cands.append(dict(impl="module"))
    res = {}

    def run(cfg):
        if cfg["impl"] in ("tile", "tile3"):
            res["out"] = _router_tile_launch(router, x2, BM=cfg["BM"], num_warps=cfg["num_warps"],
                                             split3=cfg["impl"] == "tile3", splitd=cfg.get("splitd", 1))
        elif cfg["impl"] == "split3":
            res["out"] = _router_split3(router, x2)
        else:
            res["out"] = argmax_mask(router(x2))

    key = (m_bucket(rows), D, router.w1.out_features, router.n_groups, str(x2.dtype))
    cfg = pick_config("router_rows", key, x2.device, cands, run)
    run(cfg)
    return res["out"]


def _as_rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def router_mask(router, x: torch.Tensor, add: torch.Tensor | None = None) -> torch.Tensor:
    """Argmax routing mask (Eq. 4-5) of a :class:`wide.routing.Router`.

    Args:
        router: a :class:`wide.routing.Router` (fp32 ``W1 [r, D]``, ``b1 [r]``, ``W2 [2 N_G, r]``, ``b2 [2 N_G]``).
        x: ``[..., D]`` residual stream, bf16/fp16/fp32, on the router's device.
        add: optional ``[..., D]`` of x's shape and dtype: the router reads ``x + add`` rounded to x's dtype,
            exactly the residual stream :func:`add_rmsnorm` writes (on the few-row kernel path the add happens
            inside the kernel, so the engine can run the router concurrently with that norm).

    Returns:
        bool ``[..., N_G]``, True = execute (``logit_0 >= logit_1``, ties execute, as
        :func:`wide.routing.argmax_mask`).

    With up to :data:`ROUTER_MAX_ROWS` rows on the Triton path (CUDA, or CPU under ``TRITON_INTERPRET=1``)
    and a power-of-two rank it is one kernel launch, CUDA-graph capturable (no host sync, fixed shapes):
    32 or 64 programs each compute ``x[:, D_p] W1[:, D_p]^T`` over their slice of D (so W1 is read by
    many SMs at once), and the program that arrives last (atomic counter, reset by that program) sums the
    partials in a fixed order, adds ``b1``, computes the two fp32 class logits per group with ``W2, b2``
    (one row at a time, or with fp32 dots over all rows) and writes the argmax; the program count (64 or 32),
    and for bf16 rows a two-launch form (a GEMM against W1's three bf16 pieces, then a finish kernel), are
    timed once per shape on the GPU (:func:`_router_few`).  With more rows (prefill) and a power-of-two rank
    >= 16 it is the fastest on this GPU (timed once per shape, cached like the kernels' tile configs) of: a tile kernel whose programs own 16
    to 128 rows, read them once in the model dtype (no fp32 copy of ``x``) and compute both GEMMs and the
    argmax in one launch, ``x W1^T`` either as an fp32 dot or, for bf16 ``x``, on tensor cores against W1
    split into three bf16 pieces that sum to it exactly (fp32 accumulation of exact products); the same
    split as one cuBLAS GEMM followed by PyTorch ops; and the module itself.  Otherwise the router
    module and :func:`wide.routing.argmax_mask` run (the reference).  All compute in fp32; the summation order
    differs, so a decision can differ only where the two logits tie to fp32 rounding.  Concurrent calls on
    different CUDA streams use separate workspaces; calls on one stream are serialised by the stream.

    Raises:
        ValueError: ``x.shape[-1] != D`` on the kernel path (the reference path raises torch's
            ``RuntimeError`` from the linear layer instead); ``add`` of another shape, dtype or device than x.
    """
    from wide.routing import argmax_mask

    if add is not None and not isinstance(add, torch.Tensor):
        raise ValueError(f"router_mask: add must be a tensor of x's shape {tuple(x.shape)}, got {type(add).__name__}")
    if add is not None and (add.shape != x.shape or add.dtype != x.dtype or add.device != x.device):
        raise ValueError(f"router_mask: add is {tuple(add.shape)} {add.dtype} on {add.device}; x is "
                         f"{tuple(x.shape)} {x.dtype} on {x.device}")
    few = x.numel() // max(1, x.shape[-1]) <= ROUTER_MAX_ROWS
    if add is not None and not (few and _router_ok(router, x)):
        x, add = (x.float() + add.float()).to(x.dtype), None  # the residual add, rounded as add_rmsnorm does
    if not _router_ok(router, x):
        return argmax_mask(router(x))
    if x.shape[-1] != router.w1.in_features:
        raise ValueError(f"router_mask: x has {x.shape[-1]} features, the router reads {router.w1.in_features}")
    x2 = _as_rows(x)
    if x2.shape[0] <= ROUTER_MAX_ROWS:
        out = _router_few(router, x2, _as_rows(add) if add is not None else None)
    else:
        out = _router_many(router, x2)
    return out.view(*x.shape[:-1], router.n_groups)


def _router_logits(router, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Test hook: ``(mask, fp32 logits [..., N_G, 2])`` computed by :func:`router_mask`'s kernel."""
    x2 = _as_rows(x)
    logits = torch.empty((x2.shape[0], router.n_groups, 2), dtype=torch.float32, device=x.device)
    launch = _router_launch if x2.shape[0] <= ROUTER_MAX_ROWS else _router_tile_launch
    out = launch(router, x2, logits)
    return out.view(*x.shape[:-1], router.n_groups), logits.view(*x.shape[:-1], router.n_groups, 2)


def _router_mask_rowwise(router, x: torch.Tensor) -> torch.Tensor:
    """The former kernel (one program per row streams all of W1), kept for ``benchmarks/e2e/decode_probe.py``."""
    x2 = _as_rows(x)
    rows, D = x2.shape
    N = router.n_groups
    out = torch.empty((rows, N), dtype=torch.bool, device=x.device)
    _router_rows_kernel[(rows,)](x2, router.w1.weight, router.w1.bias, router.w2.weight, router.w2.bias, out, D,
                                 N, x2.stride(0), R=router.w1.out_features, BD=min(256, next_pow2(D)),
                                 NP=max(16, next_pow2(N)), **({} if interpret_mode() else {"num_warps": 4}))
    return out.view(*x.shape[:-1], N)


# ----------------------------------------------------------------------------------------------
# Masked SwiGLU activation (the dense-GEMM form of the routed FFN)
# ----------------------------------------------------------------------------------------------


def zero_skipped_heads_ref(a: torch.Tensor, route: torch.Tensor) -> torch.Tensor:
    """Reference of :func:`zero_skipped_heads_`: ``a.masked_fill_(~head_route(route), 0)``, in place."""
    from wide.kernels.reference import head_route

    return a.masked_fill_(~head_route(route, a.shape[1]).unsqueeze(-1), 0)


def zero_skipped_heads_(a: torch.Tensor, route: torch.Tensor) -> torch.Tensor:
    """Zero, in place, the attention output of every (token, head group) the route skips (Algorithm 4's output
    for a skipped group): the engine's ``attn="dense"`` / ``"auto"`` form, where SDPA computed every head and
    the O projection then runs as a dense GEMM on this output.

    One kernel that writes only the skipped groups' bytes (a kept group's stores are masked off), instead of
    expanding the route to heads and a full read-modify-write of ``a``: with everything executed (s = 0) it
    reads only the routes.

    Args:
        a: ``[B, H_q, T, d]`` attention output, bf16/fp16/fp32, any strides (SDPA returns a transposed view).
        route: bool ``[B, T, N_G]``, True = execute; ``N_G`` divides ``H_q`` (``H_q / N_G`` consecutive query
            heads per group, Eq. 2).

    Returns:
        ``a`` itself.

    Raises:
        ValueError: ``a`` or ``route`` not a tensor, ``a`` not 4-D float or requiring grad, ``route`` not bool
            ``[B, T, N_G]`` with ``N_G`` dividing ``H_q``, or the two on different devices.
    """
    check_tensor("a", a)
    check_tensor("route", route)
    if a.requires_grad:
        raise ValueError("zero_skipped_heads_: a requires grad; it is written in place (inference only: call it "
                         "under torch.no_grad() on a tensor that does not require grad)")
    if a.dim() != 4 or a.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError("zero_skipped_heads_: a must be a 4-D [B, H_q, T, d] bf16/fp16/fp32 tensor; got "
                         f"{a.dtype} {tuple(a.shape)}")
    B, H, T, D = a.shape
    if (route.dtype != torch.bool or route.dim() != 3 or tuple(route.shape[:2]) != (B, T) or route.shape[2] < 1
            or H % route.shape[2]):
        raise ValueError(f"zero_skipped_heads_: route must be bool [B, T, N_G] = [{B}, {T}, N_G] with N_G dividing "
                         f"H_q={H}; got {route.dtype} {tuple(route.shape)}")
    if route.device != a.device:
        raise ValueError(f"zero_skipped_heads_: a is on {a.device}, route on {route.device}")
    if not use_triton(a):
        return zero_skipped_heads_ref(a, route)
    NG = route.shape[2]
    route = route.contiguous()
    BC = next_pow2(H // NG * D)
    BT = max(1, min(16, 8192 // BC)) if not interpret_mode() else 2
    _zero_skipped_heads_kernel[(triton.cdiv(T, BT), B)](
        a, route, T, NG, a.stride(0), a.stride(1), a.stride(2), a.stride(3), HPG=H // NG, DH=D, BC=BC, BT=BT,
        **({} if interpret_mode() else {"num_warps": 4}))
    return a


def masked_swiglu_act_ref(g: torch.Tensor, u: torch.Tensor, route: torch.Tensor, G: int) -> torch.Tensor:
    """Reference of :func:`masked_swiglu_act`: ``(silu(g) * u)`` in the model dtype (the MLP's own ops), times
    the route expanded to channels."""
    from wide.kernels.reference import expand_route

    y = F.silu(g) * u
    return torch.where(expand_route(route, G), y, torch.zeros((), dtype=y.dtype, device=y.device))


def masked_swiglu_act(g: torch.Tensor, u: torch.Tensor, route: torch.Tensor, G: int) -> torch.Tensor:
    """``silu(g) * u`` where ``route[m, n // G]``, else 0: the SwiGLU activation of the routed FFN (Eq. 3)
    when gate and up ran as dense GEMMs (the engine's ``naxis="dense"`` / ``"auto"`` form).

    One elementwise pass, instead of the model's two (``act_fn(gate) * up``) plus a mask multiply; the
    rounding is the MLP's (SiLU and the product each rounded to the model dtype).  Skipped groups read no
    ``g``/``u`` bytes and are written as exact zeros, so ``down_proj`` may run as a dense GEMM.

    Args:
        g, u: ``[M, N]`` gate and up projections (contiguous), bf16/fp16/fp32, same dtype and device.
        route: bool ``[M, N // G]`` (True = execute), contiguous.
        G: FFN group size (channels per group), dividing N.

    Returns:
        ``[M, N]`` in g's dtype.

    Raises:
        ValueError: inputs that are not tensors, or shapes, dtypes or G that do not fit together.
    """
    for name, t in (("g", g), ("u", u), ("route", route)):
        check_tensor(name, t)
    if g.shape != u.shape or g.dim() != 2 or g.dtype != u.dtype:
        raise ValueError(f"masked_swiglu_act: g {tuple(g.shape)} {g.dtype} and u {tuple(u.shape)} {u.dtype} must be "
                         f"equal 2-D shapes and dtypes")
    if g.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"masked_swiglu_act: dtype {g.dtype}; allowed: bfloat16, float16, float32")
    M, N = g.shape
    if isinstance(G, bool) or not isinstance(G, int) or G < 1 or N % G:
        raise ValueError(f"masked_swiglu_act: G={G!r} must be a positive int dividing N={N}")
    if route.dtype != torch.bool or tuple(route.shape) != (M, N // G):
        raise ValueError(f"masked_swiglu_act: route must be bool [M, N // G] = [{M}, {N // G}]; got {route.dtype} "
                         f"{tuple(route.shape)}")
    if not (g.device == u.device == route.device):
        raise ValueError(f"masked_swiglu_act: g, u and route must be on one device; got {g.device}, {u.device}, "
                         f"{route.device}")
    if not use_triton(g):
        return masked_swiglu_act_ref(g, u, route, G)
    g, u, route = g.contiguous(), u.contiguous(), route.contiguous()
    out = torch.empty_like(g)
    BN = min(pow2_part(G), 16 if interpret_mode() else 256)  # divides G: each tile lies in one group
    BM = max(1, (256 if interpret_mode() else 4096) // BN)
    _masked_swiglu_kernel[(triton.cdiv(M, BM), N // BN)](
        g, u, route, out, M, N, N // G, G, BN=BN, BM=BM, **({} if interpret_mode() else {"num_warps": 4}))
    return out
