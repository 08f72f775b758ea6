"""gemm_k for 4 < M < 512 rows: the split-K kernel with row tiles (``path="splitk"``, and ``auto``'s choice).

Each case forces one config (row tile, N tile, K chunk, splits, fused or second-kernel sum) through the candidate
list, against the float64 reference, with NaN-poisoned outputs: several row tiles (the last one partial), a row
tile whose rows execute no group at all, empty splits, ragged group widths.
"""

import pytest
import torch
from kernel_testutil import DTYPES, check_close, make_mask, poisoned, randn, seed_for

from wide.kernels import _common, decode, gemm_k
from wide.kernels.reference import gemm_k_ref


def _force(monkeypatch, **cfg):
    monkeypatch.setattr(decode, "splitk_cands", lambda G, K, N, M: [dict(cfg)])


@pytest.mark.parametrize("M", [5, 16, 33, 70])
@pytest.mark.parametrize("G", [16, 128])
@pytest.mark.parametrize("kind", ["random", "all", "none", "one_active", "one_row"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_splitk_matches_float64(monkeypatch, M, G, kind, dtype):
    gen = seed_for("gemm_k_splitk", M, G, kind, dtype)
    K = 3 * G if G >= 128 else 6 * G
    N = 40  # not a multiple of the N tile
    bm = 16 if (M + G) % 3 else 32
    split = 1 + (M + G // 16) % 3  # 1, 2 or 3 splits
    fuse = (M + (dtype == torch.float16)) % 2 == 0
    _force(monkeypatch, BM=bm, BN=16, BK=min(32, G), SPLIT=split, FUSE=fuse)
    a = randn((M, K), dtype, gen)
    w = randn((N, K), dtype, gen)
    r = make_mask(kind, (M, K // G), gen)
    out = poisoned((M, N), dtype)
    gemm_k(a, w, r, G, out=out, path="splitk")
    check_close(out, gemm_k_ref(a.double(), w.double(), r, G))
    assert (out[~r.any(1)] == 0).all(), "a row with no active group must be exactly 0"


@pytest.mark.parametrize("split", [1, 4, 9])
@pytest.mark.parametrize("fuse", [False, True])
def test_splitk_idle_row_tile_and_empty_splits(monkeypatch, split, fuse):
    # rows 16..31 (the second row tile) execute nothing: its programs find no active group and write zeros;
    # more splits than active chunks leave some splits empty; a second launch finds the counters reset
    gen = seed_for("gemm_k_splitk_idle", split, fuse)
    M, G, K, N = 40, 32, 192, 48
    _force(monkeypatch, BM=16, BN=16, BK=16, SPLIT=split, FUSE=fuse)
    a = randn((M, K), torch.bfloat16, gen)
    w = randn((N, K), torch.bfloat16, gen)
    r = make_mask("random", (M, K // G), gen, p=0.3)
    r[16:32] = False
    for _ in range(2):
        out = poisoned((M, N), torch.bfloat16)
        gemm_k(a, w, r, G, out=out, path="splitk")
        check_close(out, gemm_k_ref(a.double(), w.double(), r, G))
        assert (out[16:32] == 0).all()
    if fuse:
        assert all(int(c.abs().sum()) == 0 for c in _common.TILE_COUNTERS.values())


@pytest.mark.parametrize("M,G,K", [(9, 48, 144), (21, 192, 576)])
def test_splitk_ragged_groups_and_auto(M, G, K):
    # head-group widths that are not powers of two (O projection), the untuned first candidate via "auto"
    gen = seed_for("gemm_k_splitk_ragged", M, G, K)
    N = 24
    a = randn((M, K), torch.float16, gen)
    w = randn((N, K), torch.float16, gen)
    r = make_mask("random", (M, K // G), gen)
    ref = gemm_k_ref(a.double(), w.double(), r, G)
    for path in ("splitk", "auto"):
        out = poisoned((M, N), torch.float16)
        gemm_k(a, w, r, G, out=out, path=path)
        check_close(out, ref)


def test_splitk_path_name_in_error():
    a = torch.zeros(8, 32, dtype=torch.bfloat16, device=_common.torch.device("cpu"))
    with pytest.raises(ValueError, match="'splitk'"):
        gemm_k(a, torch.zeros(16, 32, dtype=torch.bfloat16), torch.ones(8, 2, dtype=torch.bool), 16, path="fast")
