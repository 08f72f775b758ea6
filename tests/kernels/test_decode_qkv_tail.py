"""gemv_mn with always-executed tail weights (the decode step's one-launch ``[Q | K | V]`` projection).

``gemv_mn(x, wq, route, G, tail=(wk, wv))`` must equal ``x @ cat(wq, wk, wv).T`` with the routed Q groups
of each row zeroed, against a float64 reference, on NaN-poisoned outputs, for both decode kernels (per-tile and
split), every mask kind, bf16 and fp16, and tail widths that are one or several groups.  The three weights are
separate tensors (the kernels address the tail by element offset from ``wq``).
"""

import pytest
import torch
from kernel_testutil import DEVICE, check_close, make_mask, poisoned, randn, seed_for

from wide.kernels import decode, gemv_mn
from wide.kernels.reference import expand_route


def _force(monkeypatch, cfg):
    monkeypatch.setattr(decode, "_gemv_mn_cands", lambda *a, **k: [dict(cfg)])


CFGS = {"tile": dict(BN=16, BK=32), "split": dict(BN=16, BK=32, SPLIT=2, SMAX=3),
        "split1": dict(BN=32, BK=64, SPLIT=1, SMAX=1)}


CASES = [(kernel, M, shape, kind, torch.bfloat16) for kernel in CFGS for M in (1, 3)
         for shape in ((32, 128, 32), (64, 256, 128), (192, 576, 192)) for kind in ("none", "random", "one_row")]
CASES += [("split", 4, (64, 256, 128), kind, torch.float16) for kind in ("all", "random")]
CASES += [("tile", 2, (32, 128, 32), "all", torch.bfloat16)]


@pytest.mark.parametrize("kernel,M,shape,kind,dtype", CASES)
def test_gemv_mn_tail_matches_float64(monkeypatch, kernel, M, shape, kind, dtype):
    G, NQ, NKV = shape
    gen = seed_for("gemv_mn_tail", kernel, M, G, kind, dtype)
    K = 96 if M % 2 else 128
    _force(monkeypatch, CFGS[kernel])
    x = randn((M, K), dtype, gen)
    wq, wk, wv = (randn((n, K), dtype, gen) for n in (NQ, NKV, NKV))
    r = make_mask(kind, (M, NQ // G), gen)
    out = poisoned((M, NQ + 2 * NKV), dtype)
    gemv_mn(x, wq, r, G, out=out, tail=(wk, wv))
    keep = torch.cat([expand_route(r, G), torch.ones((M, 2 * NKV), dtype=torch.bool, device=DEVICE)], 1)
    ref = (x.double() @ torch.cat([wq, wk, wv]).double().T) * keep
    check_close(out, ref)
    assert (out[~keep] == 0).all(), "an inactive (row, group) output must be exactly 0"


def test_gemv_mn_one_tail_and_new_output(monkeypatch):
    gen = seed_for("gemv_mn_tail_one")
    _force(monkeypatch, CFGS["split"])
    x = randn((3, 64), torch.bfloat16, gen)
    w, t = randn((64, 64), torch.bfloat16, gen), randn((32, 64), torch.bfloat16, gen)
    r = make_mask("random", (3, 2), gen)
    out = gemv_mn(x, w, r, 32, tail=(t,))
    assert out.shape == (3, 96)
    keep = torch.cat([expand_route(r, 32), torch.ones((3, 32), dtype=torch.bool, device=DEVICE)], 1)
    check_close(out, (x.double() @ torch.cat([w, t]).double().T) * keep)


def test_gemv_mn_tail_rejects_bad_input():
    x = torch.zeros((1, 64), dtype=torch.bfloat16, device=DEVICE)
    w = torch.zeros((64, 64), dtype=torch.bfloat16, device=DEVICE)
    r = torch.ones((1, 2), dtype=torch.bool, device=DEVICE)
    with pytest.raises(ValueError, match="not a multiple of G=32"):
        gemv_mn(x, w, r, 32, tail=(torch.zeros((48, 64), dtype=torch.bfloat16, device=DEVICE),))
    with pytest.raises(ValueError, match="K=64"):
        gemv_mn(x, w, r, 32, tail=(torch.zeros((32, 48), dtype=torch.bfloat16, device=DEVICE),))
    with pytest.raises(ValueError, match="float16"):
        gemv_mn(x, w, r, 32, tail=(torch.zeros((32, 64), dtype=torch.float16, device=DEVICE),))
    with pytest.raises(ValueError, match="at most two"):
        gemv_mn(x, w, r, 32, tail=(w[:32],) * 3)
    with pytest.raises(ValueError, match="tuple"):
        gemv_mn(x, w, r, 32, tail=w[:32])
    with pytest.raises(ValueError, match="w2"):
        gemv_mn(x, w, r, 32, w2=w, tail=(w[:32],))
    with pytest.raises(ValueError, match="out"):
        gemv_mn(x, w, r, 32, tail=(w[:32],), out=torch.empty((1, 64), dtype=torch.bfloat16, device=DEVICE))
