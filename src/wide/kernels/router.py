"""Router mask (paper Eq. 4-5): ``logits = (x W1^T + b1) W2^T + b2`` as ``[..., N_G, 2]``, execute group g where
``logit_0 >= logit_1``, in fp32, with the router's weights as plain tensors.

* Few rows (decode, up to the tuned ``max_rows``): one launch; each of 32 or 64 programs computes
  ``x[:, D_p] W1[:, D_p]^T`` over its slice of D (W1 is streamed by many SMs), and the program that arrives last
  (atomic counter, reset by it) sums the partials in a fixed order and finishes every row (one at a time, in one step,
  or with fp32 dots).  For bf16 rows a two-launch form is also timed: a cuBLAS GEMM against W1 split into three bf16
  pieces that sum to it exactly (products of bf16 values are exact in fp32), then a finish kernel.
* Many rows (prefill, power-of-two rank >= 16): the fastest, timed once per shape, of a tile kernel (BM rows per
  program, fp32 dots or tensor-core dots against the three pieces, D optionally split over programs), the split-W1
  cuBLAS GEMM with PyTorch ops, and the reference.

The summation order differs from the reference, so a decision can differ only where the two logits tie to fp32
rounding.
"""

from __future__ import annotations

import torch
import torch.utils.weak

from wide.kernels import reference
from wide.kernels._common import (
    FLOAT_DTYPES,
    HAS_TRITON,
    check_same_device,
    check_tensor,
    fail,
    interpret_mode,
    m_bucket,
    next_pow2,
    pick_config,
    tile_counters,
    tuned_config,
    use_triton,
    warps,
)

if HAS_TRITON:
    import triton
    import triton.language as tl

    from wide.kernels._common import mm, mma, round_to

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


_WS: dict = {}  # (device, stream, P, RP, R) -> (fp32 partials [P, RP, R], int32 arrival counter [1])


