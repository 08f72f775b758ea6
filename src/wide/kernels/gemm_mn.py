"""GEMM-MN: N-axis routed GEMM (paper §3.3, Eq. 9 level 0, Algorithm 2), used by Q, up and gate.

``out[m, n] = (x @ w.T)[m, n]`` where ``route[m, n // G]`` is True, else 0.

Each program owns one ``(BM, BN)`` tile of the *reordered* row space of one routing group
(``BN | G``).  Rows are gathered from ``x`` through the reorder index and the outputs scattered back
through it.  A tile whose first sorted row is inactive (``m0 >= counts[g]``, the level-0 predicate
``s^(0)``) does no loads and no MMA: it only writes zeros to its scattered rows (this replaces the
zero-initialisation of C, so every output element is written exactly once).  Inactive rows of the
single boundary tile per group are load-predicated off and written as zeros.  The same kernel,
with two weight pointers, is the fused routed SwiGLU (:mod:`wide.kernels.swiglu`).

For ``M <= 4`` the op dispatches to the reorder-free GEMV path in :mod:`wide.kernels.decode`.  On an sm_90 GPU
the tuner also times the warp-specialized Gluon kernel of :mod:`wide.kernels.gemm_mn_ws` for the fused SwiGLU
(:func:`_ws_candidates`).
"""

from __future__ import annotations

import torch

from wide.kernels import reference
from wide.kernels._common import (
    FLOAT_DTYPES,
    HAS_TRITON,
    Reordered,
    check_group,
    check_out,
    check_reordered,
    check_route,
    check_same_device,
    check_tensor,
    fail,
    interpret_mode,
    launch_opts,
    m_bucket,
    num_sms,
    pick_config,
    pow2_part,
    small_or_fallback,
    tma_aligned,
)

