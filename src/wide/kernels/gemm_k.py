"""GEMM-K: the K-axis routed GEMM of the O and down projections (paper Eq. 21, Algorithm 3) and its GEMV:
``out[m] = sum over the groups g that row m executes of a[m, K_g] @ w[:, K_g].T``; no reorder.

Split-K kernel (the GEMV; below the tuned ``masked_min_m`` rows): a program takes BM rows, an N tile and a share of
the weight tiles of the groups its rows execute (compacted on the device); K-split partials are summed in split
order.  Masked path (Appendix A's mask-multiply; from ``masked_min_m`` rows, a tuner candidate below): a select zeroes
the inactive groups of ``a`` (into a copy, or in place with ``overwrite_a``), then cuBLAS.
"""

import torch

from wide.kernels import _common as common
from wide.kernels import reference

PATHS = ("auto", "splitk", "masked")

if common.HAS_TRITON:
    import triton
    import triton.language as tl

    from wide.kernels._common import mma, route_union

    @triton.jit
    def _splitk_kernel(x_ptr, w_ptr, out_ptr, part_ptr, cnt_ptr, route_ptr, M, N, NG, stride_xm, stride_wn,
                       stride_om, G: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, NGP: tl.constexpr,
                       SPLITS: tl.constexpr, EVEN_N: tl.constexpr, FUSE_SUM: tl.constexpr, BM: tl.constexpr):
        # grid (N tiles x row tiles, K splits), the row tile fastest (programs reading one weight tile run together).
        # The active groups of the row tile are compacted on the device; their G // BK chunks each are numbered in K
        # order and split evenly over the SPLITS programs, so every iteration loads a full weight tile of an active
        # group.  Rows are padded to BM (>= 16) for the tensor-core dot
        pid = tl.program_id(0)
        sp = tl.program_id(1)
        num_m = tl.cdiv(M, BM)
        m0 = (pid % num_m) * BM
        offs_g = tl.arange(0, NGP)
        act = route_union(route_ptr + m0 * NG, tl.minimum(M - m0, BM), NG, offs_g, offs_g < NG, NGP)
        rank = tl.where(act != 0, tl.cumsum(act, axis=0), 0)  # 1-based rank of each active group
        CPG: tl.constexpr = G // BK
        total = tl.sum(act, axis=0) * CPG
        per = (total + SPLITS - 1) // SPLITS
        t0 = sp * per
        offs_n = (pid // num_m) * BN + tl.arange(0, BN)
        nmask = offs_n < N
        offs_m = m0 + tl.arange(0, BM)
        mmask = offs_m < M
        offs_k = tl.arange(0, BK)
        w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
        x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for t in range(t0, tl.minimum(t0 + per, total)):
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
        o_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
        if SPLITS == 1:
            tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=omask)
        else:
            p_ptrs = part_ptr + offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
            tl.store(p_ptrs + sp.to(tl.int64) * M * N, acc, mask=omask)
            if FUSE_SUM:  # the split arriving last sums the partials in split order and resets the tile's counter
                tl.debug_barrier()
                if tl.atomic_add(cnt_ptr + pid, 1, sem="acq_rel", scope="gpu") == SPLITS - 1:
                    tot = tl.zeros((BM, BN), dtype=tl.float32)
                    for s in tl.static_range(SPLITS):
                        tot += tl.load(p_ptrs + s * M * N, mask=omask, other=0.0, cache_modifier=".cg")
                    tl.store(o_ptrs, tot.to(out_ptr.dtype.element_ty), mask=omask)
                    tl.atomic_xchg(cnt_ptr + pid, 0, sem="relaxed", scope="gpu")

    @triton.jit
    def _splitk_sum_kernel(part_ptr, out_ptr, MN, SPLITS: tl.constexpr, BLOCK: tl.constexpr):
        # out (contiguous [M, N]) = the sum of the fp32 partials [SPLITS, M, N] in split order
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        msk = offs < MN
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for s in tl.static_range(SPLITS):
            acc += tl.load(part_ptr + s * MN + offs, mask=msk, other=0.0)
        tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=msk)

    @triton.jit
    def _select_kernel(a_ptr, route_ptr, out_ptr, M, NG, stride_am, stride_om, G: tl.constexpr, BR: tl.constexpr,
                       GB: tl.constexpr, GP: tl.constexpr, INPLACE: tl.constexpr):
        # BR rows x GB whole groups (G padded to GP) of out = a with the inactive groups zeroed; inactive groups are
        # not read.  INPLACE (out is a): only the zeros are stored
        pid = tl.program_id(0)
        nb = tl.cdiv(NG, GB)
        pr = pid // nb
        rows = pr * BR + tl.arange(0, BR)
        grp = (pid - pr * nb) * GB + tl.arange(0, GB)
        e = tl.arange(0, GP)
        rows64 = rows.to(tl.int64)[:, None, None]
        inb2 = (rows < M)[:, None] & (grp < NG)[None, :]
        r = tl.load(route_ptr + rows.to(tl.int64)[:, None] * NG + grp[None, :], mask=inb2, other=0) != 0
        cols = grp[None, :, None] * G + e[None, None, :]
        inb = inb2[:, :, None] & (e < G)[None, None, :]
        if INPLACE:
            tl.store(out_ptr + rows64 * stride_om + cols, tl.zeros((BR, GB, GP), dtype=out_ptr.dtype.element_ty),
                     mask=(~r)[:, :, None] & inb)
        else:
            v = tl.load(a_ptr + rows64 * stride_am + cols, mask=r[:, :, None] & inb, other=0.0)
            tl.store(out_ptr + rows64 * stride_om + cols, v, mask=inb)


