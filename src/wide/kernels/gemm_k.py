"""GEMM-K: K-axis routed GEMM (paper Eq. 21, Algorithm 3), used by the O and down projections.

``out[m, :] = sum over active groups g of a[m, gG:(g+1)G] @ w[:, gG:(g+1)G].T``

Two execution paths, chosen **on the device** by every program from the reorder counts (no host
synchronisation; the path that is not taken exits at once):

* ``sparse`` (Algorithm 3): programs own a (sorted row tile, N tile) and a chunk of ``GPC``
  K-groups, run a group-local pipeline over each active group (level-0 skip of inactive
  ``[BM, G]`` blocks), and scatter-add the fp32 partial tile through the reorder index with
  relaxed atomics into an fp32 workspace, which a last pass converts to the output dtype.
* ``masked`` (Appendix A's mask-multiply dense, host-chosen): the inactive groups of ``a`` are zeroed
  into a scratch copy (one Triton select that reads only the active groups) and cuBLAS does the GEMM,
  in row chunks whose size is autotuned (``MASKED_CHUNKS``, or all rows).  Nothing is skipped, but it
  runs at cuBLAS's speed: the auto path takes it from ``SPARSE_MIN_M`` rows for G <=
  ``MASKED_AUTO_MAX_G``, and times it against the kernels for fewer rows.
* ``dense`` (fused mask-multiply): programs own an output tile in the original row order and
  run one dense K pipeline whose A loads are predicated by the route (inactive groups read no
  A bytes, level 1), or, in the tile configs marked ``TMA`` (many rows, 16-byte aligned operands),
  whose A and weight tiles arrive whole by tensor descriptor and the route zeroes the inactive
  rows of the A tile in registers.  No atomics, no workspace pass; used when the active fraction
  is high, where the atomic epilogue of the sparse path would cost more than it saves.

For ``M <= 4`` the op dispatches to the reorder-free GEMV path in :mod:`wide.kernels.decode`.
"""

from __future__ import annotations

import torch

from wide.kernels import reference
from wide.kernels._common import (
    FLOAT_DTYPES,
    HAS_TRITON,
    Reordered,
    check_flag,
    check_group,
    check_in_place,
    check_out,
    check_reordered,
    check_route,
    check_same_device,
    check_tensor,
    fail,
    interpret_mode,
    launch_opts,
    m_bucket,
    next_pow2,
    pick_config,
    pow2_part,
    small_or_fallback,
    tma_aligned,
    use_triton,
)

SPARSE_MIN_M = 512


# From SPARSE_MIN_M rows, the auto path runs the masked cuBLAS path for G up to this (no reorder, no workspace).
# H200, down shape, every path forced in one record: with the torch.where select the masked path ran 0.77-0.86x of
# cuBLAS at M = 1024-16384 (benchmarks/kernels/kernels_h200-s17-gemmk-masked.md); with the Triton select that reads
# only the active groups (3.8 TB/s) it runs 0.86-0.95x at s in {0, 0.5} and 0.93-1.02x at s = 0.75, and beats the
# sparse path and the dense kernel at every G up to 512 and s up to 0.75 (kernels_h200-s18-gemmk-select.md; at
# G = 512, s = 0.75: 0.586 against 0.604 ms at M = 4096).  Wider groups (an O projection of more than 4 heads of
# 128 per group) keep the on-device choice between the sparse path and the dense kernel, where the sparse path's
# atomic traffic, p * M * N * K / G, keeps falling.
MASKED_AUTO_MAX_G = 512


def uses_reorder(M: int, G: int | None = None) -> bool:
    """Whether ``gemm_k(path="auto")`` consumes a reorder for M rows (and group size G, if given).  Below
    ``SPARSE_MIN_M`` rows every weight group is needed by some row with high probability, so the auto path
    is the split-K / dense kernel or the masked cuBLAS path, which need no reorder; so it is at every M for
    G <= ``MASKED_AUTO_MAX_G`` (the masked path).  Without G: whether it may (True from ``SPARSE_MIN_M``)."""
    return M >= SPARSE_MIN_M and (G is None or G > MASKED_AUTO_MAX_G)


