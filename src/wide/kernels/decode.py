"""Decode paths (M = 1..4 rows): routed GEMV for GEMM-MN, GEMM-K and fused SwiGLU (paper Appendix B:
GEMV variants dispatched for M <= 4; for decoding, mask reordering is bypassed and routing is checked
directly at the block level).  The split-KV decode attention is :mod:`wide.kernels.decode_attn`.

All kernels read the route directly (no reorder).  A group no row executes moves no weight bytes,
which is the whole cost of a GEMV: GEMV-MN predicates the weight loads of an N tile by "any of the
M rows executes this group" (or, in its split variant, maps a dense-sized grid onto the compacted
list of active N tiles x K splits); GEMV-K compacts the active groups on the device and streams only
their weight tiles, split over many programs.  Outputs of inactive (row, group) pairs are written as 0.
"""

from __future__ import annotations

import torch

from wide.kernels import reference
from wide.kernels._common import (
    HAS_TRITON,
    check_out,
    fail,
    interpret_mode,
    launch_opts,
    next_pow2,
    pick_config,
    pow2_part,
    tile_counters,
    use_triton,
)

if HAS_TRITON:
    import triton
    import triton.language as tl

    from wide.kernels._common import mm, mma, swiglu_act  # noqa: F401

    @triton.jit
    def _tail_shift(n0, N1, N2, OFF2, OFF3, stride_wn):
        """int64 element shift from ``w_ptr + n * stride_wn`` to the row of output column ``n`` (in the tile
        starting at ``n0``): 0 for the routed rows (< N1), else into the first (OFF2) or second (OFF3) tail
        weight, given as element offsets from ``w_ptr``."""
        return tl.where(n0 < N1, 0, tl.where(n0 < N1 + N2, OFF2 - N1.to(tl.int64) * stride_wn,
                                             OFF3 - (N1 + N2).to(tl.int64) * stride_wn)).to(tl.int64)

    @triton.jit
    def _gemv_mn_kernel(x_ptr, w_ptr, w2_ptr, out_ptr, route_ptr, M, N, K, NG,
                        stride_xm, stride_wn, stride_om, G, N1, N2, OFF2, OFF3,
                        BN: tl.constexpr, BK: tl.constexpr, SWIGLU: tl.constexpr, EVEN_K: tl.constexpr):
        # rows are padded to 16 for the tensor-core dot; padded rows load nothing.  Columns >= N1 are the
        # always-executed tail (NG = N1 // G routed groups): rows N1..N1+N2-1 of the weight live at element
        # offset OFF2 from w_ptr, the rest at OFF3 (a tile lies in one segment: BN divides G, G divides N1, N2)
        pid = tl.program_id(0)
        offs_n = pid * BN + tl.arange(0, BN)
        nmask = offs_n < N
        offs_m = tl.arange(0, 16)
        mmask = offs_m < M
        shift = _tail_shift(pid * BN, N1, N2, OFF2, OFF3, stride_wn)
        r = tl.load(route_ptr + offs_m[:, None] * NG + (offs_n // G)[None, :],
                    mask=mmask[:, None] & (nmask & (offs_n < N1))[None, :], other=0) != 0  # [16, BN]
        r = r | (mmask[:, None] & (nmask & (offs_n >= N1))[None, :])
        colact = (tl.max(r.to(tl.int32), axis=0) != 0) & nmask  # [BN]: some row executes this column
        o_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
        if tl.max(colact.to(tl.int32), axis=0) == 0:
            tl.store(o_ptrs, tl.zeros((16, BN), dtype=out_ptr.dtype.element_ty),
                     mask=mmask[:, None] & nmask[None, :])
        else:
            offs_k = tl.arange(0, BK)
            acc = tl.zeros((16, BN), dtype=tl.float32)
            if SWIGLU:
                acc2 = tl.zeros((16, BN), dtype=tl.float32)
            w_ptrs = w_ptr + shift + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
            w2_ptrs = w2_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
            x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
            for k0 in range(0, K, BK):
                if EVEN_K:
                    wt = tl.load(w_ptrs, mask=colact[:, None], other=0.0)
                    xt = tl.load(x_ptrs, mask=mmask[:, None], other=0.0)
                else:
                    km = (k0 + offs_k) < K
                    wt = tl.load(w_ptrs, mask=colact[:, None] & km[None, :], other=0.0)
                    xt = tl.load(x_ptrs, mask=mmask[:, None] & km[None, :], other=0.0)
                acc = mma(xt, tl.trans(wt), acc)
                if SWIGLU:
                    if EVEN_K:
                        w2t = tl.load(w2_ptrs, mask=colact[:, None], other=0.0)
                    else:
                        w2t = tl.load(w2_ptrs, mask=colact[:, None] & km[None, :], other=0.0)
                    acc2 = mma(xt, tl.trans(w2t), acc2)
                    w2_ptrs += BK
                w_ptrs += BK
                x_ptrs += BK
            if SWIGLU:
                acc = swiglu_act(acc, acc2, out_ptr.dtype.element_ty)
            res = tl.where(r, acc, 0.0).to(out_ptr.dtype.element_ty)
            tl.store(o_ptrs, res, mask=mmask[:, None] & nmask[None, :])

    @triton.jit
    def _route_union(route_ptr, M, NG, offs_g, gmask, NGP: tl.constexpr):
        """int32 ``[NGP]``: 1 where some of the M rows of bool ``route [M, NG]`` executes group g, else 0."""
        act = tl.zeros((NGP,), dtype=tl.int32)
        for m in range(0, M):
            act = tl.maximum(act, (tl.load(route_ptr + m * NG + offs_g, mask=gmask, other=0) != 0).to(tl.int32))
        return act

    @triton.jit
    def _route_union_tail(route_ptr, M, NR, NG, offs_g, NGP: tl.constexpr):
        """:func:`_route_union` of ``route [M, NR]`` over ``NG >= NR`` groups; groups ``NR..NG-1`` (the
        always-executed tail) are 1."""
        act = _route_union(route_ptr, M, NR, offs_g, offs_g < NR, NGP)
        return tl.where((offs_g >= NR) & (offs_g < NG), 1, act)

    @triton.jit
    def _chunk_loads(x_rows, w_rows, k0, mmask, offs_k, K, EVEN_K: tl.constexpr):
        """The ``[16, BK]`` rows of x (padded rows 0) and the ``[BN, BK]`` weight tile at K offset k0 (columns past
        K read as 0 unless EVEN_K)."""
        if EVEN_K:
            xt = tl.load(x_rows + k0, mask=mmask[:, None], other=0.0)
            wt = tl.load(w_rows + k0)
        else:
            km = (k0 + offs_k) < K
            xt = tl.load(x_rows + k0, mask=mmask[:, None] & km[None, :], other=0.0)
            wt = tl.load(w_rows + k0, mask=km[None, :], other=0.0)
        return xt, wt

    @triton.jit
    def _group_flags(route_ptr, M, NR, NG, NGP: tl.constexpr):
        """``(offs_g, act, inact, n_act)`` of the decode GEMM-MN kernels: group indices ``[NGP]``, int32 flags of
        the groups some of the M rows executes (:func:`_route_union_tail`, tail groups NR..NG-1 active), of the
        others (0 past NG), and the number of active groups."""
        offs_g = tl.arange(0, NGP)
        act = _route_union_tail(route_ptr, M, NR, NG, offs_g, NGP)
        inact = tl.where(offs_g < NG, 1 - act, 0)
        return offs_g, act, inact, tl.sum(act, axis=0)

    @triton.jit
    def _gemv_mn_split_kernel(x_ptr, w_ptr, w2_ptr, out_ptr, part_ptr, cnt_ptr, route_ptr, M, K, NG, PROGS,
                              stride_xm, stride_wn, stride_om, NR, N1, N2, OFF2, OFF3,
                              G: tl.constexpr, BN: tl.constexpr,
                              BK: tl.constexpr, NGP: tl.constexpr, SMAX: tl.constexpr, SWIGLU: tl.constexpr,
                              EVEN_K: tl.constexpr):
        # 1-D grid of PROGS = (N / BN) * SPLIT programs, sized for the dense case.  Every program compacts
        # the active groups (union over the M rows) on the device: rank = cumsum(active).  The A active
        # N tiles (BN divides G, so a tile lies in one group) are numbered in N order; the K axis of each
        # is cut into S = min(PROGS // A, SMAX, K chunks) splits, S chosen at run time, so the A * S work
        # items (active tile, K split) keep ~PROGS programs streaming weight rows at any sparsity.
        # Program p computes work item p (if p < A * S) and writes the zeros of the p-th inactive tile
        # (if any); programs beyond both exit at once.  Groups NR..NG-1 are the always-executed tail (route
        # is [M, NR]); their weight rows live at element offsets OFF2 (rows N1..N1+N2-1) and OFF3 (the rest)
        # from w_ptr, as in _gemv_mn_kernel.
        pid = tl.program_id(0)
        offs_g, act, inact, n_act = _group_flags(route_ptr, M, NR, NG, NGP)
        TPG: tl.constexpr = G // BN  # N tiles per group
        tiles_act = n_act * TPG
        tiles_inact = (NG - n_act) * TPG
        CH = tl.cdiv(K, BK)  # K chunks of one tile
        S = tl.minimum(tl.minimum(PROGS // tl.maximum(tiles_act, 1), SMAX), CH)
        S = tl.maximum(S, 1)
        offs_m = tl.arange(0, 16)  # rows padded to 16 for the tensor-core dot; padded rows load nothing
        mmask = offs_m < M
        offs_b = tl.arange(0, BN)
        if pid < tiles_inact:
            qi = pid // TPG
            rank_i = tl.where(inact != 0, tl.cumsum(inact, axis=0), 0)
            gi = tl.sum(tl.where(rank_i == qi + 1, offs_g, 0), axis=0)  # the qi-th inactive group
            nz = gi * G + (pid - qi * TPG) * BN + offs_b
            tl.store(out_ptr + offs_m[:, None] * stride_om + nz[None, :],
                     tl.zeros((16, BN), dtype=out_ptr.dtype.element_ty), mask=mmask[:, None])
        if pid < tiles_act * S:
            q = pid // S  # active tile
            sp = pid - q * S  # its K split
            qa = q // TPG
            rank = tl.where(act != 0, tl.cumsum(act, axis=0), 0)
            g = tl.sum(tl.where(rank == qa + 1, offs_g, 0), axis=0)  # the qa-th active group
            offs_n = g * G + (q - qa * TPG) * BN + offs_b
            shift = _tail_shift(g * G, N1, N2, OFF2, OFF3, stride_wn)
            c0 = (sp * CH) // S
            c1 = ((sp + 1) * CH) // S
            offs_k = tl.arange(0, BK)
            w_rows = w_ptr + shift + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
            w2_rows = w2_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
            x_rows = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
            acc = tl.zeros((16, BN), dtype=tl.float32)
            acc2 = tl.zeros((16, BN), dtype=tl.float32)
            for c in range(c0, c1):
                k0 = c * BK
                xt, wt = _chunk_loads(x_rows, w_rows, k0, mmask, offs_k, K, EVEN_K)
                acc = mma(xt, tl.trans(wt), acc)
                if SWIGLU:
                    if EVEN_K:
                        w2t = tl.load(w2_rows + k0)
                    else:
                        w2t = tl.load(w2_rows + k0, mask=((k0 + offs_k) < K)[None, :], other=0.0)
                    acc2 = mma(xt, tl.trans(w2t), acc2)
            rg = (tl.load(route_ptr + offs_m * NR + g, mask=mmask & (g < NR), other=0) != 0) | (g >= NR)
            o_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
            if S == 1:
                if SWIGLU:
                    acc = swiglu_act(acc, acc2, out_ptr.dtype.element_ty)
                tl.store(o_ptrs, tl.where(rg[:, None], acc, 0.0).to(out_ptr.dtype.element_ty),
                         mask=mmask[:, None])
            else:
                # fp32 partials in this program's slot [NW, M, BN] (NW = 2 with SwiGLU: gate, up); the
                # split of the tile that arrives last sums the S slots in split order (deterministic),
                # finishes the tile and resets the tile's arrival counter for the next launch
                NW: tl.constexpr = 2 if SWIGLU else 1
                SL = NW * M * BN  # slot size (floats)
                slot = offs_m[:, None] * BN + offs_b[None, :]
                pmask = mmask[:, None]
                tl.store(part_ptr + pid.to(tl.int64) * SL + slot, acc, mask=pmask)
                if SWIGLU:
                    tl.store(part_ptr + pid.to(tl.int64) * SL + M * BN + slot, acc2, mask=pmask)
                tl.debug_barrier()
                arrived = tl.atomic_add(cnt_ptr + q, 1, sem="acq_rel", scope="gpu")
                if arrived == S - 1:
                    tot = tl.zeros((16, BN), dtype=tl.float32)
                    tot2 = tl.zeros((16, BN), dtype=tl.float32)
                    base = part_ptr + (q * S).to(tl.int64) * SL + slot
                    for s in range(0, S):
                        tot += tl.load(base + s * SL, mask=pmask, other=0.0, cache_modifier=".cg")
                        if SWIGLU:
                            tot2 += tl.load(base + s * SL + M * BN, mask=pmask, other=0.0, cache_modifier=".cg")
                    if SWIGLU:
                        tot = swiglu_act(tot, tot2, out_ptr.dtype.element_ty)
                    tl.store(o_ptrs, tl.where(rg[:, None], tot, 0.0).to(out_ptr.dtype.element_ty),
                             mask=mmask[:, None])
                    tl.atomic_xchg(cnt_ptr + q, 0, sem="relaxed", scope="gpu")

    @triton.jit
    def _gemv_k_kernel(x_ptr, w_ptr, out_ptr, part_ptr, cnt_ptr, route_ptr, M, N, NG, stride_xm, stride_wn,
                       stride_om, G: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, NGP: tl.constexpr,
                       SPLITS: tl.constexpr, EVEN_N: tl.constexpr, FUSE_SUM: tl.constexpr, BM: tl.constexpr):
        # Grid (N tiles x row tiles of BM rows, K splits); the row tile varies fastest, so the programs that
        # read the same weight tile run together (L2 reuse when M > BM).  Every program compacts the active
        # groups (union over the rows of its row tile) on the device: rank = cumsum(active).  The active K
        # chunks (G // BK per group, BK divides G) are numbered 0..total-1 in K order and split evenly over
        # the SPLITS programs of a tile, so every loop iteration loads one full weight tile [BN, BK] of an
        # active group: no predicated-off iterations, no load whose address or predicate depends on another
        # load, balanced splits.  Rows are padded to BM (>= 16) for the tensor-core dot; padded rows load nothing.
        pid = tl.program_id(0)
        sp = tl.program_id(1)
        num_m = tl.cdiv(M, BM)
        pid_m = pid % num_m
        pid_n = pid // num_m
        m0 = pid_m * BM
        offs_g = tl.arange(0, NGP)
        gmask = offs_g < NG
        act = _route_union(route_ptr + m0 * NG, tl.minimum(M - m0, BM), NG, offs_g, gmask, NGP)
        rank = tl.where(act != 0, tl.cumsum(act, axis=0), 0)  # 1-based rank of each active group, 0 if inactive
        CPG: tl.constexpr = G // BK
        total = tl.sum(act, axis=0) * CPG
        per = (total + SPLITS - 1) // SPLITS
        t0 = sp * per
        t1 = tl.minimum(t0 + per, total)
        offs_n = pid_n * BN + tl.arange(0, BN)
        nmask = offs_n < N
        offs_m = m0 + tl.arange(0, BM)
        mmask = offs_m < M
        offs_k = tl.arange(0, BK)
        w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
        x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for t in range(t0, t1):
            q = t // CPG
            g = tl.sum(tl.where(rank == q + 1, offs_g, 0), axis=0)  # the q-th active group
            k0 = g * G + (t - q * CPG) * BK
            rg = tl.load(route_ptr + offs_m * NG + g, mask=mmask, other=0) != 0  # rows that execute g
            xt = tl.load(x_rows + k0, mask=mmask[:, None], other=0.0)
            xt = tl.where(rg[:, None], xt, tl.zeros_like(xt))
            if EVEN_N:
                wt = tl.load(w_rows + k0)
            else:
                wt = tl.load(w_rows + k0, mask=nmask[:, None], other=0.0)
            acc = mma(xt, tl.trans(wt), acc)
        omask = mmask[:, None] & nmask[None, :]
        if SPLITS == 1:
            tl.store(out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :],
                     acc.to(out_ptr.dtype.element_ty), mask=omask)
        else:
            p_ptrs = part_ptr + offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
            tl.store(p_ptrs + sp.to(tl.int64) * M * N, acc, mask=omask)
            if FUSE_SUM:
                # the split of this tile that arrives last sums the SPLITS partials in split order
                # (deterministic) and writes out; it resets the tile's counter for the next launch
                tl.debug_barrier()
                arrived = tl.atomic_add(cnt_ptr + pid, 1, sem="acq_rel", scope="gpu")
                if arrived == SPLITS - 1:
                    tot = tl.zeros((BM, BN), dtype=tl.float32)
                    for s in tl.static_range(SPLITS):
                        tot += tl.load(p_ptrs + s * M * N, mask=omask, other=0.0, cache_modifier=".cg")
                    tl.store(out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :],
                             tot.to(out_ptr.dtype.element_ty), mask=omask)
                    tl.atomic_xchg(cnt_ptr + pid, 0, sem="relaxed", scope="gpu")

    @triton.jit
    def _splitk_sum_kernel(part_ptr, out_ptr, MN, SPLITS: tl.constexpr, BLOCK: tl.constexpr):
        # out (contiguous [M, N]) = sum over the splits of the fp32 partials [SPLITS, M, N], in split order
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        msk = offs < MN
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for s in tl.static_range(SPLITS):
            acc += tl.load(part_ptr + s * MN + offs, mask=msk, other=0.0)
        tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=msk)