if HAS_TRITON:
    import triton
    import triton.language as tl

    from wide.kernels._common import mm, mma, swiglu_act  # noqa: F401

    @triton.jit
    def grouped_tile(tile, M, N, BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr):
        """``(pid_m, pid_n)`` of output tile number ``tile`` in the grouped order: GROUP_M row tiles share a
        weight column panel in L2."""
        num_pid_m = tl.cdiv(M, BM)
        num_pid_n = N // BN
        num_pid_in_group = GROUP_M * num_pid_n
        group_id = tile // num_pid_in_group
        first_pid_m = group_id * GROUP_M
        group_size_m = tl.minimum(num_pid_m - first_pid_m, GROUP_M)
        pid_m = first_pid_m + ((tile % num_pid_in_group) % group_size_m)
        pid_n = (tile % num_pid_in_group) // group_size_m
        return pid_m, pid_n

    @triton.jit
    def gemm_mn_tile(pid_m, pid_n, x_ptr, w_ptr, w2_ptr, out_ptr, idx_ptr, cnt_ptr, route_ptr,
                     M, N, K, NG, stride_xm, stride_wn, stride_om, G,
                     BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr,
                     SWIGLU: tl.constexpr, DIRECT: tl.constexpr, w_desc, w2_desc, USE_TMA: tl.constexpr):
        """Output tile ``(pid_m, pid_n)``: rows ``pid_m * BM`` onward of the reordered row space of group
        ``pid_n * BN // G``."""
        m0 = pid_m * BM
        n0 = pid_n * BN
        g = n0 // G
        offs_j = m0 + tl.arange(0, BM)
        valid = offs_j < M
        if DIRECT:
            # few rows: no reorder, rows in their original order, predicate from the route itself
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
        if skip:
            # level-0 predicate s^(0) = 0: CTA early exit (only the zero epilogue)
            tl.store(out_ptrs, tl.zeros((BM, BN), dtype=out_ptr.dtype.element_ty), mask=valid[:, None])
        else:
            offs_k = tl.arange(0, BK)
            a_ptrs = x_ptr + rows[:, None] * stride_xm + offs_k[None, :]
            b_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            if SWIGLU:
                b2_ptrs = w2_ptr + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
                acc2 = tl.zeros((BM, BN), dtype=tl.float32)
            for kt in range(0, tl.cdiv(K, BK)):
                if EVEN_K:
                    a = tl.load(a_ptrs, mask=active[:, None], other=0.0)
                else:
                    kmask = (kt * BK + offs_k) < K
                    a = tl.load(a_ptrs, mask=active[:, None] & kmask[None, :], other=0.0)
                if USE_TMA:  # dense weight tile through the bulk tensor copy engine
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
            res = tl.where(active[:, None], acc, 0.0).to(out_ptr.dtype.element_ty)
            tl.store(out_ptrs, res, mask=valid[:, None])

    @triton.jit
    def _gemm_mn_kernel(x_ptr, w_ptr, w2_ptr, out_ptr, idx_ptr, cnt_ptr, route_ptr,
                        M, N, K, NG, stride_xm, stride_wn, stride_om, G, num_progs,
                        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                        GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, SWIGLU: tl.constexpr,
                        DIRECT: tl.constexpr, w_desc, w2_desc, USE_TMA: tl.constexpr, PERSIST: tl.constexpr):
        """One program per tile, or with ``PERSIST`` ``num_progs`` programs (one per SM) that take the tiles in
        turn in the same grouped order: a skipped tile is then a zero store inside a running program rather
        than a program of its own.  Measured slower than one program per tile on the H200 (session 21,
        benchmarks/kernels/persist_probe_h200-s21), so no tuner candidate sets it."""
        if PERSIST:
            num_tiles = tl.cdiv(M, BM) * (N // BN)
            for tile in range(tl.program_id(0), num_tiles, num_progs):
                pid_m, pid_n = grouped_tile(tile, M, N, BM, BN, GROUP_M)
                gemm_mn_tile(pid_m, pid_n, x_ptr, w_ptr, w2_ptr, out_ptr, idx_ptr, cnt_ptr, route_ptr,
                             M, N, K, NG, stride_xm, stride_wn, stride_om, G, BM, BN, BK, EVEN_K,
                             SWIGLU, DIRECT, w_desc, w2_desc, USE_TMA)
        else:
            pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BM, BN, GROUP_M)
            gemm_mn_tile(pid_m, pid_n, x_ptr, w_ptr, w2_ptr, out_ptr, idx_ptr, cnt_ptr, route_ptr,
                         M, N, K, NG, stride_xm, stride_wn, stride_om, G, BM, BN, BK, EVEN_K,
                         SWIGLU, DIRECT, w_desc, w2_desc, USE_TMA)


DIRECT_MAX_M = 128


def uses_reorder(M: int) -> bool:
    """Whether GEMM-MN / SwiGLU consume a reorder for M rows.  Up to ``DIRECT_MAX_M`` rows (a tile or
    two) the kernel reads the route directly (tile skipped when none of its rows executes the
    group), so no reorder is computed; M <= 4 takes the GEMV path."""
    return M > DIRECT_MAX_M