def _workspace(device: torch.device, P: int, RP: int, R: int):
    """Partials and the self-resetting arrival counter of the few-row kernel, one pair per stream and shape."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (str(device), stream, P, RP, R)
    if key not in _WS:
        _WS[key] = (torch.empty((P, RP, R), dtype=torch.float32, device=device),
                    torch.zeros((1,), dtype=torch.int32, device=device))
    return _WS[key]


def _dot(rows: int, R: int, device) -> bool:
    """Whether the few-row kernel's last program finishes the rows with fp32 dots (rows padded to 16): from the tuned
    ``dot_min_rows`` rows with a rank of at least 16 (a dot's smallest size)."""
    return rows >= tuned_config(device)["router"]["dot_min_rows"] and R >= 16


def _launch(x2, W, logits=None, add2=None, dot: bool = False, programs: int | None = None) -> torch.Tensor:
    """The few-row kernel over about ``programs`` programs along D (default 64; 4 under the interpreter)."""
    w1, b1, w2, b2 = W
    (rows, D), R, N = x2.shape, w1.shape[0], w2.shape[0] // 2
    RP = max(16 if dot else 2, next_pow2(rows))
    BDP = max(16, next_pow2(-(-D // (programs or (4 if interpret_mode() else 64)))))
    BDI = max(1, min(BDP, 4096 // (R * RP)))  # keeps the [RP, R, BDI] product at <= 4096 fp32 values
    P = -(-D // BDP)
    NP = max(16, next_pow2(N))
    part, cnt = _workspace(x2.device, P, RP, R)
    out = torch.empty((rows, N), dtype=torch.bool, device=x2.device)
    a2 = x2 if add2 is None else add2
    # the last program finishes all rows in one vectorised step only for 3-4 rows with a small [RP, NP, R] product
    _router_kernel[(P,)](x2, a2, w1, b1, w2, b2, out, part, cnt, part if logits is None else logits, rows, D, N,
                         x2.stride(0), a2.stride(0), R=R, RP=RP, BDP=BDP, BDI=BDI, NP=NP, PP=max(2, next_pow2(P)),
                         ONE_STEP=RP == 4 and RP * NP * R <= 4096, WRITE_LOGITS=logits is not None,
                         HAS_ADD=add2 is not None, DOT=dot, PC=min(8, max(2, next_pow2(P))), NC=min(NP, 64),
                         **warps(4))
    return out


_SPLIT3 = torch.utils.weak.WeakTensorKeyDictionary()  # w1 -> ((version, data_ptr), bf16 [3r, D])


def _w1_split3(w1: torch.Tensor) -> torch.Tensor:
    """fp32 W1 as three bf16 pieces ``[hi; mid; lo]`` (``[3r, D]``) summing to it exactly (bf16 keeps fp32's exponent
    range and 8 of its 24 significand bits); cached per tensor and rebuilt when it changes."""
    tag = (w1._version, w1.data_ptr())
    hit = _SPLIT3.get(w1)
    if hit is None or hit[0] != tag:
        with torch.no_grad():
            hi = w1.to(torch.bfloat16)
            r1 = w1 - hi.float()
            mid = r1.to(torch.bfloat16)
            hit = _SPLIT3[w1] = (tag, torch.cat([hi, mid, (r1 - mid.float()).to(torch.bfloat16)]).contiguous())
    return hit[1]


def _mm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` of bf16 operands with fp32 accumulation and result (cuBLAS ``out_dtype`` on CUDA)."""
    return torch.mm(a, b, out_dtype=torch.float32) if a.is_cuda else a.float() @ b.float()


def _mm_launch(x2, W, add2=None, logits=None) -> torch.Tensor:
    """Few bf16 rows in two launches: ``x W1^T`` against W1's three pieces (fp32 result), then one program per row
    sums them ``(hi + mid) + lo``, adds b1 and computes the logits and the argmax.  ``add2``: added first."""
    w1, b1, w2, b2 = W
    R, N = w1.shape[0], w2.shape[0] // 2
    y = _mm_f32(x2 if add2 is None else torch.add(x2, add2), _w1_split3(w1).t()).contiguous()  # [rows, 3R]
    out = torch.empty((x2.shape[0], N), dtype=torch.bool, device=x2.device)
    _router_finish_kernel[(x2.shape[0],)](y, b1, w2, b2, out, y if logits is None else logits, N, R=R,
                                          NP=max(16, next_pow2(N)), WRITE_LOGITS=logits is not None, **warps(4))
    return out


def _few(x2, W, add2=None) -> torch.Tensor:
    """Few rows: the kernel over 64 or 32 programs along D (the finish by :func:`_dot`), and for bf16 rows the
    two-launch form, the fastest timed once per shape in a CUDA graph."""
    rows, D = x2.shape
    R = W[0].shape[0]
    dot = _dot(rows, R, x2.device)
    cands = [dict(dot=dot, programs=None), dict(dot=dot, programs=32)]
    if x2.dtype == torch.bfloat16:
        cands.append(dict(impl="mm"))
    res = {}

    def run(cfg):
        res["out"] = (_mm_launch(x2, W, add2) if cfg.get("impl") == "mm"
                      else _launch(x2, W, add2=add2, dot=cfg["dot"], programs=cfg["programs"]))

    run(pick_config("router_few", (rows, D, R, W[2].shape[0] // 2, str(x2.dtype), add2 is not None), x2.device, cands,
                    run, graph=True))
    return res["out"]


def _tile_launch(x2, W, logits=None, BM: int = 64, num_warps: int = 4, split3: bool = False,
                 splitd: int = 1) -> torch.Tensor:
    """The many-row tile kernel: BM rows per program; ``split3`` (bf16 rows): ``x W1^T`` on tensor cores against W1's
    three pieces; ``splitd > 1``: D split over that many programs per row tile, summed by the last to arrive."""
    w1, b1, w2, b2 = W
    (rows, D), R, N = x2.shape, w1.shape[0], w2.shape[0] // 2
    out = torch.empty((rows, N), dtype=torch.bool, device=x2.device)
    BM, BD = (16, 32) if interpret_mode() else (BM, 64)
    DS = triton.cdiv(triton.cdiv(D, max(1, min(int(splitd), triton.cdiv(D, BD)))), BD) * BD  # D columns per split
    splitd = triton.cdiv(D, DS)
    tiles = triton.cdiv(rows, BM)
    part = torch.empty((splitd, tiles * BM, R), dtype=torch.float32, device=x2.device) if splitd > 1 else b2
    cnt = tile_counters(x2.device, tiles) if splitd > 1 else b2
    _router_tile_kernel[(tiles, splitd)](
        x2, _w1_split3(w1) if split3 else w1, b1, w2, b2, out, b2 if logits is None else logits, part, cnt, rows, D, N,
        x2.stride(0), DS, R=R, BM=BM, BD=BD, NP=max(16, next_pow2(N)), WRITE_LOGITS=logits is not None,
        SPLIT3=split3, SPLITD=splitd, **warps(num_warps))
    return out


def _split3(x2, W) -> torch.Tensor:
    """Many bf16 rows on tensor cores: one cuBLAS GEMM against W1's three pieces, then b1, W2 and the argmax."""
    w1, b1, w2, b2 = W
    r = w1.shape[0]
    y = _mm_f32(x2, _w1_split3(w1).t())
    lg = torch.addmm(b2, (y[:, :r] + y[:, r:2 * r]) + y[:, 2 * r:] + b1, w2.t()).view(x2.shape[0], -1, 2)
    return lg[..., 0] >= lg[..., 1]


def _many(x2, W) -> torch.Tensor:
    """Many rows: the fastest of the tile kernel (fp32 dots, or for bf16 rows tensor-core dots against W1's pieces;
    several tile shapes), the split-W1 GEMM and the reference, timed once per shape."""
    rows, D = x2.shape
    bms = [(64, 4), (128, 8)] + ([(16, 4), (32, 4)] if rows <= 8192 else [])
    if x2.dtype == torch.bfloat16 and x2.is_cuda:
        cands = [dict(impl="tile3", BM=bm, num_warps=w) for bm, w in bms] + [dict(impl="split3")]
        if rows <= 4096:
            cands += [dict(impl="tile3", BM=bm, num_warps=4, splitd=sd) for bm, sd in ((64, 4), (64, 8), (32, 8))]
    else:
        cands = [dict(impl="tile", BM=bm, num_warps=w) for bm, w in bms]
    cands.append(dict(impl="reference"))
    res = {}

    def run(cfg):
        if cfg["impl"] in ("tile", "tile3"):
            res["out"] = _tile_launch(x2, W, BM=cfg["BM"], num_warps=cfg["num_warps"], split3=cfg["impl"] == "tile3",
                                      splitd=cfg.get("splitd", 1))
        else:
            res["out"] = _split3(x2, W) if cfg["impl"] == "split3" else reference.router_ref(x2, *W)

    run(pick_config("router_rows", (m_bucket(rows), D, W[0].shape[0], W[2].shape[0] // 2, str(x2.dtype)), x2.device,
                    cands, run))
    return res["out"]


def _as_rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def router_mask(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor, b2: torch.Tensor, *,
                add: torch.Tensor | None = None) -> torch.Tensor:
    """Argmax routing mask of a router (Eq. 4-5): bool ``[..., N_G]``, True = execute (``logit_0 >= logit_1``).

    x ``[..., D]`` bf16/fp16/fp32; ``w1 [r, D]``, ``b1 [r]``, ``w2 [2 N_G, r]`` (rows 2g and 2g+1: the execute and skip
    logits of group g), ``b2 [2 N_G]``, on x's device; the kernels run for fp32 weights and a power-of-two rank (with
    more than ``max_rows`` rows, at least 16), the reference otherwise.  ``add``: x's shape and dtype; the router reads
    ``x + add`` rounded to x's dtype (on the few-row kernel inside the kernel).

    Raises:
        KernelArgumentError: tensors of the wrong kind, shapes that do not fit together, or different devices.
    """
    check_tensor("x", x, None, FLOAT_DTYPES)
    for name, t, nd in (("w1", w1, 2), ("b1", b1, 1), ("w2", w2, 2), ("b2", b2, 1)):
        check_tensor(name, t, nd, FLOAT_DTYPES)
    R, D = w1.shape
    if x.dim() == 0 or x.shape[-1] != D:
        fail(f"router_mask: x has {x.shape[-1] if x.dim() else 0} features, the router reads {D}")
    if b1.shape[0] != R or w2.shape[1] != R or w2.shape[0] % 2 or tuple(b2.shape) != (w2.shape[0],):
        fail(f"router_mask: the weights must be w1 [r, D], b1 [r], w2 [2 N_G, r], b2 [2 N_G]; got {tuple(w1.shape)}, "
             f"{tuple(b1.shape)}, {tuple(w2.shape)}, {tuple(b2.shape)}")
    if add is not None:
        check_tensor("add", add)
        if add.shape != x.shape or add.dtype != x.dtype or add.device != x.device:
            fail(f"router_mask: add is {tuple(add.shape)} {add.dtype} on {add.device}; x is {tuple(x.shape)} {x.dtype} "
                 f"on {x.device}")
    check_same_device(x=x, w1=w1, b1=b1, w2=w2, b2=b2)
    N = w2.shape[0] // 2
    few = x.numel() // max(1, D) <= tuned_config(x.device)["router"]["max_rows"]
    ok = (use_triton(x) and R >= 1 and not R & (R - 1) and all(t.dtype == torch.float32 for t in (w1, b1, w2, b2))
          and (few or R >= 16))
    if add is not None and not (few and ok):
        x, add = (x.float() + add.float()).to(x.dtype), None  # the residual add, rounded as add_rmsnorm does
    if not ok:
        return reference.router_ref(x, w1, b1, w2, b2)
    W = tuple(t.contiguous() for t in (w1, b1, w2, b2))
    x2 = _as_rows(x)
    out = _few(x2, W, None if add is None else _as_rows(add)) if few else _many(x2, W)
    return out.view(*x.shape[:-1], N)
