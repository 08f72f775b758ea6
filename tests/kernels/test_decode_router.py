"""The few-row router kernel behind :func:`wide.kernels.fused.router_mask` (Eq. 4-5, decode path).

Logits are compared with a float64 evaluation of the router; decisions with the reference path
(``argmax_mask(router(x))``) wherever the float64 margin between the two logits is not a near-tie.
"""

import pytest
import torch
from kernel_testutil import DEVICE, seed_for

from wide.inference import fused
from wide.kernels import _common
from wide.kernels.fused import ROUTER_MAX_ROWS, _router_logits, _router_mask_rowwise, router_mask
from wide.routing import Router, argmax_mask


def _router(D, N, r, gen):
    torch.manual_seed(int(torch.randint(1 << 30, (1,), generator=gen)))
    R = Router(D, N, r, init_keep=0.5)
    with torch.no_grad():
        R.w1.bias.normal_(generator=gen)
        R.w2.weight.normal_(std=1.0, generator=gen)
        R.w2.bias.normal_(std=0.5, generator=gen)
    return R.to(DEVICE)


def _logits64(R, x):
    x = x.double()
    h = x @ R.w1.weight.double().T + R.w1.bias.double()
    return (h @ R.w2.weight.double().T + R.w2.bias.double()).view(*x.shape[:-1], R.n_groups, 2)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 17, 32, 33, 50])
