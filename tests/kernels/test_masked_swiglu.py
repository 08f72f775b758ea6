"""Masked SwiGLU activation (the dense-GEMM form of the routed FFN, Eq. 3): ``silu(g) * u`` where the route
executes, exact 0 elsewhere, rounded like the model's MLP; against a float64 evaluation and the module ops."""

import pytest
import torch
import torch.nn.functional as F
from kernel_testutil import DEVICE, seed_for

from wide.kernels.fused import masked_swiglu_act, masked_swiglu_act_ref

# the rounding points of act_fn(gate) * up: SiLU rounded, then the product rounded -> <= 2 ulps of the dtype
ULP = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11, torch.float32: 2.0 ** -24}


@pytest.mark.parametrize("M,N,G", [(1, 64, 16), (5, 96, 32), (17, 128, 64), (9, 48, 48)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_masked_swiglu_act(M, N, G, dtype):
    gen = seed_for("masked_swiglu", M, N, G, dtype)
    g = (torch.randn((M, N), generator=gen) * 3).to(dtype).to(DEVICE)
    u = (torch.randn((M, N), generator=gen) * 3).to(dtype).to(DEVICE)
    route = (torch.rand((M, N // G), generator=gen) < 0.5).to(DEVICE)
    route[0, 0] = True
    out = masked_swiglu_act(g, u, route, G)
    assert out.dtype == dtype and out.shape == (M, N)
    keep = route.repeat_interleave(G, dim=-1)
    assert bool((out[~keep] == 0).all())
    g64, u64 = g.double(), u.double()
    want64 = g64 / (1 + torch.exp(-g64)) * u64
    err = (out.double() - want64).abs()[keep]
    assert err.max().item() <= 3 * ULP[dtype] * want64.abs()[keep].max().item() + 1e-30
    # the module ops in the same dtype: equal up to one rounding of the dtype per element (fp32: a few ulps,
    # the SiLU formulas differ in the last bits)
    mod = (F.silu(g.cpu().float()).to(dtype).float() * u.cpu().float()).to(dtype).to(DEVICE)
    rel = ((out.double() - mod.double()).abs() / mod.double().abs().clamp_min(1e-30))[keep]
    assert rel.max().item() <= (8 if dtype == torch.float32 else 2) * ULP[dtype]
    ref = masked_swiglu_act_ref(g, u, route, G)
    assert bool((ref[~keep] == 0).all())


def test_masked_swiglu_act_bad_input():
    g = torch.zeros((3, 32), device=DEVICE)
    with pytest.raises(ValueError, match="route"):
        masked_swiglu_act(g, g, torch.ones((3, 3), dtype=torch.bool, device=DEVICE), 16)
    with pytest.raises(ValueError, match="G=5"):
        masked_swiglu_act(g, g, torch.ones((3, 6), dtype=torch.bool, device=DEVICE), 5)
    with pytest.raises(ValueError, match="equal"):
        masked_swiglu_act(g, g[:, :16], torch.ones((3, 2), dtype=torch.bool, device=DEVICE), 16)
    with pytest.raises(ValueError, match="g must be a torch.Tensor, got list"):
        masked_swiglu_act([[0.0] * 32] * 3, g, torch.ones((3, 2), dtype=torch.bool, device=DEVICE), 16)
    with pytest.raises(ValueError, match="route must be a torch.Tensor, got NoneType"):
        masked_swiglu_act(g, g, None, 16)
