import importlib

import pytest
import torch
from kernel_testutil import DEVICE, make_mask, seed_for

from wide.kernels import Reordered, reorder
from wide.kernels._common import use_triton
from wide.kernels.reference import reorder_ref


def _check_properties(mask, r):
    assert isinstance(r, Reordered)
    assert r.index.dtype == torch.int32 and r.index.shape == mask.shape
    assert r.mask.dtype == torch.bool and r.mask.shape == mask.shape
    assert r.counts.dtype == torch.int32 and r.counts.shape == mask.shape[:-2] + mask.shape[-1:]
    m = mask.cpu()
    idx = r.index.cpu().long()
    M = m.shape[-2]
    # index is a permutation of 0..M-1 in every column
    srt, _ = idx.sort(dim=-2)
    ar = torch.arange(M).view(*([1] * (m.dim() - 2)), M, 1).expand_as(idx)
    assert torch.equal(srt, ar)
    # counts, and the sorted mask is the gathered mask with active rows as a prefix
    cnt = r.counts.cpu().long()
    assert torch.equal(cnt, m.sum(-2))
    gathered = torch.gather(m, -2, idx)
    assert torch.equal(gathered, r.mask.cpu())
    prefix = ar < cnt.unsqueeze(-2)
    assert torch.equal(gathered, prefix)
    # stable: active rows, then inactive rows, each in increasing original order
    act_key = torch.where(prefix, idx, idx + M)
    assert (act_key[..., 1:, :] > act_key[..., :-1, :]).all()
    # identical to the reference
    ref = reorder_ref(m)
    assert torch.equal(ref.index, r.index.cpu()) and torch.equal(ref.counts, r.counts.cpu())


@pytest.mark.parametrize("M", [1, 2, 3, 4, 37, 130])
@pytest.mark.parametrize("kind", ["random", "all", "none", "one_row"])
def test_reorder_2d(M, kind):
    gen = seed_for("reorder2d", M, kind)
    mask = make_mask(kind, (M, 5), gen)
    _check_properties(mask, reorder(mask))


@pytest.mark.parametrize("shape", [(2, 19, 3), (3, 1, 4), (1, 70, 1)])
@pytest.mark.parametrize("p", [0.2, 0.8])
def test_reorder_3d_attention_columns(shape, p):
    gen = seed_for("reorder3d", shape, p)
    mask = make_mask("random", shape, gen, p=p)
    _check_properties(mask, reorder(mask))


def test_reorder_errors():
    with pytest.raises(ValueError, match="dtype"):
        reorder(torch.ones(4, 2, device=DEVICE))
    with pytest.raises(ValueError, match="shape"):
        reorder(torch.ones(4, device=DEVICE, dtype=torch.bool))


# --- multi-block plans -------------------------------------------------------------------------
# Under the interpreter reorder() uses 16-row blocks (and one launch up to 16 rows), so these
# shapes span several blocks with partial last blocks, several column chunks, both phase-2 outputs
# (direct for N_G <= 8, column-major tmp + transpose above), and the single-block plan.

_reorder_mod = importlib.import_module("wide.kernels.reorder")


def _check_exact(mask, r):
    ref = reorder_ref(mask.cpu())
    assert (r.index.dtype, r.mask.dtype, r.counts.dtype) == (torch.int32, torch.bool, torch.int32)
    assert torch.equal(r.index.cpu(), ref.index)
    assert torch.equal(r.mask.cpu(), ref.mask)
    assert torch.equal(r.counts.cpu(), ref.counts)


@pytest.mark.parametrize("M", [16, 17, 40, 48, 100])
@pytest.mark.parametrize("NG", [1, 3, 8, 112])
@pytest.mark.parametrize("kind", ["random", "all", "none", "one_row"])
def test_reorder_2d_blocks(M, NG, kind):
    gen = seed_for("reorder2d_blocks", M, NG, kind)
    mask = make_mask(kind, (M, NG), gen, p=0.4)
    _check_exact(mask, reorder(mask))


@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.parametrize("T", [9, 33, 70])
@pytest.mark.parametrize("NG", [1, 3, 8, 112])
@pytest.mark.parametrize("kind", ["random", "one_row"])
def test_reorder_3d_blocks(B, T, NG, kind):
    gen = seed_for("reorder3d_blocks", B, T, NG, kind)
    mask = make_mask(kind, (B, T, NG), gen, p=0.6)
    _check_exact(mask, reorder(mask))


def test_reorder_non_contiguous_mask():
    gen = seed_for("reorder_noncontig")
    mask = make_mask("random", (8, 37), gen).t()  # [37, 8], column-major storage
    _check_exact(mask, reorder(mask))


_needs_triton = pytest.mark.skipif(not use_triton(torch.empty(0, device=DEVICE)),
                                   reason="Triton kernels do not run here")


@_needs_triton
@pytest.mark.parametrize("plan", [
    ("columns", 64, 1, 4), ("columns", 64, 8, 4),
    ("blocks", 8, 2, 0, 2, 4),      # direct scatter, 2-column chunks
    ("blocks", 16, 16, 16, 128, 4),  # tmp + transpose
    ("blocks", 32, 4, 64, 2, 4),
])
@pytest.mark.parametrize("shape", [(50, 3), (64, 8), (2, 45, 20)])
def test_reorder_explicit_plans(plan, shape):
    gen = seed_for("reorder_plan", plan, shape)
    mask = make_mask("random", shape, gen).to(DEVICE)
    _check_exact(mask, _reorder_mod._launch(mask, plan))


@_needs_triton
@pytest.mark.parametrize("shape", [(300, 112), (600, 112), (5000, 3), (3, 700, 8), (700, 1)])
def test_reorder_gpu_plans(shape, monkeypatch):
    """The plans chosen for a GPU, run under whatever executes the kernels here."""
    monkeypatch.setattr(_reorder_mod, "interpret_mode", lambda: False)
    plan = _reorder_mod._plan(shape[-2], shape[-1])
    monkeypatch.undo()
    gen = seed_for("reorder_gpu_plan", shape)
    mask = make_mask("random", shape, gen, p=0.3)
    _check_exact(mask, _reorder_mod._launch(mask, plan))
