"""Router mask (paper Eq. 4-5): logits ``(x W1^T + b1) W2^T + b2`` as ``[..., N_G, 2]`` in fp32; execute group g
where ``logit_0 >= logit_1``.  Few rows (decode): one launch whose programs each take a slice of D (W1 streamed by
many SMs), the last to arrive finishing every row; for bf16 rows also a cuBLAS GEMM against W1 split into three bf16
pieces that sum to it exactly, then a finish kernel.  Many rows (prefill): a tile kernel (fp32 dots, or tensor-core
dots against the three pieces; D optionally split), the split-W1 GEMM or the reference, the fastest timed once per
shape.  Decisions differ from the reference only where the two logits tie to fp32 rounding.
"""

import torch
import torch.utils.weak

from wide.kernels import _common as common
from wide.kernels import reference

if common.HAS_TRITON:
    import triton
    import triton.language as tl

    from wide.kernels._common import mma, round_to

    @triton.jit
    def _row_class_logits(w2_ptr, b2_ptr, h1, offs_r, offs_n, nm, R: tl.constexpr):
        # one row's class logits (execute, skip) of groups offs_n from its hidden h1 [R]; rows 2g, 2g+1 of W2 [2N, R]
        w_e = tl.load(w2_ptr + (2 * offs_n)[:, None] * R + offs_r[None, :], mask=nm[:, None], other=0.0)
        w_s = tl.load(w2_ptr + (2 * offs_n + 1)[:, None] * R + offs_r[None, :], mask=nm[:, None], other=0.0)
        le = tl.sum(w_e * h1[None, :], axis=1) + tl.load(b2_ptr + 2 * offs_n, mask=nm, other=0.0)
        ls = tl.sum(w_s * h1[None, :], axis=1) + tl.load(b2_ptr + 2 * offs_n + 1, mask=nm, other=0.0)
        return le, ls

    @triton.jit
    def _router_finish_kernel(y_ptr, b1_ptr, w2_ptr, b2_ptr, out_ptr, logit_ptr, N,
                              R: tl.constexpr, NP: tl.constexpr, WRITE_LOGITS: tl.constexpr):
        # one program per row: h = (y_hi + y_mid) + y_lo + b1 from x times W1's three pieces [rows, 3R], then argmax
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
        # the decisions of rows offs_m x groups offs_n, and with WRITE_LOGITS both logits as [rows, N, 2]
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
        # every program: h_p = x[:, D_p] @ W1[:, D_p]^T over its BDP columns (HAS_ADD: x + add rounded to x's dtype);
        # the last to arrive (atomic counter): h = sum_p h_p + b1 in a fixed order, the class logits, the argmax
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
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + dd[None, :], mask=mrow[:, None] & dm[None, :], other=0.0)
            if HAS_ADD:
                a = tl.load(add_ptr + offs_m[:, None] * stride_am + dd[None, :], mask=mrow[:, None] & dm[None, :],
                            other=0.0)
                x = round_to(x.to(tl.float32) + a.to(tl.float32), x_ptr.dtype.element_ty)
            x = x.to(tl.float32)  # [RP, BDI]
            w = tl.load(w1_ptr + offs_r[:, None] * D + dd[None, :], mask=dm[None, :], other=0.0)  # [R, BDI]
            acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
        tl.store(part_ptr + pid * (RP * R) + offs_m[:, None] * R + offs_r[None, :], acc)
        tl.debug_barrier()  # every thread's partial store happens before this CTA's (release) arrival
        if tl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu") == nprog - 1:
            offs_p = tl.arange(0, PP)
            pm = offs_p < nprog
            offs_n = tl.arange(0, NP)
            nm = offs_n < N
            b1 = tl.load(b1_ptr + offs_r)
            if DOT:
                # every row with fp32 dots (RP, R >= 16): partials summed PC programs at a time, logits NC groups at
                # a time, so no [RP, NP, R] product lives in registers
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
                w_e = tl.load(w2_ptr + (2 * offs_n)[:, None] * R + offs_r[None, :], mask=nm[:, None], other=0.0)
                w_s = tl.load(w2_ptr + (2 * offs_n + 1)[:, None] * R + offs_r[None, :], mask=nm[:, None], other=0.0)
                b_e = tl.load(b2_ptr + 2 * offs_n, mask=nm, other=0.0)
                b_s = tl.load(b2_ptr + 2 * offs_n + 1, mask=nm, other=0.0)
                if ONE_STEP:
                    # every row in one step (up to 4 rows)
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
        # program (i, p): BM rows and D columns [p * DS, (p + 1) * DS) of x W1^T, W1 fp32 (fp32 dots) or with SPLIT3
        # its three bf16 pieces [3r, D] (tensor cores; exact products, accumulators summed (hi + mid) + lo).  With
        # SPLITD > 1 the last program of a row tile to arrive sums the fp32 partials in split order and finishes it
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
            _router_tile_finish(acc, offs_m64, mrow, b1_ptr, w2_ptr, b2_ptr, out_ptr, logit_ptr, N, R, NP, WRITE_LOGITS)
        else:
            slot = offs_m64[:, None] * R + offs_r[None, :]  # part [SPLITD, tiles * BM, R]
            size = tl.num_programs(0).to(tl.int64) * (BM * R)
            tl.store(part_ptr + sp * size + slot, acc)
            tl.debug_barrier()
            if tl.atomic_add(cnt_ptr + pid, 1, sem="acq_rel", scope="gpu") == SPLITD - 1:
                tot = tl.zeros((BM, R), dtype=tl.float32)
                for q in tl.static_range(SPLITD):
                    tot += tl.load(part_ptr + q * size + slot, cache_modifier=".cg")  # L2: other CTAs wrote it
                _router_tile_finish(tot, offs_m64, mrow, b1_ptr, w2_ptr, b2_ptr, out_ptr, logit_ptr, N, R, NP,
                                    WRITE_LOGITS)
                tl.atomic_xchg(cnt_ptr + pid, 0, sem="relaxed", scope="gpu")  # ready for the next launch

    @triton.jit
    def _router_tile_finish(acc, offs_m64, mrow, b1_ptr, w2_ptr, b2_ptr, out_ptr, logit_ptr, N, R: tl.constexpr,
                            NP: tl.constexpr, WRITE_LOGITS: tl.constexpr):
        # h = acc + b1, the class logits (fp32 dots) and the argmax of a row tile
        offs_r = tl.arange(0, R)
        h = acc + tl.load(b1_ptr + offs_r)[None, :]
        offs_n = tl.arange(0, NP)
        nm = offs_n < N
        w_e = tl.load(w2_ptr + (2 * offs_n)[None, :] * R + offs_r[:, None], mask=nm[None, :], other=0.0)  # [R, NP]
        w_s = tl.load(w2_ptr + (2 * offs_n + 1)[None, :] * R + offs_r[:, None], mask=nm[None, :], other=0.0)
        le = mma(h, w_e, None) + tl.load(b2_ptr + 2 * offs_n, mask=nm, other=0.0)[None, :]
        ls = mma(h, w_s, None) + tl.load(b2_ptr + 2 * offs_n + 1, mask=nm, other=0.0)[None, :]
        _store_route(out_ptr, logit_ptr, offs_m64, offs_n, mrow[:, None] & nm[None, :], le, ls, N, WRITE_LOGITS)


