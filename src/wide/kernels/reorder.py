"""Unified mask reordering (paper Eq. 7, Algorithm 1): a stable prefix-sum partition of every routing column.

Row r with ``e`` active rows above it in a column of ``total`` goes to ``e`` if active, else to ``total + r - e``.
Small M: one program per chunk of columns.  Otherwise three phases: per-block active counts, a scatter that adds the
counts of earlier blocks to the in-block prefix sum (into a column-major scratch for N_G > 8, then a transpose).
Launch sizes depend only on the shape and nothing leaves the device (CUDA-graph capturable).
"""

import torch

from wide.kernels import reference
from wide.kernels._common import HAS_TRITON, Reordered, check_tensor, fail, interpret_mode, use_triton, warps

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _columns_kernel(mask_ptr, index_ptr, smask_ptr, count_ptr, M, NG,
                        MP: tl.constexpr, NGC: tl.constexpr):
        # grid (column chunk, column set c); the tile holds the whole column chunk (MP >= M)
        c = tl.program_id(1)
        rows = tl.arange(0, MP)
        cols = tl.program_id(0) * NGC + tl.arange(0, NGC)
        ok = (rows[:, None] < M) & (cols[None, :] < NG)
        offs = (c.to(tl.int64) * M + rows[:, None]) * NG + cols[None, :]
        m = tl.load(mask_ptr + offs, mask=ok, other=0).to(tl.int32)
        total = tl.sum(m, axis=0)
        e = tl.cumsum(m, axis=0) - m
        pos = tl.where(m != 0, e, total[None, :] + rows[:, None] - e)
        tl.store(index_ptr + (c.to(tl.int64) * M + pos) * NG + cols[None, :],
                 tl.broadcast_to(rows[:, None], [MP, NGC]), mask=ok)
        tl.store(smask_ptr + offs, rows[:, None] < total[None, :], mask=ok)
        tl.store(count_ptr + c.to(tl.int64) * NG + cols, total, mask=cols < NG)

    # the block plan's grids are (row block, column set c, column chunk): axis 0 takes the many row blocks

    @triton.jit
    def _block_counts_kernel(mask_ptr, blk_ptr, M, NG, NBLK, BM: tl.constexpr,
                             NGC: tl.constexpr):
        c = tl.program_id(1)
        rows = tl.program_id(0) * BM + tl.arange(0, BM)
        cols = tl.program_id(2) * NGC + tl.arange(0, NGC)
        ok = (rows[:, None] < M) & (cols[None, :] < NG)
        m = tl.load(mask_ptr + (c.to(tl.int64) * M + rows[:, None]) * NG + cols[None, :], mask=ok, other=0).to(tl.int32)
        # blk[c, block, col], W = num_programs(2) * NGC >= NG columns (the padding holds 0)
        slot = (c.to(tl.int64) * NBLK + tl.program_id(0)) * (tl.num_programs(2) * NGC)
        tl.store(blk_ptr + slot + cols, tl.sum(m, axis=0))

    @triton.jit
    def _scatter_kernel(mask_ptr, blk_ptr, out_ptr, smask_ptr, count_ptr, M, NG, NBLK, W,
                        BM: tl.constexpr, NGC: tl.constexpr, CB: tl.constexpr,
                        DIRECT: tl.constexpr):
        b = tl.program_id(0)
        c = tl.program_id(1)
        rows = b * BM + tl.arange(0, BM)
        cols = tl.program_id(2) * NGC + tl.arange(0, NGC)
        ok = (rows[:, None] < M) & (cols[None, :] < NG)
        offs = (c.to(tl.int64) * M + rows[:, None]) * NG + cols[None, :]
        m = tl.load(mask_ptr + offs, mask=ok, other=0).to(tl.int32)
        # active rows above this block (before) and in the whole column (total), from blk
        base = c.to(tl.int64) * NBLK * W
        before = tl.zeros([NGC], dtype=tl.int32)
        total = tl.zeros([NGC], dtype=tl.int32)
        for k0 in range(0, NBLK, CB):
            ks = k0 + tl.arange(0, CB)
            t = tl.load(blk_ptr + base + ks[:, None].to(tl.int64) * W + cols[None, :],
                        mask=(ks[:, None] < NBLK) & (cols[None, :] < NG), other=0)
            total += tl.sum(t, axis=0)
            before += tl.sum(tl.where(ks[:, None] < b, t, 0), axis=0)
        e = before[None, :] + tl.cumsum(m, axis=0) - m
        pos = tl.where(m != 0, e, total[None, :] + rows[:, None] - e)
        src = tl.broadcast_to(rows[:, None], [BM, NGC])
        if DIRECT:  # out = index
            tl.store(out_ptr + (c.to(tl.int64) * M + pos) * NG + cols[None, :], src, mask=ok)
            tl.store(smask_ptr + offs, rows[:, None] < total[None, :], mask=ok)
        else:  # out = tmp [C, NG, M]: a column's positions of consecutive rows form at most two contiguous runs
            tl.store(out_ptr + (c.to(tl.int64) * NG + cols[None, :]) * M + pos, src, mask=ok)
        if b == 0:
            tl.store(count_ptr + c.to(tl.int64) * NG + cols, total, mask=cols < NG)

    @triton.jit
    def _transpose_kernel(tmp_ptr, count_ptr, index_ptr, smask_ptr, M, NG,
                          BJ: tl.constexpr, NGC: tl.constexpr):
        # grid (block of BJ sorted rows, column set c, column chunk)
        c = tl.program_id(1)
        j = tl.program_id(0) * BJ + tl.arange(0, BJ)
        cols = tl.program_id(2) * NGC + tl.arange(0, NGC)
        ok = (cols[:, None] < NG) & (j[None, :] < M)
        v = tl.load(tmp_ptr + (c.to(tl.int64) * NG + cols[:, None]) * M + j[None, :], mask=ok)
        total = tl.load(count_ptr + c.to(tl.int64) * NG + cols, mask=cols < NG, other=0)
        offs = (c.to(tl.int64) * M + j[None, :]) * NG + cols[:, None]
        tl.store(index_ptr + offs, v, mask=ok)
        tl.store(smask_ptr + offs, j[None, :] < total[:, None], mask=ok)


