"""o_proj, the K-axis routed GEMM in the shared token order, against the float64 reference (Eq. 21): dtypes, group
sizes, edge masks, A masked by the kernel / zeroed by the caller / given in the sorted order, forced tile configs
(row tiles smaller and larger than the 64-row union tile), and argument checks."""

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from kernel_testutil import DTYPES, KINDS, check_close, gpu, hopper, make_mask, poisoned, randn, seed_for

from wide.kernels import KernelArgumentError, sm90
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


@gpu
@hopper
@pytest.mark.parametrize("kind", KINDS + ["one_active"])
@pytest.mark.parametrize("M,N,G,NG,dtype", [(1000, 512, 512, 8, torch.bfloat16), (600, 256, 128, 4, torch.float16),
                                            (130, 256, 64, 1, torch.bfloat16), (4096, 4096, 512, 8, torch.bfloat16)])
@pytest.mark.parametrize("cluster", [1, 2])
def test_gpu_cute_against_reference(kind, M, N, G, NG, dtype, cluster, built, monkeypatch):
    """The CuTe kernel on sorted, zeroed A: the K loop over the groups of the cluster's rows only, rows scattered to
    their tokens; M not a multiple of the 128-row tile (600 and 1000: an odd tile count, the last pair's second CTA
    idle), N_G = 1, every mask kind, clusters of 1 and 2 CTAs."""
    monkeypatch.setattr(sm90, "launch_shape", lambda device, op: (cluster, 8))
    gen = seed_for("o_proj_cute", kind, M, N, G, NG, dtype, cluster)
    a, w = randn((M, G * NG), dtype, gen), randn((N, G * NG), dtype, gen, 0.05)
    route = make_mask(kind, (M, NG), gen, 0.4)
    a0 = torch.where(expand_route(route, G), a, torch.zeros((), dtype=dtype, device=a.device))
    order = token_order(route)
    out = poisoned((M, N), dtype)
    mod.o_proj(a0[order.perm.long()], w, route, G, order=order, zeroed=True, a_sorted=True, out=out, backend="cute")
    assert mod.LAST_BACKEND["o_proj"] == "cute"
    check_close(out, o_proj_ref(a.double(), w.double(), route, G))
    assert (out[~route.any(dim=1)] == 0).all(), "a row with no executed group must be exactly 0"


@gpu
@hopper
def test_gpu_auto_takes_cute_where_asked(built, monkeypatch):
    """An "auto" call on sorted, zeroed A takes the CuTe kernel where WIDE_GEMM_BACKEND=cute asks (or the GPU's config
    sets o_proj.cute), and stays exact; unsorted A keeps the Triton kernel."""
    monkeypatch.setenv("WIDE_GEMM_BACKEND", "cute")
    gen = seed_for("o_proj_cute_auto")
    M, N, G, NG = 1000, 512, 512, 8
    a, w = randn((M, G * NG), torch.bfloat16, gen), randn((N, G * NG), torch.bfloat16, gen, 0.05)
    route = make_mask("random", (M, NG), gen, 0.4)
    a0 = torch.where(expand_route(route, G), a, torch.zeros((), dtype=a.dtype, device=a.device))
    order = token_order(route)
    out = mod.o_proj(a0[order.perm.long()], w, route, G, order=order, zeroed=True, a_sorted=True)
    assert mod.LAST_BACKEND["o_proj"] == "cute"
    check_close(out, o_proj_ref(a.double(), w.double(), route, G))
    check_close(mod.o_proj(a0, w, route, G, order=order, zeroed=True), o_proj_ref(a.double(), w.double(), route, G))
    assert mod.LAST_BACKEND["o_proj"] == "triton"


