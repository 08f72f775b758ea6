"""reorder (Eq. 7, Algorithm 1) against the reference sort: a stable permutation per column with the active rows first,
for the one-launch plan and the three-phase block plan (direct scatter for N_G <= 8, a transpose above), 2-D GEMM
masks and 3-D attention masks, and the plans chosen for a GPU."""

import importlib

import pytest
import torch
from kernel_testutil import DEVICE, KINDS, make_mask, seed_for

from wide.kernels import KernelArgumentError, Reordered, reorder
from wide.kernels._common import use_triton
from wide.kernels.reference import reorder_ref

mod = importlib.import_module("wide.kernels.reorder")
needs_triton = pytest.mark.skipif(not use_triton(torch.empty(0, device=DEVICE)), reason="no Triton kernels here")


def check(mask, r):
    """Equal to the reference, which is checked to be a stable partition with counts and the sorted mask."""
    assert isinstance(r, Reordered)
    assert (r.index.dtype, r.mask.dtype, r.counts.dtype) == (torch.int32, torch.bool, torch.int32)
    m, ref = mask.cpu(), reorder_ref(mask.cpu())
    assert torch.equal(r.index.cpu(), ref.index) and torch.equal(r.mask.cpu(), ref.mask)
    assert torch.equal(r.counts.cpu(), ref.counts) and torch.equal(ref.counts, m.sum(-2, dtype=torch.int32))
    idx, M = ref.index.long(), m.shape[-2]
    prefix = torch.arange(M).view(-1, 1) < ref.counts.long().unsqueeze(-2)
    assert torch.equal(torch.gather(m, -2, idx), prefix) and torch.equal(ref.mask, prefix)
    key = torch.where(prefix, idx, idx + M)  # active rows, then inactive rows, each in increasing order
    assert (key[..., 1:, :] > key[..., :-1, :]).all()


@pytest.mark.parametrize("M", [1, 4, 17, 48, 130])
@pytest.mark.parametrize("NG", [1, 5, 40])
@pytest.mark.parametrize("kind", KINDS)
def test_reorder_2d(M, NG, kind):
    # under the interpreter up to 16 rows run in one launch, more in blocks of 16 (the last partial)
    gen = seed_for("reorder2d", M, NG, kind)
    mask = make_mask(kind, (M, NG), gen, p=0.4)
    check(mask, reorder(mask))


@pytest.mark.parametrize("shape", [(3, 1, 4), (1, 9, 3), (3, 33, 8), (2, 70, 20)])
@pytest.mark.parametrize("kind", ["random", "one_row"])
def test_reorder_3d(shape, kind):
    gen = seed_for("reorder3d", shape, kind)
    mask = make_mask(kind, shape, gen, p=0.6)
    check(mask, reorder(mask))


def test_non_contiguous_mask_and_refusals():
    mask = make_mask("random", (8, 37), seed_for("noncontig")).t()  # [37, 8], column-major
    check(mask, reorder(mask))
    for bad, msg in [(torch.ones(4, 2, device=DEVICE), "mask has dtype float32"),
                     (torch.ones(4, device=DEVICE, dtype=torch.bool), r"mask must have shape \[M, N_G\]")]:
        with pytest.raises(KernelArgumentError, match=msg):
            reorder(bad)


@needs_triton
@pytest.mark.parametrize("plan", [("columns", 64, 1, 4), ("columns", 64, 8, 4), ("blocks", 8, 2, 0, 2, 4),
                                  ("blocks", 16, 16, 16, 128, 4), ("blocks", 32, 4, 64, 2, 4)])
@pytest.mark.parametrize("shape", [(50, 3), (2, 45, 20)])
def test_explicit_plans(plan, shape):
    mask = make_mask("random", shape, seed_for("reorder_plan", plan, shape))
    check(mask, mod._launch(mask, plan))


@needs_triton
@pytest.mark.parametrize("shape", [(600, 40), (3000, 3), (3, 700, 8), (700, 1)])
def test_gpu_plans(shape, monkeypatch):
    monkeypatch.setattr(mod, "interpret_mode", lambda: False)
    plan = mod._plan(shape[-2], shape[-1])
    monkeypatch.undo()
    mask = make_mask("random", shape, seed_for("reorder_gpu_plan", shape), p=0.3)
    check(mask, mod._launch(mask, plan))