def _candidates(G: int, M: int, swiglu: bool) -> list[dict]:
    """Tile configs the autotuner times for ``M`` rows.  The large-M lists lead with the winners of the H200
    tile probe (benchmarks/kernels/tile_probe.json, M = 16384): weight tiles by TMA with 4 stages, 128 x 256
    tiles where the group allows (G >= 256), GROUP_M 16."""
    if interpret_mode():
        bn = min(pow2_part(G), 64)
        return [dict(BM=32, BN=bn, BK=32, GROUP_M=4)]
    # (BM, BN, BK, GROUP_M, warps, stages, TMA weights)
    if M <= 64:
        base = [(64, 128, 64, 8, 4, 4, False), (32, 64, 128, 8, 4, 4, False), (64, 64, 128, 8, 4, 3, False)]
        if swiglu:
            base = [(64, 64, 64, 8, 4, 4, False), (32, 64, 128, 8, 4, 3, False)]
    elif swiglu:
        base = [(128, 128, 64, 8, 8, 4, True), (128, 128, 64, 16, 8, 4, True), (128, 128, 64, 8, 8, 3, False),
                (128, 64, 64, 8, 4, 4, False), (64, 128, 64, 8, 4, 4, False)]
    else:
        base = [(128, 256, 64, 8, 8, 4, True), (128, 256, 64, 8, 8, 3, True), (128, 128, 64, 16, 8, 4, True),
                (128, 128, 64, 8, 8, 3, False), (128, 128, 64, 8, 8, 4, False), (128, 64, 64, 8, 4, 4, False),
                (64, 128, 64, 8, 4, 4, False)]
        if M >= 2048:
            base.append((256, 128, 64, 8, 8, 3, False))
    tma_ok = M > 128 and HAS_TRITON and hasattr(tl, "tensor_descriptor")
    cands, seen = [], set()
    for bm, bn, bk, gm, w, st, tma in base:
        bn = min(bn, pow2_part(G))
        tma = tma and tma_ok and bn >= 16
        key = (bm, bn, bk, gm, w, st, tma)
        if key in seen:
            continue
        seen.add(key)
        c = dict(BM=bm, BN=bn, BK=bk, GROUP_M=gm, num_warps=w, num_stages=st)
        if tma:
            c["TMA"] = True
        cands.append(c)
    return cands


def _ws_candidates(x, w, w2, G: int, swiglu: bool) -> list[dict]:
    """Tile configs of the warp-specialized Gluon kernel (:mod:`wide.kernels.gemm_mn_ws`) for the tuner: the fused
    SwiGLU only, where it can run (:func:`~wide.kernels.gemm_mn_ws.ws_supported`: an sm_90 GPU, bf16 / fp16, K and
    G multiples of 64).  On the H200 (benchmarks/kernels/ws_probe_h200-s22*) its persistent grid ran the SwiGLU 5 %
    faster than the Triton kernel with every group executed (0.985-0.998x of the cuBLAS pair against 0.93-0.95x at
    M = 4096 / 16384) and 1-3 % slower at s = 0.5; the plain GEMM was never faster, so it gets none."""
    from wide.kernels.gemm_mn_ws import HAS_GLUON, default_ws_config, ws_supported

    if not swiglu or not HAS_GLUON or not ws_supported(x, w, w2, G):
        return []
    base = dict(default_ws_config(G, swiglu), WS=True)
    return [base, dict(base, PERSIST=False)]


