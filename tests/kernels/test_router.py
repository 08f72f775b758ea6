"""router_mask (Eq. 4-5) against a float64 evaluation of the router: logits within fp32 rounding, decisions equal
wherever the two logits are not a near-tie; every few-row and many-row variant, the residual add, the fallback."""

import importlib

import pytest
import torch
from kernel_testutil import DEVICE, seed_for

from wide.kernels import KernelArgumentError, _common, router_mask
from wide.kernels.reference import router_ref

mod = importlib.import_module("wide.kernels.router")


def weights(D, N, r, gen):
    return (torch.randn(r, D, generator=gen) / D**0.5, torch.randn(r, generator=gen),
            torch.randn(2 * N, r, generator=gen), torch.randn(2 * N, generator=gen) * 0.5)


def logits64(W, x):
    w1, b1, w2, b2 = (t.double().cpu() for t in W)
    return ((x.double().cpu() @ w1.T + b1) @ w2.T + b2).view(*x.shape[:-1], -1, 2)


def check(mask, W, x, logits=None):
    """Decisions (and fp32 logits) against float64 where the margin is clear of ties."""
    ref = logits64(W, x)
    scale = ref.abs().max().item()
    clear = (ref[..., 0] - ref[..., 1]).abs() > 1e-4 * scale
    assert clear.float().mean().item() > 0.9, "the inputs must not be built from near-ties"
    assert torch.equal(mask.cpu()[clear], (ref[..., 0] >= ref[..., 1])[clear])
    if logits is not None:
        assert (logits.double().cpu() - ref).abs().max().item() <= 1e-5 * scale + 1e-6


def case(rows, D, N, r, dtype, tag=""):
    gen = seed_for("router", rows, D, N, r, dtype, tag)
    W = tuple(t.to(DEVICE) for t in weights(D, N, r, gen))
    return W, torch.randn((rows, D), generator=gen).to(dtype).to(DEVICE)


