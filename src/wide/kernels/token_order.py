"""Shared token order of a K-axis projection: the tokens sorted by their routing pattern (the N_G mask bits, N_G <= 16),
one order for every group, with the union of the groups each 64-row tile of the sorted order executes (paper §3.3,
Eq. 9 at the row-tile level, over one shared order instead of one order per group).

Counting sort over the 2**N_G patterns, O(M), two launches of fixed sizes and nothing read back to the host (CUDA-graph
capturable): per-block pattern counts, whose last block takes the exclusive prefix sum over (pattern, block); a stable
scatter, whose last block ORs the sorted patterns per tile.  Patterns are
ordered by their Gray-code rank, so consecutive patterns differ in one group and a tile that straddles two executes
one group more than the larger of them, not up to all.
"""

import functools
import operator
from typing import NamedTuple

import torch

from wide.kernels import _common as common
from wide.kernels import reference

TILE = 64  # rows per tile union
MAX_GROUPS = 16

if common.HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _pattern(mask_ptr, rows, M, NG, NGP: tl.constexpr):
        """``(bits, rank)`` of the rows: the mask bits ``sum_g mask[r, g] << g`` and their Gray-code rank."""
        offs_g = tl.arange(0, NGP)
        ok = (rows[:, None] < M) & (offs_g[None, :] < NG)
        m = tl.load(mask_ptr + rows[:, None].to(tl.int64) * NG + offs_g[None, :], mask=ok, other=0)
        bits = tl.sum((m != 0).to(tl.int32) << offs_g[None, :], axis=1)
        r = bits ^ (bits >> 1)
        r = r ^ (r >> 2)
        r = r ^ (r >> 4)
        r = r ^ (r >> 8)
        return bits, r

    @triton.jit
    def _chunk(mask_ptr, c0, i, M, NG, NGP: tl.constexpr):
        """Rows ``c0 + i`` of a chunk: ``(rows, ok, bits, rank, before, after)``, ``before`` / ``after`` the rows of the
        same pattern earlier / later in the chunk (padding rows get distinct negative ranks and match nothing)."""
        rows = c0 + i
        ok = rows < M
        bits, r = _pattern(mask_ptr, rows, M, NG, NGP)
        r = tl.where(ok, r, -1 - i)
        eq = (r[:, None] == r[None, :]).to(tl.int32)
        before = tl.sum(tl.where(i[None, :] < i[:, None], eq, 0), axis=1)
        after = tl.sum(tl.where(i[None, :] > i[:, None], eq, 0), axis=1)
        return rows, ok, bits, r, before, after

    @triton.jit
    def _scan(cnt_ptr, L, SB: tl.constexpr):
        """cnt (L = 2**N_G * NBLK counters, pattern-major) replaced by its exclusive prefix sum (read past L1)."""
        carry = tl.zeros((), dtype=tl.int32)
        for s in range(0, L, SB):
            offs = s + tl.arange(0, SB)
            v = tl.load(cnt_ptr + offs, mask=offs < L, other=0, cache_modifier=".cg")
            tl.store(cnt_ptr + offs, tl.cumsum(v, axis=0) - v + carry, mask=offs < L)
            carry += tl.sum(v, axis=0)

    @triton.jit
    def _or(a, b):
        return a | b

    @triton.jit
    def _unions(key_ptr, union_ptr, t0, NT, M, T: tl.constexpr, UB: tl.constexpr):
        """union[t] = OR of the sorted keys of tile t, for UB tiles from t0 (read past L1)."""
        tt = t0 + tl.arange(0, UB)
        offs = tt[:, None] * T + tl.arange(0, T)[None, :]
        k = tl.load(key_ptr + offs, mask=offs < M, other=0, cache_modifier=".cg")
        tl.store(union_ptr + tt, tl.reduce(k, 1, _or), mask=tt < NT)

    @triton.jit
    def _count_kernel(mask_ptr, cnt_ptr, tick_ptr, M, NG, NBLK, BLK, CH: tl.constexpr, NGP: tl.constexpr,
                      ZB: tl.constexpr, SB: tl.constexpr, FUSE: tl.constexpr):
        # grid (NBLK,): block b zeroes its counters cnt[rank * NBLK + b] and counts its rows [b * BLK, (b + 1) * BLK)
        # per pattern, CH at a time (only block b writes them: no atomics).  FUSE: the block arriving last scans
        b = tl.program_id(0)
        nbins = 1 << NG
        for r0 in range(0, nbins, ZB):
            rr = r0 + tl.arange(0, ZB)
            tl.store(cnt_ptr + rr.to(tl.int64) * NBLK + b, tl.zeros((ZB,), dtype=tl.int32), mask=rr < nbins)
        tl.debug_barrier()
        i = tl.arange(0, CH)
        for c0 in range(b * BLK, tl.minimum(b * BLK + BLK, M), CH):
            rows, ok, bits, r, before, after = _chunk(mask_ptr, c0, i, M, NG, NGP)
            slot = cnt_ptr + tl.maximum(r, 0) * NBLK + b
            n = tl.load(slot, mask=ok, other=0) + before + after + 1
            tl.debug_barrier()
            tl.store(slot, n, mask=ok & (after == 0))  # the pattern's last row in the chunk adds the chunk's count
            tl.debug_barrier()
        if FUSE:
            if tl.atomic_add(tick_ptr, 1, sem="acq_rel", scope="gpu") == NBLK - 1:
                _scan(cnt_ptr, nbins * NBLK, SB)
                tl.atomic_xchg(tick_ptr, 0, sem="relaxed", scope="gpu")

    @triton.jit
    def _scan_kernel(cnt_ptr, L, SB: tl.constexpr):
        _scan(cnt_ptr, L, SB)

    @triton.jit
    def _scatter_kernel(mask_ptr, cnt_ptr, perm_ptr, key_ptr, union_ptr, tick_ptr, M, NG, NBLK, BLK,
                        CH: tl.constexpr, NGP: tl.constexpr, T: tl.constexpr, UB: tl.constexpr, FUSE: tl.constexpr):
        # grid (NBLK,): block b's rows in order, CH at a time; a row goes to the next free slot of its pattern in this
        # block, cnt[rank * NBLK + b], plus the rows of its pattern before it in the chunk (stable).  FUSE: the block
        # arriving last computes the tile unions
        b = tl.program_id(0)
        i = tl.arange(0, CH)
        for c0 in range(b * BLK, tl.minimum(b * BLK + BLK, M), CH):
            rows, ok, bits, r, before, after = _chunk(mask_ptr, c0, i, M, NG, NGP)
            slot = cnt_ptr + tl.maximum(r, 0) * NBLK + b
            pos = tl.load(slot, mask=ok, other=0) + before
            tl.store(perm_ptr + pos, rows, mask=ok)
            tl.store(key_ptr + pos, bits, mask=ok)
            tl.debug_barrier()
            tl.store(slot, pos + 1, mask=ok & (after == 0))  # the pattern's last row in the chunk moves the slot on
            tl.debug_barrier()
        if FUSE:
            if tl.atomic_add(tick_ptr + 1, 1, sem="acq_rel", scope="gpu") == NBLK - 1:
                NT = tl.cdiv(M, T)
                for t0 in range(0, NT, UB):
                    _unions(key_ptr, union_ptr, t0, NT, M, T, UB)
                tl.atomic_xchg(tick_ptr + 1, 0, sem="relaxed", scope="gpu")

    @triton.jit
    def _union_kernel(key_ptr, union_ptr, M, T: tl.constexpr, UB: tl.constexpr):
        _unions(key_ptr, union_ptr, tl.program_id(0) * UB, tl.cdiv(M, T), M, T, UB)


