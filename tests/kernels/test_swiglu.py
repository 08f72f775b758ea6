"""The fused routed SwiGLU (swiglu, and gemv_swiglu for M <= 4) against the float64 reference (Eq. 3)."""

import importlib

import pytest
import torch
import torch.nn.functional as F
from kernel_testutil import DEVICE, DTYPES, KINDS, check_close, gpu, make_mask, poisoned, randn, seed_for

from wide.kernels import KernelArgumentError, gemv_swiglu, reorder, swiglu, tuned_config
from wide.kernels.reference import expand_route, swiglu_ref

mod = importlib.import_module("wide.kernels.gemm_mn")


@pytest.fixture(params=["sorted", "direct"])
def mode(request, monkeypatch):
    monkeypatch.setitem(tuned_config(DEVICE)["gemm_mn"], "direct_max_m", 0 if request.param == "sorted" else 10**9)
    return request.param


def run(M, N, K, G, dtype, kind, shared=False, op=swiglu):
    gen = seed_for("swiglu", M, N, K, G, dtype, kind, shared)
    x, wg, wu = randn((M, K), dtype, gen), randn((N, K), dtype, gen), randn((N, K), dtype, gen)
    route = make_mask(kind, (M, N // G), gen)
    out = poisoned((M, N), dtype)
    op(x, wg, wu, route, G, out=out, **({"reordered": reorder(route)} if shared else {}))
    check_close(out, swiglu_ref(x.double(), wg.double(), wu.double(), route, G))
    assert (out[~expand_route(route, G)] == 0).all()


@pytest.mark.parametrize("G", [16, 64, 512])
@pytest.mark.parametrize("dtype", DTYPES + [torch.float32])
def test_group_sizes_and_dtypes(G, dtype, mode):
    run(37, max(G, 64), 32, G, dtype, "random")


@pytest.mark.parametrize("kind", KINDS)
def test_mask_kinds(kind, mode):
    run(40, 64, 32, 16, torch.float16, kind, shared=True)


@pytest.mark.parametrize("M", [1, 4])
@pytest.mark.parametrize("split", [1, 2])
@pytest.mark.parametrize("kind", ["random", "all", "none"])
def test_gemv(M, split, kind, monkeypatch):
    # with K splits the gate and up partials are summed in split order before the SiLU
    cfg = dict(BN=32, BK=16, SPLIT=split, SMAX=5)
    monkeypatch.setattr(mod, "_gemv_cands", lambda *a, **k: [cfg])
    run(M, 128, 80, 32, torch.bfloat16, kind, op=gemv_swiglu)


def test_reference_rounds_like_the_model_mlp():
    # bf16: gate, up, SiLU and product each rounded, as act_fn(gate_proj(x)) * up_proj(x) does; one rounding of the
    # fp32 result would differ from the model on many elements
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 256, generator=g).bfloat16()
    wg, wu = ((torch.randn(512, 256, generator=g) / 16).bfloat16() for _ in range(2))
    model = F.silu(x @ wg.T) * (x @ wu.T)
    assert (swiglu_ref(x, wg, wu, torch.ones(64, 16, dtype=torch.bool), 32) == model).float().mean() > 0.999
    assert ((F.silu(x.float() @ wg.float().T) * (x.float() @ wu.float().T)).bfloat16() == model).float().mean() < 0.9


def test_refusals():
    x = torch.zeros(8, 32, dtype=torch.bfloat16, device=DEVICE)
    w = torch.zeros(64, 32, dtype=torch.bfloat16, device=DEVICE)
    r = torch.ones(8, 2, dtype=torch.bool, device=DEVICE)
    for call, msg in [
        (lambda: swiglu(x, w, w[:, :16], r, 32), "w_up must have shape"),
        (lambda: swiglu(x, w, w[:32], r, 32), r"w_up shape \(32, 32\) must equal w_gate shape \(64, 32\)"),
        (lambda: swiglu(x, w, w, r, 32, reordered="x"), "reordered must be a Reordered"),
        (lambda: swiglu(x, w, w, torch.ones(8, 3, dtype=torch.bool, device=DEVICE), 21), "multiple of 16"),
        (lambda: swiglu(x, w[:32], w[:32].clone(), r[:, :1], 32, out=x), "out overlaps x"),
        (lambda: swiglu(x, w.clone(), w, r, 32, out=w.view(-1)[:512].view(8, 64)), "out overlaps w_up"),
        (lambda: gemv_swiglu(x, w, w, r, 32), "M <= 4"),
    ]:
        with pytest.raises(KernelArgumentError, match=msg):
            call()


@gpu
@pytest.mark.parametrize("M", [1, 3, 333, 4100])
@pytest.mark.parametrize("G", [32, 128, 512])
def test_real_shapes(M, G):
    run(M, 14336, 4096, G, torch.bfloat16, "random")  # Llama-3.1-8B's gate / up
