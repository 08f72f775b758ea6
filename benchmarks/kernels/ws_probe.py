"""Probe of the warp-specialized Gluon `gemm_mn` (`wide.kernels.gemm_mn_ws`) against the Triton kernel and cuBLAS
(issue 3, session 22).

Up shape of Llama-3.1-8B (N = 14336, K = 4096), bf16, Bernoulli(1 - s) routes, reorder computed once outside the
timing, CUDA-graph replay (``triton.testing.do_bench_cudagraph``, median), cuBLAS ``x @ w.T`` in the same process.
``grid`` is the library's Triton kernel at the configs the H200 tile probes found best; ``ws`` the Gluon kernel at
each config of ``WS_CONFIGS``.  Every output is checked against cuBLAS on the executed entries and zeros elsewhere
(relative L2 error, printed; a record over 1e-2 is flagged ``BAD``).

    PYTHONPATH=src python3 benchmarks/kernels/ws_probe.py --smoke          # small shapes, correctness only
    PYTHONPATH=src python3 benchmarks/kernels/ws_probe.py --out $OUT/ws_probe.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import time

import torch

GRID_CONFIGS = {  # G -> library gemm_mn configs (BM, BN, BK, GROUP_M, warps, stages, TMA weights)
    128: [(128, 128, 64, 16, 8, 4, True)],
    512: [(128, 256, 64, 8, 8, 4, True)],
}
SW_GRID_CONFIGS = [(128, 128, 64, 8, 8, 4, True), (128, 128, 64, 16, 8, 4, True)]  # library fused SwiGLU
# session 22, second call: persistent (the first call's winners) against one program per tile, BK = 32, and the
# epilogue stored from the accumulator layout (DIRECT_STORE), whose freed shared memory buys a pipeline stage
SW_WS_CONFIGS = [dict(BN=128, STAGES=3, GROUP_M=16), dict(BN=128, STAGES=3, GROUP_M=16, PERSIST=False),
                 dict(BN=128, STAGES=4, GROUP_M=16, DIRECT_STORE=True),
                 dict(BN=128, STAGES=4, GROUP_M=16, DIRECT_STORE=True, PERSIST=False),
                 dict(BN=128, BK=32, STAGES=6, GROUP_M=16)]
WS_CONFIGS = {  # G -> Gluon configs
    128: [dict(BN=128, STAGES=4, GROUP_M=8), dict(BN=128, STAGES=4, GROUP_M=8, PERSIST=False),
          dict(BN=128, STAGES=5, GROUP_M=8, DIRECT_STORE=True, PERSIST=False),
          dict(BN=128, BK=32, STAGES=8, GROUP_M=8)],
    512: [dict(BN=256, STAGES=3, GROUP_M=8), dict(BN=256, STAGES=3, GROUP_M=8, PERSIST=False),
          dict(BN=256, STAGES=4, GROUP_M=8, DIRECT_STORE=True),
          dict(BN=256, STAGES=4, GROUP_M=8, DIRECT_STORE=True, PERSIST=False),
          dict(BN=256, BK=32, STAGES=6, GROUP_M=8, PERSIST=False)],
}


def swiglu_ref(g, u):
    """silu(gate) * up from bf16 cuBLAS outputs, in fp32."""
    return torch.nn.functional.silu(g.float()) * u.float()


def rel_err(out, ref, route, G):
    exp = torch.where(route.repeat_interleave(G, dim=1), ref.float(), 0.0)
    return ((out.float() - exp).norm() / exp.norm().clamp_min(1e-30)).item()


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--M", default="16384,4096,1024")
    p.add_argument("--G", default="512,128")
    p.add_argument("--sparsity", default="0.5,0")
    p.add_argument("--smoke", action="store_true", help="small shapes, every config once, correctness only")
    p.add_argument("--out", default=None)
    p.add_argument("--time-budget", type=float, default=400)
    a = p.parse_args(argv)
    import importlib

    from triton.testing import do_bench_cudagraph

    gm = importlib.import_module("wide.kernels.gemm_mn")
    gm._ws_candidates = lambda *args: []  # the forced Triton configs alone, not the Gluon kernel beside them
    from wide.kernels import reorder
    from wide.kernels.gemm_mn_ws import gemm_mn_ws

    t0 = time.time()
    dev = "cuda"
    N, K = 14336, 4096
    if a.smoke:
        pts = [(M, G, s) for M in (1000, 4096) for G in (128, 512) for s in (0.0, 0.5, 1.0)]
        bad = 0
        for M, G, s in pts:
            torch.manual_seed(M + G)
            x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
            w = torch.randn(N, K, device=dev, dtype=torch.bfloat16) / 64
            w2 = torch.randn(N, K, device=dev, dtype=torch.bfloat16) / 64
            route = torch.rand(M, N // G, device=dev) >= s
            ref = x @ w.T
            ref_sw = swiglu_ref(ref, x @ w2.T)
            for sw, c in [(False, c) for c in WS_CONFIGS[G]] + [(True, c) for c in SW_WS_CONFIGS]:
                out = torch.full((M, N), float("nan"), device=dev, dtype=torch.bfloat16)
                gemm_mn_ws(x, w, route, G, w2=w2 if sw else None, out=out, config=c)
                torch.cuda.synchronize()
                e = rel_err(out, ref_sw if sw else ref, route, G)
                ok = e <= 1e-2 and not out.isnan().any().item()
                bad += not ok
                print(f"smoke M={M} G={G} s={s} swiglu={sw} {c}: rel_err {e:.2e} {'ok' if ok else 'BAD'}", flush=True)
        print(f"smoke: {len(pts)} points, {bad} bad", flush=True)
        return 1 if bad else 0

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
        ref_sw = swiglu_ref(ref, x @ w2.T)
        print(f"M={M} cuBLAS {dense:.4f} ms ({2 * M * N * K / dense / 1e9:.0f} TFLOP/s), SwiGLU pair {dense_sw:.4f} ms",
              flush=True)
        for G in [int(v) for v in a.G.split(",")]:
            for s in [float(v) for v in a.sparsity.split(",")]:
                route = torch.rand(M, N // G, device=dev) >= s
                ro = reorder(route)
                p_act = route.float().mean().item()
                variants = ([("grid", c) for c in GRID_CONFIGS[G]] + [("ws", c) for c in WS_CONFIGS[G]]
                            + [("sw_grid", c) for c in SW_GRID_CONFIGS] + [("sw_ws", c) for c in SW_WS_CONFIGS])
                for var, c in variants:
                    if time.time() - t0 > a.time_budget:
                        break
                    sw = var.startswith("sw_")
                    if var.endswith("grid"):
                        bm, bn, bk, gmm, wp, st, tma = c
                        cfg = dict(BM=bm, BN=bn, BK=bk, GROUP_M=gmm, num_warps=wp, num_stages=st)
                        if tma:
                            cfg["TMA"] = True
                        gm._candidates = lambda G_, M_, sw_, cfg=cfg: [dict(cfg)]
                        fn = (lambda sw=sw: gm.launch_gemm_mn(x, w, w2 if sw else None, route, G, ro, out, swiglu=sw))
                    else:
                        cfg = dict(c)
                        fn = (lambda cfg=cfg, sw=sw: gemm_mn_ws(x, w, route, G, w2=w2 if sw else None, reordered=ro,
                                                                out=out, config=cfg))
                    try:
                        out.fill_(float("nan"))
                        fn()
                        torch.cuda.synchronize()
                        err = rel_err(out, ref_sw if sw else ref, route, G)
                        ms = do_bench_cudagraph(fn, rep=200, return_mode="median")
                    except Exception as e:  # noqa: BLE001 - a config that does not compile / fit
                        print(f"M={M} G={G} s={s} {var} {cfg}: {type(e).__name__}: {str(e)[:300]}", flush=True)
                        continue
                    d = dense_sw if sw else dense
                    rec = dict(variant=var, M=M, N=N, K=K, G=G, sparsity=s, active=round(p_act, 4), cfg=cfg,
                               ms=round(ms, 4), tflops=round(2 * M * N * K * p_act * (1 + sw) / ms / 1e9, 1),
                               dense_ms=round(d, 4), speedup=round(d / ms, 3), rel_err=round(err, 5))
                    recs.append(rec)
                    print(json.dumps(rec) + ("" if err <= 1e-2 else "  BAD"), flush=True)
        del x, w, w2, out, ref, ref_sw
        torch.cuda.empty_cache()
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                triton=importlib.import_module("triton").__version__,
                date=dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
                command="python " + " ".join(sys.argv))
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"meta": meta, "records": recs}, f, indent=1)
    for M, G, s in sorted({(r["M"], r["G"], r["sparsity"]) for r in recs}):
        for var in ("grid", "ws", "sw_grid", "sw_ws"):
            rs = sorted((r for r in recs if (r["M"], r["G"], r["sparsity"], r["variant"]) == (M, G, s, var)),
                        key=lambda r: r["ms"])
            if rs:
                print(f"best M={M} G={G} s={s} {var:7s}: {rs[0]['ms']:.4f} ms {rs[0]['tflops']} TFLOP/s "
                      f"x{rs[0]['speedup']} err {rs[0]['rel_err']} {rs[0]['cfg']}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
