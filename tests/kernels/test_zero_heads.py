"""zero_skipped_heads_ (skipped head groups of an SDPA output set to 0 in place): exact zeros where the route skips,
every other value untouched, for both memory layouts of the output."""

import pytest
import torch
from kernel_testutil import DEVICE, seed_for

from wide.kernels import KernelArgumentError, zero_skipped_heads_


@pytest.mark.parametrize("B,H,T,D,NG", [(1, 8, 5, 16, 2), (2, 9, 7, 64, 3), (3, 4, 1, 32, 4), (2, 6, 33, 8, 1)])
@pytest.mark.parametrize("layout", ["bhtd", "bthd"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kind", ["random", "all", "none"])
def test_zero_skipped_heads(B, H, T, D, NG, layout, dtype, kind):
    gen = seed_for("zero_heads", B, H, T, D, NG, layout, dtype, kind)
    x = torch.randn((B, H, T, D), generator=gen).to(dtype)
    route = {"random": torch.rand((B, T, NG), generator=gen) < 0.5, "all": torch.ones((B, T, NG), dtype=torch.bool),
             "none": torch.zeros((B, T, NG), dtype=torch.bool)}[kind]
    # SDPA returns [B, H, T, d] as a transposed view of [B, T, H, d]
    a = x.to(DEVICE) if layout == "bhtd" else x.transpose(1, 2).contiguous().to(DEVICE).transpose(1, 2)
    assert zero_skipped_heads_(a, route.to(DEVICE)) is a
    keep = torch.stack([route[:, :, h // (H // NG)] for h in range(H)], 1)  # [B, H, T]
    assert torch.equal(a.cpu(), torch.where(keep.unsqueeze(-1), x, torch.zeros((), dtype=dtype)))


def test_refusals():
    a = torch.zeros((1, 4, 3, 8), device=DEVICE)
    r = torch.ones((1, 3, 2), dtype=torch.bool, device=DEVICE)
    for call, msg in [(lambda: zero_skipped_heads_(a, torch.ones((1, 3, 3), dtype=torch.bool, device=DEVICE)),
                       "N_G dividing H_q=4"),
                      (lambda: zero_skipped_heads_(a, r.to(torch.int8)), "route must be bool"),
                      (lambda: zero_skipped_heads_(a[0], r), "4-D"),
                      (lambda: zero_skipped_heads_(a.cpu().numpy(), r), "a must be a torch.Tensor, got ndarray"),
                      (lambda: zero_skipped_heads_(a.clone().requires_grad_(), r), "requires grad")]:
        with pytest.raises(KernelArgumentError, match=msg):
            call()
