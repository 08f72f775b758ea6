"""Direct tests of the decode (M <= 4) GEMV paths and of the split-KV decode attention."""

import importlib

import pytest
import torch
from kernel_testutil import DEVICE, check_close, make_mask, poisoned, randn, seed_for

from wide.kernels import decode_attention, gemv_k, gemv_mn, gemv_swiglu, routed_attention
from wide.kernels.reference import attention_ref, gemm_k_ref, gemm_mn_ref, swiglu_ref


@pytest.mark.parametrize("M", [1, 2, 3, 4])
@pytest.mark.parametrize("G", [16, 512])
@pytest.mark.parametrize("kind", ["random", "none", "one_row"])
def test_gemv_paths(M, G, kind):
    gen = seed_for("gemv", M, G, kind)
    N, K = 512, 96
    x = randn((M, K), torch.bfloat16, gen)
    w = randn((N, K), torch.bfloat16, gen)
    w2 = randn((N, K), torch.bfloat16, gen)
    r = make_mask(kind, (M, N // G), gen)
    out = poisoned((M, N), torch.bfloat16)
    gemv_mn(x, w, r, G, out=out)
    check_close(out, gemm_mn_ref(x.double(), w.double(), r, G))
    out = poisoned((M, N), torch.bfloat16)
    gemv_swiglu(x, w, w2, r, G, out=out)
    check_close(out, swiglu_ref(x.double(), w.double(), w2.double(), r, G))
    a = randn((M, N), torch.bfloat16, gen)
    wk = randn((K, N), torch.bfloat16, gen)
    out = poisoned((M, K), torch.bfloat16)
    gemv_k(a, wk, r, G, out=out)
    check_close(out, gemm_k_ref(a.double(), wk.double(), r, G))


def test_gemv_rejects_many_rows():
    x = torch.zeros(5, 32, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match="M <= 4"):
        gemv_mn(x, torch.zeros(32, 32, dtype=torch.bfloat16, device=DEVICE),
                torch.ones(5, 2, dtype=torch.bool, device=DEVICE), 16)


@pytest.mark.parametrize("splits", [1, 3, 8])
@pytest.mark.parametrize("kind", ["random", "all", "none"])
def test_decode_attention_splits(splits, kind):
    gen = seed_for("decode_attn", splits, kind)
    B, Hq, Hk, Tk, D, NG = 3, 8, 2, 45, 32, 4
    q = randn((B, Hq, 1, D), torch.bfloat16, gen)
    k = randn((B, Hk, Tk, D), torch.bfloat16, gen)
    v = randn((B, Hk, Tk, D), torch.bfloat16, gen)
    r = make_mask(kind, (B, 1, NG), gen)
    lp = torch.tensor([0, 20, 45], dtype=torch.int64, device=DEVICE)  # last row sees no key at all
    out = poisoned((B, Hq, 1, D), torch.bfloat16)
    decode_attention(q, k, v, r, left_pad=lp, out=out, splits=splits)
    check_close(out, attention_ref(q.double(), k.double(), v.double(), r, False, lp))


@pytest.mark.parametrize("Hq,Hk,NG", [(8, 2, 8), (8, 4, 2), (6, 2, 3), (9, 3, 3)])
@pytest.mark.parametrize("kind", ["random", "one_active", "none"])
@pytest.mark.parametrize("wave", [1, 3, 1000])
def test_decode_attention_compacted_splits(Hq, Hk, NG, kind, wave):
    # two dense splits per pack, 1-4 once packs are skipped: the active packs keep two splits each (wave 1), round
    # their programs up to waves of 3, or get every program of the grid (wave 1000); packs spanning several head
    # groups (NG > Hk), one group spanning several packs (NG < Hk), packs that straddle a group boundary (6 / 2 / 3)
    # and SmolLM2's 9 / 3 heads
    gen = seed_for("decode_attn_compact", Hq, Hk, NG, kind, wave)
    B, Tk, D = 4, 70, 16
    q = randn((B, Hq, 1, D), torch.float16, gen)
    k = randn((B, Hk, Tk, D), torch.float16, gen)
    v = randn((B, Hk, Tk, D), torch.float16, gen)
    r = make_mask(kind, (B, NG), gen, p=0.3).view(B, 1, NG)
    lp = torch.tensor([0, 9, 33, 70], dtype=torch.int64, device=DEVICE)
    out = poisoned((B, Hq, 1, D), torch.float16)
    decode_attention(q, k, v, r, left_pad=lp, out=out, splits=2, max_splits=4, wave=wave)
    check_close(out, attention_ref(q.double(), k.double(), v.double(), r, False, lp))


@pytest.mark.parametrize("speculate", [True, False])
@pytest.mark.parametrize("kind", ["all", "every_pack", "random"])
@pytest.mark.parametrize("Hq,Hk,NG", [(8, 2, 8), (6, 2, 3)])
def test_decode_attention_numbering(speculate, kind, Hq, Hk, NG, monkeypatch):
    # the speculative dense numbering (every pack active: the query loaded before the pack flags) against the
    # looked-up one, for every pack active with every head ("all") or with some heads of each pack skipped
    # ("every_pack": one group per pack on, the rest random), and for a random route (lookup path)
    monkeypatch.setattr(importlib.import_module("wide.kernels.decode_attn"), "SPECULATE", speculate)
    gen = seed_for("decode_attn_numbering", kind, Hq, Hk, NG)
    B, Tk, D = 3, 50, 16
    q = randn((B, Hq, 1, D), torch.bfloat16, gen)
    k = randn((B, Hk, Tk, D), torch.bfloat16, gen)
    v = randn((B, Hk, Tk, D), torch.bfloat16, gen)
    if kind == "every_pack":
        r = make_mask("none", (B, NG), gen)
        rep, hpg = Hq // Hk, Hq // NG
        for hk in range(Hk):
            r[:, (hk * rep) // hpg] = True  # the first group of every pack: every pack active, some heads not
        assert not r.all()
    else:
        r = make_mask(kind, (B, NG), gen)
    r = r.view(B, 1, NG)
    lp = torch.tensor([0, 7, 50], dtype=torch.int64, device=DEVICE)
    out = poisoned((B, Hq, 1, D), torch.bfloat16)
    decode_attention(q, k, v, r, left_pad=lp, out=out, splits=3, wave=2)
    check_close(out, attention_ref(q.double(), k.double(), v.double(), r, False, lp))


@pytest.mark.parametrize("M,G,K", [(2, 48, 144), (1, 192, 576), (4, 16, 80)])
def test_gemv_k_ragged_groups(M, G, K):
    # K not a multiple of the interpreter tile; head-group widths that are not powers of two
    gen = seed_for("gemv_k_ragged", M, G, K)
    N = 40
    a = randn((M, K), torch.bfloat16, gen)
    w = randn((N, K), torch.bfloat16, gen)
    r = make_mask("random", (M, K // G), gen)
    out = poisoned((M, N), torch.bfloat16)
    gemv_k(a, w, r, G, out=out)
    check_close(out, gemm_k_ref(a.double(), w.double(), r, G))
    out = poisoned((M, K), torch.bfloat16)
    wm = randn((K, N), torch.bfloat16, gen)
    xm = randn((M, N), torch.bfloat16, gen)
    gemv_mn(xm, wm, r, G, out=out)
    check_close(out, gemm_mn_ref(xm.double(), wm.double(), r, G))


def test_direct_entry_points_validate():
    x = torch.zeros(2, 32, dtype=torch.bfloat16, device=DEVICE)
    w = torch.zeros(64, 32, dtype=torch.bfloat16, device=DEVICE)
    r = torch.ones(2, 2, dtype=torch.bool, device=DEVICE)
    with pytest.raises(ValueError, match="route"):
        gemv_mn(x, w, r[:, :1], 32)
    with pytest.raises(ValueError, match="w2"):
        gemv_swiglu(x, w, w[:, :16], r, 32)
    with pytest.raises(ValueError, match="does not divide"):
        gemv_k(x, w, r, 48)
    q = torch.zeros(1, 4, 2, 16, dtype=torch.bfloat16, device=DEVICE)
    kv = torch.zeros(1, 2, 8, 16, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match="Tq == 1"):
        decode_attention(q, kv, kv, torch.ones(1, 2, 2, dtype=torch.bool, device=DEVICE))
    q1 = q[:, :, :1]
    r1 = torch.ones(1, 1, 2, dtype=torch.bool, device=DEVICE)
    for kw, shown in ((dict(splits=0), "splits=0"), (dict(wave=0), "wave=0"), (dict(max_splits=-1), "max_splits=-1"),
                      (dict(wave=2.5), "wave=2.5"), (dict(splits=True), "splits=True")):
        with pytest.raises(ValueError, match=f"{shown} must be an int >= 1"):
            decode_attention(q1, kv, kv, r1, **kw)
    for bad in (float("nan"), float("inf"), "x"):  # both attention entry points
        with pytest.raises(ValueError, match="must be a finite number"):
            decode_attention(q1, kv, kv, r1, scale=bad)
        with pytest.raises(ValueError, match="must be a finite number"):
            routed_attention(q, kv, kv, torch.ones(1, 2, 2, dtype=torch.bool, device=DEVICE), scale=bad)
