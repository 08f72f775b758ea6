"""gemv_mn / gemv_swiglu (decode GEMM-MN, M <= 4): the original per-tile kernel and the split kernel.

The split kernel launches a grid sized for the dense case and maps it on the device onto (active N tile,
K split) work items, the number of splits chosen from the number of active tiles; the other programs write
the zeros of the inactive tiles.  Each case forces one config through the candidate list and checks the
result against a float64 reference, on NaN-poisoned outputs (every element must be written), with the
inactive (row, group) outputs exactly 0.
"""

import pytest
import torch
from kernel_testutil import check_close, make_mask, poisoned, randn, seed_for

from wide.kernels import _common, decode, gemm_mn, gemv_mn, gemv_swiglu, swiglu
from wide.kernels.reference import expand_route, gemm_mn_ref, swiglu_ref

OLD = dict(BN=16, BK=32)


def _force(monkeypatch, cfg):
    monkeypatch.setattr(decode, "_gemv_mn_cands", lambda *a, **k: [dict(cfg)])


def _split_cfg(M, G, dtype):
    """A split-kernel config that varies over the cases: N tile 16/32/64 (dividing G), 1-2 dense splits,
    at most 1, 3 or 8 splits when sparse (1: the direct-store path only)."""
    i = M + G // 16 + (dtype == torch.float16)
    # at G = 512 (N = 1024) the 64-wide tile only: 16- and 32-wide tiles are covered at G = 16-128, and 64 N tiles
    # of 16 under the interpreter cost ~20 s a case (CI time)
    return dict(BN=64 if G >= 512 else min((16, 32, 64)[i % 3], G), BK=32, SPLIT=1 + i % 2,
                SMAX=(1, 3, 8)[(i // 2) % 3])


def _check(x, w, w2, r, G, dtype):
    M, N = x.shape[0], w.shape[0]
    off = ~expand_route(r, G)
    out = poisoned((M, N), dtype)
    gemv_mn(x, w, r, G, out=out)
    check_close(out, gemm_mn_ref(x.double(), w.double(), r, G))
    assert (out[off] == 0).all(), "an inactive (row, group) output must be exactly 0"
    out = poisoned((M, N), dtype)
    gemv_swiglu(x, w, w2, r, G, out=out)
    check_close(out, swiglu_ref(x.double(), w.double(), w2.double(), r, G))
    assert (out[off] == 0).all(), "an inactive (row, group) output must be exactly 0"


# the old per-tile kernel is the untuned default, which tests/kernels/test_decode.py covers (M 1-4, G 16 and
# 512, random / none / one-row masks); here it is forced once per mask kind, the split kernel over the grid
@pytest.mark.parametrize("kernel", ["split"])
@pytest.mark.parametrize("M", [1, 2, 3, 4])
@pytest.mark.parametrize("G", [16, 64, 128, 512])
@pytest.mark.parametrize("kind", ["all", "none", "one_active", "random", "one_row"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gemv_mn_matches_float64(monkeypatch, kernel, M, G, kind, dtype):
    _gemv_mn_case(monkeypatch, kernel, M, G, kind, dtype)


@pytest.mark.parametrize("kind", ["all", "none", "one_active", "random", "one_row"])
def test_gemv_mn_old_kernel_forced(monkeypatch, kind):
    _gemv_mn_case(monkeypatch, "old", 3, 64, kind, torch.bfloat16)


def _gemv_mn_case(monkeypatch, kernel, M, G, kind, dtype):
    gen = seed_for("gemv_mn_split", kernel, M, G, kind, dtype)
    N = 2 * G if G >= 128 else 4 * G
    K = 96 if M % 2 else 128  # K not a multiple of the K chunk (masked last chunk) and a multiple of it
    _force(monkeypatch, _split_cfg(M, G, dtype) if kernel == "split" else OLD)
    x = randn((M, K), dtype, gen)
    w = randn((N, K), dtype, gen)
    w2 = randn((N, K), dtype, gen)
    _check(x, w, w2, make_mask(kind, (M, N // G), gen), G, dtype)


@pytest.mark.parametrize("split,smax,bn", [(1, 1, 32), (1, 16, 32), (2, 2, 32), (3, 5, 32), (8, 8, 32), (3, 5, 16)])
def test_gemv_mn_split_shapes(monkeypatch, split, smax, bn):
    # more splits than K chunks (capped), sparse masks that raise the split count, repeated launches find
    # the per-tile arrival counters reset, results bit-identical between launches (fixed split order)
    gen = seed_for("gemv_mn_split_shapes", split, smax, bn)
    M, G, K, N = 3, 32, 160, 128  # 4 groups, 10 K chunks of 16 (fewer than SPLIT x SMAX = 16: capped)
    _force(monkeypatch, dict(BN=bn, BK=16, SPLIT=split, SMAX=smax))
    x = randn((M, K), torch.bfloat16, gen)
    w = randn((N, K), torch.bfloat16, gen)
    w2 = randn((N, K), torch.bfloat16, gen)
    for p in (0.2, 0.6, 1.0):
        r = make_mask("random", (M, N // G), gen, p=p)
        prev = None
        for _ in range(2):
            out = poisoned((M, N), torch.bfloat16)
            gemv_swiglu(x, w, w2, r, G, out=out)
            check_close(out, swiglu_ref(x.double(), w.double(), w2.double(), r, G))
            assert prev is None or torch.equal(out, prev)
            prev = out
        out = poisoned((M, N), torch.bfloat16)
        gemv_mn(x, w, r, G, out=out)
        check_close(out, gemm_mn_ref(x.double(), w.double(), r, G))
    assert all(int(c.abs().sum()) == 0 for c in _common.TILE_COUNTERS.values())


@pytest.mark.parametrize("M,G,K", [(2, 48, 144), (1, 192, 576), (4, 16, 80)])
def test_gemv_mn_split_ragged_groups(monkeypatch, M, G, K):
    # head-group widths that are not powers of two (N tile = largest power of two dividing G)
    gen = seed_for("gemv_mn_split_ragged", M, G, K)
    N = 4 * G
    cfg = [c for c in decode._gemv_mn_cands(K, False, G, N) if "SPLIT" in c][0]
    assert G % cfg["BN"] == 0
    _force(monkeypatch, cfg)
    x = randn((M, K), torch.bfloat16, gen)
    w = randn((N, K), torch.bfloat16, gen)
    r = make_mask("random", (M, N // G), gen)
    out = poisoned((M, N), torch.bfloat16)
    gemv_mn(x, w, r, G, out=out)
    check_close(out, gemm_mn_ref(x.double(), w.double(), r, G))


def test_gemv_mn_split_fp32_and_fronts(monkeypatch):
    # fp32 operands, no `out`, strided x, the public gemm_mn / swiglu entries (M <= 4 -> GEMV)
    gen = seed_for("gemv_mn_split_fronts")
    M, G, K, N = 2, 64, 96, 256
    _force(monkeypatch, dict(BN=32, BK=32, SPLIT=2, SMAX=4))
    x = randn((M, 2 * K), torch.float32, gen)[:, ::2]
    w = randn((N, K), torch.float32, gen)
    w2 = randn((N, K), torch.float32, gen)
    r = make_mask("random", (M, N // G), gen)
    res = gemm_mn(x, w, r, G)
    assert res.dtype == torch.float32 and res.shape == (M, N)
    check_close(res, gemm_mn_ref(x.double(), w.double(), r, G), tol=1e-4)
    res = swiglu(x, w, w2, r, G)
    check_close(res, swiglu_ref(x.double(), w.double(), w2.double(), r, G), tol=1e-4)


def test_gemv_mn_candidates(monkeypatch):
    # on a GPU the untuned default is the split config measured fastest at s = 0 and 0.5 on the H200
    # (decode_probe.md); the interpreter keeps the per-tile kernel first; every split config is legal
    for K, G, N, sw in [(4096, 512, 4096, False), (4096, 128, 14336, True), (4096, 48, 4800, False), (96, 16, 64, True)]:
        for interp in (False, True):
            monkeypatch.setattr(decode, "interpret_mode", lambda interp=interp: interp)
            cands = decode._gemv_mn_cands(K, sw, G, N)
            if interp:
                assert "SPLIT" not in cands[0]
            else:
                bn = min(32, G & -G)
                bk = min(64 if sw else 128, 128 if K == 96 else 4096)
                assert cands[0]["SPLIT"] >= 1 and cands[0]["BN"] == bn and cands[0]["BK"] == bk, cands[0]
                assert any("SPLIT" not in c for c in cands)  # the per-tile kernel stays a candidate
            split = [c for c in cands if "SPLIT" in c]
            assert split, cands
            for c in split:
                chunks = -(-K // c["BK"])
                assert G % c["BN"] == 0 and 1 <= c["SPLIT"] <= c["SMAX"] <= max(1, chunks), c
