"""The CuTe sm_90a routed prefill attention (Eq. 2, Algorithm 4) against the float64 reference on an H100 / H200:
causal and not, chunked prefill (Tq < Tk), left padding, T not a multiple of the 128-row tile, every mask kind, GQA,
fp16, K / V as cache views; and its refusals (those also on the CPU)."""

import importlib

import pytest
import torch
from kernel_testutil import DEVICE, HOPPER, KINDS, check_close, gpu, hopper, make_mask, poisoned, randn, seed_for

from wide.kernels import KernelArgumentError, reorder, routed_attention, sm90
from wide.kernels.reference import attention_ref, head_route

mod = importlib.import_module("wide.kernels.attention")


def run(B, Hq, Hk, Tq, Tk, NG, causal, dtype=torch.bfloat16, kind="random", left_pad=None, p=0.5, kv_rows=0):
    """``kv_rows``: K / V are the first Tk rows of a longer cache."""
    gen = seed_for("attn_sm90", B, Hq, Hk, Tq, Tk, NG, causal, dtype, kind, left_pad, p, kv_rows)
    q = randn((B, Hq, Tq, 128), dtype, gen)
    k, v = (randn((B, Hk, Tk + kv_rows, 128), dtype, gen)[:, :, :Tk] for _ in range(2))
    route = make_mask(kind, (B, Tq, NG), gen, p)
    lp = None if left_pad is None else torch.tensor(left_pad, dtype=torch.int64, device=DEVICE)
    out = poisoned((B, Hq, Tq, 128), dtype)
    res = routed_attention(q, k, v, route, causal, left_pad=lp, out=out, backend="cute")
    assert res is out and mod.LAST_BACKEND["attention_prefill"] == "cute"
    check_close(out, attention_ref(q.double(), k.double(), v.double(), route, causal, lp))
    assert (out[~head_route(route, Hq)] == 0).all(), "an inactive (token, group) output must be exactly 0"


@gpu
@hopper
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("Tq,Tk", [(300, 300), (130, 517), (1024, 1024)])
def test_prefill(causal, Tq, Tk, built):
    # Tq = 300, 130: not multiples of the tile; Tk = 517: chunked prefill, a ragged last key block
    run(1, 8, 2, Tq, Tk, 2, causal)


@gpu
@hopper
@pytest.mark.parametrize("kind", KINDS)
def test_mask_kinds(kind, built):
    run(2, 8, 2, 257, 257, 2, True, kind=kind)  # all on, all off, one active row


@gpu
@hopper
@pytest.mark.parametrize("causal", [False, True])
def test_left_padding(causal, built):
    # pads inside the first key block, past it, past the whole sequence (those rows are 0)
    run(3, 4, 1, 200, 260, 1, causal, left_pad=[5, 140, 10**6])


@gpu
@hopper
@pytest.mark.parametrize("Hq,Hk,NG", [(32, 8, 8), (8, 8, 4), (8, 1, 1)])
def test_gqa_and_groups(Hq, Hk, NG, built):
    run(1, Hq, Hk, 384, 384, NG, True, p=0.3)


@gpu
@hopper
def test_fp16_cache_view(built):
    run(2, 4, 2, 96, 200, 2, True, torch.float16, kv_rows=56)


@gpu
@hopper
def test_engine_layout(built):
    # q and out as views of [B, T, Hq, d] (the projections' layout), a shared reorder
    gen = seed_for("attn_sm90_layout")
    B, T, Hq, Hk = 2, 333, 8, 2
    q = randn((B, T, Hq, 128), torch.bfloat16, gen).transpose(1, 2)
    k, v = (randn((B, T, Hk, 128), torch.bfloat16, gen).transpose(1, 2) for _ in range(2))
    route = make_mask("random", (B, T, 2), gen, 0.6)
    out = routed_attention(q, k, v, route, True, reordered=reorder(route), backend="cute")
    check_close(out, attention_ref(q.double(), k.double(), v.double(), route, True))


@gpu
@hopper
@pytest.mark.parametrize("pingpong", [False, True])
@pytest.mark.parametrize("grid", [0, 3, 132])  # one CTA per tile; a persistent grid, 3 CTAs taking every 3rd tile
def test_launch_variants(pingpong, grid, built):
    # the ping-pong of the consumers and the persistent tile loop (the K / V ring and Q's barriers carried from tile
    # to tile, tiles without an active row in between)
    gen = seed_for("attn_sm90_variants", pingpong, grid)
    B, Hq, Hk, T = 2, 8, 2, 700
    q = randn((B, Hq, T, 128), torch.bfloat16, gen)
    k, v = (randn((B, Hk, T, 128), torch.bfloat16, gen) for _ in range(2))
    route = make_mask("random", (B, T, 4), gen, 0.4)
    route[1, :, 3] = False  # a group with no active row: only zero tiles
    r = reorder(route)
    out = poisoned((B, Hq, T, 128), torch.bfloat16)
    sm90.module(q.device).attention(q, k, v, r.index, r.counts, None, out, True, 128 ** -0.5, pingpong, grid)
    check_close(out, attention_ref(q.double(), k.double(), v.double(), route, True))


