import pytest
import torch
from kernel_testutil import DEVICE, DTYPES, check_close, make_mask, poisoned, randn, seed_for

from wide.kernels import reorder, routed_attention
from wide.kernels.reference import attention_ref


def _run(B, Hq, Hk, Tq, Tk, D, NG, causal, dtype=torch.bfloat16, kind="random", left_pad=None, shared=False):
    gen = seed_for("attn", B, Hq, Hk, Tq, Tk, D, NG, causal, dtype, kind, left_pad, shared)
    q = randn((B, Hq, Tq, D), dtype, gen)
    k = randn((B, Hk, Tk, D), dtype, gen)
    v = randn((B, Hk, Tk, D), dtype, gen)
    route = make_mask(kind, (B, Tq, NG), gen)
    lp = None if left_pad is None else torch.tensor(left_pad, dtype=torch.int32, device=DEVICE)
    out = poisoned((B, Hq, Tq, D), dtype)
    kw = {"reordered": reorder(route)} if shared else {}
    routed_attention(q, k, v, route, causal, left_pad=lp, out=out, **kw)
    ref = attention_ref(q.double(), k.double(), v.double(), route, causal, lp)
    check_close(out, ref)
    head_route = route.transpose(1, 2).repeat_interleave(Hq // NG, dim=1)
    assert (out[~head_route] == 0).all()


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("Tq,Tk", [(21, 21), (13, 40), (2, 9)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill(causal, Tq, Tk, dtype):
    # GQA 4 query heads on 2 KV heads, head group = 2 heads (G = 2d, the paper's choice)
    _run(2, 4, 2, Tq, Tk, 16, 2, causal, dtype)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("Tq,Tk", [(19, 19), (7, 30), (1, 23)])
def test_left_padding(causal, Tq, Tk):
    _run(3, 2, 1, Tq, Tk, 32, 1, causal, left_pad=[0, 5, Tk - 3])


@pytest.mark.parametrize("Hq,Hk,NG", [(6, 2, 6), (6, 2, 2), (6, 3, 1), (4, 4, 2)])
def test_gqa_and_group_sizes(Hq, Hk, NG):
    _run(1, Hq, Hk, 18, 25, 16, NG, True)


@pytest.mark.parametrize("kind", ["all", "none", "one_row"])
@pytest.mark.parametrize("causal", [False, True])
def test_mask_kinds(kind, causal):
    _run(2, 4, 2, 17, 17, 16, 2, causal, torch.float16, kind, shared=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("Hq,Hk,NG", [(8, 2, 2), (4, 4, 4), (6, 2, 3)])
def test_decode(dtype, Hq, Hk, NG):
    _run(2, Hq, Hk, 1, 37, 16, NG, False, dtype, left_pad=[3, 0])


def test_errors():
    q = torch.zeros(1, 4, 8, 16, dtype=torch.bfloat16, device=DEVICE)
    k = torch.zeros(1, 2, 8, 16, dtype=torch.bfloat16, device=DEVICE)
    r = torch.ones(1, 8, 2, dtype=torch.bool, device=DEVICE)
    with pytest.raises(ValueError, match="multiple of Hk"):
        routed_attention(q, k[:, :1].expand(1, 3, 8, 16), k[:, :1].expand(1, 3, 8, 16), r)
    with pytest.raises(ValueError, match="N_G"):
        routed_attention(q, k, k, torch.ones(1, 8, 3, dtype=torch.bool, device=DEVICE))
    with pytest.raises(ValueError, match="Tq"):
        routed_attention(torch.zeros(1, 4, 9, 16, dtype=torch.bfloat16, device=DEVICE), k, k,
                         torch.ones(1, 9, 2, dtype=torch.bool, device=DEVICE))
    with pytest.raises(ValueError, match="left_pad"):
        routed_attention(q, k, k, r, left_pad=torch.zeros(2, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="k has dtype float16, q bfloat16: k and v must have q's dtype"):
        routed_attention(q, k.half(), k, r)
    with pytest.raises(ValueError, match="causal='yes' must be True or False"):
        routed_attention(q, k, k, r, causal="yes")
