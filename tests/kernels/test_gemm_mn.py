import importlib

import pytest
import torch
from kernel_testutil import DEVICE, DTYPES, check_close, make_mask, poisoned, randn, seed_for

from wide.kernels import gemm_mn, reorder
from wide.kernels.reference import expand_route, gemm_mn_ref

gemm_mn_mod = importlib.import_module("wide.kernels.gemm_mn")  # the module, not the op it exports

GS = [16, 32, 64, 128, 256, 512]


@pytest.fixture(params=["sorted", "direct"])
def mode(request, monkeypatch):
    """sorted: reorder + gathered tiles (Algorithm 2); direct: few-row path reading the route."""
    monkeypatch.setattr(gemm_mn_mod, "DIRECT_MAX_M", 0 if request.param == "sorted" else 10**9)
    return request.param


def _run(M, N, K, G, dtype, kind, shared=False):
    gen = seed_for("gemm_mn", M, N, K, G, dtype, kind, shared)
    x = randn((M, K), dtype, gen)
    w = randn((N, K), dtype, gen)
    route = make_mask(kind, (M, N // G), gen)
    out = poisoned((M, N), dtype)
    kw = {"reordered": reorder(route)} if shared else {}
    res = gemm_mn(x, w, route, G, out=out, **kw)
    assert res is out
    ref = gemm_mn_ref(x.double(), w.double(), route, G)
    check_close(out, ref)
    assert (out[~expand_route(route, G)] == 0).all()


@pytest.mark.parametrize("G", GS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_group_size(G, dtype, mode):
    # M = 37 is not a multiple of the row tile; N = max(2G, 64) keeps the interpreter fast
    _run(37, max(G, 64), 48, G, dtype, "random")


@pytest.mark.parametrize("M", [1, 2, 3, 4])
@pytest.mark.parametrize("G", [16, 64, 256])
def test_decode_rows(M, G):
    _run(M, max(G, 128), 96, G, torch.bfloat16, "random")


@pytest.mark.parametrize("kind", ["all", "none", "one_row"])
@pytest.mark.parametrize("M", [3, 70])
def test_mask_kinds(kind, M, mode):
    _run(M, 128, 64, 32, torch.float16, kind)


def test_shared_reorder_and_ragged_k(mode):
    _run(45, 64, 40, 16, torch.bfloat16, "random", shared=True)


def test_errors():
    x = torch.zeros(8, 32, dtype=torch.bfloat16, device=DEVICE)
    w = torch.zeros(64, 32, dtype=torch.bfloat16, device=DEVICE)
    r = torch.ones(8, 2, dtype=torch.bool, device=DEVICE)
    with pytest.raises(ValueError, match="G=24"):
        gemm_mn(x, w, torch.ones(8, 1, dtype=torch.bool, device=DEVICE), 24)
    with pytest.raises(ValueError, match="does not divide"):
        gemm_mn(x, w[:48], r, 32)
    with pytest.raises(ValueError, match="route"):
        gemm_mn(x, w, r[:7], 32)
    with pytest.raises(ValueError, match="dtype"):
        gemm_mn(x, w.half(), r, 32)
    with pytest.raises(ValueError, match="dtype"):
        gemm_mn(x, w, r.int(), 32)
    with pytest.raises(ValueError, match="shape"):
        gemm_mn(x, w[:, :16], r, 32)
    with pytest.raises(ValueError, match="out"):
        gemm_mn(x, w, r, 32, out=torch.empty(8, 63, dtype=torch.bfloat16, device=DEVICE))
    # a malformed reorder is refused on every path: the CPU reference fallback and the few-row GEMV too
    for rows in (8, 3):
        with pytest.raises(ValueError, match="reordered must be a Reordered"):
            gemm_mn(x[:rows], w, r[:rows], 32, reordered="x")
        with pytest.raises(ValueError, match="reordered must be a Reordered.* got tuple of int, int, int"):
            gemm_mn(x[:rows], w, r[:rows], 32, reordered=(1, 2, 3))
        with pytest.raises(ValueError, match=r"reordered.index must be int32 with shape \(%d, 2\)" % rows):
            gemm_mn(x[:rows], w, r[:rows], 32, reordered=reorder(torch.ones(9, 2, dtype=torch.bool, device=DEVICE)))


@pytest.mark.parametrize("G,M", [(48, 37), (192, 21), (192, 2)])
def test_head_group_widths(G, M, mode):
    # attention Q projection: G is the head-group width, a multiple of head_dim (e.g. 3 x 64)
    _run(M, 2 * G, 64, G, torch.bfloat16, "random")


@pytest.mark.parametrize("swiglu", [False, True])
@pytest.mark.parametrize("K", [40, 64])
def test_tma_weight_tiles(swiglu, K, monkeypatch):
    # the candidate that loads the weight tile through a tensor descriptor (TMA on Hopper); K = 40 leaves a
    # ragged last K tile
    orig = gemm_mn_mod._candidates
    monkeypatch.setattr(gemm_mn_mod, "_candidates", lambda G, M, sw: [dict(orig(G, M, sw)[0], TMA=True)])
    monkeypatch.setattr(gemm_mn_mod, "DIRECT_MAX_M", 0)
    gen = seed_for("tma", swiglu, K)
    M, N, G = 70, 128, 32
    x = randn((M, K), torch.bfloat16, gen)
    w = randn((N, K), torch.bfloat16, gen)
    w2 = randn((N, K), torch.bfloat16, gen)
    route = make_mask("random", (M, N // G), gen)
    out = poisoned((M, N), torch.bfloat16)
    gemm_mn_mod.launch_gemm_mn(x, w, w2 if swiglu else None, route, G, None, out, swiglu)
    from wide.kernels.reference import swiglu_ref
    ref = (swiglu_ref(x.double(), w.double(), w2.double(), route, G) if swiglu
           else gemm_mn_ref(x.double(), w.double(), route, G))
    check_close(out, ref)
    assert (out[~expand_route(route, G)] == 0).all()


@pytest.mark.parametrize("swiglu", [False, True])
@pytest.mark.parametrize("kind", ["random", "all", "none"])
def test_persistent_grid(swiglu, kind, mode, monkeypatch):
    # the PERSIST candidate: fewer programs than tiles (3 under the interpreter), each taking tiles in turn;
    # M = 70 with 32-row tiles leaves a ragged last row tile, and skipped tiles sit between executed ones
    orig = gemm_mn_mod._candidates
    monkeypatch.setattr(gemm_mn_mod, "_candidates", lambda G, M, sw: [dict(orig(G, M, sw)[0], PERSIST=True)])
    gen = seed_for("persist", swiglu, kind, mode)
    M, N, K, G = 70, 128, 48, 32
    x = randn((M, K), torch.bfloat16, gen)
    w = randn((N, K), torch.bfloat16, gen)
    w2 = randn((N, K), torch.bfloat16, gen)
    route = make_mask(kind, (M, N // G), gen)
    out = poisoned((M, N), torch.bfloat16)
    gemm_mn_mod.launch_gemm_mn(x, w, w2 if swiglu else None, route, G, None, out, swiglu)
    from wide.kernels.reference import swiglu_ref
    ref = (swiglu_ref(x.double(), w.double(), w2.double(), route, G) if swiglu
           else gemm_mn_ref(x.double(), w.double(), route, G))
    check_close(out, ref)
    assert (out[~expand_route(route, G)] == 0).all()


def test_gpu_tile_candidates_fit_the_group(monkeypatch):
    """The compiled-mode tile lists: every BN divides G (a tile never straddles two groups), no duplicates, TMA
    weight tiles only for the many-row path."""
    from wide.kernels._common import pow2_part

    monkeypatch.setattr(gemm_mn_mod, "interpret_mode", lambda: False)
    for G in (16, 48, 128, 192, 512):
        for M in (5, 64, 100, 129, 4096, 16384):
            for sw in (False, True):
                cands = gemm_mn_mod._candidates(G, M, sw)
                assert cands and all(G % c["BN"] == 0 and c["BN"] <= pow2_part(G) for c in cands)
                assert len({tuple(sorted(c.items())) for c in cands}) == len(cands)
                assert all(M > 128 or not c.get("TMA") for c in cands)