@gpu
@hopper
@pytest.mark.parametrize("pingpong", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_persistent_grid_over_padded_tiles(pingpong, causal, built):
    """A persistent grid of 3 CTAs over sequences whose left pads hold whole tiles of active query rows (pad 300:
    causal tiles of the first ~256 tokens read no key block; pad past the end: no tile reads one).  Such tiles load
    no Q and touch no Q barrier, in the gather and the consumers alike, so the barriers stay in step from tile to
    tile.  Twenty launches back to back."""
    gen = seed_for("attn_sm90_padded", pingpong, causal)
    B, Hq, Hk, T = 3, 8, 2, 768
    q = randn((B, Hq, T, 128), torch.bfloat16, gen)
    k, v = (randn((B, Hk, T, 128), torch.bfloat16, gen) for _ in range(2))
    route = make_mask("random", (B, T, 4), gen, 0.5)
    lp = torch.tensor([300, 0, 10**6], dtype=torch.int64, device=DEVICE)
    r = reorder(route)
    lp32 = lp.clamp(0, T).to(torch.int32)  # as routed_attention hands it to the kernel
    out = poisoned((B, Hq, T, 128), torch.bfloat16)
    for _ in range(20):
        sm90.module(q.device).attention(q, k, v, r.index, r.counts, lp32, out, causal, 128 ** -0.5, pingpong, 3)
    check_close(out, attention_ref(q.double(), k.double(), v.double(), route, causal, lp))


def test_cute_refusals():
    q = torch.zeros(1, 4, 8, 64, dtype=torch.bfloat16, device=DEVICE)
    k = torch.zeros(1, 2, 8, 64, dtype=torch.bfloat16, device=DEVICE)
    r = torch.ones(1, 8, 2, dtype=torch.bool, device=DEVICE)
    with pytest.raises(KernelArgumentError, match="d=64: it takes bfloat16 / float16 with d = 128"):
        routed_attention(q, k, k, r, backend="cute")
    with pytest.raises(KernelArgumentError, match="backend='flash' is not allowed"):
        routed_attention(q, k, k, r, backend="flash")
    q1 = torch.zeros(1, 4, 1, 128, dtype=torch.bfloat16, device=DEVICE)
    k1 = torch.zeros(1, 2, 8, 128, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(KernelArgumentError, match="Tq = 1 is decode attention"):
        routed_attention(q1, k1, k1, torch.ones(1, 1, 2, dtype=torch.bool, device=DEVICE), backend="cute")
    q2 = torch.zeros(1, 4, 8, 128, dtype=torch.bfloat16, device=DEVICE)
    for scale in (0.0, -0.1):  # the kernel's softmax takes the row max of unscaled scores
        with pytest.raises(KernelArgumentError, match=f"scale={scale}: it takes a positive softmax scale"):
            routed_attention(q2, k1, k1, r, scale=scale, backend="cute")
    with pytest.raises(KernelArgumentError, match="route must be \\[B=1, Tq=8, N_G\\] .*got \\(1, 5, 2\\)"):
        routed_attention(q2, k1, k1, r[:, :5])
    if not HOPPER:
        with pytest.raises(KernelArgumentError, match="no sm_90 GPU"):
            routed_attention(q2, k1, k1, r, backend="cute")


@pytest.mark.parametrize("value", ["bogus", "CUTE", "flash"])
def test_backend_variable_is_checked(value, monkeypatch):
    q = torch.zeros(1, 4, 8, 16, dtype=torch.float32, device=DEVICE)
    r = torch.ones(1, 8, 2, dtype=torch.bool, device=DEVICE)
    monkeypatch.setenv("WIDE_ATTN_BACKEND", value)
    with pytest.raises(KernelArgumentError, match=f"WIDE_ATTN_BACKEND='{value}' is not allowed; allowed: 'triton', "
                                                  "'cute', or unset / 'auto'"):
        routed_attention(q, q, q, r)
    for ok in ("", "auto", "triton", " triton "):
        monkeypatch.setenv("WIDE_ATTN_BACKEND", ok)
        assert routed_attention(q, q, q, r).shape == q.shape


def test_triton_backend_runs_the_reference_semantics():
    # backend="triton" (and "auto") compute the same result as the reference on any device
    gen = seed_for("attn_sm90_triton")
    q, k, v = (randn((1, 4, 9, 16), torch.float32, gen) for _ in range(3))
    route = make_mask("random", (1, 9, 2), gen)
    ref = attention_ref(q.double(), k.double(), v.double(), route, True)
    for backend in ("triton", "auto"):
        check_close(routed_attention(q, k, v, route, True, backend=backend), ref)
