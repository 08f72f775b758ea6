"""The CuTe sm_90a backend of gemm_mn and the fused SwiGLU, and its dense fused SwiGLU, against the float64 references
(Algorithm 2, Eq. 3) on an H100 / H200; the backend choice and its refusals (those also on the CPU)."""

import importlib

import pytest
import torch
from kernel_testutil import DEVICE, KINDS, check_close, gpu, hopper, make_mask, poisoned, randn, seed_for

from wide.kernels import KernelArgumentError, gemm_mn, reorder, sm90, swiglu, tuned_config
from wide.kernels.reference import expand_route, gemm_mn_ref, swiglu_ref

mod = importlib.import_module("wide.kernels.gemm_mn")


def run(op, M, N, K, G, dtype, kind, shared=True, p=0.5):
    gen = seed_for("sm90", op, M, N, K, G, dtype, kind, shared)
    x = randn((M, K), dtype, gen)
    w, w2 = randn((N, K), dtype, gen, 0.05), randn((N, K), dtype, gen, 0.05)
    route = make_mask(kind, (M, N // G), gen, p)
    out = poisoned((M, N), dtype)
    kw = dict(out=out, backend="cute", **({"reordered": reorder(route)} if shared else {}))
    if op == "gemm_mn":
        res, ref = gemm_mn(x, w, route, G, **kw), gemm_mn_ref(x.double(), w.double(), route, G)
    else:
        res, ref = swiglu(x, w, w2, route, G, **kw), swiglu_ref(x.double(), w.double(), w2.double(), route, G)
    assert res is out and mod.LAST_BACKEND[op] == "cute"
    check_close(out, ref)
    assert (out[~expand_route(route, G)] == 0).all(), "an inactive (row, group) output must be exactly 0"


@gpu
@hopper
@pytest.mark.parametrize("op", ["gemm_mn", "swiglu"])
@pytest.mark.parametrize("G", [128, 512])
@pytest.mark.parametrize("K", [128, 4096])
@pytest.mark.parametrize("kind", KINDS)
def test_routed_against_reference(op, G, K, kind, built):
    # M = 300: not a multiple of the 128-row tile; N_G = 4
    run(op, 300, 4 * G, K, G, torch.bfloat16, kind)


@gpu
@hopper
@pytest.mark.parametrize("op", ["gemm_mn", "swiglu"])
@pytest.mark.parametrize("G,M,dtype,shared", [(128, 1, torch.bfloat16, True), (256, 129, torch.bfloat16, False),
                                              (512, 1000, torch.float16, True), (384, 77, torch.float16, False)])
def test_edges(op, G, M, dtype, shared, built):
    # N_G = 1 (N = G), one row, a row tile plus one row, fp16, G = 384 (128-wide tiles), the reorder made inside
    run(op, M, G, 192, G, dtype, "random", shared=shared, p=0.6)


@gpu
@hopper
@pytest.mark.parametrize("op", ["gemm_mn", "swiglu"])
@pytest.mark.parametrize("G", [128, 512])
def test_runs_of_consecutive_rows(op, G, built):
    """Tiles whose rows are consecutive token rows take TMA, the others the gather: group g executes the tokens from
    50 g on (runs that start off a tile boundary), group 3 with a hole at token 400 (its tiles around it gather)."""
    M, N, K = 600, 4 * G, 256
    gen = seed_for("sm90_runs", op, G)
    x = randn((M, K), torch.bfloat16, gen)
    w, w2 = randn((N, K), torch.bfloat16, gen, 0.05), randn((N, K), torch.bfloat16, gen, 0.05)
    route = torch.arange(M, device=DEVICE)[:, None] >= 50 * torch.arange(4, device=DEVICE)[None, :]
    route[400, 3] = False
    out = poisoned((M, N), torch.bfloat16)
    if op == "gemm_mn":
        gemm_mn(x, w, route, G, out=out, backend="cute")
        check_close(out, gemm_mn_ref(x.double(), w.double(), route, G))
    else:
        swiglu(x, w, w2, route, G, out=out, backend="cute")
        check_close(out, swiglu_ref(x.double(), w.double(), w2.double(), route, G))
    assert (out[~expand_route(route, G)] == 0).all()


@gpu
@hopper
@pytest.mark.parametrize("op", ["gemm_mn", "swiglu"])
@pytest.mark.parametrize("grid_ctas", [1, 2])
def test_runs_and_gathers_share_the_stage_ring(op, grid_ctas, built):
    """One or two CTAs take every tile, K = 512 (8 steps over 4 stages): TMA and gathered tiles follow each other
    through the same stages, their phases and byte counts alternating."""
    M, G, K = 600, 128, 512
    N = 4 * G
    gen = seed_for("sm90_ring", op, grid_ctas)
    x = randn((M, K), torch.bfloat16, gen)
    w, w2 = randn((N, K), torch.bfloat16, gen, 0.05), randn((N, K), torch.bfloat16, gen, 0.05)
    route = torch.arange(M, device=DEVICE)[:, None] >= 50 * torch.arange(4, device=DEVICE)[None, :]
    route[400, 3] = False
    route[::7, 2] = False  # group 2 gathers throughout
    r = reorder(route)
    out = poisoned((M, N), torch.bfloat16)
    sm90.module(x.device).run(sm90.OPS[op], x, w, w2 if op == "swiglu" else None, r.index, r.counts, None, out, G,
                              8, grid_ctas, 1)
    ref = (gemm_mn_ref(x.double(), w.double(), route, G) if op == "gemm_mn" else
           swiglu_ref(x.double(), w.double(), w2.double(), route, G))
    check_close(out, ref)


@gpu
@hopper
@pytest.mark.parametrize("cluster", [1, 2])
@pytest.mark.parametrize("op,G", [("gemm_mn", 128), ("gemm_mn", 512), ("swiglu", 128), ("swiglu", 512)])
def test_gathers_at_llama_scale(op, G, cluster, built):
    """Bernoulli routes at s = 0.5 on the Llama-3.1-8B up / gate shape (4096 -> 14336), M = 4096: every busy row tile
    gathers, each CTA of the SM-count grid runs about a dozen (row tile, N tile) pairs of 64 K steps through the ring,
    and with clusters of 2 some fifty pairs per launch have one CTA whose stages only pass through.  Thirty launches
    back to back; every 8th row is checked against the float64 reference, and every inactive (row, group) output
    is 0."""
    M, N, K = 4096, 14336, 4096
    gen = seed_for("sm90_scale", op, G, cluster)
    x = randn((M, K), torch.bfloat16, gen)
    w, w2 = randn((N, K), torch.bfloat16, gen, 0.02), randn((N, K), torch.bfloat16, gen, 0.02)
    route = make_mask("random", (M, N // G), gen, 0.5)
    r = reorder(route)
    out = poisoned((M, N), torch.bfloat16)
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    for _ in range(30):  # back to back, as a timing loop runs them: the pairs' idle-partner pass-throughs race
        sm90.module(x.device).run(sm90.OPS[op], x, w, w2 if op == "swiglu" else None, r.index, r.counts, None, out, G,
                                  8, sms, cluster)
    rows = torch.arange(0, M, 8, device=DEVICE)
    ref = (swiglu_ref(x[rows].double(), w.double(), w2.double(), route[rows], G) if op == "swiglu" else
           gemm_mn_ref(x[rows].double(), w.double(), route[rows], G))
    check_close(out[rows], ref)
    assert (out[~expand_route(route, G)] == 0).all(), "an inactive (row, group) output must be exactly 0"


def cluster_route(pattern: str, M: int) -> torch.Tensor:
    """Masks [M, 4] for the cluster test: "mixed" has group 0 on for tokens < 100 only (its count ends inside the
    first row tile), group 1 from token 50 on, group 2 off at every 7th token (gathers), group 3 on but at token 400;
    "off", "on" and "one" (token 299 alone)."""
    t = torch.arange(M, device=DEVICE)[:, None]
    if pattern == "mixed":
        route = torch.cat([t < 100, t >= 50, t % 7 != 0, t != 400], dim=1)
    elif pattern == "one":
        route = (t == 299).expand(M, 4)
    else:
        route = torch.full((M, 4), pattern == "on", device=DEVICE)
    return route.contiguous()


@gpu
@hopper
@pytest.mark.parametrize("op", ["gemm_mn", "swiglu", "dense_swiglu"])
@pytest.mark.parametrize("G", [128, 512])
@pytest.mark.parametrize("grid_ctas", [2, 6, 0])
@pytest.mark.parametrize("pattern", ["mixed", "off", "on", "one"])
def test_clusters_of_two_share_the_weights(op, G, grid_ctas, pattern, built):
    """Pairs of CTAs along M, each loading half of every weight stage and multicasting it to both: M = 600 gives an
    odd number of row tiles (the last pair's second CTA has no rows), and counts that end inside a pair's first tile
    leave one CTA of the pair computing while the other only passes its half on.  One pair takes every tile
    (grid_ctas 2: K = 512 wraps the 4-stage ring many times), three pairs, or as many as fit (0: the SM count)."""
    if op == "dense_swiglu" and (G != 128 or pattern != "mixed"):
        pytest.skip("the dense kernel has no groups or masks")
    M, K = 600, 512
    N = 4 * G
    gen = seed_for("sm90_cluster", op, G, grid_ctas, pattern)
    x = randn((M, K), torch.bfloat16, gen)
    w, w2 = randn((N, K), torch.bfloat16, gen, 0.05), randn((N, K), torch.bfloat16, gen, 0.05)
    route = cluster_route(pattern, M) if op != "dense_swiglu" else torch.ones((M, 4), dtype=torch.bool,
                                                                                    device=DEVICE)
    r = reorder(route)
    out = poisoned((M, N), torch.bfloat16)
    ctas = grid_ctas or torch.cuda.get_device_properties(x.device).multi_processor_count
    gated = op != "gemm_mn"
    sm90.module(x.device).run(sm90.OPS[op], x, w, w2 if gated else None, None if op == "dense_swiglu" else r.index,
                              None if op == "dense_swiglu" else r.counts, None, out, G, 8, ctas, 2)
    ref = (swiglu_ref(x.double(), w.double(), w2.double(), route, G) if gated else
           gemm_mn_ref(x.double(), w.double(), route, G))
    check_close(out, ref)
    assert (out[~expand_route(route, G)] == 0).all(), "an inactive (row, group) output must be exactly 0"


@gpu
@hopper
def test_cluster_size_is_checked(built):
    x = torch.zeros(256, 64, dtype=torch.bfloat16, device=DEVICE)
    w = torch.zeros(256, 64, dtype=torch.bfloat16, device=DEVICE)
    out = torch.empty(256, 256, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(RuntimeError, match="invalid argument"):
        sm90.module(x.device).run(sm90.OPS["dense_swiglu"], x, w, w, None, None, None, out, 256, 8, 132, 3)


@gpu
@hopper
@pytest.mark.parametrize("M", [1, 300, 1000])
@pytest.mark.parametrize("K", [64, 4096])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dense_swiglu(M, K, dtype, built):
    gen = seed_for("dense_swiglu", M, K, dtype)
    x = randn((M, K), dtype, gen)
    wg, wu = randn((384, K), dtype, gen, 0.05), randn((384, K), dtype, gen, 0.05)
    out = poisoned((M, 384), dtype)
    assert sm90.dense_swiglu(x, wg, wu, out=out) is out
    ones = torch.ones((M, 1), dtype=torch.bool, device=DEVICE)
    check_close(out, swiglu_ref(x.double(), wg.double(), wu.double(), ones, 384))


@gpu
@hopper
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("M,G,dtype,cluster", [(300, 128, torch.bfloat16, 1), (1000, 256, torch.float16, 2),
                                               (1, 384, torch.bfloat16, 2)])
def test_dense_swiglu_with_route(kind, M, G, dtype, cluster, built, monkeypatch):
    """The dense SwiGLU with a route: every row computed, the skipped (row, group) blocks written as exact zeros in
    the epilogue (Eq. 3); M not a multiple of the tile, N_G = 3, both cluster sizes."""
    monkeypatch.setattr(sm90, "launch_shape", lambda device, op: (cluster, 8))
    gen = seed_for("dense_swiglu_route", kind, M, G, dtype, cluster)
    N, K = 3 * G, 256
    x = randn((M, K), dtype, gen)
    wg, wu = randn((N, K), dtype, gen, 0.05), randn((N, K), dtype, gen, 0.05)
    route = make_mask(kind, (M, N // G), gen, 0.5)
    out = poisoned((M, N), dtype)
    assert sm90.dense_swiglu(x, wg, wu, out=out, route=route) is out
    check_close(out, swiglu_ref(x.double(), wg.double(), wu.double(), route, G))
    assert (out[~expand_route(route, G)] == 0).all(), "a skipped (row, group) output must be exactly 0"


@gpu
@hopper
def test_auto_takes_cute_above_direct_rows_and_graph_replay(built):
    gen = seed_for("sm90_auto")
    M, N, K, G = 513, 1024, 256, 128
    x, w, w2 = (randn(shape, torch.bfloat16, gen, 0.1) for shape in ((M, K), (N, K), (N, K)))
    route = make_mask("random", (M, N // G), gen, 0.4)
    swiglu(x, w, w2, route, G)  # auto: CuTe at the group sizes the GPU's table lists for the op
    assert mod.LAST_BACKEND["swiglu"] == ("cute" if G in tuned_config(DEVICE)["gemm_mn"]["cute_G"]["swiglu"] else
                                          "triton")
    gemm_mn(x, w, route, G)
    assert mod.LAST_BACKEND["gemm_mn"] == ("cute" if G in tuned_config(DEVICE)["gemm_mn"]["cute_G"]["gemm_mn"] else
                                           "triton")
    swiglu(x[:64], w, w2, route[:64], G)
    assert mod.LAST_BACKEND["swiglu"] == "triton"
    gemm_mn(x, w, route, G, backend="triton")
    assert mod.LAST_BACKEND["gemm_mn"] == "triton"
    # reorder + kernel captured in one CUDA graph (no host sync), replayed on a new route
    out = torch.empty((M, N), dtype=torch.bfloat16, device=DEVICE)
    gemm_mn(x, w, route, G, out=out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gemm_mn(x, w, route, G, reordered=reorder(route), out=out)
    route.copy_(make_mask("random", (M, N // G), gen, 0.7))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    check_close(out, gemm_mn_ref(x.double(), w.double(), route, G))


@pytest.mark.parametrize("op", ["gemm_mn", "swiglu"])
def test_backend_variable_is_checked(op, monkeypatch):
    x = torch.zeros(8, 64, dtype=torch.float32, device=DEVICE)
    w = torch.zeros(128, 64, dtype=torch.float32, device=DEVICE)
    r = torch.ones(8, 2, dtype=torch.bool, device=DEVICE)
    call = (lambda: gemm_mn(x, w, r, 64)) if op == "gemm_mn" else (lambda: swiglu(x, w, w, r, 64))
    monkeypatch.setenv("WIDE_GEMM_BACKEND", "cutlass")
    with pytest.raises(KernelArgumentError, match="WIDE_GEMM_BACKEND='cutlass' is not allowed"):
        call()
    monkeypatch.setenv("WIDE_GEMM_BACKEND", "triton")
    assert call().shape == (8, 128)


def test_backend_refusals():
    x = torch.zeros(8, 64, dtype=torch.bfloat16, device=DEVICE)
    w = torch.zeros(128, 64, dtype=torch.bfloat16, device=DEVICE)
    r = torch.ones(8, 2, dtype=torch.bool, device=DEVICE)
    with pytest.raises(KernelArgumentError, match="backend='tvm' is not allowed; allowed: 'auto', 'triton', 'cute'"):
        gemm_mn(x, w, r, 64, backend="tvm")
    with pytest.raises(KernelArgumentError, match="backend='cute' cannot run this swiglu"):
        swiglu(x, w, w, r, 64, backend="cute")  # G = 64: the CuTe tiles take multiples of 128 (and CPU: no GPU)
    with pytest.raises(KernelArgumentError, match="dense_swiglu takes"):
        sm90.dense_swiglu(x, w[:, :32], w[:, :32])
    for bad in (r.int(), r[:, :1].expand(8, 3), r[:4], torch.ones(8, 4, dtype=torch.bool, device=DEVICE)):
        # not bool; N = 128 not a multiple of N_G = 3; other row count; G = 32, not a multiple of 128
        with pytest.raises(KernelArgumentError, match=r"route must be a bool tensor \[M=8, N_G\]"):
            sm90.dense_swiglu(x, w, w, route=bad)