def _plan(M: int, NG: int) -> tuple:
    """Launch plan for an ``[..., M, N_G]`` mask, see :func:`_launch`."""
    ngp = triton.next_power_of_2(NG)
    if interpret_mode():  # small tiles, so that the CPU tests cover several blocks and chunks
        if M <= 16:
            return ("columns", max(2, triton.next_power_of_2(M)), min(ngp, 4), 1)
        return ("blocks", 16, min(ngp, 16), 16 if NG > 8 else 0, min(ngp, 32), 1)
    mp = max(16, triton.next_power_of_2(M))
    if mp <= 512:  # one launch; about 512-1024 elements a program
        return ("columns", mp, min(ngp, 8, max(1, (1024 if NG > 8 else 512) // mp)), 4)
    if NG <= 8:  # direct scatter, two launches
        bm = min(8192 // ngp, max(512 // ngp, mp // 256))
        return ("blocks", bm, ngp, 0, ngp, 4)
    ngt = min(ngp, 128)
    bm = 64 if M <= 2048 else 128
    while bm < 512 and triton.cdiv(M, 2 * bm) * triton.cdiv(NG, 16) >= 384:  # keep ~3 waves
        bm *= 2
    return ("blocks", bm, 16, max(16, 8192 // ngt), ngt, 4)


def _launch(mask: torch.Tensor, plan: tuple) -> Reordered:
    """Runs ``("columns", MP, NGC, warps)`` or ``("blocks", BM, NGC, BJ, NGT, warps)`` (BJ 0: no transpose)."""
    M, NG = mask.shape[-2], mask.shape[-1]
    C = mask.shape[0] if mask.dim() == 3 else 1
    dev = mask.device
    index = torch.empty(mask.shape, dtype=torch.int32, device=dev)
    smask = torch.empty(mask.shape, dtype=torch.bool, device=dev)
    counts = torch.empty(mask.shape[:-2] + (NG,), dtype=torch.int32, device=dev)
    kw = warps(plan[-1])
    if plan[0] == "columns":
        _, mp, ngc, _ = plan
        _columns_kernel[(triton.cdiv(NG, ngc), C)](mask, index, smask, counts, M, NG, MP=mp, NGC=ngc, **kw)
        return Reordered(index, smask, counts)
    _, bm, ngc, bj, ngt, _ = plan
    nblk, nchunk = triton.cdiv(M, bm), triton.cdiv(NG, ngc)
    grid = (nblk, C, nchunk)
    blk = torch.empty((C, nblk, nchunk * ngc), dtype=torch.int32, device=dev)
    _block_counts_kernel[grid](mask, blk, M, NG, nblk, BM=bm, NGC=ngc, **kw)
    out = index if bj == 0 else torch.empty((C, NG, M), dtype=torch.int32, device=dev)
    cb = max(1, min(triton.next_power_of_2(nblk), 4096 // ngc))
    _scatter_kernel[grid](mask, blk, out, smask, counts, M, NG, nblk, nchunk * ngc,
                          BM=bm, NGC=ngc, CB=cb, DIRECT=bj == 0, **kw)
    if bj:
        _transpose_kernel[(triton.cdiv(M, bj), C, triton.cdiv(NG, ngt))](
            out, counts, index, smask, M, NG, BJ=bj, NGC=ngt, **kw)
    return Reordered(index, smask, counts)


def reorder(mask: torch.Tensor) -> Reordered:
    """Stable sort of every routing column of a bool mask ``[M, N_G]`` (GEMM routing) or ``[B, T, N_G]`` (attention
    routing), active rows first (Eq. 7).  Returns :class:`Reordered`; one result serves every op of a routing decision.
    Raises KernelArgumentError: not a 2-D or 3-D bool tensor, or 2**31 - 1 rows or more.
    """
    check_tensor("mask", mask, None, (torch.bool,))
    if mask.dim() not in (2, 3):
        fail(f"mask must have shape [M, N_G] or [B, T, N_G], got {tuple(mask.shape)}")
    if mask.shape[-2] >= 2**31 - 1:
        fail(f"mask has {mask.shape[-2]} rows; at most 2**31 - 2 are supported")
    if not use_triton(mask) or mask.numel() == 0:
        return reference.reorder_ref(mask)
    mask = mask.contiguous()
    return _launch(mask, _plan(mask.shape[-2], mask.shape[-1]))
