"""gemv_k (decode GEMM-K, M <= 4): device-side compaction of the active groups and the split-K reduction.

Each case forces one kernel config (N tile, K chunk, number of K splits) through the candidate list, so the
direct-store path (1 split), the fp32-partials path (several splits) and splits with no work are all run.
"""

import pytest
import torch
from kernel_testutil import check_close, make_mask, poisoned, randn, seed_for

from wide.kernels import _common, decode, gemm_k, gemv_k
from wide.kernels.reference import gemm_k_ref


def _force(monkeypatch, **cfg):
    monkeypatch.setattr(decode, "_gemv_k_cands", lambda G, K, N, M: [dict(cfg)])


@pytest.mark.parametrize("M", [1, 2, 3, 4])
@pytest.mark.parametrize("G", [16, 128, 512])
@pytest.mark.parametrize("kind", ["all", "none", "one_active", "random", "one_row"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gemv_k_matches_float64(monkeypatch, M, G, kind, dtype):
    gen = seed_for("gemv_k_splitk", M, G, kind, dtype)
    K = 2 * G if G >= 128 else 6 * G
    N = 40  # not a multiple of the N tile
    split = 1 + 2 * ((M + G // 16) % 2)  # 1 or 3 splits, varying over the cases
    fuse = (M + (dtype == torch.float16)) % 2 == 0  # fused (last split sums) or second-kernel sum
    _force(monkeypatch, BN=16, BK=min(32, G), SPLIT=split, FUSE=fuse)
    a = randn((M, K), dtype, gen)
    w = randn((N, K), dtype, gen)
    r = make_mask(kind, (M, K // G), gen)
    out = poisoned((M, N), dtype)
    gemv_k(a, w, r, G, out=out)
    check_close(out, gemm_k_ref(a.double(), w.double(), r, G))
    if kind == "none":
        assert out.abs().max().item() == 0.0
    rows_off = ~r.any(1)
    assert (out[rows_off] == 0).all(), "a row with no active group must be exactly 0"


@pytest.mark.parametrize("split", [1, 2, 5, 16])
@pytest.mark.parametrize("bn,bk", [(16, 16), (32, 64)])
@pytest.mark.parametrize("fuse", [False, True])
def test_gemv_k_split_shapes(monkeypatch, split, bn, bk, fuse):
    # more splits than active chunks (empty splits write zero partials), chunks smaller than a group
    gen = seed_for("gemv_k_split_shapes", split, bn, bk)
    M, G, K, N = 3, 64, 640, 96
    _force(monkeypatch, BN=bn, BK=bk, SPLIT=split, FUSE=fuse)
    a = randn((M, K), torch.bfloat16, gen)
    w = randn((N, K), torch.bfloat16, gen)
    r = make_mask("random", (M, K // G), gen, p=0.3)
    for _ in range(2):  # a second launch finds the per-tile arrival counters reset
        out = poisoned((M, N), torch.bfloat16)
        gemv_k(a, w, r, G, out=out)
        check_close(out, gemm_k_ref(a.double(), w.double(), r, G))
    if fuse:
        assert all(int(c.abs().sum()) == 0 for c in _common.TILE_COUNTERS.values())


def test_gemv_k_default_config_and_gemm_k_front():
    # the untuned default (first candidate) through the public gemm_k entry, without `out`; strided a
    gen = seed_for("gemv_k_default")
    M, G, K, N = 2, 32, 256, 64
    big = randn((M, 2 * K), torch.float16, gen)
    a = big[:, ::2]
    w = randn((N, K), torch.float16, gen)
    r = make_mask("random", (M, K // G), gen)
    res = gemm_k(a, w, r, G)
    assert res.dtype == torch.float16 and res.shape == (M, N)
    check_close(res, gemm_k_ref(a.double(), w.double(), r, G))
    res2 = gemv_k(a.contiguous(), w, r, G)
    assert torch.equal(res, res2)  # deterministic: fixed split order, no atomics
