"""GEMM-MN: the N-axis routed GEMM of Q, gate and up (paper Eq. 3, Eq. 9, Algorithm 2), its fused SwiGLU and its
GEMV for M <= 4 rows (Appendix B): ``out[m, n] = (x @ w.T)[m, n]`` where ``route[m, n // G]``, else 0.

Backends: ``"cute"`` (:mod:`wide.kernels.sm90`, the warp-specialized CuTe kernel on sm_90a: bf16 / fp16, K a
multiple of 64, G of 128), ``"triton"`` (every GPU, and the CPU interpreter); ``"auto"`` takes CuTe where it runs,
the rows go through the reorder (M above ``direct_max_m``) and the GPU's config lists G for the op (``cute_G``: where
it measured faster than Triton), Triton elsewhere. ``WIDE_GEMM_BACKEND`` in the environment overrides the table for
``"auto"`` calls: ``triton`` runs Triton everywhere, ``cute`` takes CuTe at every G it runs.  :data:`LAST_BACKEND`
records what ran per op.  The config's ``cute_launch`` sets, per op, the CuTe kernel's CTAs per cluster along M
(``cluster_m``, 1 or 2: a pair shares each weight tile by TMA multicast) and its L2 raster band (``group_m``).

Tile kernel: a program owns a ``(BM, BN | G)`` tile of the reordered rows of one group, gathered and scattered
through the reorder index; a tile whose first sorted row is inactive only writes zeros (level 0).  Up to the tuned
``direct_max_m`` rows it reads the route directly.  GEMV: a dense-sized grid mapped on the device onto the
(N tile, K split) work of the groups some row executes; a tile's fp32 partials are summed in split order.
"""

import torch

from wide.kernels import _common as common
from wide.kernels import gemm_mn_ws, reference, sm90
from wide.kernels.reorder import reorder

BACKENDS = common.BACKEND_CHOICES
LAST_BACKEND: dict[str, str] = {}  # op ("gemm_mn", "swiglu") -> what ran last: "cute", "triton" or "reference"

