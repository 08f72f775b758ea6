"""Unified mask reordering (paper Eq. 7, Algorithm 1).

A binary routing column needs no comparison sort: a stable prefix-sum partition puts the active
rows first (in their original order) and the inactive rows after them, in O(M) work.  The kernel
runs one program per routing column, entirely on the device (no ``.item()``, no ``nonzero``, no
host synchronisation), so it can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch

from . import reference
from ._common import HAS_TRITON, Reordered, check_tensor, fail, interpret_mode, use_triton

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _reorder_kernel(mask_ptr, index_ptr, smask_ptr, count_ptr, M, NG, BLOCK: tl.constexpr):
        col = tl.program_id(0)
        c = col // NG
        g = col % NG
        base = c.to(tl.int64) * M * NG + g
        # pass 1: number of active rows of this column
        total = tl.full([], 0, tl.int32)
        for start in range(0, M, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            m = tl.load(mask_ptr + base + offs * NG, mask=offs < M, other=0).to(tl.int32)
            total += tl.sum(m, axis=0)
        # pass 2: stable partition by prefix sums
        act_before = tl.full([], 0, tl.int32)
        inact_before = tl.full([], 0, tl.int32)
        for start in range(0, M, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            valid = offs < M
            m = tl.load(mask_ptr + base + offs * NG, mask=valid, other=0).to(tl.int32)
            im = tl.where(valid, 1 - m, 0)
            ca = tl.cumsum(m, axis=0)
            ci = tl.cumsum(im, axis=0)
            pos = tl.where(m == 1, act_before + ca - 1, total + inact_before + ci - 1)
            tl.store(index_ptr + base + pos * NG, offs, mask=valid)
            tl.store(smask_ptr + base + offs * NG, offs < total, mask=valid)
            act_before += tl.sum(m, axis=0)
            inact_before += tl.sum(im, axis=0)
        tl.store(count_ptr + col, total)


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
    M, NG = mask.shape[-2], mask.shape[-1]
    C = mask.shape[0] if mask.dim() == 3 else 1
    index = torch.empty(mask.shape, dtype=torch.int32, device=mask.device)
    smask = torch.empty(mask.shape, dtype=torch.bool, device=mask.device)
    counts = torch.empty(mask.shape[:-2] + (NG,), dtype=torch.int32, device=mask.device)
    if interpret_mode():
        block = 64
    else:
        block = 1024 if M > 512 else max(16, triton.next_power_of_2(M))
    _reorder_kernel[(C * NG,)](mask, index, smask, counts, M, NG, BLOCK=block,
                               **({} if interpret_mode() else {"num_warps": 4}))
    return Reordered(index, smask, counts)