@pytest.mark.parametrize("rows", [1, 3, 17, 33])
@pytest.mark.parametrize("D,N,r", [(64, 8, 16), (200, 112, 16), (96, 3, 4)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_router_mask(rows, D, N, r, dtype):
    # a rank below 16 with more than max_rows rows runs the reference
    W, x = case(rows, D, N, r, dtype)
    check(router_mask(x, *W), W, x)


def test_long_hidden_and_many_groups():
    W, x = case(4, 4096, 8, 16, torch.bfloat16)  # Llama-3.1-8B's hidden size: the long D loop
    check(router_mask(x, *W), W, x)
    W, x = case(3, 64, 896, 16, torch.bfloat16)  # 896 groups (G = 16 on Llama's FFN): finished one row at a time
    check(router_mask(x, *W), W, x)


@pytest.mark.parametrize("rows", [3, 16])
@pytest.mark.parametrize("dot", [False, True])
@pytest.mark.parametrize("programs", [16, 32, 64])
def test_few_row_kernel_variants(rows, dot, programs):
    # the last program's finish (row loop / one step / fp32 dots over rows padded to 16) over 16-64 programs along D
    W, x = case(rows, 1024, 40, 16, torch.bfloat16)
    logits = torch.full((rows, 40, 2), float("nan"), device=DEVICE)
    check(mod._launch(x, W, logits, dot=dot, programs=programs), W, x, logits)


@pytest.mark.parametrize("rows", [1, 5, 32])
@pytest.mark.parametrize("with_add", [False, True])
def test_two_launch_form(rows, with_add):
    # a GEMM against W1's three bf16 pieces (exact products, fp32 sums), then the finish kernel
    W, x = case(rows, 512, 112, 16, torch.bfloat16, with_add)
    add = torch.randn(x.shape, generator=seed_for("add", rows)).to(torch.bfloat16).to(DEVICE) if with_add else None
    logits = torch.full((rows, 112, 2), float("nan"), device=DEVICE)
    mask = mod._mm_launch(x, W, add, logits=logits)
    check(mask, W, x if add is None else (x.float() + add.float()).bfloat16(), logits)


@pytest.mark.parametrize("rows", [33, 70])
@pytest.mark.parametrize("split3,splitd", [(True, 1), (True, 3), (False, 4)])
def test_tile_kernel(rows, split3, splitd):
    # many rows: x W1^T against W1's pieces (tensor cores) or as an fp32 dot, D unsplit or split over programs whose
    # last arrival finishes the tile; a second launch finds the counters reset
    W, x = case(rows, 200, 112, 16, torch.bfloat16)
    for _ in range(2):
        logits = torch.full((rows, 112, 2), float("nan"), device=DEVICE)
        check(mod._tile_launch(x, W, logits, split3=split3, splitd=splitd), W, x, logits)
    assert all(int(c.abs().sum()) == 0 for c in _common._COUNTERS.values())


def test_split3_pieces_sum_to_w1_and_follow_changes():
    W, x = case(70, 4096, 112, 16, torch.bfloat16)
    pieces = mod._w1_split3(W[0])
    assert pieces.dtype == torch.bfloat16 and pieces.shape == (48, 4096) and mod._w1_split3(W[0]) is pieces
    assert torch.equal(pieces.view(3, 16, 4096).double().sum(0), W[0].double())
    with torch.no_grad():
        W[0].mul_(0.5)  # an in-place change rebuilds the pieces
    assert torch.equal(mod._w1_split3(W[0]).view(3, 16, 4096).double().sum(0), W[0].double())
    check(mod._mm_launch(x, W), W, x)  # many rows through the two-launch form


@pytest.mark.parametrize("rows", [1, 3, 40])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_residual_add(rows, dtype):
    """router_mask(h, ..., add=a) routes on h + a rounded to h's dtype (what add_rmsnorm writes)."""
    W, h = case(rows, 200, 112, 16, dtype)
    a = torch.randn(h.shape, generator=seed_for("add", rows, dtype)).to(dtype).to(DEVICE)
    s = (h.double() + a.double()).to(dtype)
    got = router_mask(h.view(rows, 1, 200), *W, add=a.view(rows, 1, 200))
    assert got.shape == (rows, 1, 112)
    check(got.view(rows, 112), W, s)
    assert torch.equal(got.view(rows, 112), router_mask(s, *W))


def test_counter_reset_strided_rows_and_reference():
    W, x = case(2, 64, 6, 16, torch.bfloat16)
    first = router_mask(x, *W)
    for _ in range(3):  # the arrival counter is reset by the last program of every launch
        assert torch.equal(router_mask(x, *W), first)
    assert all(int(c.abs().sum()) == 0 for c in _common._COUNTERS.values())
    xs = torch.randn((3, 2, 128), generator=seed_for("strided")).to(DEVICE)[..., ::2]
    check(router_mask(xs, *W), W, xs)
    rows = _common.tuned_config(DEVICE)["router"]["max_rows"] + 1
    many = torch.randn((rows, 64), generator=seed_for("many")).to(DEVICE)
    assert torch.equal(router_mask(many, *W), router_ref(many, *W))  # the tile kernel, same convention


def test_refusals():
    W, x = case(2, 64, 6, 16, torch.float32)
    w1, b1, w2, b2 = W
    for call, msg in [
        (lambda: router_mask(torch.zeros(1, 32, device=DEVICE), *W), "x has 32 features, the router reads 64"),
        (lambda: router_mask(x, w1, b1, w2[:, :8], b2), r"w2 \[2 N_G, r\]"),
        (lambda: router_mask(x, w1, b1, w2[:11], b2[:11]), r"w2 \[2 N_G, r\]"),
        (lambda: router_mask(x, *W, add=x[:, :32]), "add is"),
        (lambda: router_mask(x, *W, add=1.0), "add must be a torch.Tensor"),
        (lambda: router_mask(x.int(), *W), "x has dtype int32"),
    ]:
        with pytest.raises(KernelArgumentError, match=msg):
            call()
