"""add_rmsnorm (the engine's residual add + LlamaRMSNorm in one kernel) against the float64 and the dtype reference."""

import pytest
import torch
from kernel_testutil import check_close, randn, seed_for

from wide.kernels.reference import add_rmsnorm_ref
from wide.kernels.rmsnorm import add_rmsnorm


@pytest.mark.parametrize("shape", [(3, 5, 64), (1, 4096), (7, 48)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("with_add", [False, True])
def test_add_rmsnorm(shape, dtype, with_add):
    gen = seed_for("rmsnorm", shape, dtype, with_add)
    h, w = randn(shape, dtype, gen), randn(shape[-1:], dtype, gen)
    add = randn(shape, dtype, gen) if with_add else None
    h2, y = add_rmsnorm(h, add, w, 1e-5)
    assert h2.dtype == y.dtype == dtype and (h2 is h) == (add is None)
    s = h if add is None else (h.double() + add.double()).to(dtype)  # the sum rounded once to the dtype
    assert torch.equal(h2, s)
    check_close(y, add_rmsnorm_ref(s.double(), None, w.double(), 1e-5)[1])
    if dtype == torch.float32:
        assert (y - add_rmsnorm_ref(h, add, w, 1e-5)[1]).abs().max().item() <= 1e-5 * y.abs().max().item()