def _launch(x2, W, logits=None, add2=None, dot: bool = False, programs: int | None = None) -> torch.Tensor:
    """The few-row kernel over about ``programs`` programs along D (default 64; 4 under the interpreter)."""
    w1, b1, w2, b2 = W
    (rows, D), R, N = x2.shape, w1.shape[0], w2.shape[0] // 2
    RP = max(16 if dot else 2, common.next_pow2(rows))
    BDP = max(16, common.next_pow2(-(-D // (programs or (4 if common.interpret_mode() else 64)))))
    BDI = max(1, min(BDP, 4096 // (R * RP)))  # keeps the [RP, R, BDI] product at <= 4096 fp32 values
    P = -(-D // BDP)
    NP, PP = max(16, common.next_pow2(N)), common.next_pow2(P)
    part = torch.empty((P, RP, R), dtype=torch.float32, device=x2.device)
    cnt = common.tile_counters(x2.device, 1)
    out = torch.empty((rows, N), dtype=torch.bool, device=x2.device)
    a2 = x2 if add2 is None else add2
    # the last program finishes all rows in one vectorised step only for 3-4 rows with a small [RP, NP, R] product
    _router_kernel[(P,)](x2, a2, w1, b1, w2, b2, out, part, cnt, part if logits is None else logits, rows, D, N,
                         x2.stride(0), a2.stride(0), R=R, RP=RP, BDP=BDP, BDI=BDI, NP=NP, PP=max(2, PP),
                         ONE_STEP=RP == 4 and RP * NP * R <= 4096, WRITE_LOGITS=logits is not None,
                         HAS_ADD=add2 is not None, DOT=dot, PC=min(8, max(2, PP)), NC=min(NP, 64),
                         **common.warps(4))
    return out


_SPLIT3 = torch.utils.weak.WeakTensorKeyDictionary()  # w1 -> ((version, data_ptr), bf16 [3r, D])


def _w1_split3(w1: torch.Tensor) -> torch.Tensor:
    """fp32 W1 as three bf16 pieces ``[hi; mid; lo]`` summing to it exactly; cached, rebuilt on change."""
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
    """bf16 rows in two launches: a GEMM against W1's three pieces, then a finish kernel per row."""
    w1, b1, w2, b2 = W
    R, N = w1.shape[0], w2.shape[0] // 2
    y = _mm_f32(x2 if add2 is None else torch.add(x2, add2), _w1_split3(w1).t()).contiguous()  # [rows, 3R]
    out = torch.empty((x2.shape[0], N), dtype=torch.bool, device=x2.device)
    _router_finish_kernel[(x2.shape[0],)](y, b1, w2, b2, out, y if logits is None else logits, N, R=R,
                                          NP=max(16, common.next_pow2(N)), WRITE_LOGITS=logits is not None,
                                          **common.warps(4))
    return out


def _few(x2, W, add2=None) -> torch.Tensor:
    """Few rows: the one-launch kernel over 64 or 32 programs, or for bf16 the two-launch form (tuned)."""
    rows, D = x2.shape
    R = W[0].shape[0]
    dot = rows >= common.tuned_config(x2.device)["router"]["dot_min_rows"] and R >= 16
    cands = [dict(dot=dot, programs=None), dict(dot=dot, programs=32)]
    if x2.dtype == torch.bfloat16:
        cands.append(dict(impl="mm"))
    res = {}

    def run(cfg):
        res["out"] = (_mm_launch(x2, W, add2) if cfg.get("impl") == "mm"
                      else _launch(x2, W, add2=add2, dot=cfg["dot"], programs=cfg["programs"]))

    key = (rows, D, R, W[2].shape[0] // 2, str(x2.dtype), add2 is not None)
    run(common.pick_config("router_few", key, x2.device, cands, run, graph=True))
    return res["out"]


def _tile_launch(x2, W, logits=None, BM: int = 64, num_warps: int = 4, split3: bool = False,
                 splitd: int = 1) -> torch.Tensor:
    """The tile kernel: BM rows a program, ``split3``: tensor cores on W1's pieces, D split ``splitd`` ways."""
    w1, b1, w2, b2 = W
    (rows, D), R, N = x2.shape, w1.shape[0], w2.shape[0] // 2
    out = torch.empty((rows, N), dtype=torch.bool, device=x2.device)
    BM, BD = (16, 32) if common.interpret_mode() else (BM, 64)
    DS = triton.cdiv(triton.cdiv(D, max(1, min(int(splitd), triton.cdiv(D, BD)))), BD) * BD  # D columns per split
    splitd = triton.cdiv(D, DS)
    tiles = triton.cdiv(rows, BM)
    part = torch.empty((splitd, tiles * BM, R), dtype=torch.float32, device=x2.device) if splitd > 1 else b2
    cnt = common.tile_counters(x2.device, tiles) if splitd > 1 else b2
    _router_tile_kernel[(tiles, splitd)](
        x2, _w1_split3(w1) if split3 else w1, b1, w2, b2, out, b2 if logits is None else logits, part, cnt, rows, D, N,
        x2.stride(0), DS, R=R, BM=BM, BD=BD, NP=max(16, common.next_pow2(N)), WRITE_LOGITS=logits is not None,
        SPLIT3=split3, SPLITD=splitd, **common.warps(num_warps))
    return out


def _many(x2, W) -> torch.Tensor:
    """Many rows: the tile kernel (several shapes), the two-launch form or the reference (tuned)."""
    rows, D = x2.shape
    bms = [(64, 4), (128, 8)] + ([(16, 4), (32, 4)] if rows <= 8192 else [])
    if x2.dtype == torch.bfloat16 and x2.is_cuda:
        cands = [dict(impl="tile3", BM=bm, num_warps=w) for bm, w in bms] + [dict(impl="mm")]
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
            res["out"] = _mm_launch(x2, W) if cfg["impl"] == "mm" else reference.router_ref(x2, *W)

    key = (common.m_bucket(rows), D, W[0].shape[0], W[2].shape[0] // 2, str(x2.dtype))
    run(common.pick_config("router_rows", key, x2.device, cands, run))
    return res["out"]


def _as_rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def router_mask(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor, b2: torch.Tensor, *,
                add: torch.Tensor | None = None) -> torch.Tensor:
    """Argmax routing mask of a router (Eq. 4-5): bool ``[..., N_G]``, True = execute (``logit_0 >= logit_1``).

    x ``[..., D]`` bf16/fp16/fp32; ``w1 [r, D]``, ``b1 [r]``, ``w2 [2 N_G, r]`` (rows 2g, 2g+1: group g's execute and
    skip logits), ``b2 [2 N_G]``; the kernels run for fp32 weights and a power-of-two rank, the reference otherwise.
    ``add``: x's shape and dtype, the router reads ``x + add`` rounded to x's dtype.  Raises KernelArgumentError:
    tensors of the wrong kind, shapes that do not fit together, or different devices.
    """
    common.check_tensor("x", x, None, common.FLOAT_DTYPES)
    for name, t, nd in (("w1", w1, 2), ("b1", b1, 1), ("w2", w2, 2), ("b2", b2, 1)):
        common.check_tensor(name, t, nd, common.FLOAT_DTYPES)
    R, D = w1.shape
    if x.dim() == 0 or x.shape[-1] != D:
        common.fail(f"router_mask: x has {x.shape[-1] if x.dim() else 0} features, the router reads {D}")
    if b1.shape[0] != R or w2.shape[1] != R or w2.shape[0] % 2 or tuple(b2.shape) != (w2.shape[0],):
        common.fail(f"router_mask: the weights must be w1 [r, D], b1 [r], w2 [2 N_G, r], b2 [2 N_G]; got "
                    f"{tuple(w1.shape)}, {tuple(b1.shape)}, {tuple(w2.shape)}, {tuple(b2.shape)}")
    if add is not None:
        common.check_tensor("add", add)
        if add.shape != x.shape or add.dtype != x.dtype or add.device != x.device:
            common.fail(f"router_mask: add is {tuple(add.shape)} {add.dtype} on {add.device}; x is {tuple(x.shape)} "
                        f"{x.dtype} on {x.device}")
    common.check_same_device(x=x, w1=w1, b1=b1, w2=w2, b2=b2)
    N = w2.shape[0] // 2
    few = x.numel() // max(1, D) <= common.tuned_config(x.device)["router"]["max_rows"]
    fp32 = all(t.dtype == torch.float32 for t in (w1, b1, w2, b2))
    ok = common.use_triton(x) and R >= 1 and not R & (R - 1) and fp32 and (few or R >= 16)
    if add is not None and not (few and ok):
        x, add = (x.float() + add.float()).to(x.dtype), None  # the residual add, rounded as add_rmsnorm does
    if not ok:
        return reference.router_ref(x, w1, b1, w2, b2)
    W = tuple(t.contiguous() for t in (w1, b1, w2, b2))
    x2 = _as_rows(x)
    out = _few(x2, W, None if add is None else _as_rows(add)) if few else _many(x2, W)
    return out.view(*x.shape[:-1], N)
