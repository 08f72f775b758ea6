"""gemm_k and its GEMV (gemv_k) against the float64 reference (Eq. 21, Algorithm 3): the split-K kernel (forced configs,
idle row tiles, empty splits) and the masked path (scratch copy and in place)."""

import importlib

import pytest
import torch
from kernel_testutil import DEVICE, DTYPES, KINDS, check_close, gpu, make_mask, poisoned, randn, seed_for

from wide.kernels import KernelArgumentError, gemm_k, gemv_k, reorder, tuned_config
from wide.kernels.reference import gemm_k_ref

mod = importlib.import_module("wide.kernels.gemm_k")


def force(monkeypatch, **cfg):
    monkeypatch.setattr(mod, "_splitk_cands", lambda *a: [dict(cfg)])
    monkeypatch.setattr(mod, "_gemv_cands", lambda *a: [dict(cfg)])


def run(M, N, K, G, dtype, kind, path="auto", p=0.5, op=gemm_k):
    gen = seed_for("gemm_k", M, N, K, G, dtype, kind, path, p)
    a, w = randn((M, K), dtype, gen), randn((N, K), dtype, gen)
    route = make_mask(kind, (M, K // G), gen, p)
    out = poisoned((M, N), dtype)
    assert op(a, w, route, G, out=out, **({} if op is gemv_k else {"path": path})) is out
    check_close(out, gemm_k_ref(a.double(), w.double(), route, G))
    assert (out[~route.any(dim=1)] == 0).all(), "a row with no active group must be exactly 0"


@pytest.mark.parametrize("G", [16, 64, 128, 512])
@pytest.mark.parametrize("dtype", DTYPES + [torch.float32])
@pytest.mark.parametrize("path", ["splitk", "masked"])
def test_group_sizes_and_dtypes(G, dtype, path):
    # M = 37 rows: not a multiple of the row tile; K = G: N_G = 1; N = 40: not a multiple of the N tile
    run(37, 40, max(G, 64), G, dtype, "random", path)


@pytest.mark.parametrize("kind", KINDS + ["one_active"])
@pytest.mark.parametrize("path", ["auto", "masked"])
def test_mask_kinds(kind, path):
    run(33, 32, 128, 32, torch.float16, kind, path)


@pytest.mark.parametrize("M", [5, 37])
@pytest.mark.parametrize("split,fuse", [(1, False), (2, True), (3, False)])
@pytest.mark.parametrize("kind", ["random", "one_active"])
def test_splitk_configs(M, split, fuse, kind, monkeypatch):
    # row tiles of 16 (the last partial), 1-3 K splits summed by the last split or by the second kernel
    force(monkeypatch, BM=16, BN=16, BK=16, SPLIT=split, FUSE=fuse)
    run(M, 40, 96, 32, torch.bfloat16, kind)


@pytest.mark.parametrize("split", [1, 5])
@pytest.mark.parametrize("fuse", [False, True])
def test_splitk_idle_row_tile_and_empty_splits(split, fuse, monkeypatch):
    # rows 16..31 (one row tile) execute nothing; more splits than active chunks leave splits empty; a second launch
    # finds the arrival counters reset
    from wide.kernels import _common

    force(monkeypatch, BM=16, BN=16, BK=16, SPLIT=split, FUSE=fuse)
    gen = seed_for("gemm_k_idle", split, fuse)
    a, w = randn((40, 192), torch.bfloat16, gen), randn((48, 192), torch.bfloat16, gen)
    r = make_mask("random", (40, 6), gen, p=0.3)
    r[16:32] = False
    for _ in range(2):
        out = poisoned((40, 48), torch.bfloat16)
        gemm_k(a, w, r, 32, out=out, path="splitk")
        check_close(out, gemm_k_ref(a.double(), w.double(), r, 32))
        assert (out[16:32] == 0).all()
    assert all(int(c.abs().sum()) == 0 for c in _common._COUNTERS.values())


@pytest.mark.parametrize("M", [1, 2, 3, 4])
@pytest.mark.parametrize("G", [16, 128])
@pytest.mark.parametrize("kind", ["random", "none", "one_row"])
def test_gemv(M, G, kind, monkeypatch):
    force(monkeypatch, BN=16, BK=min(32, G), SPLIT=1 + 2 * (M % 2), FUSE=M % 4 < 2)
    run(M, 40, 2 * G if G >= 128 else 6 * G, G, torch.bfloat16, kind, op=gemv_k)


@pytest.mark.parametrize("G,M", [(48, 2), (192, 1), (48, 9), (192, 21)])
def test_head_group_widths(G, M):
    # the O projection's K-groups are head-group widths, not powers of two
    run(M, 24, 3 * G, G, torch.float16, "random")


def test_masked_drops_inactive_inf_and_nan(monkeypatch):
    """A select, not a multiply: inf / NaN in inactive groups never reach the result; from masked_min_m rows auto runs
    the masked path."""
    monkeypatch.setitem(tuned_config(DEVICE)["gemm_k"], "masked_min_m", 8)
    gen = seed_for("gemm_k_nan")
    M, N, K, G = 20, 24, 128, 32
    a, w = randn((M, K), torch.bfloat16, gen), randn((N, K), torch.bfloat16, gen)
    route = make_mask("random", (M, K // G), gen)
    a.view(M, K // G, G)[~route] = float("nan")
    a[~route.repeat_interleave(G, dim=1) & (torch.arange(K, device=DEVICE) % 7 == 0)] = float("inf")
    ref = gemm_k_ref(a.double(), w.double(), route, G)
    assert torch.isfinite(ref).all()
    monkeypatch.setattr(mod, "_splitk", lambda *a: pytest.fail("auto ran the split-K kernel from masked_min_m rows"))
    for path in ("masked", "auto"):
        out = poisoned((M, N), torch.bfloat16)
        check_close(gemm_k(a, w, route, G, out=out, path=path), ref)


@pytest.mark.parametrize("path", ["masked", "auto", "auto-tuned"])
def test_overwrite_a(path, monkeypatch):
    """overwrite_a: the masked path zeroes a's inactive groups in place (NaN there too) and keeps the executed ones'
    bits: forced, as auto's choice from masked_min_m rows, and as auto's tuned choice below."""
    gen = seed_for("gemm_k_overwrite_a", path)
    M, N, K, G = 37, 40, 192, 64
    a = randn((M, K + 16), torch.bfloat16, gen)[:, 8:8 + K]  # a column slice: row stride > K
    w = randn((N, K), torch.bfloat16, gen)
    route = make_mask("random", (M, K // G), gen)
    keep = route.repeat_interleave(G, dim=1)
    a[~keep] = float("nan")
    a0 = a.clone()
    ref = gemm_k_ref(a.double(), w.double(), route, G)
    if path == "auto-tuned":
        monkeypatch.setattr(mod.common, "pick_config", lambda op, key, dev, cands, *x, **k: dict(KIND="masked"))
    else:
        monkeypatch.setitem(tuned_config(DEVICE)["gemm_k"], "masked_min_m", 8)
    out = poisoned((M, N), torch.bfloat16)
    assert gemm_k(a, w, route, G, out=out, path=path.split("-")[0], overwrite_a=True) is out
    check_close(out, ref)
    assert torch.equal(a[keep], a0[keep]) and (a[~keep] == 0).all()
    a1 = a0.clone()
    gemm_k(a1, w, route, G, out=out, path=path.split("-")[0])  # without the flag, a is never written
    assert torch.equal(a1[keep], a0[keep]) and a1[~keep].isnan().all()


def test_overwrite_a_of_an_expanded_view_copies_it():
    gen = seed_for("gemm_k_expanded")
    w = randn((40, 128), torch.bfloat16, gen)
    ex = randn((1, 128), torch.bfloat16, gen).expand(6, 128)
    route = torch.tensor([[True, False, True, False]] * 6, device=DEVICE)
    out = gemm_k(ex, w, route, 32, path="masked", overwrite_a=True)
    check_close(out, gemm_k_ref(ex.double(), w.double(), route, 32))
    assert (ex != 0).all(), "the expanded a itself must not be written"


def test_refusals():
    a = torch.zeros(8, 64, dtype=torch.bfloat16, device=DEVICE)
    w = torch.zeros(16, 64, dtype=torch.bfloat16, device=DEVICE)
    r = torch.ones(8, 2, dtype=torch.bool, device=DEVICE)
    both = torch.ones(46, 128, dtype=torch.bfloat16, device=DEVICE)
    ag = torch.ones(6, 64, device=DEVICE, requires_grad=True)
    r4 = torch.ones(8, 4, dtype=torch.bool, device=DEVICE)
    for call, msg in [
        (lambda: gemm_k(a[:, :48], w[:, :48], r[:, :1], 32), "G=32 does not divide K"),
        (lambda: gemm_k(a, w, torch.ones(8, 4, dtype=torch.bool, device=DEVICE), 32), "route must have shape"),
        (lambda: gemm_k(a, w, r, 32, path="sparse"), "path='sparse'; allowed: 'auto', 'splitk', 'masked'"),
        (lambda: gemm_k(a, w, r, 32, reordered=reorder(torch.ones(8, 4, dtype=torch.bool, device=DEVICE))),
         "reordered.index"),
        (lambda: gemm_k(a[:2], w, r[:2], 32, reordered=(1, 2)), "reordered must be a Reordered"),
        (lambda: gemm_k(a, w, r, 32, overwrite_a="yes"), "overwrite_a='yes' must be True or False"),
        (lambda: gemm_k(ag, w.float(), r[:6], 32, overwrite_a=True), "requires grad"),
        (lambda: gemm_k(both[:6], both[4:44], r4[:6], 32, overwrite_a=True),
         "a overlaps w in memory, and a is written in place"),
        (lambda: gemm_k(a, w, r, 32, out=torch.empty(16, 8, dtype=torch.bfloat16, device=DEVICE).t()),
         "not contiguous"),
        (lambda: gemv_k(a, w, r, 32), "M <= 4"),
    ]:
        with pytest.raises(KernelArgumentError, match=msg):
            call()
    assert (both == 1).all()


@gpu
@pytest.mark.parametrize("D,F", [(4096, 14336), (576, 1536)])
@pytest.mark.parametrize("M", [1, 3, 64, 333, 4100])
@pytest.mark.parametrize("G", [32, 128, 512])
@pytest.mark.parametrize("path", ["auto", "splitk", "masked"])
def test_real_shapes(D, F, M, G, path):
    if F % G:
        pytest.skip("G does not divide the FFN width")
    run(M, D, F, G, torch.bfloat16, "random", path)  # the down projection
