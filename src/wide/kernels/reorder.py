"""Unified mask reordering (paper Eq. 7, Algorithm 1).

A binary routing column needs no comparison sort: a stable prefix-sum partition puts the active
rows first (in their original order) and the inactive rows after them, in O(M) work.  For row r
of a column with ``e`` active rows above it and ``total`` active rows in all, the sorted
position of r is ``e`` if r is active, else ``total + r - e`` (``r - e`` inactive rows lie above).

The mask is row-major (a row holds N_G contiguous bytes), so the kernels load row tiles
``[BM rows, NGC columns]`` (coalesced) and advance all columns of a tile together.  Two plans:

* ``columns`` (small M, one launch): one program per chunk of NGC columns holds the whole column
  chunk in one tile; ``total`` is its column sum and ``e`` its exclusive ``tl.cumsum``.
* ``blocks`` (larger M): the rows are cut into blocks of BM and every phase has one program per
  (row block, column set, column chunk):

  1. ``_block_counts_kernel`` writes each block's active count per column to a small int32
     workspace ``blk[C, n_blocks, W]``;
  2. ``_scatter_kernel`` sums ``blk`` over the earlier blocks (active rows above the block) and
     over all blocks (``total``), adds the in-block prefix sum (``tl.cumsum`` along the rows) and
     scatters ``r`` to its sorted position;
  3. for wide masks only, ``_transpose_kernel`` (below).

  The scatter is the costly part: ``index`` is row-major, so a column's consecutive positions
  lie N_G * 4 bytes apart and every 4-byte store fills its own 32-byte sector (about 40 us at
  16384 x 112 on an H200).  For N_G > 8 phase 2 therefore scatters into a column-major ``tmp
  [C, N_G, M]``, where one block's rows of a column land in two contiguous runs (coalesced), and
  phase 3 transposes ``tmp`` into ``index`` with coalesced loads and stores and writes the sorted
  mask ``smask[j, g] = j < total[g]``.  For N_G <= 8 an index row is at most one sector anyway,
  so phase 2 writes ``index`` and ``smask`` directly and there is no phase 3.

  Each phase-2 program re-reads ``blk`` ([n_blocks, NGC] int32, L2-resident) instead of a
  separate exclusive-scan launch; BM grows with M so n_blocks stays small.

Measured on an H200 (CUDA-graph replay, per call): 15.3 us at 16384 x 112 (phases 2.6 + 8.3 +
4.4 us; the one-program-per-column kernel before took 110 us), 10.5 us at 8192 x 112, 7.6 us at
2048 x 112, 4.2 us at 512 x 112, 5.2 us at [1, 16384, 8] and 3.1 us at 16384 x 1.

Launch sizes depend only on the shape, and nothing leaves the device (no ``.item()``, no
``nonzero``, no host synchronisation), so the op can be captured in a CUDA graph.  Offsets are
int64 where ``M * N_G`` can pass 2**31.
"""

from __future__ import annotations

import torch

from wide.kernels import reference
from wide.kernels._common import HAS_TRITON, Reordered, check_tensor, fail, interpret_mode, use_triton

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

    # The block plan's grids are (row block, column set c, column chunk): axis 0 takes the many
    # row blocks (its limit is 2**31 - 1; axes 1 and 2 stop at 65535).

    @triton.jit
    def _block_counts_kernel(mask_ptr, blk_ptr, M, NG, NBLK, BM: tl.constexpr,
                             NGC: tl.constexpr):
        c = tl.program_id(1)
        rows = tl.program_id(0) * BM + tl.arange(0, BM)
        cols = tl.program_id(2) * NGC + tl.arange(0, NGC)
        ok = (rows[:, None] < M) & (cols[None, :] < NG)
        m = tl.load(mask_ptr + (c.to(tl.int64) * M + rows[:, None]) * NG + cols[None, :],
                    mask=ok, other=0).to(tl.int32)
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
        else:
            # out = tmp [C, NG, M].  The pointer has no provable contiguity, so Triton lays this
            # store's threads along axis 0 (the rows): one store instruction writes one column's
            # positions of consecutive rows, which form at most two contiguous runs (seen in the
            # sm_90 TTGIR of Triton 3.6; a [columns, rows] tile gets the columns-first layout).
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
    """Launch plan for an ``[..., M, N_G]`` mask (tuned on an H200), see :func:`_launch`."""
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
    """Run a plan: ``("columns", MP, NGC, num_warps)``, or ``("blocks", BM, NGC, BJ, NGT,
    num_warps)``: row blocks of BM and column chunks of NGC in phases 1 and 2, and a transpose
    tile ``[NGT, BJ]`` in phase 3, where ``BJ == 0`` selects the direct scatter (no phase 3).
    All sizes are powers of two."""
    M, NG = mask.shape[-2], mask.shape[-1]
    C = mask.shape[0] if mask.dim() == 3 else 1
    dev = mask.device
    index = torch.empty(mask.shape, dtype=torch.int32, device=dev)
    smask = torch.empty(mask.shape, dtype=torch.bool, device=dev)
    counts = torch.empty(mask.shape[:-2] + (NG,), dtype=torch.int32, device=dev)
    kw = {} if interpret_mode() else {"num_warps": plan[-1]}
    if plan[0] == "columns":
        _, mp, ngc, _ = plan
        _columns_kernel[(triton.cdiv(NG, ngc), C)](mask, index, smask, counts, M, NG,
                                                   MP=mp, NGC=ngc, **kw)
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
    """Sort every routing column of a bool mask so that its active rows form a prefix (Eq. 7).

    Args:
        mask: bool ``[M, N_G]`` (GEMM routing, tokens flattened into M) or ``[B, T, N_G]``
            (attention routing: one column of length T per (b, g)).  True = execute.

    Returns:
        :class:`Reordered` ``(index, mask, counts)``: ``index`` int32 of the mask's shape with
        ``index[..., j, g]`` the original row of sorted row j (stable: active rows in increasing
        order, then inactive rows in increasing order); ``mask`` the sorted bool mask
        (``mask[..., j, g] == (j < counts[..., g])``); ``counts`` int32 ``[..., N_G]``.

    One result serves every op that shares the routing decision (pass it as ``reordered=``).
    Runs on the device with no host synchronisation (CUDA-graph capturable).  On CPU without
    ``TRITON_INTERPRET=1`` (or without Triton) it runs :func:`reference.reorder_ref`.

    Raises:
        ValueError: mask not a bool tensor of 2 or 3 dimensions, or with more than 2**31 - 1 rows.
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
