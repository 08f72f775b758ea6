"""routed_attention (prefill, Algorithm 4) against the float64 reference: causal and not, chunked prefill (Tq < Tk),
left padding (in range, out of range, strided), GQA and head-group sizes, every mask kind."""

import pytest
import torch
from kernel_testutil import DEVICE, DTYPES, KINDS, check_close, gpu, make_mask, poisoned, randn, seed_for

from wide.kernels import KernelArgumentError, Reordered, reorder, routed_attention
from wide.kernels.reference import attention_ref, head_route


def run(B, Hq, Hk, Tq, Tk, D, NG, causal, dtype=torch.bfloat16, kind="random", left_pad=None, shared=False,
        kv_pad=(0, 0)):
    """``kv_pad`` (extra keys, extra channels): K / V are views of a larger buffer, as a KV cache hands them over."""
    gen = seed_for("attn", B, Hq, Hk, Tq, Tk, D, NG, causal, dtype, kind, left_pad, shared, kv_pad)
    q = randn((B, Hq, Tq, D), dtype, gen)
    k, v = (randn((B, Hk, Tk + kv_pad[0], D + kv_pad[1]), dtype, gen)[:, :, :Tk, :D] for _ in range(2))
    route = make_mask(kind, (B, Tq, NG), gen)
    lp = None if left_pad is None else torch.tensor(left_pad, dtype=torch.int64, device=DEVICE)
    out = poisoned((B, Hq, Tq, D), dtype)
    routed_attention(q, k, v, route, causal, left_pad=lp, out=out, **({"reordered": reorder(route)} if shared else {}))
    check_close(out, attention_ref(q.double(), k.double(), v.double(), route, causal, lp))
    assert (out[~head_route(route, Hq)] == 0).all()


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("Tq,Tk", [(21, 21), (13, 40)])
@pytest.mark.parametrize("dtype", DTYPES + [torch.float32])
def test_prefill(causal, Tq, Tk, dtype):
    run(2, 4, 2, Tq, Tk, 16, 2, causal, dtype)  # GQA: 4 query heads on 2 KV heads, 2 heads per group


@pytest.mark.parametrize("kv_pad", [(0, 0), (7, 0), (5, 4)])  # contiguous, a cache view, rows not 16-byte aligned
@pytest.mark.parametrize("causal", [False, True])
def test_kv_layouts(kv_pad, causal):
    run(1, 4, 2, 19, 35, 16, 2, causal, kv_pad=kv_pad)  # TMA descriptors where the layout allows, pointers otherwise


@pytest.mark.parametrize("kind", KINDS)
def test_mask_kinds(kind):
    run(2, 4, 2, 17, 17, 16, 2, True, torch.float16, kind, shared=True)


@pytest.mark.parametrize("Hq,Hk,NG", [(6, 2, 6), (6, 3, 1), (4, 4, 2)])
def test_gqa_and_group_sizes(Hq, Hk, NG):
    run(1, Hq, Hk, 18, 25, 16, NG, True)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("pad", [[0, 5, 27], [-3, 2**31, 10**12]])
def test_left_padding(causal, pad):
    # a negative pad masks nothing, one >= Tk every key (that row is 0), int64 values do not wrap
    run(3, 2, 1, 19, 30, 32, 1, causal, left_pad=pad)


def test_strided_left_pad_and_reordered():
    # row b uses left_pad[b], not the b-th int in memory; a non-contiguous reorder is read correctly
    gen = seed_for("attn_strided")
    B, Tq, Tk = 3, 5, 37
    q, k, v = randn((B, 4, Tq, 16), torch.float32, gen), randn((B, 2, Tk, 16), torch.float32, gen), \
        randn((B, 2, Tk, 16), torch.float32, gen)
    route = make_mask("random", (B, Tq, 2), gen, p=0.7)
    lp = torch.tensor([0, 99, 5, 99, 18, 99], dtype=torch.int32, device=DEVICE)[::2]
    r = reorder(route)
    nc = Reordered(r.index.permute(2, 0, 1).contiguous().permute(1, 2, 0), r.mask, r.counts)
    assert not lp.is_contiguous() and not nc.index.is_contiguous()
    ref = attention_ref(q.double(), k.double(), v.double(), route, True, lp.contiguous())
    check_close(routed_attention(q, k, v, route, True, left_pad=lp, reordered=nc), ref)


def test_refusals():
    q = torch.zeros(1, 4, 8, 16, dtype=torch.bfloat16, device=DEVICE)
    k = torch.zeros(1, 2, 8, 16, dtype=torch.bfloat16, device=DEVICE)
    r = torch.ones(1, 8, 2, dtype=torch.bool, device=DEVICE)
    k3 = k[:, :1].expand(1, 3, 8, 16)
    for call, msg in [
        (lambda: routed_attention(q, k3, k3, r), "multiple of Hk"),
        (lambda: routed_attention(q, k, k, torch.ones(1, 8, 3, dtype=torch.bool, device=DEVICE)), "N_G=3"),
        (lambda: routed_attention(torch.zeros(1, 4, 9, 16, dtype=torch.bfloat16, device=DEVICE), k, k,
                                  torch.ones(1, 9, 2, dtype=torch.bool, device=DEVICE)), "Tq=9 must not exceed"),
        (lambda: routed_attention(q, k, k, r, left_pad=torch.zeros(2, dtype=torch.int32, device=DEVICE)), "left_pad"),
        (lambda: routed_attention(q, k.half(), k, r), "k has dtype float16, q bfloat16: k and v must have q's dtype"),
        (lambda: routed_attention(q, k, k, r, causal="yes"), "causal='yes' must be True or False"),
        (lambda: routed_attention(q, k, k, r, scale=float("nan")), "must be a finite number"),
        (lambda: routed_attention(q, k, k, r, out=q), "out overlaps q"),
        (lambda: routed_attention(q, k, k, r, reordered="garbage"), "reordered must be a Reordered"),
        (lambda: routed_attention(q[..., :12], k[..., :12], k[..., :12], r), "power of two"),
    ]:
        with pytest.raises(KernelArgumentError, match=msg):
            call()


@gpu
@pytest.mark.parametrize("Hq,Hk,d", [(32, 8, 128), (9, 3, 64)])  # Llama-3.1-8B, SmolLM2-135M
@pytest.mark.parametrize("Tq,Tk,causal", [(300, 300, True), (200, 520, True), (256, 256, False)])
def test_real_shapes(Hq, Hk, d, Tq, Tk, causal):
    run(2, Hq, Hk, Tq, Tk, d, Hk, causal, left_pad=[0, 37])