class TokenOrder(NamedTuple):
    """Result of :func:`token_order`: ``perm`` int32 ``[M]`` (sorted position -> token row), ``keys`` int32 ``[M]``
    (the mask bits ``sum_g mask[perm[j], g] << g`` of sorted row j), ``union`` int32 ``[ceil(M / 64)]`` (the OR of
    ``keys`` over each 64-row tile of the sorted order: the groups some row of the tile executes)."""

    perm: torch.Tensor
    keys: torch.Tensor
    union: torch.Tensor


def _plan(M: int, NG: int) -> tuple[int, int, int]:
    """``(NBLK, BLK, CH)``: blocks of BLK rows (a multiple of the chunk CH), 2**N_G * NBLK counters at most 2**15."""
    ch = 16 if common.interpret_mode() else 64
    nblk = max(1, min(triton.cdiv(M, 4 * ch), (1 << 15) >> NG))
    blk = triton.cdiv(triton.cdiv(M, nblk), ch) * ch
    return triton.cdiv(M, blk), blk, ch


def _launch(mask: torch.Tensor, fuse: bool = True) -> TokenOrder:
    """The sort on a contiguous mask: two launches (``fuse``: the last block of the count scans, the last block of the
    scatter computes the unions, through two arrival counters each reset by its last block), else four."""
    M, NG = mask.shape
    dev = mask.device
    nblk, blk, ch = _plan(M, NG)
    ngp = max(2, triton.next_power_of_2(NG))
    cnt = torch.empty(((1 << NG) * nblk,), dtype=torch.int32, device=dev)
    perm = torch.empty((M,), dtype=torch.int32, device=dev)
    keys = torch.empty((M,), dtype=torch.int32, device=dev)
    union = torch.empty((triton.cdiv(M, TILE),), dtype=torch.int32, device=dev)
    tick = common.tile_counters(dev, 2)
    interp = common.interpret_mode()
    sb, ub, zb = (1024, 4, 1024) if interp else (4096, 16, 1024)
    _count_kernel[(nblk,)](mask, cnt, tick, M, NG, nblk, blk, CH=ch, NGP=ngp, ZB=min(zb, 1 << NG), SB=sb, FUSE=fuse,
                           **common.warps(4))
    if not fuse:
        _scan_kernel[(1,)](cnt, cnt.numel(), SB=sb, **common.warps(8))
    _scatter_kernel[(nblk,)](mask, cnt, perm, keys, union, tick, M, NG, nblk, blk, CH=ch, NGP=ngp, T=TILE, UB=ub,
                             FUSE=fuse, **common.warps(4))
    if not fuse:
        _union_kernel[(triton.cdiv(union.numel(), ub),)](keys, union, M, T=TILE, UB=ub, **common.warps(4))
    return TokenOrder(perm, keys, union)


