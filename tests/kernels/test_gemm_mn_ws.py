"""The warp-specialized Gluon ``gemm_mn`` / fused SwiGLU (:mod:`wide.kernels.gemm_mn_ws`) against the float64
reference.  The numeric tests need Hopper (Gluon's warp specialization and wgmma) and skip elsewhere; the argument
checks run on any device.  Its sm_90 compile is checked on the CPU by ``aot_sm90.py``."""

import pytest
import torch
from kernel_testutil import check_close, make_mask, poisoned, randn, seed_for

from wide.kernels import reorder
from wide.kernels.gemm_mn_ws import HAS_GLUON, gemm_mn_ws
from wide.kernels.reference import gemm_mn_ref, swiglu_ref

hopper = [pytest.mark.gpu, pytest.mark.skipif(
    not (HAS_GLUON and torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9),
    reason="needs Triton's Gluon and an sm_90 GPU")]

# (M, N, K): a tile tail in M, SmolLM2's FFN, a slice of Llama-3.1-8B's up projection
SHAPES = [(333, 1536, 576), (1000, 2048, 4096), (4100, 1024, 256)]


@hopper[0]
@hopper[1]
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M,N,K", SHAPES)
@pytest.mark.parametrize("G", [64, 128, 256, 512])
@pytest.mark.parametrize("kind", ["random", "all", "none", "one_row"])
@pytest.mark.parametrize("swiglu", [False, True])
def test_gemm_mn_ws_matches_reference(dtype, M, N, K, G, kind, swiglu):
    if N % G:
        pytest.skip("G does not divide N")
    gen = seed_for("ws", dtype, M, N, K, G, kind, swiglu)
    x = randn((M, K), dtype, gen)
    w = randn((N, K), dtype, gen) * 0.05
    w2 = randn((N, K), dtype, gen) * 0.05
    route = make_mask(kind, (M, N // G), gen)
    out = poisoned((M, N), dtype)
    gemm_mn_ws(x, w, route, G, w2=w2 if swiglu else None, reordered=reorder(route), out=out)
    ref = (swiglu_ref(x.double(), w.double(), w2.double(), route, G) if swiglu
           else gemm_mn_ref(x.double(), w.double(), route, G))
    check_close(out, ref)


@hopper[0]
@hopper[1]
@pytest.mark.parametrize("cfg", [dict(BN=128, STAGES=5, GROUP_M=16), dict(BN=64, STAGES=4, PREGS=56, maxnreg=160),
                                 dict(BN=128, STAGES=4, PERSIST=False),
                                 dict(BN=128, BK=32, STAGES=6, PERSIST=False)])
def test_gemm_mn_ws_other_configs(cfg):
    gen = seed_for("ws-cfg", repr(cfg))
    M, N, K, G = 777, 1024, 512, 128
    x = randn((M, K), torch.bfloat16, gen)
    w = randn((N, K), torch.bfloat16, gen) * 0.05
    route = make_mask("random", (M, N // G), gen)
    out = gemm_mn_ws(x, w, route, G, config=cfg)
    check_close(out, gemm_mn_ref(x.double(), w.double(), route, G))


def test_gemm_mn_ws_refuses_bad_arguments():
    """Arguments are checked before the GPU is asked for, so the same messages come on any device."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.randn(8, 100, device=dev, dtype=torch.bfloat16)
    w = torch.randn(256, 100, device=dev, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="K a multiple of 64"):
        gemm_mn_ws(x, w, torch.ones(8, 2, dtype=torch.bool, device=dev), 128)
    x = torch.randn(8, 128, device=dev, dtype=torch.bfloat16)
    w = torch.randn(256, 128, device=dev, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="G a multiple of 64"):
        gemm_mn_ws(x, w, torch.ones(8, 8, dtype=torch.bool, device=dev), 32)
    with pytest.raises(ValueError, match="bf16 / fp16"):
        gemm_mn_ws(x.float(), w.float(), torch.ones(8, 2, dtype=torch.bool, device=dev), 128)
    with pytest.raises(ValueError, match=r"route must have shape \[M, N_G\] = \[8, 2\]"):
        gemm_mn_ws(x, w, torch.ones(8, 3, dtype=torch.bool, device=dev), 128)
    with pytest.raises(ValueError, match="w2 shape"):
        gemm_mn_ws(x, w, torch.ones(8, 2, dtype=torch.bool, device=dev), 128, w2=w[:128])
    with pytest.raises(ValueError, match="out must be"):
        gemm_mn_ws(x, w, torch.ones(8, 2, dtype=torch.bool, device=dev), 128, out=torch.empty(8, 255, device=dev))
    if dev == "cpu":  # good arguments on the CPU: the GPU requirement, in one line
        with pytest.raises(RuntimeError, match="needs an sm_90"):
            gemm_mn_ws(x, w, torch.ones(8, 2, dtype=torch.bool), 128)
