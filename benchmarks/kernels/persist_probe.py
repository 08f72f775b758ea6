"""Probe of where `gemm_mn` loses efficiency at s = 0.5 against s = 0 (issue 3, session 21).

At M = 16384, G = 512 the session-17 tile probe ran the routed kernel at 724 TFLOP/s with every group executed
and at 600 TFLOP/s on the executed work at s = 0.5.  This probe times, for the up shape (N = 14336,
K = 4096), forced configs, CUDA-graph replay (``triton.testing.do_bench_cudagraph``, median), the kernel alone
(reorder computed once outside the timing), cuBLAS in the same process:

- ``grid``: the library's kernel as it is (one program per (row tile, N tile)).
- ``contig``: the same kernel and the same work, but each group's active rows are the first ``counts[g]``
  rows in order (index = identity, counts taken from the real route): no gathered / scattered rows, the same
  number of executed and skipped tiles.  The difference to ``grid`` is the cost of the gather.
- ``persist``: the library's kernel with ``PERSIST`` (one program per SM looping over the tiles in the same
  grouped order): a skipped tile costs a zero store inside a running program instead of a program launch.
- ``persist_il``: the persistent loop over the library's tile body with the row tiles interleaved (low and high
  halves alternate), so skipped tiles run between executed ones instead of as a tail.
- ``sw_grid`` / ``sw_persist``: the library's fused SwiGLU (gate + up), as it is and with ``PERSIST``, against two
  cuBLAS GEMMs + ``silu(a) * b``.

``warp_specialize=True`` on the K loop (Triton's autoWS) is not among them: compiled for sm_90 with Triton 3.6 the
kernel's PTX is byte-identical with and without it, so Hopper warp specialization does not apply to this loop
(its token operand is a gathered pointer load).

Each variant's output is checked against cuBLAS on the executed entries (and zeros elsewhere).

    PYTHONPATH=src python3 benchmarks/kernels/persist_probe.py --out $OUT/persist_probe.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import time

import torch
import triton
import triton.language as tl

from wide.kernels._common import Reordered
from wide.kernels.gemm_mn import gemm_mn_tile, grouped_tile

CONFIGS = {  # G -> list of (BM, BN, BK, GROUP_M, warps, stages, TMA weights)
    128: [(128, 128, 64, 16, 8, 4, True), (128, 128, 64, 8, 8, 4, True), (128, 128, 64, 8, 8, 3, False),
          (256, 128, 64, 8, 8, 3, False)],
    512: [(128, 256, 64, 8, 8, 4, True), (128, 256, 64, 16, 8, 4, True), (128, 256, 64, 8, 8, 3, True)],
}
SW_CONFIGS = [(128, 128, 64, 8, 8, 4, True), (128, 128, 64, 16, 8, 4, True)]  # fused SwiGLU (two accumulators)


@triton.jit
def _mn_persist(x_ptr, w_ptr, out_ptr, idx_ptr, cnt_ptr, M, N, K, NG, stride_xm, stride_wn, stride_om, G,
                w_desc, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                NUM_SMS: tl.constexpr, USE_TMA: tl.constexpr, INTERLEAVE: tl.constexpr, EVEN_K: tl.constexpr):
    """The library's persistent loop over its own tile body, with the row tiles optionally interleaved."""
    num_pid_m = tl.cdiv(M, BM)
    for tile in range(tl.program_id(0), num_pid_m * (N // BN), NUM_SMS):
        pid_m, pid_n = grouped_tile(tile, M, N, BM, BN, GROUP_M)
        if INTERLEAVE:  # low and high row tiles alternate
            half = (num_pid_m + 1) // 2
            pid_m = tl.where(pid_m % 2 == 0, pid_m // 2, half + pid_m // 2)
        gemm_mn_tile(pid_m, pid_n, x_ptr, w_ptr, w_ptr, out_ptr, idx_ptr, cnt_ptr, cnt_ptr, M, N, K, NG,
                     stride_xm, stride_wn, stride_om, G, BM, BN, BK, EVEN_K, False, False, w_desc, w_desc,
                     USE_TMA)


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--M", default="4096,16384")
    p.add_argument("--G", default="128,512")
    p.add_argument("--sparsity", default="0,0.5")
    p.add_argument("--variants", default="grid,contig,persist,persist_il,sw_grid,sw_persist")
    p.add_argument("--out", default=None)
    p.add_argument("--time-budget", type=float, default=420)
    a = p.parse_args(argv)
    import importlib

    from triton.testing import do_bench_cudagraph
    from triton.tools.tensor_descriptor import TensorDescriptor

    gm = importlib.import_module("wide.kernels.gemm_mn")
    gm._ws_candidates = lambda *args: []  # the forced Triton configs alone, not the Gluon kernel beside them
    from wide.kernels import reorder

    t0 = time.time()
    dev = "cuda"
    nsm = torch.cuda.get_device_properties(0).multi_processor_count
    N, K = 14336, 4096
    recs = []
    for M in [int(v) for v in a.M.split(",")]:
        torch.manual_seed(0)
        x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
        w = torch.randn(N, K, device=dev, dtype=torch.bfloat16) / 64
        w2 = torch.randn(N, K, device=dev, dtype=torch.bfloat16) / 64
        out = torch.empty(M, N, device=dev, dtype=torch.bfloat16)
        dense = do_bench_cudagraph(lambda: torch.mm(x, w.T, out=out), rep=200, return_mode="median")
        dense_sw = do_bench_cudagraph(lambda: torch.mul(torch.nn.functional.silu(x @ w.T), x @ w2.T), rep=200,
                                      return_mode="median")
        ref = x @ w.T
        ref_sw = torch.nn.functional.silu(ref.float()) * (x @ w2.T).float()
        print(f"M={M} cuBLAS {dense:.4f} ms ({2 * M * N * K / dense / 1e9:.0f} TFLOP/s), SwiGLU pair {dense_sw:.4f} ms",
              flush=True)
        for G in [int(v) for v in a.G.split(",")]:
            for s in [float(v) for v in a.sparsity.split(",")]:
                route = torch.rand(M, N // G, device=dev) >= s
                ro = reorder(route)
                p_act = route.float().mean().item()
                ar = torch.arange(M, device=dev, dtype=torch.int32)[:, None].expand(M, N // G).contiguous()
                route_c = ar < ro.counts[None, :]
                ro_c = Reordered(ar, route_c, ro.counts)
                for bm, bn, bk, gmm, wp, st, tma in CONFIGS[G] + SW_CONFIGS:
                    cfg = dict(BM=bm, BN=bn, BK=bk, GROUP_M=gmm, num_warps=wp, num_stages=st)
                    if tma:
                        cfg["TMA"] = True
                    sw_cfg = (bm, bn, bk, gmm, wp, st, tma) in SW_CONFIGS
                    mn_cfg = (bm, bn, bk, gmm, wp, st, tma) in CONFIGS[G]
                    for var in a.variants.split(","):
                        if (var.startswith("sw_") and not sw_cfg) or (not var.startswith("sw_") and not mn_cfg):
                            continue
                        if time.time() - t0 > a.time_budget:
                            break
                        rt, r = (route_c, ro_c) if var == "contig" else (route, ro)
                        if var.startswith("sw_"):
                            c = dict(cfg, PERSIST=True) if var == "sw_persist" else cfg
                            gm._candidates = lambda G_, M_, sw, c=c: [dict(c)]
                            fn = (lambda rt=rt, r=r: gm.launch_gemm_mn(x, w, w2, rt, G, r, out, swiglu=True))
                        elif var in ("grid", "contig", "persist"):
                            c = dict(cfg, PERSIST=True) if var == "persist" else cfg
                            gm._candidates = lambda G_, M_, sw, c=c: [dict(c)]
                            fn = (lambda rt=rt, r=r: gm.launch_gemm_mn(x, w, None, rt, G, r, out, swiglu=False))
                        else:
                            wd = TensorDescriptor.from_tensor(w, [bn, bk]) if tma else w
                            grid = (min(nsm, triton.cdiv(M, bm) * (N // bn)),)

                            def fn(r=r, wd=wd, grid=grid, var=var):
                                _mn_persist[grid](x, w, out, r.index, r.counts, M, N, K, N // G, x.stride(0),
                                                  w.stride(0), out.stride(0), G, wd, BM=bm, BN=bn, BK=bk,
                                                  GROUP_M=gmm, NUM_SMS=grid[0], USE_TMA=tma,
                                                  INTERLEAVE=(var == "persist_il"), EVEN_K=(K % bk == 0),
                                                  num_warps=wp, num_stages=st)
                        try:
                            out.fill_(float("nan"))
                            fn()
                            torch.cuda.synchronize()
                            full = ref_sw if var.startswith("sw_") else ref.float()
                            exp = torch.where(rt.repeat_interleave(G, dim=1), full, 0.0)
                            err = ((out.float() - exp.float()).norm() / exp.float().norm().clamp_min(1e-30)).item()
                            ms = do_bench_cudagraph(fn, rep=200, return_mode="median")
                        except Exception as e:  # noqa: BLE001 - a variant that does not compile / fit
                            print(f"M={M} G={G} s={s} {var} {cfg}: {type(e).__name__}: {str(e)[:300]}", flush=True)
                            continue
                        flop = 2 * M * N * K * p_act * (2 if var.startswith("sw_") else 1)
                        d = dense_sw if var.startswith("sw_") else dense
                        rec = dict(variant=var, M=M, N=N, K=K, G=G, sparsity=s, active=round(p_act, 4), cfg=cfg,
                                   ms=round(ms, 4), tflops=round(flop / ms / 1e9, 1), dense_ms=round(d, 4),
                                   speedup=round(d / ms, 3), rel_err=round(err, 5))
                        recs.append(rec)
                        print(json.dumps(rec), flush=True)
        del x, w, w2, out, ref, ref_sw
        torch.cuda.empty_cache()
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                date=dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
                command="python " + " ".join(sys.argv))
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"meta": meta, "records": recs}, f, indent=1)
    keys = sorted({(r["M"], r["G"], r["sparsity"]) for r in recs})
    for M, G, s in keys:
        for var in a.variants.split(","):
            rs = sorted((r for r in recs if (r["M"], r["G"], r["sparsity"], r["variant"]) == (M, G, s, var)),
                        key=lambda r: r["ms"])
            if rs:
                print(f"best M={M} G={G} s={s} {var:10s}: {rs[0]['ms']:.4f} ms {rs[0]['tflops']} TFLOP/s "
                      f"x{rs[0]['speedup']} err {rs[0]['rel_err']} {rs[0]['cfg']}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