# Row chunks of the masked path tried by the autotuner (besides all rows at once): the zeroed copy of ``a`` is then
# ``[chunk, K]``, a bound on the extra memory that does not grow with M.
MASKED_CHUNKS = (4096, 2048, 1024)


def masked_cands(M: int) -> list[dict]:
    """Configs ``{"ROWS": r}`` of :func:`masked_dense` for M rows: all rows in one GEMM first (``ROWS=0``), then the
    row chunks of ``MASKED_CHUNKS`` below M's autotuning bucket (:func:`m_bucket`, so every M of a bucket tunes the
    same list; ``r`` rows of the zeroed copy at a time, one cuBLAS GEMM each)."""
    return [dict(ROWS=0)] + [dict(ROWS=r) for r in MASKED_CHUNKS if r < m_bucket(M)]


def mask_select(a: torch.Tensor, route: torch.Tensor, G: int, out: torch.Tensor) -> torch.Tensor:
    """``out = a`` with the inactive groups zeroed: ``out[m, k] = a[m, k] if route[m, k // G] else 0`` (the
    ``A ⊙_G M`` of Eq. 21 as a select, so inf / NaN in inactive groups never pass).

    Args:
        a: ``[M, K]`` with unit column stride (bf16/fp16/fp32; any row stride); route: contiguous bool
            ``[M, K // G]``; G: group size along K (a multiple of 16 dividing K); out: contiguous ``[M, K]`` in a's
            dtype on a's device that does not overlap ``a``, or ``a`` itself: in place, only the inactive groups
            are written (zeros) and the executed ones are neither read nor written.

    Returns:
        ``out``.  With Triton (a CUDA tensor, or ``TRITON_INTERPRET=1``) one elementwise kernel that reads only the
        active groups of ``a`` (``(1 - s) * M * K`` elements read, ``M * K`` written; in place: ``s * M * K``
        written, none read; no host sync, CUDA-graph capturable), else ``torch.where`` (``masked_fill_`` in place).

    Raises:
        ValueError: (:class:`~wide.kernels.KernelArgumentError`) a not a 2-D bf16/fp16/fp32 tensor, G not a multiple
            of 16 dividing K, route not bool ``[M, K // G]``, tensors on different devices, ``out`` not a
            contiguous ``[M, K]`` tensor in a's dtype (or overlapping ``route``, or overlapping ``a`` without being
            ``a``), or in place with an ``a`` whose column stride is not 1, whose rows share memory (an expanded
            view), that requires grad, or that overlaps ``route``.
    """
    check_tensor("a", a, 2, FLOAT_DTYPES)
    M, K = a.shape
    check_group(G, K, "K (input features)")
    check_route(route, M, K // G)
    check_same_device(a=a, route=route)
    if out is None:
        fail("mask_select: out must be a contiguous [M, K] tensor (or a itself, in place), got None")
    if _same_view(out, a):
        check_in_place(a, "mask_select in place", route=route)
        _select(a, route.contiguous(), G, a)
        return out
    check_out(out, (M, K), a.dtype, a.device, a=a, route=route)
    return _select(a if a.stride(1) == 1 else a.contiguous(), route.contiguous(), G, out)


def _same_view(t: torch.Tensor, a: torch.Tensor) -> bool:
    """Whether ``t`` is ``a`` (the same elements: storage offset, shape, strides and dtype)."""
    return t is a or (isinstance(t, torch.Tensor) and t.device == a.device and t.dtype == a.dtype
                      and t.data_ptr() == a.data_ptr() and t.shape == a.shape and t.stride() == a.stride())


def _select(a: torch.Tensor, route: torch.Tensor, G: int, out: torch.Tensor) -> torch.Tensor:
    """:func:`mask_select` on checked arguments (unit column stride ``a``, contiguous ``route``; ``out`` contiguous,
    or ``a`` itself for in place)."""
    M, K = a.shape
    if M == 0 or K == 0:
        return out
    inplace = out is a
    if not use_triton(a):  # (False without Triton; warns once where Triton was wanted)
        if inplace:
            a.view(M, K // G, G).masked_fill_(~route.view(M, K // G, 1), 0)
            return a
        zero = torch.zeros((), dtype=a.dtype, device=a.device)
        torch.where(route.view(M, K // G, 1), a.view(M, K // G, G), zero, out=out.view(M, K // G, G))
        return out
    NG = K // G
    gp = next_pow2(G)
    br, cols = (4, 64) if interpret_mode() else (8, 1024)
    gb = max(1, min(cols // gp, next_pow2(NG)))  # whole groups per block
    grid = (triton.cdiv(M, br) * triton.cdiv(NG, gb),)
    _mask_select_kernel[grid](a, route, out, M, K, NG, a.stride(0), out.stride(0), G=G, BR=br, GB=gb, GP=gp,
                              INPLACE=inplace, **({} if interpret_mode() else {"num_warps": 4}))
    return out


def masked_dense(a: torch.Tensor, w: torch.Tensor, route: torch.Tensor, G: int, out: torch.Tensor,
                 rows: int | None = None, overwrite_a: bool = False) -> torch.Tensor:
    """GEMM-K as Appendix A's mask-multiply dense: ``out = (a with the inactive groups zeroed) @ w.T``.

    Args:
        a: ``[M, K]`` with unit column stride (bf16/fp16/fp32); w: ``[N, K]``, a's dtype; route: contiguous bool
            ``[M, K // G]``; G: group size along K; out: contiguous ``[M, N]`` in a's dtype; rows: rows per chunk
            (an int; default None or 0: all M): the zeroed copy is ``[rows, K]`` and one GEMM runs per chunk;
            overwrite_a: zero the inactive groups of ``a`` itself (:func:`mask_select` in place) and run one GEMM on
            it: no copy, no extra memory, ``rows`` ignored; the executed groups of ``a`` are left unchanged.

    Returns:
        ``out``.  The zeroed copy of ``a`` is a select (:func:`mask_select`), not a multiply, so values of ``a`` in
        inactive groups (inf / NaN too) never reach the result, as in the kernels; the GEMM is ``torch.mm``
        (cuBLAS on a GPU, its fp32 accumulation).  Extra memory: ``min(rows, M) * K`` elements (none with
        ``overwrite_a``).  CUDA-graph capturable, no host sync.

    Raises:
        ValueError: (:class:`~wide.kernels.KernelArgumentError`) bad a / route / G (as :func:`mask_select`), w not
            ``[N, K]`` in a's dtype, ``out`` not a contiguous ``[M, N]`` tensor in a's dtype, rows not None /
            an int >= 0, or ``overwrite_a`` not a bool / set with an ``a`` that cannot be overwritten (column
            stride not 1, rows sharing memory, requiring grad, or sharing memory with ``w`` / ``route``).
    """
    check_tensor("a", a, 2, FLOAT_DTYPES)
    check_tensor("w", w, 2, (a.dtype,))
    M, K = a.shape
    if w.shape[1] != K:
        fail(f"w must have shape [N, K] with K={K}; got {tuple(w.shape)}")
    check_same_device(a=a, w=w)
    if out is None:
        fail("masked_dense: out must be a contiguous [M, N] tensor, got None")
    check_out(out, (M, w.shape[0]), a.dtype, a.device, a=a, w=w, route=route)
    if rows is not None and (isinstance(rows, bool) or not isinstance(rows, int) or rows < 0):
        fail(f"masked_dense: rows={rows!r} must be None or an int >= 0 (0: all rows)")
    check_flag("overwrite_a", overwrite_a)
    check_group(G, K, "K (input features)")
    check_route(route, M, K // G)
    check_same_device(a=a, route=route)
    if overwrite_a:
        check_in_place(a, "masked_dense(overwrite_a=True)", w=w, route=route)
    return _masked_mm(a if a.stride(1) == 1 else a.contiguous(), w, route.contiguous(), G, out, rows, overwrite_a)


def _masked_mm(a: torch.Tensor, w: torch.Tensor, route: torch.Tensor, G: int, out: torch.Tensor,
               rows: int | None, overwrite_a: bool = False) -> torch.Tensor:
    """:func:`masked_dense` on checked arguments (what :func:`gemm_k` has already validated)."""
    M, K = a.shape
    rows = M if not rows else min(rows, M)
    if M == 0:
        return out
    if overwrite_a:
        return torch.mm(_select(a, route, G, a), w.t(), out=out)
    buf = torch.empty((rows, K), dtype=a.dtype, device=a.device)
    wt = w.t()
    for r0 in range(0, M, rows):
        r1 = min(M, r0 + rows)
        am = _select(a[r0:r1], route[r0:r1], G, buf[: r1 - r0])
        torch.mm(am, wt, out=out[r0:r1])
    return out


# Active fraction above which the auto path runs the dense (mask-predicated) kernel rather than the sparse one; only
# groups wider than MASKED_AUTO_MAX_G reach this choice.  From the H200 probe (benchmarks/kernels/README.md): at
# M = 4096 the sparse (atomic) path took about 0.32 + 1.38 p ms at G = 512, the dense kernel 0.95 ms (p = active
# fraction), a crossover at p = 0.45; the atomic term scales with 1 / G, so at G = 1024 it moves to about 0.9.
DENSE_ABOVE = 0.8

if HAS_TRITON:
    import triton
    import triton.language as tl

    from wide.kernels._common import mm, mma  # noqa: F401

    @triton.jit
    def _use_dense(cnt_ptr, M, NG, THR_PPM, NG_P2: tl.constexpr):
        offs = tl.arange(0, NG_P2)
        c = tl.load(cnt_ptr + offs, mask=offs < NG, other=0).to(tl.int64)
        total = tl.sum(c, axis=0)
        # dense iff total / (M * NG) > THR_PPM / 1e6
        return total * 1000000 > THR_PPM.to(tl.int64) * M * NG

    @triton.jit
    def _mask_select_kernel(a_ptr, route_ptr, out_ptr, M, K, NG, stride_am, stride_om, G: tl.constexpr,
                            BR: tl.constexpr, GB: tl.constexpr, GP: tl.constexpr, INPLACE: tl.constexpr):
        # one block of out = a with the inactive groups zeroed: BR rows x GB whole groups of G columns (G padded to
        # the power of two GP); the route is read once per (row, group) and inactive groups are not read at all.
        # INPLACE (out is a): only the zeros of the inactive groups are stored; a is not read
        pid = tl.program_id(0)
        nb = tl.cdiv(NG, GB)
        pr = pid // nb
        pg = pid - pr * nb
        rows = pr * BR + tl.arange(0, BR)
        grp = pg * GB + tl.arange(0, GB)
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

    @triton.jit
    def _gemm_k_sparse_kernel(x_ptr, w_ptr, ws_ptr, idx_ptr, cnt_ptr, M, N, NG, THR_PPM,
                              stride_xm, stride_wn, G,
                              BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                              GPC: tl.constexpr, NG_P2: tl.constexpr):
        if _use_dense(cnt_ptr, M, NG, THR_PPM, NG_P2):
            return
        pid = tl.program_id(0)
        split = tl.program_id(1)
        num_pid_n = tl.cdiv(N, BN)
        pid_m = pid // num_pid_n
        pid_n = pid % num_pid_n
        m0 = pid_m * BM
        offs_j = m0 + tl.arange(0, BM)
        valid = offs_j < M
        offs_n = pid_n * BN + tl.arange(0, BN)
        nmask = offs_n < N
        offs_k = tl.arange(0, BK)
        for gi in range(0, GPC):
            g = split * GPC + gi
            if g < NG:
                cnt = tl.load(cnt_ptr + g)
                if m0 < cnt:  # level 0: skip the whole [BM, G] block otherwise
                    active = offs_j < cnt
                    rows = tl.load(idx_ptr + offs_j.to(tl.int64) * NG + g, mask=valid, other=0).to(tl.int64)
                    a_ptrs = x_ptr + rows[:, None] * stride_xm + (g * G + offs_k)[None, :]
                    b_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + (g * G + offs_k)[:, None]
                    acc = tl.zeros((BM, BN), dtype=tl.float32)
                    for kk in range(0, G // BK):
                        a = tl.load(a_ptrs, mask=active[:, None], other=0.0)
                        b = tl.load(b_ptrs, mask=nmask[None, :], other=0.0)
                        acc = mma(a, b, acc)
                        a_ptrs += BK
                        b_ptrs += BK
                    c_ptrs = ws_ptr + rows[:, None] * N + offs_n[None, :]
                    tl.atomic_add(c_ptrs, acc, mask=active[:, None] & nmask[None, :], sem="relaxed")

    @triton.jit
    def _gemm_k_dense_kernel(x_ptr, w_ptr, out_ptr, route_ptr, cnt_ptr, M, N, K, NG, THR_PPM,
                             stride_xm, stride_wn, stride_om, G,
                             BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                             GROUP_M: tl.constexpr, NG_P2: tl.constexpr, FORCE: tl.constexpr,
                             a_desc, w_desc, USE_TMA: tl.constexpr):
        if not FORCE:
            if not _use_dense(cnt_ptr, M, NG, THR_PPM, NG_P2):
                return
        pid = tl.program_id(0)
        num_pid_m = tl.cdiv(M, BM)
        num_pid_n = tl.cdiv(N, BN)
        num_pid_in_group = GROUP_M * num_pid_n
        group_id = pid // num_pid_in_group
        first_pid_m = group_id * GROUP_M
        group_size_m = tl.minimum(num_pid_m - first_pid_m, GROUP_M)
        pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
        pid_n = (pid % num_pid_in_group) // group_size_m
        offs_m = pid_m * BM + tl.arange(0, BM)
        valid = offs_m < M
        offs_m64 = offs_m.to(tl.int64)
        offs_n = pid_n * BN + tl.arange(0, BN)
        nmask = offs_n < N
        offs_k = tl.arange(0, BK)
        a_ptrs = x_ptr + offs_m64[:, None] * stride_xm + offs_k[None, :]
        b_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
        r_ptrs = route_ptr + offs_m64 * NG
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for kt in range(0, K // BK):
            g = (kt * BK) // G
            rm = tl.load(r_ptrs + g, mask=valid, other=0) != 0
            if USE_TMA:
                # both tiles by the bulk tensor copy engine (rows past M / N arrive as zeros); the route then
                # zeroes the inactive rows of the A tile in registers (a fused mask-multiply: no A bytes saved,
                # but the loads run at the copy engine's rate)
                a = a_desc.load([pid_m * BM, kt * BK])
                a = tl.where(rm[:, None], a, tl.zeros_like(a))
                b = w_desc.load([pid_n * BN, kt * BK]).T
            else:
                a = tl.load(a_ptrs, mask=rm[:, None], other=0.0)
                b = tl.load(b_ptrs, mask=nmask[None, :], other=0.0)
            acc = mma(a, b, acc)
            a_ptrs += BK
            b_ptrs += BK
        o_ptrs = out_ptr + offs_m64[:, None] * stride_om + offs_n[None, :]
        tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & nmask[None, :])

    @triton.jit
    def _ws_kernel(ws_ptr, out_ptr, cnt_ptr, M, NG, THR_PPM, total, CONVERT: tl.constexpr,
                   BLOCK: tl.constexpr, NG_P2: tl.constexpr):
        """Zero (CONVERT=False) or convert (CONVERT=True) the fp32 workspace, sparse path only."""
        if _use_dense(cnt_ptr, M, NG, THR_PPM, NG_P2):
            return
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        msk = offs < total
        if CONVERT:
            v = tl.load(ws_ptr + offs, mask=msk, other=0.0)
            tl.store(out_ptr + offs, v.to(out_ptr.dtype.element_ty), mask=msk)
        else:
            tl.store(ws_ptr + offs, tl.zeros((BLOCK,), dtype=tl.float32), mask=msk)


def _sparse_candidates(G):
    if interpret_mode():
        return [dict(BM=32, BN=32, BK=min(pow2_part(G), 32), GPC=2)]
    out = []
    for bm, bn, bk, gpc, w, s in [(128, 128, 64, 8, 8, 3), (64, 128, 64, 8, 4, 3), (128, 64, 64, 4, 4, 3)]:
        out.append(dict(BM=bm, BN=bn, BK=min(bk, pow2_part(G)), GPC=gpc, num_warps=w, num_stages=s))
    return out


def _dense_candidates(G, M):
    """Tile configs of the route-predicated dense kernel for M rows (the autotuner times them on the GPU).  From
    129 rows the list adds tiles whose A and weight tiles both come by TMA, the route applied in registers
    (``TMA``); such a config runs its pointer-load variant when an operand is not :func:`tma_aligned`.  Under the
    interpreter: one small pointer-load config."""
    if interpret_mode():
        return [dict(BM=32, BN=32, BK=min(pow2_part(G), 32), GROUP_M=4)]
    base = [(128, 256, 64, 8, 3), (128, 128, 64, 8, 4), (64, 128, 64, 4, 4)]
    if M <= 64:
        base = [(64, 128, 64, 4, 4), (32, 64, 128, 4, 4), (64, 64, 128, 4, 3)]
    cands = [dict(BM=bm, BN=bn, BK=min(bk, pow2_part(G)), GROUP_M=8, num_warps=w, num_stages=s)
             for bm, bn, bk, w, s in base]
    if M > 128 and HAS_TRITON and hasattr(tl, "tensor_descriptor"):
        cands += [dict(BM=128, BN=256, BK=min(64, pow2_part(G)), GROUP_M=8, num_warps=8, num_stages=s, TMA=True)
                  for s in (3, 4)] + [dict(BM=128, BN=128, BK=min(64, pow2_part(G)), GROUP_M=8, num_warps=8,
                                           num_stages=4, TMA=True)]
    return cands


def _launch_dense(a, w, out, route, cnt, G, thr_ppm, ng_p2, force, cfg):
    """One launch of ``_gemm_k_dense_kernel`` (route-predicated, original row order) with tile config ``cfg``;
    ``force`` runs it unconditionally, else it exits unless the device-side counts ``cnt`` choose it."""
    M, K = a.shape
    N = w.shape[0]
    grid = (triton.cdiv(M, cfg["BM"]) * triton.cdiv(N, cfg["BN"]),)
    tma = bool(cfg.get("TMA", False)) and tma_aligned(a, w)
    if tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        ad = TensorDescriptor.from_tensor(a, [cfg["BM"], cfg["BK"]])
        wd = TensorDescriptor.from_tensor(w, [cfg["BN"], cfg["BK"]])
    else:
        ad, wd = a, w
    _gemm_k_dense_kernel[grid](a, w, out, route, cnt, M, N, K, K // G, thr_ppm, a.stride(0), w.stride(0),
                               out.stride(0), G, BM=cfg["BM"], BN=cfg["BN"], BK=cfg["BK"], GROUP_M=cfg["GROUP_M"],
                               NG_P2=ng_p2, FORCE=force, a_desc=ad, w_desc=wd, USE_TMA=tma, **launch_opts(cfg))


def gemm_k(a: torch.Tensor, w: torch.Tensor, route: torch.Tensor, G: int, *,
           reordered: Reordered | None = None, out: torch.Tensor | None = None,
           path: str = "auto", overwrite_a: bool = False) -> torch.Tensor:
    """K-axis routed GEMM (Eq. 21, Algorithm 3): ``out[m] = sum_{g: route[m, g]} a[m, K_g] @ w[:, K_g].T``.

    Args:
        a: ``[M, K]`` activations (bf16/fp16/fp32), e.g. the attention output or SwiGLU output.
        w: ``[N, K]`` weight (``nn.Linear`` layout), same dtype/device as a.
        route: bool ``[M, K // G]``, True = group g of the reduction dimension is used by row m.
        G: group size along K, a multiple of 16 dividing K (FFN down: a power of two 16..512;
            O projection: the head-group width).
        reordered: optional shared :func:`wide.kernels.reorder` result of ``route``.  Ignored for
            M <= 4.
        out: optional preallocated contiguous ``[M, N]`` output (a's dtype); every element written.
        path: ``"auto"`` (default: for M < ``SPARSE_MIN_M`` the fastest of ``splitk``, ``dense`` and ``masked``
            for this shape, autotuned once with every group executed; from ``SPARSE_MIN_M`` rows ``masked`` for
            G <= ``MASKED_AUTO_MAX_G``, else chosen on the device from the active fraction, see
            ``DENSE_ABOVE``), ``"sparse"`` (atomic scatter-add, Algorithm 3), ``"dense"`` (route-predicated
            dense pipeline), ``"splitk"`` (:func:`wide.kernels.decode.splitk_k`: per row tile, only the groups
            some row executes are read, split over K; no reorder) or ``"masked"`` (:func:`masked_dense`: the
            inactive groups of ``a`` zeroed into a scratch copy, then one cuBLAS GEMM; no reorder).  All paths
            give the same function for finite ``w`` (an inf / NaN weight in a group that row m skips makes row m
            NaN on every path, as in the reference, except ``sparse``, which never reads that group for m).
        overwrite_a: allow the masked path to zero the inactive groups of ``a`` in place (:func:`mask_select`
            with ``out=a``: ``s * M * K`` elements written, none read) instead of into a scratch copy, so it needs
            no extra memory; set it when ``a`` is a temporary (e.g. the activation of a layer).  The executed
            groups of ``a`` are never changed; other paths leave ``a`` untouched; an ``a`` whose column stride is
            not 1 or whose rows share memory (an expanded view) is first copied, and the copy is overwritten.

    Returns:
        ``[M, N]`` in a's dtype, accumulated in fp32 (the result does not depend on the order of the
        atomics beyond fp32 rounding).  The sparse path, and ``auto`` from ``SPARSE_MIN_M`` rows where the
        device may pick it (G > ``MASKED_AUTO_MAX_G``), allocate an fp32 ``[M, N]`` workspace; the masked path
        a ``[rows, K]`` zeroed copy of ``a`` (rows = M or the autotuned chunk of ``MASKED_CHUNKS``; none with
        ``overwrite_a``).

    M <= 4 uses :func:`wide.kernels.decode.gemv_k`.  CPU without ``TRITON_INTERPRET=1`` falls back to
    :func:`reference.gemm_k_ref`.

    Raises:
        ValueError: wrong rank/shape/dtype/device, G illegal or not dividing K, bad route/out/path, overwrite_a not
            a bool, or set with an ``a`` that requires grad or shares memory with ``w`` / ``route``.
    """
    check_tensor("a", a, 2, FLOAT_DTYPES)
    check_tensor("w", w, 2, FLOAT_DTYPES)
    if w.dtype != a.dtype:
        fail(f"w dtype {w.dtype} must match a dtype {a.dtype}")
    M, K = a.shape
    N = w.shape[0]
    if w.shape[1] != K:
        fail(f"w must have shape [N, K] with K={K} (a is [M, K]); got {tuple(w.shape)}")
    check_group(G, K, "K (input features)")
    NG = K // G
    check_route(route, M, NG)
    check_same_device(a=a, w=w, route=route)
    check_out(out, (M, N), a.dtype, a.device, a=a, w=w, route=route)
    if path not in ("auto", "sparse", "dense", "splitk", "masked"):
        fail(f"path={path!r}; allowed: 'auto', 'sparse', 'dense', 'splitk', 'masked'")
    check_flag("overwrite_a", overwrite_a)
    if overwrite_a:  # on every path, before anything is written (a bad layout is copied below, not refused)
        check_in_place(a, "gemm_k(overwrite_a=True)", layout=False, w=w, route=route)
    if reordered is not None:  # checked on every path, so that code that runs on the CPU runs on a GPU too
        reordered = check_reordered(reordered, (M, NG), route.device)
    from wide.kernels.decode import gemv_k

    done = small_or_fallback(a, M, N, out, lambda: reference.gemm_k_ref(a, w, route, G),
                             lambda: gemv_k(a, w, route, G, out=out))
    if done is not None:
        return done
    if a.stride(1) != 1 or (overwrite_a and M > 1 and abs(a.stride(0)) < K):
        a = a.contiguous()  # (rows that share memory cannot be zeroed per row in place: the copy is)
    if w.stride(1) != 1:
        w = w.contiguous()
    route = route.contiguous()
    if out is None:
        out = torch.empty((M, N), dtype=a.dtype, device=a.device)
    if path == "masked" or (path == "auto" and M >= SPARSE_MIN_M and G <= MASKED_AUTO_MAX_G):
        if overwrite_a:  # in place: one select kernel and one GEMM, nothing to tune
            return _masked_mm(a, w, route, G, out, None, True)
        mcfg = pick_config("gemm_k_masked", (m_bucket(M), N, K, G, str(a.dtype)), a.device, masked_cands(M),
                           lambda c: _masked_mm(a, w, route, G, out, c["ROWS"]))
        return _masked_mm(a, w, route, G, out, mcfg["ROWS"])
    if path == "splitk" or (path == "auto" and M < SPARSE_MIN_M):
        from wide.kernels.decode import _dense_tuner, splitk_cands, splitk_k

        def run_small(cfg, route=route):
            kind = cfg.pop("KIND", "splitk")
            if kind == "splitk":
                splitk_k(a, w, route, G, out, cfg)
            elif kind == "masked":
                _masked_mm(a, w, route, G, out, cfg.get("ROWS"), overwrite_a)
            else:
                _launch_dense(a, w, out, route, route, G, -1, 16, True, cfg)

        cands = [dict(c, KIND="splitk") for c in splitk_cands(G, K, N, M)]
        if path == "auto":  # the split-K kernel against the dense-order one and cuBLAS, with every group executed
            cands += [dict(c, KIND="dense") for c in _dense_candidates(G, M)]
            if not interpret_mode():
                cands += [dict(c, KIND="masked") for c in masked_cands(M)]
        # in place the masked candidate costs less (its own tuning entry); the tuner's route executes every group,
        # so tuning never changes a
        key = (m_bucket(M), N, K, G, str(a.dtype)) + (("overwrite_a",) if overwrite_a and path == "auto" else ())
        cfg = pick_config("gemm_k_small" if path == "auto" else "gemm_k_splitk", key,
                          a.device, cands, _dense_tuner(lambda c, r: run_small(dict(c), r), route), graph=True)
        run_small(cfg)
        return out
    thr = DENSE_ABOVE if path == "auto" else (2.0 if path == "sparse" else -1.0)
    thr_ppm = int(round(thr * 1_000_000))
    ng_p2 = max(16, next_pow2(NG))

    if path == "dense":  # no reorder, no fp32 workspace
        cnt = torch.zeros(1, dtype=torch.int32, device=a.device)
        def run_dense(cfg):
            _launch_dense(a, w, out, route, cnt, G, thr_ppm, 16, True, cfg)
        cfg = pick_config("gemm_k_dense", (m_bucket(M), N, K, G, str(a.dtype)), a.device,
                          _dense_candidates(G, M), run_dense)
        run_dense(cfg)
        return out

    if reordered is None:
        from wide.kernels.reorder import reorder
        reordered = reorder(route)
    idx, cnt = reordered.index, reordered.counts
    ws = torch.empty((M, N), dtype=torch.float32, device=a.device)
    total = M * N
    wsblock = 1024

    def run_ws(convert, thr=thr_ppm):
        _ws_kernel[(triton.cdiv(total, wsblock),)](ws, out, cnt, M, NG, thr, total, CONVERT=convert,
                                                  BLOCK=wsblock, NG_P2=ng_p2)

    def run_sparse(cfg, thr=thr_ppm):
        grid = (triton.cdiv(M, cfg["BM"]) * triton.cdiv(N, cfg["BN"]), triton.cdiv(NG, cfg["GPC"]))
        _gemm_k_sparse_kernel[grid](a, w, ws, idx, cnt, M, N, NG, thr, a.stride(0), w.stride(0), G,
                                    BM=cfg["BM"], BN=cfg["BN"], BK=cfg["BK"], GPC=cfg["GPC"],
                                    NG_P2=ng_p2, **launch_opts(cfg))

    def run_dense_auto(cfg):
        _launch_dense(a, w, out, route, cnt, G, thr_ppm, ng_p2, False, cfg)

    key = (m_bucket(M), N, K, G, str(a.dtype))
    if thr < 1.0:
        # tune the dense kernel with the path forced on (the auto kernel may exit early)
        def run_dense_forced(cfg):
            _launch_dense(a, w, out, route, cnt, G, thr_ppm, ng_p2, True, cfg)
        dcfg = pick_config("gemm_k_dense", key, a.device, _dense_candidates(G, M), run_dense_forced)
    if thr >= 0.0:
        scfg = pick_config("gemm_k_sparse", key, a.device, _sparse_candidates(G),
                           lambda c: (run_ws(False, 2_000_000), run_sparse(c, 2_000_000)))  # forced sparse
        run_ws(False)
        run_sparse(scfg)
        run_ws(True)
    if thr < 1.0:
        run_dense_auto(dcfg)
    return out
