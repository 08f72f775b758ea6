"""Arguments that used to pass the checks and then give a wrong answer on the Triton path (a fresh-user break test,
session 16): strided or out-of-range ``left_pad``, an ``out`` aliasing an input, a non-contiguous or foreign-device
``reordered``; and the error messages of a few misuses.  Values are checked against the float64 reference."""

import json
import subprocess
import sys

import pytest
import torch
from kernel_testutil import DEVICE, check_close, make_mask, poisoned, randn, seed_for

from wide.kernels import (
    KernelArgumentError,
    Reordered,
    decode_attention,
    gemm_k,
    gemm_mn,
    gemv_k,
    gemv_mn,
    reorder,
    routed_attention,
    swiglu,
)
from wide.kernels.reference import attention_ref, gemm_mn_ref


def _qkv(B, Hq, Hk, Tq, Tk, D, dtype, gen):
    return (randn((B, Hq, Tq, D), dtype, gen), randn((B, Hk, Tk, D), dtype, gen), randn((B, Hk, Tk, D), dtype, gen))


@pytest.mark.parametrize("Tq", [1, 5])
def test_strided_left_pad(Tq):
    # every other element of a buffer: row b must use left_pad[b], not the b-th int in memory
    gen = seed_for("strided_lp", Tq)
    B, Hq, Hk, Tk, D = 3, 4, 2, 37, 16
    q, k, v = _qkv(B, Hq, Hk, Tq, Tk, D, torch.float32, gen)
    route = make_mask("random", (B, Tq, 2), gen, p=0.7)
    lp = torch.tensor([0, 99, 5, 99, 18, 99], dtype=torch.int32, device=DEVICE)[::2]
    assert not lp.is_contiguous()
    ref = attention_ref(q.double(), k.double(), v.double(), route, True, lp.contiguous())
    check_close(routed_attention(q, k, v, route, True, left_pad=lp), ref, tol=1e-5)
    if Tq == 1:
        check_close(decode_attention(q, k, v, route, left_pad=lp), ref, tol=1e-5)


@pytest.mark.parametrize("pad", [-3, -16, -64, -100_000_000, 2**31, 2**32, 37, 10**12])
@pytest.mark.parametrize("Tq", [1, 6])
def test_left_pad_out_of_range(pad, Tq):
    # a negative pad masks nothing and one >= Tk masks every key (the reference's j < left_pad[b]); no read
    # outside K / V, no int32 wrap-around of int64 values
    gen = seed_for("lp_range", pad, Tq)
    B, Hq, Hk, Tk, D = 2, 2, 1, 37, 16
    q, k, v = _qkv(B, Hq, Hk, Tq, Tk, D, torch.float32, gen)
    route = make_mask("all", (B, Tq, 1), gen)
    lp = torch.tensor([pad, 4], dtype=torch.int64, device=DEVICE)
    ref = attention_ref(q.double(), k.double(), v.double(), route, False, lp)
    check_close(routed_attention(q, k, v, route, False, left_pad=lp), ref, tol=1e-5)
    if pad >= Tk:
        assert (routed_attention(q, k, v, route, False, left_pad=lp)[0] == 0).all()


def test_out_aliasing_an_input_is_refused():
    gen = seed_for("alias")
    for M in (2, 6, 130):
        x = randn((M, 64), torch.bfloat16, gen)
        w = randn((64, 64), torch.bfloat16, gen)
        route = make_mask("random", (M, 4), gen)
        with pytest.raises(KernelArgumentError, match="out overlaps x"):
            gemm_mn(x, w, route, 16, out=x)
        with pytest.raises(KernelArgumentError, match="out overlaps a"):
            gemm_k(x, w, route, 16, out=x)
        with pytest.raises(KernelArgumentError, match="out overlaps x"):
            swiglu(x, w, w.clone(), route, 16, out=x)
        if M <= 64:
            with pytest.raises(KernelArgumentError, match="out overlaps w"):
                gemm_mn(x, w, route, 16, out=w[:M])
            with pytest.raises(KernelArgumentError, match="out overlaps w_up"):
                swiglu(x, w.clone(), w, route, 16, out=w[:M])
    x = randn((2, 64), torch.bfloat16, gen)
    route = make_mask("random", (2, 4), gen)
    with pytest.raises(KernelArgumentError, match="out overlaps x"):
        gemv_mn(x, randn((64, 64), torch.bfloat16, gen), route, 16, out=x)
    with pytest.raises(KernelArgumentError, match="out overlaps a"):
        gemv_k(x, randn((64, 64), torch.bfloat16, gen), route, 16, out=x)
    q, k, v = _qkv(1, 2, 1, 4, 4, 16, torch.float32, gen)
    with pytest.raises(KernelArgumentError, match="out overlaps q"):
        routed_attention(q, k, v, make_mask("all", (1, 4, 1), gen), out=q)
    with pytest.raises(KernelArgumentError, match="out overlaps k"):
        decode_attention(q[:, :, :1].contiguous(), k, v, make_mask("all", (1, 1, 1), gen),
                         out=k.view(-1)[:32].view(1, 2, 1, 16))
    # a separate buffer of the same size is fine, and so is one that only shares the storage without overlap
    buf = poisoned((2 * 6, 64), torch.bfloat16)
    x = randn((6, 64), torch.bfloat16, gen)
    buf[:6] = x
    w = randn((64, 64), torch.bfloat16, gen)
    route = make_mask("random", (6, 4), gen)
    out = gemm_mn(buf[:6], w, route, 16, out=buf[6:])
    check_close(out, gemm_mn_ref(x.double(), w.double(), route, 16))


