"""rope_cache (the engine's RoPE of Q and K + the K / V cache write) against the float64 and the dtype reference."""

import pytest
import torch
from kernel_testutil import DEVICE, check_close, randn, seed_for

from wide.kernels.reference import rope_cache_ref
from wide.kernels.rope import rope_cache


def inputs(B, T, Hq, Hk, d, Tmax, dtype, gen):
    q = randn((B, T, Hq * d), dtype, gen).view(B, T, Hq, d)
    kv = randn((B, T, 2, Hk * d), dtype, gen)  # K and V as views of one projection output
    ang = torch.randn(B, T, d // 2, generator=gen)
    cos, sin = (torch.cat([f(ang)] * 2, -1).to(dtype).to(DEVICE) for f in (torch.cos, torch.sin))
    slots = torch.stack([torch.randperm(Tmax, generator=gen)[:T] for _ in range(B)]).to(DEVICE)
    caches = [torch.full((B + 1, Hk, Tmax, d), 7.0, dtype=dtype, device=DEVICE) for _ in range(2)]
    return q, kv[:, :, 0].view(B, T, Hk, d), kv[:, :, 1].view(B, T, Hk, d), cos, sin, caches, slots


@pytest.mark.parametrize("B,T", [(1, 1), (3, 1), (2, 37)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("want_k", [True, False])
def test_rope_cache(B, T, dtype, want_k):
    # token blocks with a partial last block (74 tokens), one token per sequence at decode; other slots untouched
    gen = seed_for("rope", B, T, dtype, want_k)
    q, k, v, cos, sin, (ck, cv), slots = inputs(B, T, 4, 2, 16, 48, dtype, gen)
    qo, ko = rope_cache(q, k, v, cos, sin, ck, cv, slots, want_k)
    f64 = [t.double() for t in (q, k, v, cos, sin)]
    c64 = [torch.full(ck.shape, 7.0, dtype=torch.float64, device=DEVICE) for _ in range(2)]
    qr, kr = rope_cache_ref(*f64, *c64, slots, True)
    check_close(qo, qr)
    check_close(ck, c64[0])
    assert torch.equal(cv, c64[1].to(dtype)) and (ko is None) == (not want_k)
    if want_k:
        check_close(ko, kr)
    if dtype == torch.float32:  # bitwise the model's apply_rotary_pos_emb in fp32
        cr = [torch.full(ck.shape, 7.0, dtype=dtype, device=DEVICE) for _ in range(2)]
        assert torch.equal(qo, rope_cache_ref(q, k, v, cos, sin, *cr, slots, want_k)[0]) and torch.equal(ck, cr[0])