def check_order(order, M: int, device: torch.device) -> TokenOrder:
    """``order`` checked as a :func:`token_order` of M rows on ``device``."""
    want = ((M,), (M,), (-(-M // TILE),))
    if not isinstance(order, tuple) or len(order) != 3 or not all(isinstance(t, torch.Tensor) for t in order):
        common.fail(f"order must be a TokenOrder(perm, keys, union) from wide.kernels.token_order; got "
                    f"{type(order).__name__}")
    order = TokenOrder(*order)
    for name, t, shape in zip(TokenOrder._fields, order, want):
        if tuple(t.shape) != shape or t.dtype != torch.int32 or t.device != device:
            common.fail(f"order.{name} must be an int32 tensor of shape {shape} on {device}, got {t.dtype} "
                        f"{tuple(t.shape)} on {t.device}")
    return TokenOrder(*(t.contiguous() for t in order))


def token_order(mask: torch.Tensor) -> TokenOrder:
    """Stable sort of the tokens of a bool mask ``[M, N_G]`` or ``[B, T, N_G]`` (flattened to ``M = B * T``) by their
    routing pattern (Gray-code rank of the N_G mask bits), and per 64-row tile of that order the OR of its rows'
    patterns.  Returns :class:`TokenOrder`; one order serves every K-axis op of the routing decision.
    Raises KernelArgumentError: not a 2-D or 3-D bool tensor, N_G outside 1..16, or 2**31 - 1 rows or more.
    """
    common.check_tensor("mask", mask, None, (torch.bool,))
    if mask.dim() not in (2, 3):
        common.fail(f"mask must have shape [M, N_G] or [B, T, N_G], got {tuple(mask.shape)}")
    NG = mask.shape[-1]
    if not 1 <= NG <= MAX_GROUPS:
        common.fail(f"mask has N_G={NG} groups; the shared token order takes 1 to {MAX_GROUPS}")
    mask = mask.reshape(-1, NG)
    if mask.shape[0] >= 2**31 - 1:
        common.fail(f"mask has {mask.shape[0]} rows; at most 2**31 - 2 are supported")
    if not common.use_triton(mask) or mask.shape[0] == 0:
        return TokenOrder(*reference.token_order_ref(mask, TILE))
    return _launch(mask.contiguous())


def union_density(order: TokenOrder, NG: int, rows: int = TILE) -> float:
    """U: the fraction of (row tile, group) blocks that some row of the tile executes, tiles of ``rows`` (a multiple
    of 64) sorted rows: the share of the dense work a kernel with ``rows``-row tiles in this order does (host sync)."""
    u = order.union.to(torch.int64)
    per = max(1, rows // TILE)
    if per > 1:
        u = torch.nn.functional.pad(u, (0, -u.numel() % per)).view(-1, per)
        u = functools.reduce(operator.or_, u.unbind(1))
    bits = ((u[:, None] >> torch.arange(NG, device=u.device)) & 1).sum()
    return float(bits) / max(1, u.numel() * NG)
