"""Zeroing the attention output of skipped head groups in place (the SDPA form of routed attention,
Algorithm 4's output for a skipped group): exact zeros where the route skips, every other value untouched."""

import pytest
import torch
from kernel_testutil import DEVICE, seed_for

from wide.kernels.fused import zero_skipped_heads_


@pytest.mark.parametrize("B,H,T,D,NG", [(1, 8, 5, 16, 2), (2, 9, 7, 64, 3), (3, 4, 1, 32, 4), (2, 6, 33, 8, 1)])
@pytest.mark.parametrize("layout", ["bhtd", "bthd"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("kind", ["random", "all", "none"])
def test_zero_skipped_heads(B, H, T, D, NG, layout, dtype, kind):
    gen = seed_for("zero_skipped_heads", B, H, T, D, NG, layout, dtype, kind)
    x = torch.randn((B, H, T, D), generator=gen).to(dtype)
    route = {"random": torch.rand((B, T, NG), generator=gen) < 0.5, "all": torch.ones((B, T, NG), dtype=torch.bool),
             "none": torch.zeros((B, T, NG), dtype=torch.bool)}[kind]
    # SDPA returns [B, H, T, d] as a transposed view of [B, T, H, d]: test both memory layouts
    a = x.to(DEVICE) if layout == "bhtd" else x.transpose(1, 2).contiguous().to(DEVICE).transpose(1, 2)
    out = zero_skipped_heads_(a, route.to(DEVICE))
    assert out is a
    # independent expectation: per (b, head, t), the group is head // (H / NG)
    keep = torch.zeros((B, H, T), dtype=torch.bool)
    for h in range(H):
        keep[:, h, :] = route[:, :, h // (H // NG)]
    want = torch.where(keep.unsqueeze(-1), x, torch.zeros((), dtype=dtype))
    assert torch.equal(a.cpu(), want)


def test_zero_skipped_heads_bad_input():
    a = torch.zeros((1, 4, 3, 8), device=DEVICE)
    with pytest.raises(ValueError, match="N_G dividing H_q=4"):
        zero_skipped_heads_(a, torch.ones((1, 3, 3), dtype=torch.bool, device=DEVICE))
    with pytest.raises(ValueError, match="route must be bool"):
        zero_skipped_heads_(a, torch.ones((1, 3, 2), dtype=torch.int8, device=DEVICE))
    with pytest.raises(ValueError, match="route must be bool"):
        zero_skipped_heads_(a, torch.ones((1, 2, 2), dtype=torch.bool, device=DEVICE))
    with pytest.raises(ValueError, match="4-D"):
        zero_skipped_heads_(a[0], torch.ones((1, 3, 2), dtype=torch.bool, device=DEVICE))
    with pytest.raises(ValueError, match="4-D"):
        zero_skipped_heads_(a.to(torch.int32), torch.ones((1, 3, 2), dtype=torch.bool, device=DEVICE))
    with pytest.raises(ValueError, match="a must be a torch.Tensor, got ndarray"):
        zero_skipped_heads_(a.cpu().numpy(), torch.ones((1, 3, 2), dtype=torch.bool, device=DEVICE))
    with pytest.raises(ValueError, match="route must be a torch.Tensor, got list"):
        zero_skipped_heads_(a, [[True]])
    with pytest.raises(ValueError, match="requires grad"):
        zero_skipped_heads_(a.clone().requires_grad_(), torch.ones((1, 3, 2), dtype=torch.bool, device=DEVICE))
