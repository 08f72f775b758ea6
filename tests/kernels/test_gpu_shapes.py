"""Real-shape checks on the GPU (Llama-3.1-8B and SmolLM2-135M); skipped without CUDA."""

import zlib

import pytest
import torch
from kernel_testutil import check_close

from wide.kernels import gemm_k, gemm_mn, reorder, routed_attention, swiglu
from wide.kernels.reference import attention_ref, gemm_k_ref, gemm_mn_ref, swiglu_ref

pytestmark = pytest.mark.gpu

# (hidden, ffn, Hq, Hk, head_dim)
MODELS = {"llama31_8b": (4096, 14336, 32, 8, 128), "smollm2_135m": (576, 1536, 9, 3, 64)}


def _rand(shape, gen, dtype=torch.bfloat16):
    return torch.randn(shape, generator=gen, device="cuda", dtype=torch.float32).to(dtype)


def _mask(shape, gen, p=0.5):
    return torch.rand(shape, generator=gen, device="cuda") < p


def _gen(*parts):
    g = torch.Generator(device="cuda")
    g.manual_seed(zlib.crc32(repr(parts).encode()))
    return g


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("M", [1, 3, 333])
@pytest.mark.parametrize("G", [32, 128, 512])
def test_ffn_shapes(model, M, G):
    D, F, *_ = MODELS[model]
    if F % G:
        pytest.skip("G does not divide the FFN width")
    gen = _gen("ffn", model, M, G)
    x = _rand((M, D), gen)
    wg, wu = _rand((F, D), gen) * 0.02, _rand((F, D), gen) * 0.02
    wd = _rand((D, F), gen) * 0.02
    route = _mask((M, F // G), gen)
    r = reorder(route)
    out = torch.full((M, F), float("nan"), device="cuda", dtype=torch.bfloat16)
    gemm_mn(x, wg, route, G, reordered=r, out=out)
    check_close(out, gemm_mn_ref(x.double(), wg.double(), route, G))
    h = swiglu(x, wg, wu, route, G, reordered=r)
    check_close(h, swiglu_ref(x.double(), wg.double(), wu.double(), route, G))
    for path in ("auto", "sparse", "dense"):
        y = torch.full((M, D), float("nan"), device="cuda", dtype=torch.bfloat16)
        gemm_k(h, wd, route, G, reordered=r, out=y, path=path)
        check_close(y, gemm_k_ref(h.double(), wd.double(), route, G))


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("Tq,Tk,causal", [(1, 700, True), (300, 300, True), (200, 520, True), (256, 256, False)])
def test_attention_shapes(model, Tq, Tk, causal):
    D, _, Hq, Hk, d = MODELS[model]
    G = Hq // Hk * d
    gen = _gen("attn", model, Tq, Tk, causal)
    B = 2
    q = _rand((B, Hq, Tq, d), gen)
    k = _rand((B, Hk, Tk, d), gen)
    v = _rand((B, Hk, Tk, d), gen)
    route = _mask((B, Tq, Hk), gen)
    lp = torch.tensor([0, 37], device="cuda")
    out = routed_attention(q, k, v, route, causal, left_pad=lp)
    check_close(out, attention_ref(q.double(), k.double(), v.double(), route, causal, lp))
    # the attention routing also drives the Q and O projections (G = head-group width)
    x = _rand((B * Tq, D), gen)
    wq = _rand((Hq * d, D), gen) * 0.02
    rq = route.reshape(B * Tq, Hk)
    check_close(gemm_mn(x, wq, rq, G), gemm_mn_ref(x.double(), wq.double(), rq, G))
    a = out.transpose(1, 2).reshape(B * Tq, Hq * d)
    wo = _rand((D, Hq * d), gen) * 0.02
    check_close(gemm_k(a, wo, rq, G), gemm_k_ref(a.double(), wo.double(), rq, G))


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("p", [0.5, 0.1])
@pytest.mark.parametrize("wave", [1, 264, 100000])
def test_decode_attention_batch_shapes(model, p, wave):
    # a decode batch whose skipped head packs keep their split count (wave 1), round their programs up to waves
    # of 264, or get every program of the grid (up to 4x the dense split count here); left padding in some rows
    from wide.kernels import decode_attention

    _, _, Hq, Hk, d = MODELS[model]
    gen = _gen("decode_batch", model, p, wave)
    B, Tk = 16, 3000
    q = _rand((B, Hq, 1, d), gen)
    k = _rand((B, Hk, Tk, d), gen)
    v = _rand((B, Hk, Tk, d), gen)
    route = _mask((B, 1, Hk), gen, p)
    lp = torch.zeros(B, dtype=torch.int64, device="cuda")
    lp[::3] = 1234
    out = torch.full_like(q, float("nan"))
    decode_attention(q, k, v, route, left_pad=lp, out=out, wave=wave)
    check_close(out, attention_ref(q.double(), k.double(), v.double(), route, False, lp))


def test_cuda_graph_capture():
    gen = _gen("graph")
    M, K, N, G = 512, 1024, 2048, 128
    x = _rand((M, K), gen)
    w = _rand((N, K), gen)
    wd = _rand((K, N), gen)
    route = _mask((M, N // G), gen)
    # tune outside the capture
    h = gemm_mn(x, w, route, G)
    gemm_k(h, wd, route, G)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        r = reorder(route)
        h2 = gemm_mn(x, w, route, G, reordered=r)
        y2 = gemm_k(h2, wd, route, G, reordered=r)
    route.copy_(_mask((M, N // G), gen))  # new routing decision, same graph
    graph.replay()
    torch.cuda.synchronize()
    ref_h = gemm_mn_ref(x.double(), w.double(), route, G)
    check_close(h2, ref_h)
    check_close(y2, gemm_k_ref(h2.double(), wd.double(), route, G))