def _validate(x, w, route, G, name_w="w"):
    check_tensor("x", x, 2, FLOAT_DTYPES)
    check_tensor(name_w, w, 2, FLOAT_DTYPES)
    if w.dtype != x.dtype:
        fail(f"{name_w} dtype {w.dtype} must match x dtype {x.dtype}")
    M, K = x.shape
    N = w.shape[0]
    if w.shape[1] != K:
        fail(f"{name_w} must have shape [N, K] with K={K} (x is [M, K]); got {tuple(w.shape)}")
    check_group(G, N, "N (output features)")
    check_route(route, M, N // G)
    check_same_device(x=x, **{name_w: w}, route=route)
    return M, N, K


def launch_gemm_mn(x, w, w2, route, G, reordered, out, swiglu):
    """Shared launcher of the GEMM-MN / fused-SwiGLU tile kernel (M > 4 path); arguments checked by the caller
    (``reordered`` by :func:`check_reordered`)."""
    M, K = x.shape
    N = w.shape[0]
    NG = N // G
    direct = not uses_reorder(M)
    route = route.contiguous()
    if direct:
        reordered = None
    elif reordered is None:
        from wide.kernels.reorder import reorder
        reordered = reorder(route)
    if x.stride(1) != 1:
        x = x.contiguous()
    if w.stride(1) != 1:
        w = w.contiguous()
    if w2 is not None and (w2.stride(1) != 1 or w2.stride(0) != w.stride(0)):
        w2 = w2.contiguous()
        w = w.contiguous()
    if out is None:
        out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    idx, cnt = (route, route) if direct else (reordered.index, reordered.counts)

    w2_ = w2 if w2 is not None else w

    def run(cfg):
        if cfg.get("WS"):  # the warp-specialized Gluon kernel (Hopper)
            from wide.kernels.gemm_mn_ws import gemm_mn_ws

            gemm_mn_ws(x, w, route, G, w2=w2, reordered=reordered, out=out,
                       config={k: v for k, v in cfg.items() if k != "WS"})
            return
        tiles = triton.cdiv(M, cfg["BM"]) * (N // cfg["BN"])
        persist = bool(cfg.get("PERSIST", False))
        grid = (min(tiles, num_sms(x.device)) if persist else tiles,)
        tma = bool(cfg.get("TMA", False)) and tma_aligned(w, w2_)
        if tma:
            from triton.tools.tensor_descriptor import TensorDescriptor

            wd = TensorDescriptor.from_tensor(w, [cfg["BN"], cfg["BK"]])
            w2d = TensorDescriptor.from_tensor(w2_, [cfg["BN"], cfg["BK"]]) if w2 is not None else wd
        else:
            wd = w2d = w
        _gemm_mn_kernel[grid](x, w, w2_, out, idx, cnt, route,
                              M, N, K, NG, x.stride(0), w.stride(0), out.stride(0), G, grid[0],
                              BM=cfg["BM"], BN=cfg["BN"], BK=cfg["BK"], GROUP_M=cfg["GROUP_M"],
                              EVEN_K=(K % cfg["BK"] == 0), SWIGLU=swiglu, DIRECT=direct,
                              w_desc=wd, w2_desc=w2d, USE_TMA=tma, PERSIST=persist, **launch_opts(cfg))

    op = "swiglu" if swiglu else "gemm_mn"
    cands = _candidates(G, M, swiglu) + ([] if direct else _ws_candidates(x, w, w2, G, swiglu))
    cfg = pick_config(op, (m_bucket(M), N, K, G, str(x.dtype)), x.device, cands, run)
    run(cfg)
    return out


def gemm_mn(x: torch.Tensor, w: torch.Tensor, route: torch.Tensor, G: int, *,
            reordered: Reordered | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """N-axis routed GEMM (Algorithm 2): ``out[m, n] = (x @ w.T)[m, n] if route[m, n // G] else 0``.

    Args:
        x: ``[M, K]`` activations, bf16/fp16/fp32, last dim contiguous preferred.
        w: ``[N, K]`` weight (``nn.Linear`` layout), same dtype and device as x.
        route: bool ``[M, N // G]``, True = execute group g = n // G for row m.
        G: group size along N, a multiple of 16 dividing N (FFN: a power of two 16..512;
            Q projection: the head-group width Hq/N_G*d).
        reordered: optional :func:`wide.kernels.reorder` result of ``route`` (shared with the other
            ops of the same routing decision); computed here when None.  Not used (and not
            computed) for M <= ``DIRECT_MAX_M`` (128): see :func:`uses_reorder`.
        out: optional preallocated contiguous ``[M, N]`` output of x's dtype; every element is written.

    Returns:
        ``[M, N]`` in x's dtype; fp32 accumulation.

    M <= 4 uses the reorder-free GEMV path (:func:`wide.kernels.decode.gemv_mn`).  On CPU without
    ``TRITON_INTERPRET=1`` (or without Triton) falls back to :func:`reference.gemm_mn_ref`.

    Raises:
        ValueError: wrong rank/shape/dtype/device, G not a multiple of 16 or not dividing N,
            route not bool ``[M, N // G]``, malformed ``reordered`` or ``out``.
    """
    M, N, K = _validate(x, w, route, G)
    check_out(out, (M, N), x.dtype, x.device, x=x, w=w, route=route)
    if reordered is not None:  # checked on every path, so that code that runs on the CPU runs on a GPU too
        reordered = check_reordered(reordered, (M, N // G), route.device)
    from wide.kernels.decode import gemv_mn

    done = small_or_fallback(x, M, N, out, lambda: reference.gemm_mn_ref(x, w, route, G),
                             lambda: gemv_mn(x, w, route, G, out=out))
    if done is not None:
        return done
    return launch_gemm_mn(x, w, None, route, G, reordered, out, swiglu=False)
