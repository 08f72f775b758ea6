"""gemm_mn and its GEMV (gemv_mn, with the always-executed tail) against the float64 reference (Algorithm 2)."""

import importlib

import pytest
import torch
from kernel_testutil import DEVICE, DTYPES, KINDS, check_close, gpu, make_mask, poisoned, randn, seed_for

from wide.kernels import KernelArgumentError, gemm_mn, gemv_mn, reorder, tuned_config
from wide.kernels.reference import expand_route, gemm_mn_ref

mod = importlib.import_module("wide.kernels.gemm_mn")  # the module (wide.kernels.gemm_mn is the op)


@pytest.fixture(params=["sorted", "direct"])
def mode(request, monkeypatch):
    """sorted: reorder + gathered tiles; direct: the tile kernel reading the route (no reorder)."""
    monkeypatch.setitem(tuned_config(DEVICE)["gemm_mn"], "direct_max_m", 0 if request.param == "sorted" else 10**9)
    return request.param


def force_gemv(monkeypatch, cfg):
    monkeypatch.setattr(mod, "_gemv_cands", lambda *a, **k: [dict(cfg)])


def run(M, N, K, G, dtype, kind, shared=False, p=0.5):
    gen = seed_for("gemm_mn", M, N, K, G, dtype, kind, shared, p)
    x, w = randn((M, K), dtype, gen), randn((N, K), dtype, gen)
    route = make_mask(kind, (M, N // G), gen, p)
    out = poisoned((M, N), dtype)
    assert gemm_mn(x, w, route, G, out=out, **({"reordered": reorder(route)} if shared else {})) is out
    check_close(out, gemm_mn_ref(x.double(), w.double(), route, G))
    assert (out[~expand_route(route, G)] == 0).all(), "an inactive (row, group) output must be exactly 0"


@pytest.mark.parametrize("G", [16, 64, 128, 512])
@pytest.mark.parametrize("dtype", DTYPES + [torch.float32])
def test_group_sizes_and_dtypes(G, dtype, mode):
    # M = 37: not a multiple of the row tile; G = N: N_G = 1
    run(37, max(G, 64), 48, G, dtype, "random")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("M", [5, 70])
def test_mask_kinds(kind, M, mode):
    run(M, 128, 64, 32, torch.float16, kind, shared=True)


@pytest.mark.parametrize("G,M", [(48, 37), (192, 21)])
def test_head_group_widths(G, M, mode):
    # the Q projection's G is the head-group width, a multiple of head_dim (e.g. 3 x 64): BN = largest power of 2
    run(M, 2 * G, 40, G, torch.bfloat16, "random")


@pytest.mark.parametrize("M", [1, 2, 3, 4])
@pytest.mark.parametrize("smax", [1, 8])
@pytest.mark.parametrize("kind", ["random", "none", "one_active"])
def test_gemv(M, smax, kind, monkeypatch):
    # one or more K splits per active tile; K = 96 leaves a ragged last K chunk, more splits than chunks are capped
    force_gemv(monkeypatch, dict(BN=16 if smax == 1 else 32, BK=32, SPLIT=1 if smax == 1 else 1 + M % 2, SMAX=smax))
    run(M, 128, 96 if M % 2 else 128, 32, torch.bfloat16, kind)


@pytest.mark.parametrize("split,smax", [(1, 1), (2, 2), (8, 8)])
def test_gemv_split_counters_reset(split, smax, monkeypatch):
    # a second launch finds the per-tile arrival counters reset; the fixed split order gives identical results
    from wide.kernels import _common

    force_gemv(monkeypatch, dict(BN=32, BK=16, SPLIT=split, SMAX=smax))
    gen = seed_for("gemv_counters", split, smax)
    x, w = randn((3, 160), torch.bfloat16, gen), randn((128, 160), torch.bfloat16, gen)
    r = make_mask("random", (3, 4), gen, p=0.3)
    first = gemv_mn(x, w, r, 32)
    check_close(first, gemm_mn_ref(x.double(), w.double(), r, 32))
    assert torch.equal(gemv_mn(x, w, r, 32), first)
    assert all(int(c.abs().sum()) == 0 for c in _common._COUNTERS.values())


@pytest.mark.parametrize("split", [1, 2])
@pytest.mark.parametrize("G,NQ,NKV", [(32, 128, 32), (192, 576, 192)])
@pytest.mark.parametrize("kind", ["random", "none"])
def test_gemv_tail(split, G, NQ, NKV, kind, monkeypatch):
    # the decode step's one-launch [Q | K | V]: Q routed, K and V (separate tensors) always computed
    force_gemv(monkeypatch, dict(BN=16, BK=32, SPLIT=split, SMAX=3))
    gen = seed_for("gemv_tail", split, G, kind)
    M, K = 3, 96
    x = randn((M, K), torch.bfloat16, gen)
    wq, wk, wv = (randn((n, K), torch.bfloat16, gen) for n in (NQ, NKV, NKV))
    r = make_mask(kind, (M, NQ // G), gen)
    out = poisoned((M, NQ + 2 * NKV), torch.bfloat16)
    gemv_mn(x, wq, r, G, out=out, tail=(wk, wv))
    keep = torch.cat([expand_route(r, G), torch.ones((M, 2 * NKV), dtype=torch.bool, device=DEVICE)], 1)
    check_close(out, (x.double() @ torch.cat([wq, wk, wv]).double().T) * keep)
    assert (out[~keep] == 0).all()


@pytest.mark.parametrize("K", [40, 64])
def test_tma_weight_tiles(K, monkeypatch):
    # the candidate loading weight tiles by tensor descriptor (TMA on Hopper), forced; K = 40: ragged last K tile
    orig = mod._candidates
    monkeypatch.setattr(mod, "_candidates", lambda G, M, sw: [dict(orig(G, M, sw)[0], TMA=True)])
    monkeypatch.setitem(tuned_config(DEVICE)["gemm_mn"], "direct_max_m", 0)
    run(70, 128, K, 32, torch.bfloat16, "random")


def test_gpu_tile_candidates_fit_the_group(monkeypatch):
    """Compiled-mode lists: every BN divides G, no duplicates, TMA only on the reorder path; GEMV splits legal."""
    monkeypatch.setattr(mod.common, "interpret_mode", lambda: False)
    for G in (16, 48, 128, 192, 512):
        for M in (5, 64, 129, 16384):
            for sw in (False, True):
                cands = mod._candidates(G, M, sw)
                assert cands and all(G % c["BN"] == 0 for c in cands) and all(M > 128 or "TMA" not in c for c in cands)
                assert len({tuple(sorted(c.items())) for c in cands}) == len(cands)
        for K, sw in ((4096, False), (4096, True), (96, True)):
            for c in mod._gemv_cands(K, sw, G):
                chunks = max(1, -(-K // c["BK"]))
                assert G % c["BN"] == 0 and 1 <= c["SPLIT"] <= c["SMAX"] <= chunks


def test_refusals():
    x = torch.zeros(8, 32, dtype=torch.bfloat16, device=DEVICE)
    w = torch.zeros(64, 32, dtype=torch.bfloat16, device=DEVICE)
    r = torch.ones(8, 2, dtype=torch.bool, device=DEVICE)
    for call, msg in [
        (lambda: gemm_mn(x, w, torch.ones(8, 1, dtype=torch.bool, device=DEVICE), 24), "G=24 is not allowed"),
        (lambda: gemm_mn(x, w[:48], r, 32), "G=32 does not divide N"),
        (lambda: gemm_mn(x, w, r[:7], 32), r"route must have shape \[M, N_G\] = \[8, 2\]"),
        (lambda: gemm_mn(x, w.half(), r, 32), "w dtype float16 must match x dtype bfloat16"),
        (lambda: gemm_mn(x, w, r.int(), 32), "route has dtype int32"),
        (lambda: gemm_mn(x, w[:, :16], r, 32), "w must have shape"),
        (lambda: gemm_mn(x, w, r, 32, out=torch.empty(8, 63, dtype=torch.bfloat16, device=DEVICE)), "out must be"),
        (lambda: gemm_mn(x, w[:32], r[:, :1], 32, out=x), "out overlaps x"),
        (lambda: gemm_mn(x[:3], w, r[:3], 32, reordered="x"), "reordered must be a Reordered"),
        (lambda: gemm_mn(x, w, r, 32, reordered=(1, 2, 3)), "got tuple of int, int, int"),
        (lambda: gemm_mn(x, w, r, 32, reordered=reorder(r[:7])), r"reordered.index must be int32 with shape \(8, 2\)"),
        (lambda: gemv_mn(x[:5], w, r[:5], 32), "M <= 4"),
        (lambda: gemv_mn(x[:1], w, r[:1], 32, tail=w[:32]), "tail must be a tuple of at most two"),
        (lambda: gemv_mn(x[:1], w, r[:1], 32, tail=(w[:32],) * 3), "got tuple of 3"),
        (lambda: gemv_mn(x[:1], w, r[:1], 32, tail=(w[:16],)), "multiple of G=32"),
        (lambda: gemv_mn(x[:1], w, r[:1], 32, tail=(w.half()[:32],)), r"tail\[0\] must be"),
    ]:
        with pytest.raises(KernelArgumentError, match=msg):
            call()


def test_reordered_made_contiguous():
    from wide.kernels import Reordered

    gen = seed_for("reordered_nc")
    x, w = randn((130, 32), torch.float32, gen), randn((32, 32), torch.float32, gen)
    route = make_mask("random", (130, 2), gen)
    ro = reorder(route)
    nc = Reordered(ro.index.t().contiguous().t(), ro.mask, ro.counts)
    assert not nc.index.is_contiguous()
    check_close(gemm_mn(x, w, route, 16, reordered=nc), gemm_mn_ref(x.double(), w.double(), route, 16))


@gpu
@pytest.mark.parametrize("D,F", [(4096, 14336), (576, 1536)])  # Llama-3.1-8B and SmolLM2-135M
@pytest.mark.parametrize("M", [1, 3, 333, 4100])
@pytest.mark.parametrize("G", [32, 128, 512])
def test_real_shapes(D, F, M, G):
    if F % G:
        pytest.skip("G does not divide the FFN width")
    gen = seed_for("gemm_mn_gpu", D, F, M, G)
    x, w = randn((M, D), torch.bfloat16, gen), randn((F, D), torch.bfloat16, gen, 0.02)
    route = make_mask("random", (M, F // G), gen)
    check_close(gemm_mn(x, w, route, G), gemm_mn_ref(x.double(), w.double(), route, G))