if common.HAS_TRITON:
    import triton
    import triton.language as tl

    from wide.kernels._common import mma, nth_active, route_union, swiglu_act

    @triton.jit
    def _gemm_mn_kernel(x_ptr, w_ptr, w2_ptr, out_ptr, idx_ptr, cnt_ptr, route_ptr, M, N, K, NG, stride_xm,
                        stride_wn, stride_om, G, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                        GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, SWIGLU: tl.constexpr, DIRECT: tl.constexpr,
                        w_desc, w2_desc, USE_TMA: tl.constexpr):
        # grouped tile order: GROUP_M row tiles share a weight column panel in L2
        pid = tl.program_id(0)
        in_group = GROUP_M * (N // BN)
        first_m = (pid // in_group) * GROUP_M
        size_m = tl.minimum(tl.cdiv(M, BM) - first_m, GROUP_M)
        m0 = (first_m + (pid % in_group) % size_m) * BM
        n0 = ((pid % in_group) // size_m) * BN
        g = n0 // G
        offs_j = m0 + tl.arange(0, BM)
        valid = offs_j < M
        if DIRECT:  # rows in their original order, the predicate from the route itself
            rows = offs_j.to(tl.int64)
            active = tl.load(route_ptr + rows * NG + g, mask=valid, other=0) != 0
            skip = tl.max(active.to(tl.int32), axis=0) == 0
        else:
            cnt = tl.load(cnt_ptr + g)
            rows = tl.load(idx_ptr + offs_j.to(tl.int64) * NG + g, mask=valid, other=0).to(tl.int64)
            active = offs_j < cnt
            skip = m0 >= cnt
        offs_n = n0 + tl.arange(0, BN)
        out_ptrs = out_ptr + rows[:, None] * stride_om + offs_n[None, :]
        if skip:  # level-0 predicate s^(0) = 0: only the zero epilogue
            tl.store(out_ptrs, tl.zeros((BM, BN), dtype=out_ptr.dtype.element_ty), mask=valid[:, None])
        else:
            offs_k = tl.arange(0, BK)
            a_ptrs = x_ptr + rows[:, None] * stride_xm + offs_k[None, :]
            b_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
            b2_ptrs = w2_ptr + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            acc2 = tl.zeros((BM, BN), dtype=tl.float32)
            for kt in range(0, tl.cdiv(K, BK)):
                if EVEN_K:
                    a = tl.load(a_ptrs, mask=active[:, None], other=0.0)
                else:
                    kmask = (kt * BK + offs_k) < K
                    a = tl.load(a_ptrs, mask=active[:, None] & kmask[None, :], other=0.0)
                if USE_TMA:  # dense weight tiles through the bulk tensor copy engine
                    b = w_desc.load([n0, kt * BK]).T
                elif EVEN_K:
                    b = tl.load(b_ptrs)
                else:
                    b = tl.load(b_ptrs, mask=kmask[:, None], other=0.0)
                acc = mma(a, b, acc)
                if SWIGLU:
                    if USE_TMA:
                        b2 = w2_desc.load([n0, kt * BK]).T
                    elif EVEN_K:
                        b2 = tl.load(b2_ptrs)
                    else:
                        b2 = tl.load(b2_ptrs, mask=kmask[:, None], other=0.0)
                    acc2 = mma(a, b2, acc2)
                    b2_ptrs += BK
                a_ptrs += BK
                b_ptrs += BK
            if SWIGLU:
                acc = swiglu_act(acc, acc2, out_ptr.dtype.element_ty)
            tl.store(out_ptrs, tl.where(active[:, None], acc, 0.0).to(out_ptr.dtype.element_ty), mask=valid[:, None])

    @triton.jit
    def _tail_shift(n0, N1, N2, OFF2, OFF3, stride_wn):
        """int64 shift of column n0's weight row from ``w_ptr``: 0 (routed), else into tail OFF2 or OFF3."""
        return tl.where(n0 < N1, 0, tl.where(n0 < N1 + N2, OFF2 - N1.to(tl.int64) * stride_wn,
                                             OFF3 - (N1 + N2).to(tl.int64) * stride_wn)).to(tl.int64)

    @triton.jit
    def _gemv_mn_split_kernel(x_ptr, w_ptr, w2_ptr, out_ptr, part_ptr, cnt_ptr, route_ptr, M, K, NG, PROGS,
                              stride_xm, stride_wn, stride_om, NR, N1, N2, OFF2, OFF3, G: tl.constexpr,
                              BN: tl.constexpr, BK: tl.constexpr, NGP: tl.constexpr, SMAX: tl.constexpr,
                              SWIGLU: tl.constexpr, EVEN_K: tl.constexpr):
        # PROGS = (N / BN) * SPLIT programs, sized for the dense case.  The A active N tiles (union over the rows;
        # groups NR..NG-1 are the always-executed tail) are numbered in N order on the device and each cut into
        # S = min(PROGS // A, SMAX, K chunks) K splits.  Program p computes work item p (if p < A * S) and writes the
        # zeros of the p-th inactive tile (if any)
        pid = tl.program_id(0)
        offs_g = tl.arange(0, NGP)
        act = route_union(route_ptr, M, NR, offs_g, offs_g < NR, NGP)
        act = tl.where((offs_g >= NR) & (offs_g < NG), 1, act)
        inact = tl.where(offs_g < NG, 1 - act, 0)
        n_act = tl.sum(act, axis=0)
        TPG: tl.constexpr = G // BN  # N tiles per group
        tiles_act = n_act * TPG
        CH = tl.cdiv(K, BK)
        S = tl.maximum(tl.minimum(tl.minimum(PROGS // tl.maximum(tiles_act, 1), SMAX), CH), 1)
        offs_m = tl.arange(0, 16)
        mmask = offs_m < M
        offs_b = tl.arange(0, BN)
        if pid < (NG - n_act) * TPG:
            qi = pid // TPG
            nz = nth_active(inact, qi, offs_g) * G + (pid - qi * TPG) * BN + offs_b
            tl.store(out_ptr + offs_m[:, None] * stride_om + nz[None, :],
                     tl.zeros((16, BN), dtype=out_ptr.dtype.element_ty), mask=mmask[:, None])
        if pid < tiles_act * S:
            q = pid // S  # active tile
            sp = pid - q * S  # its K split
            qa = q // TPG
            g = nth_active(act, qa, offs_g)
            offs_n = g * G + (q - qa * TPG) * BN + offs_b
            offs_k = tl.arange(0, BK)
            w_rows = (w_ptr + _tail_shift(g * G, N1, N2, OFF2, OFF3, stride_wn)
                      + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :])
            w2_rows = w2_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
            x_rows = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
            acc = tl.zeros((16, BN), dtype=tl.float32)
            acc2 = tl.zeros((16, BN), dtype=tl.float32)
            for c in range((sp * CH) // S, ((sp + 1) * CH) // S):
                k0 = c * BK
                if EVEN_K:
                    xt = tl.load(x_rows + k0, mask=mmask[:, None], other=0.0)
                    wt = tl.load(w_rows + k0)
                else:
                    km = (k0 + offs_k) < K
                    xt = tl.load(x_rows + k0, mask=mmask[:, None] & km[None, :], other=0.0)
                    wt = tl.load(w_rows + k0, mask=km[None, :], other=0.0)
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
                tl.store(o_ptrs, tl.where(rg[:, None], acc, 0.0).to(out_ptr.dtype.element_ty), mask=mmask[:, None])
            else:
                # fp32 partials in this program's slot [NW, M, BN]; the split arriving last sums the S slots in split
                # order, finishes the tile and resets the tile's arrival counter for the next launch
                SL = (2 if SWIGLU else 1) * M * BN
                slot = offs_m[:, None] * BN + offs_b[None, :]
                pmask = mmask[:, None]
                tl.store(part_ptr + pid.to(tl.int64) * SL + slot, acc, mask=pmask)
                if SWIGLU:
                    tl.store(part_ptr + pid.to(tl.int64) * SL + M * BN + slot, acc2, mask=pmask)
                tl.debug_barrier()
                if tl.atomic_add(cnt_ptr + q, 1, sem="acq_rel", scope="gpu") == S - 1:
                    tot = tl.zeros((16, BN), dtype=tl.float32)
                    tot2 = tl.zeros((16, BN), dtype=tl.float32)
                    base = part_ptr + (q * S).to(tl.int64) * SL + slot
                    for s in range(0, S):
                        tot += tl.load(base + s * SL, mask=pmask, other=0.0, cache_modifier=".cg")
                        if SWIGLU:
                            tot2 += tl.load(base + s * SL + M * BN, mask=pmask, other=0.0, cache_modifier=".cg")
                    if SWIGLU:
                        tot = swiglu_act(tot, tot2, out_ptr.dtype.element_ty)
                    tl.store(o_ptrs, tl.where(rg[:, None], tot, 0.0).to(out_ptr.dtype.element_ty), mask=pmask)
                    tl.atomic_xchg(cnt_ptr + q, 0, sem="relaxed", scope="gpu")


def uses_reorder(M: int, device=None) -> bool:
    """Whether gemm_mn / swiglu read a reorder for M rows: above the tuned ``direct_max_m``."""
    return M > common.tuned_config(device)["gemm_mn"]["direct_max_m"]


def _candidates(G: int, M: int, swiglu: bool) -> list[dict]:
    """Tile configs timed for M rows: ``(BM, BN, BK, GROUP_M, warps, stages, TMA weight tiles)``, BN cut to divide G."""
    if common.interpret_mode():
        return [dict(BM=32, BN=min(common.pow2_part(G), 64), BK=32, GROUP_M=4)]
    if M <= 64:
        base = ([(64, 64, 64, 8, 4, 4, False), (32, 64, 128, 8, 4, 3, False)] if swiglu else
                [(64, 128, 64, 8, 4, 4, False), (32, 64, 128, 8, 4, 4, False), (64, 64, 128, 8, 4, 3, False)])
    elif swiglu:
        base = [(128, 128, 64, 8, 8, 4, True), (128, 128, 64, 16, 8, 4, True), (128, 128, 64, 8, 8, 3, False),
                (128, 64, 64, 8, 4, 4, False), (64, 128, 64, 8, 4, 4, False)]
    else:
        base = [(128, 256, 64, 8, 8, 4, True), (128, 256, 64, 8, 8, 3, True), (128, 128, 64, 16, 8, 4, True),
                (128, 128, 64, 8, 8, 3, False), (128, 128, 64, 8, 8, 4, False), (128, 64, 64, 8, 4, 4, False),
                (64, 128, 64, 8, 4, 4, False)] + ([(256, 128, 64, 8, 8, 3, False)] if M >= 2048 else [])
    tma_ok = M > 128 and common.HAS_TRITON and hasattr(tl, "tensor_descriptor")
    cands = []
    for bm, bn, bk, gm, w, st, tma in base:
        bn = min(bn, common.pow2_part(G))
        c = dict(BM=bm, BN=bn, BK=bk, GROUP_M=gm, num_warps=w, num_stages=st, **({"TMA": True} if tma and tma_ok
                                                                                  and bn >= 16 else {}))
        if c not in cands:
            cands.append(c)
    return cands


def _launch(x, w, w2, route, G, reordered, out):
    """The tile kernel (M > 4) on checked arguments; ``w2``: the fused SwiGLU's up weight (None: plain GEMM)."""
    M, K = x.shape
    N = w.shape[0]
    direct = not uses_reorder(M, x.device)
    route = route.contiguous()
    if not direct and reordered is None:
        reordered = reorder(route)
    x = x if x.stride(1) == 1 else x.contiguous()
    w = w if w.stride(1) == 1 else w.contiguous()
    if w2 is not None and (w2.stride(1) != 1 or w2.stride(0) != w.stride(0)):
        w, w2 = w.contiguous(), w2.contiguous()
    out = torch.empty((M, N), dtype=x.dtype, device=x.device) if out is None else out
    idx, cnt = (route, route) if direct else (reordered.index, reordered.counts)
    w2_ = w if w2 is None else w2

    def run(cfg):
        if cfg.get("WS"):
            gemm_mn_ws.launch(x, w, w2, G, reordered, out, cfg)
            return
        tma = cfg.get("TMA", False) and common.tma_aligned(w, w2_)
        wd = w2d = w
        if tma:
            from triton.tools.tensor_descriptor import TensorDescriptor

            wd, w2d = (TensorDescriptor.from_tensor(t, [cfg["BN"], cfg["BK"]]) for t in (w, w2_))
        _gemm_mn_kernel[(triton.cdiv(M, cfg["BM"]) * (N // cfg["BN"]),)](
            x, w, w2_, out, idx, cnt, route, M, N, K, N // G, x.stride(0), w.stride(0), out.stride(0), G,
            BM=cfg["BM"], BN=cfg["BN"], BK=cfg["BK"], GROUP_M=cfg["GROUP_M"], EVEN_K=K % cfg["BK"] == 0,
            SWIGLU=w2 is not None, DIRECT=direct, w_desc=wd, w2_desc=w2d, USE_TMA=tma, **common.launch_opts(cfg))

    cands = _candidates(G, M, w2 is not None)
    if w2 is not None and not direct:
        cands += gemm_mn_ws.candidates(x, w, w2, G)
    key = (common.m_bucket(M), N, K, G, str(x.dtype))
    cfg = common.pick_config("gemm_mn" if w2 is None else "swiglu", key, x.device, cands, run)
    run(cfg)
    return out


def _gemv_cands(K: int, swiglu: bool, G: int) -> list[dict]:
    """GEMV configs ``BN, BK, SPLIT, SMAX`` (K splits when dense, at most SMAX when sparse), default first."""
    ch = lambda bk: max(1, -(-K // bk))  # noqa: E731  K chunks of width bk
    if common.interpret_mode():
        bk = min(32, common.next_pow2(K))
        return [dict(BN=min(32, common.pow2_part(G)), BK=bk, SPLIT=min(2, ch(bk)), SMAX=min(4, ch(bk)))]
    # (BN, BK, SPLIT, SMAX, warps, stages)
    sc = ([(32, 64, 2, 32, 4, 4), (64, 128, 2, 16, 8, 3), (64, 128, 4, 16, 8, 3), (64, 64, 4, 32, 4, 3),
           (128, 64, 2, 32, 8, 3), (16, 128, 1, 16, 4, 4), (32, 64, 4, 32, 4, 4)] if swiglu else
          [(32, 128, 4, 32, 4, 3), (64, 128, 8, 32, 4, 3), (64, 128, 8, 32, 8, 3), (32, 256, 4, 16, 8, 3),
           (16, 256, 2, 16, 4, 4), (128, 64, 8, 64, 8, 3), (64, 64, 8, 64, 4, 3)])
    cands = []
    for bn, bk, sp, smax, w, st in sc + [(16, 256, 1, 1, 4, 4), (32, 128, 1, 1, 4, 3)]:
        bk = min(bk, common.next_pow2(K))
        sp = max(1, min(sp, ch(bk)))
        cfg = dict(BN=min(bn, common.pow2_part(G)), BK=bk, SPLIT=sp, SMAX=max(sp, min(smax, ch(bk))), num_warps=w,
                   num_stages=st)
        if cfg not in cands:
            cands.append(cfg)
    return cands


def _gemv(x, w, w2, route, G, out, tail=()):
    """The GEMV on checked arguments; ``tail``: always-executed weights after the routed columns."""
    M, K = x.shape
    N1 = w.shape[0]
    NT = sum(t.shape[0] for t in tail)
    N = N1 + NT
    out = torch.empty((M, N), dtype=x.dtype, device=x.device) if out is None else out
    if not common.use_triton(x):
        if tail:
            full = torch.cat([route, torch.ones((M, NT // G), dtype=torch.bool, device=route.device)], 1)
            return out.copy_(reference.gemm_mn_ref(x, torch.cat([w, *tail]), full, G))
        return out.copy_(reference.gemm_mn_ref(x, w, route, G) if w2 is None
                         else reference.swiglu_ref(x, w, w2, route, G))
    if M == 0 or N == 0:
        return out
    x, w, route = x.contiguous(), w.contiguous(), route.contiguous()
    w2c = w if w2 is None else w2.contiguous()
    tail = tuple(t.contiguous() for t in tail)
    offs = [(t.data_ptr() - w.data_ptr()) // w.element_size() for t in tail] + [0, 0]  # element offsets from w
    N2 = tail[0].shape[0] if tail else 0
    NR, NG = N1 // G, N // G

    def run(cfg, route=route):
        tiles = N // cfg["BN"]
        progs = tiles * cfg["SPLIT"]
        part = torch.empty((progs * (1 if w2 is None else 2) * M * cfg["BN"] if cfg["SMAX"] > 1 else 1,),
                           dtype=torch.float32, device=x.device)
        _gemv_mn_split_kernel[(progs,)](
            x, w, w2c, out, part, common.tile_counters(x.device, tiles), route, M, K, NG, progs, x.stride(0),
            w.stride(0), out.stride(0), NR, N1, N2, offs[0], offs[1], G=G, BN=cfg["BN"], BK=cfg["BK"],
            NGP=max(2, common.next_pow2(NG)), SMAX=cfg["SMAX"], SWIGLU=w2 is not None, EVEN_K=K % cfg["BK"] == 0,
            **common.launch_opts(cfg))

    key = (M, N, K, G, str(x.dtype)) + ((N1, N2) if tail else ())
    cfg = common.pick_config("gemv_mn4" if w2 is None else "gemv_swiglu4", key, x.device,
                             _gemv_cands(K, w2 is not None, G), common.dense_tuner(run, route), graph=True)
    run(cfg)
    return out


def _checked(op, x, w, w2, route, G, out, reordered=None, tail=()):
    """The checks of the public ops (``w2``: the SwiGLU's up weight); returns ``reordered`` checked."""
    wn, w2n = ("w", "w2") if w2 is None else ("w_gate", "w_up")
    M, N, K = common.check_gemm(x, w, route, G, "N", wname=wn, w2=w2, w2name=w2n)
    if op.startswith("gemv") and M > 4:
        common.fail(f"{op}: the GEMV path takes M <= 4 rows, got M={M}")
    if not isinstance(tail, (tuple, list)) or len(tail) > 2:
        common.fail(f"{op}: tail must be a tuple of at most two [N_t, K] weights (() for none), got "
                    f"{type(tail).__name__}" + (f" of {len(tail)}" if isinstance(tail, (tuple, list)) else ""))
    for j, t in enumerate(tail):
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.shape[1] != K or t.dtype != x.dtype \
                or t.device != x.device or t.shape[0] % G:
            got = f"{t.dtype} {tuple(t.shape)} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__
            common.fail(f"tail[{j}] must be a [N_t, K={K}] {x.dtype} tensor on {x.device} with N_t a multiple of "
                        f"G={G}, got {got}")
    common.check_out(out, (M, N + sum(t.shape[0] for t in tail)), x.dtype, x.device, x=x, route=route,
                     **{wn: w, w2n: w2}, **{f"tail[{j}]": t for j, t in enumerate(tail)})
    return None if reordered is None else common.check_reordered(reordered, (M, N // G), route.device)


def cute_unsupported(x, w, w2, G: int, out) -> str:
    """Why the CuTe kernel cannot take these checked arguments ("" when it can); builds it on first use."""
    if x.dtype not in (torch.bfloat16, torch.float16):
        return f"dtype {str(x.dtype).replace('torch.', '')} (it takes bfloat16 and float16)"
    if x.shape[1] % 64 or G % 128:
        return f"K={x.shape[1]}, G={G} (it takes K a multiple of 64 and G a multiple of 128)"
    if not common.tma_aligned(*(t for t in (x, w, w2, out) if t is not None)):
        return "tensors not 16-byte aligned with unit column stride"
    if not sm90.available(x.device):
        return "no sm_90 GPU, or the CuTe kernels did not build (see the warning)"
    return ""


def _cute(x, w, w2, route, G, reordered, out):
    """The CuTe kernel on checked, supported arguments."""
    if reordered is None:
        reordered = reorder(route.contiguous())
    out = torch.empty((x.shape[0], w.shape[0]), dtype=x.dtype, device=x.device) if out is None else out
    if w2 is not None and w2.stride(0) != w.stride(0):
        w, w2 = w.contiguous(), w2.contiguous()
    sm90.run("gemm_mn" if w2 is None else "swiglu", x, w, w2, reordered.index, reordered.counts, out, G)
    return out


def _gemm_mn(x, w, w2, route, G, reordered, out, backend="auto"):
    op = "gemm_mn" if w2 is None else "swiglu"
    if backend not in BACKENDS:
        common.fail(f"backend={backend!r} is not allowed; allowed: {', '.join(map(repr, BACKENDS))}")
    env = common.env_backend("WIDE_GEMM_BACKEND")
    if backend == "auto" and env == "triton":
        backend = "triton"
    if backend == "cute" or (backend == "auto" and x.is_cuda and uses_reorder(x.shape[0], x.device)
                             and (G in common.tuned_config(x.device)["gemm_mn"]["cute_G"][op] or env == "cute")):
        why = cute_unsupported(x, w, w2, G, out) if x.is_cuda else f"x is on {x.device}, not an sm_90 GPU"
        if not why and backend == "cute":
            LAST_BACKEND[op] = "cute"
            return _cute(x, w, w2, route, G, reordered, out)
        if not why and common.auto_cute(op, lambda: _cute(x, w, w2, route, G, reordered, out)) is not None:
            LAST_BACKEND[op] = "cute"
            return out
        if backend == "cute":
            common.fail(f"backend='cute' cannot run this {op}: {why}")
    LAST_BACKEND[op] = "triton" if common.use_triton(x) else "reference"
    if x.shape[0] <= 4 or not common.use_triton(x):
        return _gemv(x, w, w2, route, G, out)
    return _launch(x, w, w2, route, G, reordered, out)


def gemm_mn(x: torch.Tensor, w: torch.Tensor, route: torch.Tensor, G: int, *, reordered: common.Reordered | None = None,
            out: torch.Tensor | None = None, backend: str = "auto") -> torch.Tensor:
    """N-axis routed GEMM (Algorithm 2): ``out[m, n] = (x @ w.T)[m, n] if route[m, n // G] else 0``.

    x ``[M, K]`` bf16/fp16/fp32, w ``[N, K]``, route bool ``[M, N // G]``, G a multiple of 16 dividing N, ``reordered``
    an optional :func:`~wide.kernels.reorder` of route, out optional contiguous ``[M, N]``, ``backend`` one of
    :data:`BACKENDS`.  Returns ``[M, N]`` in x's dtype, fp32-accumulated.  Raises KernelArgumentError: bad shapes,
    dtypes, devices, G, route, reordered, out or backend, or ``backend="cute"`` where the CuTe kernel cannot run.
    """
    return _gemm_mn(x, w, None, route, G, _checked("gemm_mn", x, w, None, route, G, out, reordered), out, backend)


def swiglu(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, route: torch.Tensor, G: int, *,
           reordered: common.Reordered | None = None, out: torch.Tensor | None = None,
           backend: str = "auto") -> torch.Tensor:
    """Fused routed SwiGLU (Eq. 3): ``silu(x Wg^T)[m, n] * (x Wu^T)[m, n] if route[m, n // G] else 0``, rounded as the
    model's MLP rounds; as :func:`gemm_mn` with ``w_gate`` and ``w_up`` ``[N, K]``.  Raises KernelArgumentError: as
    :func:`gemm_mn`.
    """
    return _gemm_mn(x, w_gate, w_up, route, G, _checked("swiglu", x, w_gate, w_up, route, G, out, reordered), out,
                    backend)


def gemv_mn(x: torch.Tensor, w: torch.Tensor, route: torch.Tensor, G: int, *, out: torch.Tensor | None = None,
            tail: tuple[torch.Tensor, ...] = ()) -> torch.Tensor:
    """Decode GEMM-MN for ``M <= 4`` rows (Algorithm 2, GEMV, no reorder); as :func:`gemm_mn`, plus ``tail``: up to two
    weights ``[N_t, K]`` (N_t a multiple of G) computed for every row after the routed columns (the decode step's
    ``[Q | K | V]`` in one launch).  Returns ``[M, N + N_tail]``.  Raises KernelArgumentError: M > 4, a bad tail, or as
    :func:`gemm_mn`.
    """
    _checked("gemv_mn", x, w, None, route, G, out, tail=tail)
    return _gemv(x, w, None, route, G, out, tuple(tail))


def gemv_swiglu(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, route: torch.Tensor, G: int, *,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """Decode fused SwiGLU for ``M <= 4`` rows (Eq. 3, GEMV, no reorder); as :func:`swiglu`; raises for M > 4 too."""
    _checked("gemv_swiglu", x, w_gate, w_up, route, G, out)
    return _gemv(x, w_gate, w_up, route, G, out)