@pytest.mark.parametrize("D,N,r", [(64, 8, 16), (200, 112, 16), (96, 3, 4), (128, 20, 32)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_router_kernel_matches_reference(rows, D, N, r, dtype):
    _check_router(rows, D, N, r, dtype)


@pytest.mark.parametrize("rows", [1, 4, 17, 33])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_router_kernel_llama_hidden(rows, dtype):
    # Llama-3.1-8B's hidden size: the long D loop. The row counts are one of each row-tiling case above
    # (one row, the <= 4-row decode batch, odd counts above 16 and above 32); at 13 s a case under the
    # interpreter the rest of the row list runs at the small D's only
    _check_router(rows, 4096, 8, 16, dtype)


@pytest.mark.parametrize("rows", [3, 32])
def test_router_kernel_many_groups(rows):
    """896 groups (G = 16 on Llama-3.1-8B's FFN): the last program finishes one row at a time."""
    _check_router(rows, 64, 896, 16, torch.bfloat16)


def _check_router(rows, D, N, r, dtype):
    gen = seed_for("router", rows, D, N, r, dtype)
    R = _router(D, N, r, gen)
    x = torch.randn((rows, D), generator=gen).to(dtype).to(DEVICE)
    ref = _logits64(R, x)
    scale = ref.abs().max().item()
    margin = (ref[..., 0] - ref[..., 1]).abs()
    clear = margin > 1e-4 * scale
    assert clear.float().mean().item() > 0.9  # the inputs are not built from near-ties
    want = argmax_mask(R(x))
    # a kernel computes this router: the few-row one, or for more rows the tile one (rank >= 16, its fp32 dots'
    # smallest size on the GPU); otherwise router_mask runs the module (checked below)
    if rows <= ROUTER_MAX_ROWS or r >= 16:
        mask, logits = _router_logits(R, x)
        assert logits.dtype == torch.float32 and logits.shape == (rows, N, 2)
        assert (logits.double() - ref).abs().max().item() <= 1e-5 * scale + 1e-6
        assert torch.equal(mask[clear], want[clear])
        assert torch.equal(mask[clear], (ref[..., 0] >= ref[..., 1])[clear])
    assert torch.equal(router_mask(R, x)[clear], want[clear])
    if rows <= ROUTER_MAX_ROWS:
        assert torch.equal(_router_mask_rowwise(R, x)[clear], want[clear])


def test_router_shapes_counter_and_fallback():
    gen = seed_for("router_shapes")
    R = _router(64, 6, 16, gen)
    x = torch.randn((2, 1, 64), generator=gen).to(torch.bfloat16).to(DEVICE)
    first = router_mask(R, x)
    assert first.shape == (2, 1, 6) and first.dtype == torch.bool
    for _ in range(3):  # the arrival counter is reset by the last program of every launch
        assert torch.equal(router_mask(R, x), first)
    for (dev, _s, *_), (part, cnt) in fused._ROUTER_WS.items():
        assert cnt.item() == 0
    assert torch.equal(first, argmax_mask(R(x)))
    # strided rows (last dim not contiguous) and a 3-D batch
    xs = torch.randn((3, 2, 128), generator=gen).to(DEVICE)[..., ::2]
    assert torch.equal(router_mask(R, xs), argmax_mask(R(xs)))
    # more rows than the few-row kernel takes: the tile kernel (rank 16), same convention
    xb = torch.randn((ROUTER_MAX_ROWS + 1, 64), generator=gen).to(DEVICE)
    assert torch.equal(router_mask(R, xb), argmax_mask(R(xb)))
    # a rank below 16 with many rows: the reference path
    R4 = _router(64, 6, 4, gen)
    assert not fused._router_ok(R4, xb)
    assert torch.equal(router_mask(R4, xb), argmax_mask(R4(xb)))
    with pytest.raises(ValueError, match="features"):
        router_mask(R, torch.zeros((1, 32), device=DEVICE))


def test_router_split3_many_rows():
    """The tensor-core variant of the many-row router: W1 as three bf16 pieces summing to it exactly, one GEMM
    with fp32 accumulation (emulated in fp32 on the CPU), then W2 and the argmax; against float64."""
    gen = seed_for("router_split3")
    R = _router(4096, 112, 16, gen)
    x = torch.randn((70, 4096), generator=gen).to(torch.bfloat16).to(DEVICE)
    w = fused._w1_split3(R)
    assert w.dtype == torch.bfloat16 and w.shape == (48, 4096)
    assert torch.equal(w[:16].double() + w[16:32].double() + w[32:].double(), R.w1.weight.double())
    assert fused._w1_split3(R) is w  # cached
    with torch.no_grad():
        R.w1.weight.mul_(0.5)  # an in-place change rebuilds the pieces
    w2 = fused._w1_split3(R)
    assert torch.equal(w2[:16].double() + w2[16:32].double() + w2[32:].double(), R.w1.weight.double())
    ref = _logits64(R, x)
    margin = (ref[..., 0] - ref[..., 1]).abs()
    clear = margin > 1e-4 * ref.abs().max().item()
    assert clear.float().mean().item() > 0.9
    got = fused._router_split3(R, x)
    assert torch.equal(got[clear], (ref[..., 0] >= ref[..., 1])[clear])
    assert torch.equal(router_mask(R, x)[clear], got[clear])  # the path router_mask picks on this device


@pytest.mark.parametrize("rows", [33, 70])
@pytest.mark.parametrize("D,N", [(64, 8), (200, 112)])
@pytest.mark.parametrize("split3,splitd", [(True, 1), (True, 3), (False, 4)])
def test_router_tile_split3(rows, D, N, split3, splitd):
    """The many-row tile kernel with ``x W1^T`` on tensor cores against W1's three bf16 pieces (bf16 rows) or as an
    fp32 dot, with D unsplit or split over ``splitd`` programs per row tile (partials summed by the last to arrive):
    logits within fp32 rounding of float64, decisions equal away from near-ties, the same on a second launch (the
    arrival counters reset themselves); fp16 rows are refused by the tensor-core form."""
    gen = seed_for("router_tile3", rows, D, N, split3, splitd)
    R = _router(D, N, 16, gen)
    x = torch.randn((rows, D), generator=gen).to(torch.bfloat16).to(DEVICE)
    ref = _logits64(R, x)
    scale = ref.abs().max().item()
    clear = (ref[..., 0] - ref[..., 1]).abs() > 1e-4 * scale
    assert clear.float().mean().item() > 0.9
    for _ in range(2):
        logits = torch.full((rows, N, 2), float("nan"), dtype=torch.float32, device=DEVICE)
        mask = fused._router_tile_launch(R, x, logits, split3=split3, splitd=splitd)
        assert (logits.double() - ref).abs().max().item() <= 1e-5 * scale + 1e-6
        assert torch.equal(mask[clear], (ref[..., 0] >= ref[..., 1])[clear])
    assert all(int(c.abs().sum()) == 0 for c in _common.TILE_COUNTERS.values())
    with pytest.raises(ValueError, match="bf16"):
        fused._router_tile_launch(R, x.half(), split3=True)
    with pytest.raises(ValueError, match="bf16"):
        fused._router_tile_launch(R, x.half(), split3=True)


@pytest.mark.parametrize("rows", [1, 3, 40])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_router_reads_residual_add(rows, dtype):
    """``router_mask(R, h, add)`` routes on ``h + add`` rounded to the model dtype (what add_rmsnorm writes):
    the few-row kernel adds inside the kernel, more rows add first; float64 logits of the rounded sum decide."""
    gen = seed_for("router_add", rows, dtype)
    R = _router(200, 112, 16, gen)
    h = torch.randn((rows, 1, 200), generator=gen).to(dtype).to(DEVICE)
    a = torch.randn((rows, 1, 200), generator=gen).to(dtype).to(DEVICE)
    s = (h.double() + a.double()).to(dtype)  # one rounding of the exact sum, as the fp32 add then cast
    ref = _logits64(R, s)
    clear = (ref[..., 0] - ref[..., 1]).abs() > 1e-4 * ref.abs().max().item()
    got = router_mask(R, h, add=a)
    assert got.shape == (rows, 1, 112)
    assert torch.equal(got[clear], (ref[..., 0] >= ref[..., 1])[clear])
    assert torch.equal(got, router_mask(R, s))  # same input, same kernel: same decisions, ties included
    with pytest.raises(ValueError, match="add is"):
        router_mask(R, h, add=a[:, :, :100])
    with pytest.raises(ValueError, match="add must be a tensor"):
        router_mask(R, h, add=1.0)


@pytest.mark.parametrize("rows", [5, 16])
@pytest.mark.parametrize("dot", [True, False])
def test_router_dot_and_row_loop_agree(rows, dot):
    """The two ways the few-row kernel's last program finishes 5-32 rows: fp32 dots over rows padded to 16
    (``DOT``, the default from 9 rows at rank >= 16) and the row loop; both against float64."""
    gen = seed_for("router_dot", rows, dot)
    R = _router(256, 112, 16, gen)
    x = torch.randn((rows, 256), generator=gen).to(torch.bfloat16).to(DEVICE)
    ref = _logits64(R, x)
    scale = ref.abs().max().item()
    clear = (ref[..., 0] - ref[..., 1]).abs() > 1e-4 * scale
    logits = torch.full((rows, 112, 2), float("nan"), device=DEVICE)
    mask = fused._router_launch(R, x, logits, dot=dot)
    assert (logits.double() - ref).abs().max().item() <= 1e-5 * scale + 1e-6
    assert torch.equal(mask[clear], (ref[..., 0] >= ref[..., 1])[clear])
    assert fused._router_dot(9, 16) and fused._router_dot(32, 32)
    assert not fused._router_dot(8, 16) and not fused._router_dot(16, 8)
    with pytest.raises(ValueError, match="rank"):
        fused._router_launch(_router(64, 6, 4, gen), x[:, :64].contiguous(), dot=True)


@pytest.mark.parametrize("rows", [3, 16])
def test_router_few_candidates_agree(rows, monkeypatch):
    """Every config :func:`fused._router_few` can pick (the fixed rule's finish over 64 or 32 programs along D),
    and 16 programs and the other finish as well, give the float64 decisions; the tuner sees the fixed rule
    first, timed in a CUDA graph."""
    from wide.kernels import _common

    gen = seed_for("router_few", rows)
    R = _router(1024, 40, 16, gen)
    x = torch.randn((rows, 1024), generator=gen).to(torch.bfloat16).to(DEVICE)
    ref = _logits64(R, x)
    clear = (ref[..., 0] - ref[..., 1]).abs() > 1e-4 * ref.abs().max().item()
    want = (ref[..., 0] >= ref[..., 1])[clear]
    seen = {}

    def fake_pick(op, key, device, cands, run, graph=False):
        seen["cands"], seen["graph"], seen["key"] = cands, graph, key
        return dict(cands[0])

    monkeypatch.setattr(_common, "pick_config", fake_pick)
    mask = fused._router_few(R, x)
    dot = fused._router_dot(rows, 16)
    assert seen["graph"] and seen["key"][0] == rows
    assert seen["cands"] == [dict(dot=dot, programs=None), dict(dot=dot, programs=32), dict(impl="mm")]
    assert torch.equal(mask[clear], want)
    for d in (False, True):
        for p in (16, 32, 64):
            m = fused._router_launch(R, x, dot=d, programs=p)
            assert torch.equal(m[clear], want), (d, p)
    fused._router_few(R, x.float())  # fp32 rows: no mm candidate (its GEMM is exact for bf16 operands only)
    assert seen["cands"] == [dict(dot=dot, programs=None), dict(dot=dot, programs=32)]


@pytest.mark.parametrize("rows", [1, 5, 32])
@pytest.mark.parametrize("N", [8, 112])
@pytest.mark.parametrize("with_add", [False, True])
def test_router_mm_launch_matches_float64(rows, N, with_add):
    """The two-launch few-row router (GEMM against W1's three bf16 pieces, then the finish kernel): fp32 logits
    within 1e-5 of the largest against float64, decisions equal wherever the two logits are apart, with the
    residual add rounded to bf16 first as add_rmsnorm does."""
    gen = seed_for("router_mm", rows, N, with_add)
    R = _router(512, N, 16, gen)
    x = torch.randn((rows, 512), generator=gen).to(torch.bfloat16).to(DEVICE)
    add = torch.randn((rows, 512), generator=gen).to(torch.bfloat16).to(DEVICE) if with_add else None
    xin = (x.float() + add.float()).to(torch.bfloat16) if with_add else x
    ref = _logits64(R, xin)
    scale = ref.abs().max().item()
    clear = (ref[..., 0] - ref[..., 1]).abs() > 1e-4 * scale
    logits = torch.full((rows, N, 2), float("nan"), device=DEVICE)
    mask = fused._router_mm_launch(R, x, add, logits=logits)
    assert mask.dtype == torch.bool and mask.shape == (rows, N)
    assert (logits.double() - ref).abs().max().item() <= 1e-5 * scale + 1e-6
    assert torch.equal(mask[clear], (ref[..., 0] >= ref[..., 1])[clear])
    with pytest.raises(ValueError, match="bf16"):
        fused._router_mm_launch(R, x.float())
