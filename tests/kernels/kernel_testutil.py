"""Helpers shared by the kernel tests: seeded inputs, edge masks, NaN-poisoned outputs and per-dtype tolerances."""

import zlib

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.bfloat16, torch.float16]
# relative L2 error allowed against the float64 reference, per output dtype
TOL = {torch.bfloat16: 1e-2, torch.float16: 1e-2, torch.float32: 1e-5}
KINDS = ["random", "all", "none", "one_row"]  # every mask kind (all on, all off, one active row)
gpu = pytest.mark.gpu
HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
hopper = pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU (H100 / H200)")


def seed_for(*parts) -> torch.Generator:
    """A generator seeded from the test case's parameters (fresh inputs per case, reproducible)."""
    g = torch.Generator(device="cpu")
    g.manual_seed(zlib.crc32(repr(parts).encode()))
    return g


def randn(shape, dtype, gen, scale=1.0):
    return (torch.randn(shape, generator=gen, dtype=torch.float32) * scale).to(dtype).to(DEVICE)


def make_mask(kind, shape, gen, p=0.5):
    """kind: random (Bernoulli p) | all | none | one_row (one active row, the others off) | one_active (one (row,
    group) pair executes; 2-D shapes)."""
    m = torch.zeros(shape, dtype=torch.bool)
    if kind == "random":
        m = torch.rand(shape, generator=gen) < p
    elif kind == "all":
        m[:] = True
    elif kind == "one_row":
        m[..., int(torch.randint(shape[-2], (1,), generator=gen)), :] = True
    elif kind == "one_active":
        m[int(torch.randint(shape[0], (1,), generator=gen)), int(torch.randint(shape[1], (1,), generator=gen))] = True
    elif kind != "none":
        raise AssertionError(kind)
    return m.to(DEVICE)


def poisoned(shape, dtype):
    """NaN-filled output buffer: an element the kernel does not write fails the check."""
    return torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)


def check_close(out, ref, tol=None):
    """Every element written (finite) and relative L2 error <= tol (default: :data:`TOL` of out's dtype) against a
    float64 reference; an all-zero reference needs an all-zero output."""
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert torch.isfinite(out).all(), "output has NaN/inf: some element was not written"
    o, r = out.double().cpu(), ref.double().cpu()
    nr = r.norm().item()
    if nr == 0.0:
        assert o.abs().max().item() == 0.0, "reference is exactly 0 but output is not"
        return
    err = (o - r).norm().item() / nr
    assert err <= (TOL[out.dtype] if tol is None else tol), f"relative L2 error {err:.3e}"
