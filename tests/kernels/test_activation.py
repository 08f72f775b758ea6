"""masked_swiglu_act (the SwiGLU activation after dense gate / up GEMMs) against a float64 evaluation and the model's
own ops: exact zeros where the route skips, within the MLP's two roundings elsewhere."""

import pytest
import torch
import torch.nn.functional as F
from kernel_testutil import DEVICE, make_mask, randn, seed_for

from wide.kernels import KernelArgumentError, masked_swiglu_act

ULP = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11, torch.float32: 2.0 ** -24}


@pytest.mark.parametrize("M,N,G", [(1, 64, 16), (17, 128, 64), (9, 48, 48), (5, 32, 32)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("kind", ["random", "all", "none"])
def test_masked_swiglu_act(M, N, G, dtype, kind):
    gen = seed_for("masked_swiglu", M, N, G, dtype, kind)
    g, u = randn((M, N), dtype, gen, 3.0), randn((M, N), dtype, gen, 3.0)
    route = make_mask(kind, (M, N // G), gen)
    out = masked_swiglu_act(g, u, route, G)
    keep = route.repeat_interleave(G, dim=-1)
    assert out.dtype == dtype and out.shape == (M, N) and (out[~keep] == 0).all()
    if not keep.any():
        return
    want = (g.double() * torch.sigmoid(g.double()) * u.double())[keep]
    assert ((out[keep].double() - want).abs() <= 3 * ULP[dtype] * want.abs().max().item()).all()
    mod = (F.silu(g.float()).to(dtype).float() * u.float()).to(dtype)[keep]  # the MLP's ops in the dtype
    # SiLU may round to the neighbouring value of the dtype (its fp32 formula differs in the last bits), and the
    # product is rounded again: two ulps of the dtype (4 * ULP), plus one spacing where the result is subnormal
    err = (out[keep].double() - mod.double()).abs()
    subnormal = torch.finfo(dtype).tiny * torch.finfo(dtype).eps
    assert (err <= (8 if dtype == torch.float32 else 4) * ULP[dtype] * mod.double().abs() + subnormal).all()


def test_refusals():
    g = torch.zeros((3, 32), device=DEVICE)
    r2, r3 = (torch.ones((3, n), dtype=torch.bool, device=DEVICE) for n in (2, 3))
    for call, msg in [(lambda: masked_swiglu_act(g, g, r3, 16), "route"),
                      (lambda: masked_swiglu_act(g, g, r2, 5), "G=5"),
                      (lambda: masked_swiglu_act(g, g[:, :16], r2, 16), "equal shapes and dtypes"),
                      (lambda: masked_swiglu_act([[0.0] * 32] * 3, g, r2, 16), "g must be a torch.Tensor, got list"),
                      (lambda: masked_swiglu_act(g, g, None, 16), "route must be a torch.Tensor, got NoneType")]:
        with pytest.raises(KernelArgumentError, match=msg):
            call()
