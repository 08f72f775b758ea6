"""Tile-config probe of the large-M GEMM-MN / fused SwiGLU kernel on the GPU (issue 3: why 565 TFLOP/s?).

For Llama-3.1-8B up/gate shapes (N = 14336, K = 4096) at M = 16384, G in {128, 512}, s in {0, 0.5}, times
every config of a list (each forced, bypassing the autotuner) and cuBLAS in the same process
(``triton.testing.do_bench``, median of >= 25 runs after warm-up; a reorder shared as in the kernel
benchmark is not included: the kernel alone).  Reports ms, TFLOP/s on the executed work and the ratio to
cuBLAS.  Writes ``--out`` (JSON list) and prints a table.

    PYTHONPATH=src python3 benchmarks/kernels/tile_probe.py --out $OUT/tile_probe.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import time

CONFIGS = [  # BM, BN, BK, GROUP_M, warps, stages, TMA weights
    (128, 128, 64, 8, 8, 3, False), (128, 128, 64, 8, 8, 4, False), (128, 128, 64, 8, 8, 5, False),
    (128, 128, 64, 8, 4, 4, False), (128, 128, 128, 8, 8, 3, False), (128, 128, 64, 8, 8, 4, True),
    (128, 128, 64, 16, 8, 4, True), (128, 128, 64, 8, 8, 5, True), (128, 128, 128, 8, 8, 3, True),
    (256, 128, 64, 8, 8, 3, False), (256, 128, 64, 8, 8, 4, False), (256, 128, 64, 8, 8, 3, True),
    (256, 128, 64, 8, 8, 4, True), (128, 256, 64, 8, 8, 3, False), (128, 256, 64, 8, 8, 3, True),
    (128, 256, 64, 8, 8, 4, True), (64, 256, 64, 8, 4, 4, True), (256, 64, 64, 8, 4, 4, False),
]


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--M", type=int, default=16384)
    p.add_argument("--G", default="128,512", help="comma list of group sizes")
    p.add_argument("--sparsity", default="0,0.5", help="comma list")
    p.add_argument("--out", default=None)
    p.add_argument("--ops", default="gemm_mn,swiglu")
    p.add_argument("--time-budget", type=float, default=400)
    a = p.parse_args(argv)
    import importlib

    import torch
    from triton.testing import do_bench

    gm = importlib.import_module("wide.kernels.gemm_mn")  # the module (wide.kernels.gemm_mn is also the op)
    from wide.kernels import reorder

    Gs = [int(g) for g in a.G.split(",")]
    ss = [float(v) for v in a.sparsity.split(",")]
    t0 = time.time()
    dev = "cuda"
    torch.manual_seed(0)
    M, N, K = a.M, 14336, 4096
    x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
    w = torch.randn(N, K, device=dev, dtype=torch.bfloat16) / 64
    w2 = torch.randn(N, K, device=dev, dtype=torch.bfloat16) / 64
    out = torch.empty(M, N, device=dev, dtype=torch.bfloat16)
    dense_mn = do_bench(lambda: torch.mm(x, w.T, out=out), warmup=10, rep=100, return_mode="median")
    dense_sw = do_bench(lambda: torch.mul(torch.nn.functional.silu(x @ w.T), x @ w2.T), warmup=10, rep=100,
                        return_mode="median")
    print(f"cuBLAS gemm {dense_mn:.4f} ms ({2 * M * N * K / dense_mn / 1e9:.0f} TFLOP/s); swiglu pair "
          f"{dense_sw:.4f} ms", flush=True)
    recs = []
    orig, orig_ws = gm._candidates, gm._ws_candidates
    gm._ws_candidates = lambda *args: []  # the forced Triton configs alone
    for op in a.ops.split(","):
        for G in Gs:
            for s in ss:
                route = torch.rand(M, N // G, device=dev) >= s
                ro = reorder(route)
                p_act = route.float().mean().item()
                for bm, bn, bk, gmm, wp, st, tma in CONFIGS:
                    if time.time() - t0 > a.time_budget:
                        break
                    if bn > G:
                        continue
                    cfg = dict(BM=bm, BN=bn, BK=bk, GROUP_M=gmm, num_warps=wp, num_stages=st)
                    if tma:
                        cfg["TMA"] = True
                    gm._candidates = lambda G_, M_, sw, c=cfg: [dict(c)]
                    fn = (lambda: gm.launch_gemm_mn(x, w, w2, route, G, ro, out, swiglu=True)) if op == "swiglu" \
                        else (lambda: gm.launch_gemm_mn(x, w, None, route, G, ro, out, swiglu=False))
                    try:
                        fn()
                        torch.cuda.synchronize()
                        ms = do_bench(fn, warmup=5, rep=60, return_mode="median")
                    except Exception as e:  # noqa: BLE001 - a config that does not compile / fit
                        print(f"{op} G={G} s={s} {cfg}: {type(e).__name__}", flush=True)
                        continue
                    dense = dense_sw if op == "swiglu" else dense_mn
                    flop = 2 * M * N * K * p_act * (2 if op == "swiglu" else 1)
                    rec = dict(op=op, M=M, N=N, K=K, G=G, sparsity=s, active=round(p_act, 4), cfg=cfg,
                               ms=round(ms, 4), tflops=round(flop / ms / 1e9, 1), dense_ms=round(dense, 4),
                               speedup=round(dense / ms, 3))
                    recs.append(rec)
                    print(json.dumps(rec), flush=True)
    gm._candidates, gm._ws_candidates = orig, orig_ws
    meta = dict(gpu=torch.cuda.get_device_name(), date=dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
                command="python " + " ".join(sys.argv), cublas_gemm_ms=dense_mn, cublas_swiglu_ms=dense_sw)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"meta": meta, "records": recs}, f, indent=1)
    for op in a.ops.split(","):
        for G in Gs:
            for s in ss:
                rs = sorted((r for r in recs if r["op"] == op and r["G"] == G and r["sparsity"] == s),
                            key=lambda r: r["ms"])
                if rs:
                    print(f"best {op} G={G} s={s}: {rs[0]['ms']} ms {rs[0]['tflops']} TFLOP/s x{rs[0]['speedup']} "
                          f"{rs[0]['cfg']}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
