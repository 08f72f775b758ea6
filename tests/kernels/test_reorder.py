import pytest
import torch

from kernel_testutil import DEVICE, make_mask, seed_for
from wide.kernels import Reordered, reorder
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