def test_cute_refusals():
    gen = seed_for("o_proj_cute_refusal")
    a, w = randn((8, 128), torch.bfloat16, gen), randn((256, 128), torch.bfloat16, gen)
    route = make_mask("random", (8, 2), gen)
    with pytest.raises(KernelArgumentError, match="backend='tvm' is not allowed; allowed: 'auto', 'triton', 'cute'"):
        mod.o_proj(a, w, route, 64, backend="tvm")
    with pytest.raises(KernelArgumentError, match="backend='cute' cannot run this o_proj"):
        mod.o_proj(a, w, route, 64, backend="cute")  # not sorted (and, on a CPU, no GPU)


def test_compiles_for_sm90():
    """The sort's kernels and the shared-order kernel (TMA weights, gathered or TMA-read A, masked A) compile for sm_90
    without a GPU (Triton ships ptxas): gathered rows through cp.async, wgmma, 16-byte scattered stores."""
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    here = Path(__file__).resolve()
    env["PYTHONPATH"] = os.pathsep.join([str(here.parents[2] / "src"), str(here.parent), env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, str(here)], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert r.stdout.count("ok ") == 11, r.stdout


def _compile_sm90():
    from aot_sm90 import compile_sm90, types_of

    to = importlib.import_module("wide.kernels.token_order")
    i32 = "*i32"
    t = dict(mask_ptr="*i1", cnt_ptr=i32, perm_ptr=i32, key_ptr=i32, union_ptr=i32, tick_ptr=i32)
    for fuse in (True, False):
        compile_sm90(to._count_kernel, {n: t.get(n, "i32") for n in to._count_kernel.arg_names},
                     dict(CH=64, NGP=8, ZB=256, SB=4096, FUSE=fuse))
        compile_sm90(to._scatter_kernel, {n: t.get(n, "i32") for n in to._scatter_kernel.arg_names},
                     dict(CH=64, NGP=16, T=64, UB=16, FUSE=fuse))
    compile_sm90(to._scan_kernel, {n: t.get(n, "i32") for n in to._scan_kernel.arg_names}, dict(SB=4096))
    compile_sm90(to._union_kernel, {n: t.get(n, "i32") for n in to._union_kernel.arg_names}, dict(T=64, UB=16))
    fn = mod._shared_order_kernel
    div = ("a_ptr", "w_ptr", "out_ptr", "perm_ptr", "key_ptr", "N", "stride_am", "stride_wn", "stride_om")
    configs = ((128, 128, 8, 4, True, False, False), (128, 256, 8, 3, True, False, False),
               (64, 256, 4, 4, True, False, False), (128, 128, 8, 4, True, True, False),
               (128, 128, 8, 3, False, False, True))
    for bm, bn, w, st, tma, a_sorted, mask in configs:
        ty = types_of(fn, perm_ptr=i32, key_ptr=i32, union_ptr=i32)
        ty.update(a_desc=f"tensordesc<bf16[{bm}, 64]>" if a_sorted else "*bf16",
                  w_desc=f"tensordesc<bf16[{bn}, 64]>" if tma else "*bf16")
        k = compile_sm90(fn, ty, dict(G=512, BM=bm, BN=bn, BK=64, GROUP_M=8, NGP=8, UT=64, A_SORTED=a_sorted,
                                      MASK_A=mask, EVEN_N=True, TMA_A=a_sorted, TMA_W=tma),
                         num_warps=w, num_stages=st, div16=div)
        ptx = k.asm["ptx"]
        want = ["wgmma.mma_async", "st.global.v4"] + (["cp.async.bulk.tensor"] if tma else []) + (
            [] if a_sorted else ["cp.async.cg.shared.global"])
        missing = [op for op in want if op not in ptx]
        if missing:
            raise RuntimeError(f"shared-order kernel {bm}x{bn} (A sorted {a_sorted}, masked {mask}): no {missing} in "
                               "its PTX")


if __name__ == "__main__":  # run by test_compiles_for_sm90 without TRITON_INTERPRET
    try:
        _compile_sm90()
    except Exception as e:  # one line naming the failure, for the test's message
        print(f"FAILED: {type(e).__name__}: {e}", file=sys.stderr)
        raise SystemExit(1)
