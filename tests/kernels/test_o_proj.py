"""o_proj, the K-axis routed GEMM in the shared token order, against the float64 reference (Eq. 21): dtypes, group
sizes, edge masks, A masked by the kernel / zeroed by the caller / given in the sorted order, forced tile configs
(row tiles smaller and larger than the 64-row union tile), and argument checks."""

import importlib

import pytest
import torch
from kernel_testutil import DTYPES, KINDS, check_close, gpu, make_mask, poisoned, randn, seed_for

from wide.kernels import KernelArgumentError
from wide.kernels.reference import expand_route, o_proj_ref
from wide.kernels.token_order import token_order

mod = importlib.import_module("wide.kernels.o_proj")
VARIANTS = ["masked", "zeroed", "sorted"]


def run(M, N, G, NG, dtype, kind, variant="masked", p=0.4, tag=""):
    gen = seed_for("o_proj", M, N, G, NG, dtype, kind, variant, p, tag)
    K = G * NG
    a, w = randn((M, K), dtype, gen), randn((N, K), dtype, gen)
    route = make_mask(kind, (M, NG), gen, p)
    ref = o_proj_ref(a.double(), w.double(), route, G)
    out = poisoned((M, N), dtype)
    if variant == "masked":  # a's skipped blocks hold values the kernel must not add
        res = mod.o_proj(a, w, route, G, out=out)
    elif variant == "zeroed":
        a0 = torch.where(expand_route(route, G), a, torch.zeros((), dtype=dtype, device=a.device))
        res = mod.o_proj(a0, w, route, G, zeroed=True, out=out)
    else:  # A produced in the sorted order
        order = token_order(route)
        res = mod.o_proj(a[order.perm.long()], w, route, G, order=order, a_sorted=True, out=out)
    assert res is out
    check_close(out, ref)
    assert (out[~route.any(dim=1)] == 0).all(), "a row with no executed group must be exactly 0"


@pytest.mark.parametrize("dtype", DTYPES + [torch.float32])
@pytest.mark.parametrize("G,NG", [(16, 3), (64, 2), (32, 1)])
@pytest.mark.parametrize("variant", VARIANTS)
def test_dtypes_groups_and_variants(dtype, G, NG, variant):
    # M = 37: not a multiple of the row tile; N = 40: not a multiple of the N tile; N_G = 1 included
    run(37, 40, G, NG, dtype, "random", variant)


@pytest.mark.parametrize("kind", KINDS + ["one_active"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_edge_masks(kind, variant):
    run(70, 32, 16, 4, torch.bfloat16, kind, variant)


@pytest.mark.parametrize("M", [1, 4, 5])
def test_few_rows(M):
    run(M, 16, 16, 8, torch.float16, "random", p=0.5)


@pytest.mark.parametrize("BM,BN,BK", [(16, 16, 16), (64, 32, 32), (128, 16, 16)])
@pytest.mark.parametrize("variant", ["masked", "zeroed"])
def test_tile_configs(BM, BN, BK, variant, monkeypatch):
    # row tiles inside one 64-row union tile, equal to it, and spanning two (their unions OR-ed)
    monkeypatch.setattr(mod, "candidates", lambda *a: [dict(BM=BM, BN=BN, BK=BK, GROUP_M=2)])
    run(150, 48, 32, 5, torch.bfloat16, "random", variant, p=0.3, tag=(BM, BN, BK))


def test_order_is_reused_and_out_allocated():
    gen = seed_for("o_proj_reuse")
    a, w = randn((40, 64), torch.bfloat16, gen), randn((24, 64), torch.bfloat16, gen)
    route = make_mask("random", (40, 4), gen, 0.5)
    order = token_order(route)
    out = mod.o_proj(a, w, route, 16, order=order)
    assert out.shape == (40, 24) and out.dtype == torch.bfloat16
    check_close(out, o_proj_ref(a.double(), w.double(), route, 16))
    check_close(mod.o_proj(a, w, route, 16, order=order), out.double(), tol=0.0)


@pytest.mark.parametrize("call,msg", [
    (lambda a, w, r, o: mod.o_proj(a.repeat(1, 2)[:, :272], w.repeat(1, 2)[:, :272], r.repeat(1, 2)[:, :17], 16),
     "N_G = K / G = 17"),
    (lambda a, w, r, o: mod.o_proj(a, w, r, 16, a_sorted=True), "a_sorted"),
    (lambda a, w, r, o: mod.o_proj(a, w, r, 16, order=o[:2]), "TokenOrder"),
    (lambda a, w, r, o: mod.o_proj(a, w, r, 16, order=(o.perm[:5], o.keys, o.union)), "order.perm"),
    (lambda a, w, r, o: mod.o_proj(a, w, r, 16, zeroed=1), "zeroed"),
    (lambda a, w, r, o: mod.o_proj(a, w, r[:, :3], 16), "route"),
    (lambda a, w, r, o: mod.o_proj(a, w, r, 24), "G=24"),
])
def test_bad_arguments(call, msg):
    gen = seed_for("o_proj_bad")
    a, w = randn((8, 144), torch.bfloat16, gen), randn((16, 144), torch.bfloat16, gen)
    route = make_mask("random", (8, 9), gen)
    with pytest.raises(KernelArgumentError, match=msg):
        call(a, w, route, token_order(route))


@gpu
@pytest.mark.parametrize("M,p", [(1000, 0.5), (4096, 1.0), (4096, 0.3), (16384, 0.3)])
@pytest.mark.parametrize("variant", VARIANTS)
def test_gpu_llama_o_shape_every_config(M, p, variant, monkeypatch):
    # 4096 -> 4096, N_G = 8 (Llama-3.1-8B), each tile config of the tuner
    for cfg in mod.candidates(512, M):
        monkeypatch.setattr(mod, "candidates", lambda *a, cfg=cfg: [dict(cfg)])
        run(M, 4096, 512, 8, torch.bfloat16, "random", variant, p=p, tag=tuple(sorted(cfg.items())))


@gpu
@pytest.mark.parametrize("kind", KINDS + ["one_active"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_edge_masks(kind, dtype):
    run(1000, 4096, 512, 8, dtype, kind, "zeroed")
    run(333, 512, 128, 1, dtype, kind, "masked")


@gpu
def test_gpu_capturable():
    gen = seed_for("o_proj_graph")
    a, w = randn((4096, 4096), torch.bfloat16, gen), randn((4096, 4096), torch.bfloat16, gen, 0.02)
    route = make_mask("random", (4096, 8), gen, 0.3)
    mod.o_proj(a, w, route, 512)  # tunes outside the graph
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = mod.o_proj(a, w, route, 512)
    route.copy_(make_mask("random", (4096, 8), seed_for("o_proj_graph2"), 0.6))
    graph.replay()
    check_close(out, o_proj_ref(a.double(), w.double(), route, 512))