def _gemv_cands(G: int, K: int) -> list[dict]:
    """Split-K configs ``BN, BK, SPLIT, FUSE`` for M <= 4 rows (BK divides G), the untuned default first."""
    if common.interpret_mode():
        bk = min(32, common.pow2_part(G))
        sp = max(1, min(3, K // bk))
        return [dict(BN=16, BK=bk, SPLIT=sp, FUSE=sp > 1)]
    out = []
    for bn, bk, sp, fuse, w, st in [(64, 128, 8, 1, 4, 3), (64, 128, 8, 0, 4, 3), (64, 128, 8, 1, 4, 4),
                                    (32, 128, 8, 1, 4, 4), (64, 128, 4, 1, 4, 4), (128, 128, 4, 1, 8, 3),
                                    (64, 256, 4, 1, 4, 3), (32, 256, 8, 1, 4, 3), (16, 128, 16, 1, 4, 4),
                                    (64, 64, 16, 1, 4, 4), (32, 128, 1, 0, 4, 4)]:
        bk = min(bk, common.pow2_part(G))
        sp = max(1, min(sp, K // bk))
        cfg = dict(BN=bn, BK=bk, SPLIT=sp, FUSE=bool(fuse and sp > 1), num_warps=w, num_stages=st)
        if cfg not in out:
            out.append(cfg)
    return out


def _splitk_cands(G: int, K: int, N: int, M: int) -> list[dict]:
    """Split-K configs for M > 4 rows: row tiles of 16-64, about 512 programs (or half); default first."""
    if common.interpret_mode():
        return [dict(BM=16 if M <= 16 else 32, BN=16, BK=min(32, common.pow2_part(G)),
                     SPLIT=max(1, min(2, K // min(32, common.pow2_part(G)))), FUSE=True)]
    top = min(64, max(16, common.next_pow2(M)))
    out = []
    for bm in [top] + [b for b in (32, 16) if b < top]:
        for bn, bk, w in ((64, 128, 4), (128, 64, 8), (32, 128, 4)):
            bk = min(bk, common.pow2_part(G))
            sp = max(1, min(8, 512 // (-(-N // bn) * -(-M // bm)), K // bk))
            for split in (sp, max(1, sp // 2)):
                cfg = dict(BM=bm, BN=bn, BK=bk, SPLIT=split, FUSE=split > 1, num_warps=w, num_stages=3)
                if cfg not in out:
                    out.append(cfg)
    return out


def _splitk(a, w, route, G, out, cfg) -> torch.Tensor:
    """One launch of the split-K kernel with config ``cfg`` (contiguous a, w and route; contiguous out)."""
    M, K = a.shape
    N = w.shape[0]
    bm, split = cfg.get("BM", 16), cfg["SPLIT"]
    fuse = split > 1 and cfg.get("FUSE", False)
    part = torch.empty((split, M, N), dtype=torch.float32, device=a.device) if split > 1 else out
    tiles = triton.cdiv(N, cfg["BN"]) * triton.cdiv(M, bm)
    cnt = common.tile_counters(a.device, tiles) if fuse else route
    _splitk_kernel[(tiles, split)](a, w, out, part, cnt, route, M, N, K // G, a.stride(0), w.stride(0), out.stride(0),
                                   G=G, BN=cfg["BN"], BK=cfg["BK"], NGP=max(2, common.next_pow2(K // G)), SPLITS=split,
                                   EVEN_N=N % cfg["BN"] == 0, FUSE_SUM=fuse, BM=bm, **common.launch_opts(cfg))
    if split > 1 and not fuse:
        blk = 256 if common.interpret_mode() else 1024
        _splitk_sum_kernel[(triton.cdiv(M * N, blk),)](part, out, M * N, SPLITS=split, BLOCK=blk, **common.warps(4))
    return out


def _masked(a, w, route, G, out, inplace: bool) -> torch.Tensor:
    """``(a with inactive groups zeroed) @ w.T`` by ``torch.mm``; zeroed in a copy or, ``inplace``, in ``a``."""
    M, K = a.shape
    dst = a if inplace else torch.empty((M, K), dtype=a.dtype, device=a.device)
    if M and K:
        NG, gp = K // G, common.next_pow2(G)
        br, cols = (4, 64) if common.interpret_mode() else (8, 1024)
        gb = max(1, min(cols // gp, common.next_pow2(NG)))  # whole groups per block
        _select_kernel[(triton.cdiv(M, br) * triton.cdiv(NG, gb),)](
            a, route, dst, M, NG, a.stride(0), dst.stride(0), G=G, BR=br, GB=gb, GP=gp, INPLACE=inplace,
            **common.warps(4))
    return torch.mm(dst, w.t(), out=out)


def _gemm_k(a, w, route, G, out, path: str, overwrite_a: bool) -> torch.Tensor:
    M, K = a.shape
    N = w.shape[0]
    out = torch.empty((M, N), dtype=a.dtype, device=a.device) if out is None else out
    if not common.use_triton(a):
        return out.copy_(reference.gemm_k_ref(a, w, route, G))
    if M == 0 or N == 0:
        return out
    if a.stride(1) != 1 or (overwrite_a and M > 1 and abs(a.stride(0)) < K):
        a = a.contiguous()  # rows that share memory cannot be zeroed per row in place: the copy is
    w = w if w.stride(1) == 1 else w.contiguous()
    route = route.contiguous()
    masked_min_m = common.tuned_config(a.device)["gemm_k"]["masked_min_m"]
    if M > 4 and (path == "masked" or (path == "auto" and M >= masked_min_m)):
        return _masked(a, w, route, G, out, overwrite_a)

    def run(cfg, route=route):
        if cfg.get("KIND") == "masked":
            _masked(a, w, route, G, out, overwrite_a)  # the tuner's all-True route zeroes nothing
        else:
            _splitk(a, w, route, G, out, cfg)

    if M <= 4:
        op, key, cands = "gemv_k4", (M, N, K, G, str(a.dtype)), _gemv_cands(G, K)
    else:
        op, key = ("gemm_k_small" if path == "auto" else "gemm_k_splitk"), (common.m_bucket(M), N, K, G, str(a.dtype))
        cands = _splitk_cands(G, K, N, M)
        if path == "auto" and not common.interpret_mode():
            cands, key = cands + [dict(KIND="masked")], key + (("overwrite_a",) if overwrite_a else ())
    run(common.pick_config(op, key, a.device, cands, common.dense_tuner(run, route), graph=True))
    return out


def gemm_k(a: torch.Tensor, w: torch.Tensor, route: torch.Tensor, G: int, *, reordered: common.Reordered | None = None,
           out: torch.Tensor | None = None, path: str = "auto", overwrite_a: bool = False) -> torch.Tensor:
    """K-axis routed GEMM (Eq. 21, Algorithm 3): ``out[m] = sum over g with route[m, g] of a[m, K_g] @ w[:, K_g].T``.

    a ``[M, K]`` bf16/fp16/fp32, w ``[N, K]``, route bool ``[M, K // G]``, G a multiple of 16 dividing K, ``reordered``
    checked, not needed; out optional contiguous ``[M, N]``.  ``path``: ``"auto"`` (the GEMV for M <= 4; below
    ``masked_min_m`` rows split-K or masked, whichever was faster with every group executed; masked above),
    ``"splitk"`` or ``"masked"``.  ``overwrite_a``: the masked path zeroes a's inactive groups in place (its executed
    groups unchanged).  Raises KernelArgumentError: bad arguments, or overwrite_a with an a that requires grad or shares
    memory with w or route.
    """
    M, N, K = common.check_gemm(a, w, route, G, "K", xname="a")
    common.check_out(out, (M, N), a.dtype, a.device, a=a, w=w, route=route)
    if path not in PATHS:
        common.fail(f"path={path!r}; allowed: {', '.join(map(repr, PATHS))}")
    if common.check_flag("overwrite_a", overwrite_a):
        if a.requires_grad:
            common.fail("gemm_k(overwrite_a=True) cannot zero an a that requires grad in place (it would break "
                        "autograd): pass a.detach() or leave it off")
        common.check_no_overlap(a, "a", w=w, route=route)
    if reordered is not None:
        common.check_reordered(reordered, (M, K // G), route.device)
    return _gemm_k(a, w, route, G, out, path, overwrite_a)


def gemv_k(a: torch.Tensor, w: torch.Tensor, route: torch.Tensor, G: int, *,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """Decode GEMM-K for ``M <= 4`` rows (Eq. 21, GEMV, no reorder); as :func:`gemm_k`; raises for M > 4 too."""
    M, N, K = common.check_gemm(a, w, route, G, "K", xname="a")
    if M > 4:
        common.fail(f"gemv_k: the GEMV path takes M <= 4 rows, got M={M}")
    common.check_out(out, (M, N), a.dtype, a.device, a=a, w=w, route=route)
    return _gemm_k(a, w, route, G, out, "auto", False)