def test_reordered_is_made_contiguous_and_device_checked():
    gen = seed_for("reordered_nc")
    M = 130  # > 128 rows: gemm_mn consumes the reorder
    x = randn((M, 32), torch.float32, gen)
    w = randn((32, 32), torch.float32, gen)
    route = make_mask("random", (M, 2), gen)
    ro = reorder(route)
    nc = Reordered(ro.index.t().contiguous().t(), ro.mask, ro.counts)
    assert not nc.index.is_contiguous()
    check_close(gemm_mn(x, w, route, 16, reordered=nc), gemm_mn_ref(x.double(), w.double(), route, 16), tol=1e-5)
    meta = Reordered(*(t.to("meta") for t in ro))
    for rows in (M, 3):  # the reorder path and the few-row path (which ignores it) both refuse it
        with pytest.raises(KernelArgumentError, match="route's device"):
            gemm_mn(x[:rows], w, route[:rows], 16, reordered=meta if rows == M else Reordered(
                *(t.to("meta") for t in reorder(route[:rows]))))
    B, Tq = 2, 5
    q, k, v = _qkv(B, 2, 1, Tq, 9, 16, torch.float32, gen)
    aroute = make_mask("random", (B, Tq, 2), gen)
    ar = reorder(aroute)
    anc = Reordered(ar.index.permute(2, 0, 1).contiguous().permute(1, 2, 0), ar.mask, ar.counts)
    assert not anc.index.is_contiguous()
    ref = attention_ref(q.double(), k.double(), v.double(), aroute, True)
    check_close(routed_attention(q, k, v, aroute, True, reordered=anc), ref, tol=1e-5)


def test_routed_attention_checks_reordered_on_every_path():
    gen = seed_for("attn_reordered_paths")
    q, k, v = _qkv(2, 4, 2, 1, 9, 16, torch.float32, gen)
    route = make_mask("random", (2, 1, 2), gen)
    with pytest.raises(KernelArgumentError, match="reordered must be a Reordered"):
        routed_attention(q, k, v, route, reordered="garbage")  # Tq == 1: the decode kernel
    with pytest.raises(KernelArgumentError, match="reordered.index"):
        routed_attention(q, k, v, route, reordered=reorder(make_mask("random", (2, 3, 2), gen)))


def test_misuse_messages():
    gen = seed_for("misuse")
    x = randn((2, 64), torch.bfloat16, gen)
    w = randn((64, 64), torch.bfloat16, gen)
    route = make_mask("random", (2, 4), gen)
    with pytest.raises(KernelArgumentError, match="w2 shape"):
        gemv_mn(x, w, route, 16, w2=w[:32])
    with pytest.raises(KernelArgumentError, match="tail must be a tuple"):
        gemv_mn(x, w, route, 16, tail=None)
    q, k, v = _qkv(1, 2, 1, 1, 9, 16, torch.float32, gen)
    empty = decode_attention(q[:, :0], k, v, make_mask("all", (1, 1, 1), gen))
    assert empty.shape == (1, 0, 1, 16)


def test_bench_report_only_names_a_missing_field(tmp_path):
    (tmp_path / "kernels_t.json").write_text(json.dumps([{"op": "gemm_mn"}]))
    r = subprocess.run([sys.executable, "-m", "wide", "bench", "kernels", "--report-only", "--out-dir",
                        str(tmp_path), "--tag", "t"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "lacks the field" in r.stderr and "Traceback" not in r.stderr
    (tmp_path / "kernels_u.json").write_text(json.dumps([1, 2]))
    r = subprocess.run([sys.executable, "-m", "wide", "bench", "kernels", "--report-only", "--out-dir",
                        str(tmp_path), "--tag", "u"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "not a JSON object" in r.stderr and "Traceback" not in r.stderr
