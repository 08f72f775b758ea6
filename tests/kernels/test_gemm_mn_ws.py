"""The warp-specialized Gluon kernel of gemm_mn and the fused SwiGLU (:mod:`wide.kernels.gemm_mn_ws`) against the
float64 reference, on Hopper only (Gluon's warp specialization and wgmma); ``aot_sm90.py`` compiles it on the CPU."""

import pytest
import torch
from kernel_testutil import KINDS, check_close, make_mask, poisoned, randn, seed_for

from wide.kernels import reorder
from wide.kernels.gemm_mn_ws import HAS_GLUON, candidates, launch
from wide.kernels.reference import gemm_mn_ref, swiglu_ref

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not (HAS_GLUON and torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9),
    reason="needs Triton's Gluon and an sm_90 GPU")]


def run(M, N, K, G, dtype, kind, swiglu, cfg=None):
    gen = seed_for("ws", M, N, K, G, dtype, kind, swiglu, repr(cfg))
    x = randn((M, K), dtype, gen)
    w, w2 = randn((N, K), dtype, gen, 0.05), randn((N, K), dtype, gen, 0.05)
    route = make_mask(kind, (M, N // G), gen)
    out = poisoned((M, N), dtype)
    launch(x, w, w2 if swiglu else None, G, reorder(route), out, cfg or {})
    check_close(out, swiglu_ref(x.double(), w.double(), w2.double(), route, G) if swiglu
                else gemm_mn_ref(x.double(), w.double(), route, G))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M,N,K", [(333, 1536, 576), (1000, 2048, 4096), (4100, 1024, 256)])  # tail, SmolLM2, Llama
@pytest.mark.parametrize("G", [64, 128, 256, 512])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("swiglu", [False, True])
def test_matches_reference(dtype, M, N, K, G, kind, swiglu):
    if N % G:
        pytest.skip("G does not divide N")
    run(M, N, K, G, dtype, kind, swiglu)


@pytest.mark.parametrize("cfg", [dict(BN=128, STAGES=5, GROUP_M=16), dict(BN=64, STAGES=4, PREGS=56, maxnreg=160),
                                 dict(BN=128, STAGES=4, PERSIST=False), dict(BN=128, BK=32, STAGES=6, PERSIST=False)])
def test_other_configs(cfg):
    run(777, 1024, 512, 128, torch.bfloat16, "random", False, cfg)


def test_offered_for_the_swiglu_only():
    x, w = (torch.zeros(s, 4096, dtype=torch.bfloat16, device="cuda") for s in (8, 512))
    assert len(candidates(x, w, w, 128)) == 2 and not candidates(x, w, None, 128)
    assert not candidates(x[:, :100], w[:, :100], w[:, :100], 128) and not candidates(x, w, w, 32)
