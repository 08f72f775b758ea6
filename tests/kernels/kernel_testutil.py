"""Helpers shared by the kernel tests."""

import zlib

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.bfloat16, torch.float16]
TOL = 1e-2  # relative L2 for bf16/fp16 operands (device METHOD.md)


def seed_for(*parts) -> torch.Generator:
    """A generator seeded from the test case parameters (fresh inputs per case, reproducible)."""
    g = torch.Generator(device="cpu")
    g.manual_seed(zlib.crc32(repr(parts).encode()))
    return g


def randn(shape, dtype, gen):
    return torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype).to(DEVICE)


def make_mask(kind, shape, gen, p=0.5):
    """kind: random | all | none | one_row (exactly one active row, the others all inactive) |
    one_active (exactly one (row, group) pair executes; 2-D shapes)."""
    if kind == "random":
        m = torch.rand(shape, generator=gen) < p
    elif kind == "all":
        m = torch.ones(shape, dtype=torch.bool)
    elif kind == "none":
        m = torch.zeros(shape, dtype=torch.bool)
    elif kind == "one_row":
        m = torch.zeros(shape, dtype=torch.bool)
        rows = shape[-2]
        r = int(torch.randint(rows, (1,), generator=gen))
        m[..., r, :] = True
    elif kind == "one_active":
        m = torch.zeros(shape, dtype=torch.bool)
        m[int(torch.randint(shape[0], (1,), generator=gen)), int(torch.randint(shape[1], (1,), generator=gen))] = True
    else:
        raise AssertionError(kind)
    return m.to(DEVICE)


def poisoned(shape, dtype):
    return torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)


def check_close(out, ref, tol=TOL):
    """Every element written (finite) and relative L2 error <= tol against a float64 reference."""
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert torch.isfinite(out).all(), "output has NaN/inf: some element was not written"
    o = out.double().cpu()
    r = ref.double().cpu()
    nr = r.norm().item()
    if nr == 0.0:
        assert o.abs().max().item() == 0.0, "reference is exactly 0 but output is not"
        return 0.0
    err = (o - r).norm().item() / nr
    assert err <= tol, f"relative L2 error {err:.3e} > {tol}"
    return err
