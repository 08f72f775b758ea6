import importlib

import pytest
import torch
from kernel_testutil import DEVICE, DTYPES, check_close, make_mask, poisoned, randn, seed_for

from wide.kernels import reorder, swiglu
from wide.kernels.reference import expand_route, swiglu_ref

gemm_mn_mod = importlib.import_module("wide.kernels.gemm_mn")  # the module, not the op it exports


@pytest.fixture(params=["sorted", "direct"])
def mode(request, monkeypatch):
    """sorted: reorder + gathered tiles (Algorithm 2); direct: few-row path reading the route."""
    monkeypatch.setattr(gemm_mn_mod, "DIRECT_MAX_M", 0 if request.param == "sorted" else 10**9)
    return request.param


def _run(M, N, K, G, dtype, kind, shared=False):
    gen = seed_for("swiglu", M, N, K, G, dtype, kind, shared)
    x = randn((M, K), dtype, gen)
    wg = randn((N, K), dtype, gen)
    wu = randn((N, K), dtype, gen)
    route = make_mask(kind, (M, N // G), gen)
    out = poisoned((M, N), dtype)
    kw = {"reordered": reorder(route)} if shared else {}
    swiglu(x, wg, wu, route, G, out=out, **kw)
    check_close(out, swiglu_ref(x.double(), wg.double(), wu.double(), route, G))
    assert (out[~expand_route(route, G)] == 0).all()


@pytest.mark.parametrize("G", [16, 32, 64, 128, 256, 512])
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_group_size(G, dtype, mode):
    _run(37, max(G, 64), 32, G, dtype, "random")


@pytest.mark.parametrize("M", [1, 2, 3, 4])
def test_decode_rows(M):
    _run(M, 128, 80, 32, torch.bfloat16, "random")


@pytest.mark.parametrize("kind", ["all", "none", "one_row"])
def test_mask_kinds(kind, mode):
    _run(40, 64, 32, 16, torch.float16, kind, shared=True)


def test_errors():
    x = torch.zeros(8, 32, dtype=torch.bfloat16, device=DEVICE)
    w = torch.zeros(64, 32, dtype=torch.bfloat16, device=DEVICE)
    r = torch.ones(8, 2, dtype=torch.bool, device=DEVICE)
    with pytest.raises(ValueError, match="w_up"):
        swiglu(x, w, w[:, :16], r, 32)
    # a w_up with fewer rows is named as such (it used to read as a route of the wrong shape)
    with pytest.raises(ValueError, match=r"w_up shape \(32, 32\) must equal w_gate shape \(64, 32\)"):
        swiglu(x, w, w[:32], r, 32)
    with pytest.raises(ValueError, match="reordered must be a Reordered"):
        swiglu(x, w, w, r, 32, reordered="x")
    with pytest.raises(ValueError, match="multiple of 16"):
        swiglu(x, w, w, torch.ones(8, 3, dtype=torch.bool, device=DEVICE), 21)


def test_reference_rounds_like_the_model_mlp():
    # bf16: gate, up, SiLU and product each rounded to bf16, as act_fn(gate_proj(x)) * up_proj(x) computes
    # it in the model (the masking path), so the engine's SwiGLU flips no router decision downstream by a
    # different rounding; one rounding of an fp32 result matched the model on only ~58 % of the elements
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 256, generator=g).bfloat16()
    wg = (torch.randn(512, 256, generator=g) / 16).bfloat16()
    wu = (torch.randn(512, 256, generator=g) / 16).bfloat16()
    route = torch.ones(64, 512 // 32, dtype=torch.bool)
    model = F.silu(x @ wg.T) * (x @ wu.T)
    assert (swiglu_ref(x, wg, wu, route, 32) == model).float().mean() > 0.999
    once = (F.silu(x.float() @ wg.float().T) * (x.float() @ wu.float().T)).bfloat16()
    assert (once == model).float().mean() < 0.9
