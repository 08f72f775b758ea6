"""decode_attention (split-KV, GQA packs; Algorithm 4 decode) against the float64 reference: split counts, the
compaction of skipped packs into more splits of the active ones (wave rounding), packs spanning several groups or
straddling a group boundary, left padding, and routed_attention's Tq == 1 path."""

import pytest
import torch
from kernel_testutil import DEVICE, check_close, gpu, make_mask, poisoned, randn, seed_for

from wide.kernels import KernelArgumentError, decode_attention, routed_attention
from wide.kernels.reference import attention_ref


def run(B, Hq, Hk, Tk, D, NG, kind, lp, dtype=torch.bfloat16, p=0.5, op="decode", **kw):
    gen = seed_for("decode_attn", B, Hq, Hk, Tk, NG, kind, dtype, p, op, repr(kw))
    q, k, v = randn((B, Hq, 1, D), dtype, gen), randn((B, Hk, Tk, D), dtype, gen), randn((B, Hk, Tk, D), dtype, gen)
    if kind == "every_pack":  # every pack active through one of its groups, some heads skipped
        r = make_mask("none", (B, NG), gen)
        for hk in range(Hk):
            r[:, hk * (Hq // Hk) // (Hq // NG)] = True
    else:
        r = make_mask(kind, (B, NG), gen, p)
    r = r.view(B, 1, NG)
    lp = torch.tensor(lp, dtype=torch.int64, device=DEVICE)
    out = poisoned((B, Hq, 1, D), dtype)
    if op == "decode":
        decode_attention(q, k, v, r, left_pad=lp, out=out, **kw)
    else:
        routed_attention(q, k, v, r, left_pad=lp, out=out)
    check_close(out, attention_ref(q.double(), k.double(), v.double(), r, False, lp))


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("kind", ["random", "all", "none"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_splits(splits, kind, dtype):
    run(3, 8, 2, 45, 32, 4, kind, [0, 20, 45], dtype, splits=splits)  # the last row sees no key


@pytest.mark.parametrize("Hq,Hk,NG", [(8, 2, 8), (8, 4, 2), (6, 2, 3), (9, 3, 3)])
@pytest.mark.parametrize("kind,wave", [("random", 1), ("every_pack", 3), ("one_active", 1000)])
def test_compacted_splits(Hq, Hk, NG, kind, wave):
    # skipped packs' programs become splits of the active ones: kept (wave 1), rounded to waves of 3, or all of
    # them (wave 1000); several groups per pack (NG > Hk), several packs per group (NG < Hk), a pack straddling a
    # group boundary (6 / 2 / 3) and SmolLM2's 9 / 3 heads
    run(3, Hq, Hk, 40, 16, NG, kind, [0, 9, 40], torch.float16, p=0.3, splits=2, max_splits=4, wave=wave)


def test_routed_attention_decode_path():
    run(2, 8, 2, 37, 16, 2, "random", [3, 0], op="routed")


def test_refusals():
    q = torch.zeros(1, 4, 2, 16, dtype=torch.bfloat16, device=DEVICE)
    kv = torch.zeros(1, 2, 8, 16, dtype=torch.bfloat16, device=DEVICE)
    q1, r1 = q[:, :, :1], torch.ones(1, 1, 2, dtype=torch.bool, device=DEVICE)
    cases = [(lambda: decode_attention(q, kv, kv, torch.ones(1, 2, 2, dtype=torch.bool, device=DEVICE)), "Tq == 1"),
             (lambda: decode_attention(q1, kv, kv, r1, scale="x"), "must be a finite number"),
             (lambda: decode_attention(q1.contiguous(), kv, kv, r1, out=kv.view(-1)[:64].view(1, 4, 1, 16)),
              "out overlaps k")]
    cases += [(lambda kw=kw: decode_attention(q1, kv, kv, r1, **kw), f"{shown} must be an int >= 1")
              for kw, shown in ((dict(splits=0), "splits=0"), (dict(wave=2.5), "wave=2.5"),
                                (dict(max_splits=-1), "max_splits=-1"), (dict(splits=True), "splits=True"))]
    for call, msg in cases:
        with pytest.raises(KernelArgumentError, match=msg):
            call()
    assert decode_attention(q1[:, :0], kv, kv, r1).shape == (1, 0, 1, 16)


@gpu
@pytest.mark.parametrize("Hq,Hk,d", [(32, 8, 128), (9, 3, 64)])
@pytest.mark.parametrize("p", [0.5, 0.1])
@pytest.mark.parametrize("wave", [None, 1, 100000])
def test_real_shapes(Hq, Hk, d, p, wave):
    run(16, Hq, Hk, 3000, d, Hk, "random", [1234, 0, 0] * 5 + [1234], p=p, wave=wave)