def _check_small(x, M, what):
    if M > 4:
        fail(f"{what}: the GEMV path takes M <= 4 rows, got M={M}")


def _gemv_mn_cands(K, swiglu=False, G=16, N=None):
    """Configs of :func:`gemv_mn` / :func:`gemv_swiglu`; the first is used untuned (graph capture, CPU).

    Two kernels.  ``BN, BK`` (+ warps/stages): one program per N tile of BN columns; a tile that no row
    executes reads nothing, so at sparsity s only ``(1 - s)`` of the programs stream weights.
    ``BN, BK, SPLIT, SMAX``: :func:`_gemv_mn_split_kernel`, ``N / BN * SPLIT`` programs (the dense case:
    SPLIT K splits per tile) mapped on the device onto the active tiles with
    ``S = min(programs // active tiles, SMAX)`` K splits each, so about as many programs stream weight
    rows at any sparsity.  BN must divide G (kept to ``pow2_part(G)``).  The untuned default is the split
    config that was fastest at both s = 0 and s = 0.5 in the H200 probe (``benchmarks/e2e/decode_probe.md``:
    q_proj 12.6 / 8.5 us against cuBLAS 13.9 us; SwiGLU 62.6 / 37.3 us against 67.4 us).
    """
    bnmax = pow2_part(G)
    ch = lambda bk: max(1, -(-K // bk))  # noqa: E731  K chunks of width bk
    if interpret_mode():
        bk = min(32, next_pow2(K))
        return [dict(BN=16, BK=min(64, next_pow2(K))),
                dict(BN=min(32, bnmax), BK=bk, SPLIT=min(2, ch(bk)), SMAX=min(4, ch(bk)))]
    c = [(16, 256, 4, 4), (32, 256, 4, 4), (16, 512, 4, 3), (64, 128, 4, 4)]
    if swiglu:
        c = [(16, 256, 4, 4), (32, 128, 4, 4), (16, 128, 4, 5)]
    tiles = [dict(BN=bn, BK=min(bk, next_pow2(K)), num_warps=w, num_stages=st) for bn, bk, w, st in c]
    # split kernel: (BN, BK, SPLIT, SMAX, warps, stages), the default first.  At Llama-3.1-8B shapes (H200,
    # 132 SMs) the q_proj list launches 256-512 programs (N = 4096) and the SwiGLU list 224-896
    # (N = 14336, two weight tiles per K chunk), like the gemv_k configs that stream HBM at full rate.
    # None of them spills registers when compiled for sm_90 (ptxas; the SwiGLU tiles of 64 x 128 need
    # 8 warps).
    sc = [(32, 128, 4, 32, 4, 3), (64, 128, 8, 32, 4, 3), (64, 128, 8, 32, 8, 3), (32, 256, 4, 16, 8, 3),
          (16, 256, 2, 16, 4, 4), (128, 64, 8, 64, 8, 3), (64, 64, 8, 64, 4, 3)]
    if swiglu:
        sc = [(32, 64, 2, 32, 4, 4), (64, 128, 2, 16, 8, 3), (64, 128, 4, 16, 8, 3), (64, 64, 4, 32, 4, 3),
              (128, 64, 2, 32, 8, 3), (16, 128, 1, 16, 4, 4), (32, 64, 4, 32, 4, 4)]
    splits = []
    for bn, bk, sp, smax, w, st in sc:
        bn = min(bn, bnmax)
        bk = min(bk, next_pow2(K))
        sp = max(1, min(sp, ch(bk)))
        cfg = dict(BN=bn, BK=bk, SPLIT=sp, SMAX=max(sp, min(smax, ch(bk))), num_warps=w, num_stages=st)
        if cfg not in splits:
            splits.append(cfg)
    return splits[:1] + tiles + splits[1:]


def _gemv_k_cands(G, K, N, M):
    """Configs ``BN, BK, SPLIT`` (+ warps/stages) of :func:`gemv_k`; the first is used untuned (graph capture).

    An H200 has 132 SMs and needs ~2-3 MB of loads in flight to stream HBM at full rate, so the first
    config launches 64 N tiles x 8 K splits = 512 programs (at N = 4096; ~41 KB of shared memory each,
    so 4 per SM, one wave), each keeping 2 tiles of 64 x 128 bf16 (16 KB) in flight."""
    bkmax = pow2_part(G)
    if interpret_mode():
        bk = min(32, bkmax)
        sp = max(1, min(3, K // bk))
        return [dict(BN=16, BK=bk, SPLIT=sp, FUSE=sp > 1)]
    c = [(64, 128, 8, 1, 4, 3), (64, 128, 8, 0, 4, 3), (64, 128, 8, 1, 4, 4), (32, 128, 8, 1, 4, 4),
         (64, 128, 4, 1, 4, 4), (128, 128, 4, 1, 8, 3), (64, 256, 4, 1, 4, 3), (32, 256, 8, 1, 4, 3),
         (16, 128, 16, 1, 4, 4), (64, 64, 16, 1, 4, 4), (32, 128, 1, 0, 4, 4)]
    out = []
    for bn, bk, sp, fuse, w, st in c:
        bk = min(bk, bkmax)
        sp = max(1, min(sp, K // bk))
        cfg = dict(BN=bn, BK=bk, SPLIT=sp, FUSE=bool(fuse and sp > 1), num_warps=w, num_stages=st)
        if cfg not in out:
            out.append(cfg)
    return out


def splitk_cands(G, K, N, M):
    """Configs of the split-K GEMM-K kernel for ``M > 4`` rows (``BM`` rows per tile; see :func:`splitk_k`).

    Rows are tiled by ``BM`` in {16, 32, 64} (at most the padded row count); the grid is N tiles x row tiles x K
    splits, with the splits chosen so that about 512 programs run (2-4 per SM of an H200, 132 SMs; or half as
    many splits), enough weight bytes in flight to stream HBM; the row tiles of one weight tile run next to each
    other and share it through L2.  The first entry is used untuned."""
    bkmax = pow2_part(G)
    if interpret_mode():
        bm = 16 if M <= 16 else 32
        return [dict(BM=bm, BN=16, BK=min(32, bkmax), SPLIT=max(1, min(2, K // min(32, bkmax))), FUSE=True)]
    top = min(64, max(16, next_pow2(M)))
    out = []
    for bm in [top] + [b for b in (32, 16) if b < top]:
        for bn, bk, w in ((64, 128, 4), (128, 64, 8), (32, 128, 4)):
            bk = min(bk, bkmax)
            progs = -(-N // bn) * -(-M // bm)
            sp = max(1, min(8, 512 // progs, K // bk))
            for split in (sp, max(1, sp // 2)):  # and half as many splits (fewer partials to sum)
                cfg = dict(BM=bm, BN=bn, BK=bk, SPLIT=split, FUSE=split > 1, num_warps=w, num_stages=3)
                if cfg not in out:
                    out.append(cfg)
    return out


def splitk_k(a: torch.Tensor, w: torch.Tensor, route: torch.Tensor, G: int, out: torch.Tensor,
             cfg: dict) -> torch.Tensor:
    """GEMM-K for a few rows (Eq. 21, no reorder): the kernel of :func:`gemv_k` with rows tiled by ``cfg["BM"]``.

    ``out[m] = sum_{g: route[m, g]} a[m, K_g] @ w[:, K_g].T``.  Each program compacts the groups that some row
    of its row tile executes (on the device) and streams only their ``[BN, BK]`` weight tiles, split over
    ``cfg["SPLIT"]`` programs; row tiles of one weight tile run next to each other, so the weight is read from
    HBM about once.  :func:`wide.kernels.gemm_k` uses it for ``4 < M < 512`` rows (autotuned against its
    route-predicated dense kernel), where a dense-order GEMM has too few output tiles to fill the GPU.

    Args:
        a: contiguous ``[M, K]`` (bf16/fp16/fp32); w: contiguous ``[N, K]``, same dtype; route: contiguous bool
            ``[M, K // G]``; G: group size along K; out: contiguous ``[M, N]`` in a's dtype (every element
            written); cfg: one entry of :func:`splitk_cands`.

    Returns:
        ``out``.  Inputs are not validated here (the public ops do it).
    """
    M, K = a.shape
    N = w.shape[0]
    NG = K // G
    bm = cfg.get("BM", 16)
    split = cfg["SPLIT"]
    fuse = split > 1 and cfg.get("FUSE", False)
    part = torch.empty((split, M, N), dtype=torch.float32, device=a.device) if split > 1 else out
    tiles = triton.cdiv(N, cfg["BN"]) * triton.cdiv(M, bm)
    cnt = tile_counters(a.device, tiles) if fuse else route
    _gemv_k_kernel[(tiles, split)](a, w, out, part, cnt, route, M, N, NG, a.stride(0), w.stride(0),
                                   out.stride(0), G=G, BN=cfg["BN"], BK=cfg["BK"], NGP=max(2, next_pow2(NG)),
                                   SPLITS=split, EVEN_N=(N % cfg["BN"] == 0), FUSE_SUM=fuse, BM=bm,
                                   **launch_opts(cfg))
    if split > 1 and not fuse:
        blk = 1024 if not interpret_mode() else 256
        _splitk_sum_kernel[(triton.cdiv(M * N, blk),)](part, out, M * N, SPLITS=split, BLOCK=blk,
                                                     **({} if interpret_mode() else {"num_warps": 4}))
    return out


def gemv_mn(x: torch.Tensor, w: torch.Tensor, route: torch.Tensor, G: int, *,
            out: torch.Tensor | None = None, w2: torch.Tensor | None = None,
            tail: tuple[torch.Tensor, ...] = ()) -> torch.Tensor:
    """Decode GEMV for GEMM-MN, ``M <= 4`` (Algorithm 2, GEMV variant; no reorder).

    ``out[m, n] = (x @ w.T)[m, n] if route[m, n // G] else 0``.

    Args:
        x: ``[M, K]`` with ``1 <= M <= 4``, bf16/fp16/fp32.
        w: ``[N, K]``, same dtype/device.
        route: bool ``[M, N // G]``, True = execute.
        G: group size along N (multiple of 16 dividing N).
        out: optional contiguous ``[M, N + sum of the tail widths]`` output in x's dtype.
        w2: optional second weight ``[N, K]``: computes the fused SwiGLU
            ``silu(x w.T) * (x w2.T)`` instead (see :func:`gemv_swiglu`).
        tail: up to two more weights ``[N_t, K]`` (same dtype/device, each ``N_t`` a multiple of G) whose
            outputs follow the routed ones in ``out`` and are always computed: ``out[:, N:] = x @ cat(tail).T``.
            The engine's decode step runs ``[Q | K | V]`` as one launch this way (Q routed by head group, K/V
            dense) without copying the three weights into one tensor: the kernels address the tail
            weights by their element offset from ``w``.  Not with ``w2``.

    Returns:
        ``out`` (or a new ``[M, N + N_tail]`` tensor in x's dtype), fp32-accumulated; every column of a group
        that row m does not execute is exactly 0 in row m.

    Weight bytes read: ``(fraction of groups executed by some row) * N * K * itemsize`` (level-0 skip).
    The autotuner (:func:`wide.kernels._common.pick_config`) picks one of two kernels, see
    :func:`_gemv_mn_cands`; untuned (CUDA-graph capture, ``WIDE_AUTOTUNE=0``, CPU) it is the first:

    * one program per N tile of BN columns; a tile that no row executes reads no weight byte and
      writes zeros, so at sparsity s only ``1 - s`` of the programs stream memory;
    * split kernel: a grid sized for the dense case (``N / BN * SPLIT`` programs).  Each program
      compacts the active groups on the device (union over the M rows, ``cumsum``; no host sync,
      CUDA-graph capturable) and takes one work item (active N tile, K split), with the number of K
      splits per tile chosen at run time from the number of active tiles, so about as many programs
      stream contiguous weight rows at any sparsity.  Partials of a split tile are fp32 and summed in
      split order by the split that arrives last (per-tile arrival counter it resets; deterministic for
      a given route), which then applies SiLU-and-product (SwiGLU) and the row mask.  Programs beyond
      the active work write the zeros of the inactive tiles or exit.

    Raises:
        ValueError: M > 4, or bad shapes/dtypes/devices/G/route/out (as :func:`wide.kernels.gemm_mn`), a
            tail weight whose width is not a multiple of G or whose K, dtype or device differs, more than
            two tail weights, or a tail together with ``w2``.
    """
    from wide.kernels.gemm_mn import _validate

    _validate(x, w, route, G)
    if w2 is not None:
        if isinstance(w2, torch.Tensor) and w2.shape != w.shape:
            fail(f"w2 shape {tuple(w2.shape)} must equal w shape {tuple(w.shape)}")
        _validate(x, w2, route, G, "w2")
    if isinstance(tail, torch.Tensor):
        fail(f"gemv_mn: tail must be a tuple of up to two [N_t, K] weights, got one tensor {tuple(tail.shape)} "
             f"(write tail=(w,))")
    if not isinstance(tail, (tuple, list)):
        fail(f"gemv_mn: tail must be a tuple of up to two [N_t, K] weights (() for none), got {type(tail).__name__}")
    tail = tuple(tail)
    if tail and w2 is not None:
        fail("gemv_mn: tail weights are not supported with w2 (fused SwiGLU)")
    if len(tail) > 2:
        fail(f"gemv_mn: at most two tail weights, got {len(tail)}")
    for j, t in enumerate(tail):
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.shape[1] != x.shape[1]:
            fail(f"tail[{j}] must be a [N_t, K={x.shape[1]}] tensor, got "
                 f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
        if t.dtype != x.dtype or t.device != x.device:
            fail(f"tail[{j}] is {t.dtype} on {t.device}; x is {x.dtype} on {x.device}")
        if t.shape[0] % G:
            fail(f"tail[{j}] has {t.shape[0]} rows, not a multiple of G={G}")
    M, K = x.shape
    N = w.shape[0]
    NT = sum(t.shape[0] for t in tail)
    check_out(out, (M, N + NT), x.dtype, x.device, x=x, w=w, w2=w2, route=route,
              **{f"tail[{j}]": t for j, t in enumerate(tail)})
    _check_small(x, M, "gemv_mn")
    if out is None:
        out = torch.empty((M, N + NT), dtype=x.dtype, device=x.device)
    if not use_triton(x):
        if tail:
            full = torch.cat([route, torch.ones((M, NT // G), dtype=torch.bool, device=route.device)], 1)
            return out.copy_(reference.gemm_mn_ref(x, torch.cat([w, *tail]), full, G))
        res = (reference.gemm_mn_ref(x, w, route, G) if w2 is None
               else reference.swiglu_ref(x, w, w2, route, G))
        return out.copy_(res)
    x = x.contiguous()
    w = w.contiguous()
    w2c = w2.contiguous() if w2 is not None else w
    route = route.contiguous()
    NR = N // G  # routed groups
    tail = tuple(t.contiguous() for t in tail)
    esz = w.element_size()
    offs = [(t.data_ptr() - w.data_ptr()) // esz for t in tail] + [0, 0]  # element offsets from w
    N2 = tail[0].shape[0] if tail else 0
    N1 = N
    N = N + NT
    NG = N // G

    swiglu = w2 is not None
    if M == 0 or N == 0:
        return out

    def run(cfg, route=route):
        if "SPLIT" in cfg:
            bn = cfg["BN"]
            tiles = N // bn
            progs = tiles * cfg["SPLIT"]
            nw = 2 if swiglu else 1
            # fp32 partial slots, one per program (unused, 1 element, when a tile never splits)
            part = torch.empty((progs * nw * M * bn if cfg["SMAX"] > 1 else 1,), dtype=torch.float32,
                               device=x.device)
            cnt = tile_counters(x.device, tiles)
            _gemv_mn_split_kernel[(progs,)](x, w, w2c, out, part, cnt, route, M, K, NG, progs, x.stride(0),
                                            w.stride(0), out.stride(0), NR, N1, N2, offs[0], offs[1],
                                            G=G, BN=bn, BK=cfg["BK"],
                                            NGP=max(2, next_pow2(NG)), SMAX=cfg["SMAX"], SWIGLU=swiglu,
                                            EVEN_K=(K % cfg["BK"] == 0), **launch_opts(cfg))
            return
        grid = (triton.cdiv(N, cfg["BN"]),)
        _gemv_mn_kernel[grid](x, w, w2c, out, route, M, N, K, NR, x.stride(0), w.stride(0), out.stride(0),
                              G, N1, N2, offs[0], offs[1], BN=cfg["BN"], BK=cfg["BK"], SWIGLU=swiglu,
                              EVEN_K=(K % cfg["BK"] == 0), **launch_opts(cfg))

    # "4": tuned under CUDA-graph replay with every group executed (see _dense_tuner); older entries (timed
    # with do_bench, or on the live route) are not reused
    op = "gemv_swiglu4" if swiglu else "gemv_mn4"
    key = (M, N, K, G, str(x.dtype)) + ((N1, N2) if tail else ())
    cfg = pick_config(op, key, x.device, _gemv_mn_cands(K, swiglu, G, N), _dense_tuner(run, route), graph=True)
    run(cfg)
    return out


def gemv_swiglu(x, w_gate, w_up, route, G, *, out=None):
    """Decode fused routed SwiGLU, ``M <= 4`` (Eq. 3; Algorithm 2, GEMV variant; no reorder).

    ``out[m, n] = silu((x @ w_gate.T)[m, n]) * (x @ w_up.T)[m, n] if route[m, n // G] else 0``: the gated
    activation of Eq. 3, ``(phi(X W_gate^T) ⊙ (X W_up^T)) ⊙_G M_ffn`` with ``phi`` = SiLU, whose zeros for the
    skipped groups then feed ``down_proj`` (:func:`gemv_k`, the same ``M_ffn``).

    Args:
        x: ``[M, K]`` with ``1 <= M <= 4`` (the decode rows), bf16/fp16/fp32.
        w_gate: ``gate_proj`` weight ``[N, K]``, x's dtype and device.
        w_up: ``up_proj`` weight, the same shape ``[N, K]``, x's dtype and device.
        route: bool ``[M, N // G]`` on x's device, True = row m executes FFN group g (``M_ffn``, Eq. 5).
        G: group size along N (an int, a multiple of 16 dividing N; for the FFN 16, 32, ..., 512).
        out: optional contiguous ``[M, N]`` output in x's dtype on x's device.

    Returns:
        ``out`` (or a new ``[M, N]`` tensor in x's dtype).  Both products are accumulated in fp32; the gate and
        up sums, the SiLU and the product are rounded to x's dtype as the model's own MLP rounds them
        (``act_fn(gate_proj(x)) * up_proj(x)``; nothing is rounded for fp32).  Every column of a group that row
        m does not execute is exactly 0 in row m.

    As in the paper's decode path (Appendix B: GEMV variants dispatched for M <= 4; mask reordering is
    bypassed and routing is checked directly at the block level), the level-0 predicate of an N tile (Eq. 9
    with the block of rows = all M rows) is "some row executes its group": a tile no row executes reads
    neither weight and writes zeros.  Weight bytes read: ``2 * (fraction of groups executed by some row) * N *
    K * itemsize``; x is read once per K tile for both weights.  The same two kernels and autotuning as
    :func:`gemv_mn` (tile kernel, or the split kernel mapping a dense-sized grid onto the active N tiles x K
    splits on the device: no host sync, CUDA-graph capturable), tuned separately; the fp32 gate and up
    partials of a split tile are summed in split order before the SiLU.  CPU without ``TRITON_INTERPRET=1``
    (or without Triton) falls back to :func:`wide.kernels.reference.swiglu_ref`.

    Raises:
        ValueError: (:class:`~wide.kernels.KernelArgumentError`, a :class:`wide.errors.WideError`) M > 4; x
            not a 2-D bf16/fp16/fp32 tensor; ``w_gate`` / ``w_up`` not ``[N, K]`` in x's dtype, or shaped
            differently from each other; G not an int multiple of 16 dividing N; route not bool
            ``[M, N // G]``; tensors on different devices; ``out`` of the wrong shape, dtype or device, or
            not contiguous.
    """
    return gemv_mn(x, w_gate, route, G, out=out, w2=w_up)


def _dense_tuner(run, route: torch.Tensor):
    """``run`` for the autotuner with every group executed (an all-True copy of ``route``, made on the first call).

    A decode GEMV's config is cached per shape, not per mask, so the first route seen would otherwise decide it
    for every sparsity.  Tuned at s = 0.5, the H200 picked configs that ran the whole decode step at 0.96x
    dense with everything executed; tuned with everything executed they ran it at 1.02x, and at s = 0.5 within
    1.5 % of the s = 0.5 pick (``benchmarks/e2e/e2e_h200-quick6.*`` against ``e2e_h200-decode6.*``).  The
    split kernels size their grid for the dense case and map it onto the active work at run time, so the
    dense-tuned config also serves sparse routes."""
    dense: dict = {}

    def tune(cfg):
        if "route" not in dense:
            dense["route"] = torch.ones_like(route)
        run(cfg, dense["route"])

    return tune


def gemv_k(a: torch.Tensor, w: torch.Tensor, route: torch.Tensor, G: int, *,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """Decode GEMV for GEMM-K, ``M <= 4`` (Eq. 21 / Algorithm 3, GEMV variant; no reorder).

    ``out[m] = sum_{g: route[m, g]} a[m, K_g] @ w[:, K_g].T`` (0 for a row with no active group).

    Args:
        a: ``[M, K]`` with ``1 <= M <= 4``, bf16/fp16/fp32.
        w: ``[N, K]``, same dtype/device.
        route: bool ``[M, K // G]``, True = execute.
        G: group size along K (multiple of 16 dividing K).
        out: optional contiguous ``[M, N]`` output in a's dtype.

    Returns:
        ``out`` (or a new ``[M, N]`` tensor in a's dtype), fp32-accumulated.

    Only weight bytes of groups that some row executes are read.  The grid is (N tiles x K splits);
    each program computes on the device the compacted list of active groups (union over the M rows,
    ``cumsum``; no host sync, CUDA-graph capturable) and takes an even share of their ``[BN, BK]``
    weight tiles, so every program streams useful bytes with a full software pipeline.  With more than
    one split the fp32 partials ``[SPLIT, M, N]`` are summed in split order (deterministic) and
    converted, either by the split of each N tile that finishes last (an atomic arrival counter per
    tile, reset by that split: one launch) or by a second small kernel, whichever the autotuner found
    faster.

    Raises:
        ValueError: M > 4, or bad shapes/dtypes/devices/G/route/out (as :func:`wide.kernels.gemm_k`).
    """
    from wide.kernels._common import FLOAT_DTYPES, check_group, check_route, check_same_device, check_tensor

    check_tensor("a", a, 2, FLOAT_DTYPES)
    check_tensor("w", w, 2, (a.dtype,))
    if w.shape[1] != a.shape[1]:
        fail(f"w must have shape [N, K] with K={a.shape[1]}; got {tuple(w.shape)}")
    check_group(G, a.shape[1], "K (input features)")
    check_route(route, a.shape[0], a.shape[1] // G)
    check_same_device(a=a, w=w, route=route)
    check_out(out, (a.shape[0], w.shape[0]), a.dtype, a.device, a=a, w=w, route=route)
    M, K = a.shape
    N = w.shape[0]
    _check_small(a, M, "gemv_k")
    if out is None:
        out = torch.empty((M, N), dtype=a.dtype, device=a.device)
    if not use_triton(a):
        return out.copy_(reference.gemm_k_ref(a, w, route, G))
    if M == 0 or N == 0:
        return out
    if a.stride(1) != 1:
        a = a.contiguous()
    if w.stride(1) != 1:
        w = w.contiguous()
    route = route.contiguous()
    def run(cfg, route=route):
        splitk_k(a, w, route, G, out, cfg)

    cfg = pick_config("gemv_k4", (M, N, K, G, str(a.dtype)), a.device, _gemv_k_cands(G, K, N, M),
                      _dense_tuner(run, route), graph=True)
    run(cfg)
    return out
