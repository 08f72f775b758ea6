"""The CuTe GEMM kernels with clusters of 1 and 2 CTAs along M (a pair shares each weight tile by TMA multicast),
in one process on an sm_90 GPU, against cuBLAS and the dense SwiGLU baselines.  Llama-3.1-8B up / gate shapes
(4096 -> 14336), M = 4096 / 16384 rows, G = 128 / 512, Bernoulli routes at s = 0 and 0.5 reordered outside the timed
region (kernel time only); medians of ``triton.testing.do_bench_cudagraph``.  Prints one line per point; ``--out``
also writes the records.

    python3 benchmarks/kernels/gemm_cluster_ab.py --out benchmarks/kernels/gemm_cluster_h200.json

The tuned config's ``gemm_mn.cute_cluster_m`` takes the winner.
"""

import argparse
import datetime
import json
import subprocess
import sys

import torch
import torch.nn.functional as F
import triton.testing as tt

from wide.kernels import reorder, sm90
from wide.kernels.reference import gemm_mn_ref, swiglu_ref

D, FFN = 4096, 14336


def bench(fn) -> float:
    fn()
    torch.cuda.synchronize()
    return tt.do_bench_cudagraph(fn, rep=200, return_mode="median")


def rel_err(out, ref) -> float:
    return float((out.double() - ref).norm() / ref.norm().clamp_min(1e-30))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="JSON file for the records")
    p.add_argument("--M", default="4096,16384", help="row counts (default: 4096,16384)")
    p.add_argument("--clusters", default="1,2", help="cluster sizes along M to time (default: 1,2)")
    args = p.parse_args()
    dev = torch.device("cuda")
    m = sm90.module(dev)
    if m is None:
        sys.exit("the CuTe kernels need an sm_90 GPU and a working build")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    records = []
    clusters = [int(v) for v in args.clusters.split(",")]

    def add(rec, line):
        records.append(rec)
        print(line, flush=True)

    for M in (int(v) for v in args.M.split(",")):
        g = torch.Generator(device="cuda").manual_seed(M)
        x = torch.randn(M, D, device="cuda", dtype=torch.bfloat16, generator=g)
        w = torch.randn(2 * FFN, D, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02  # [W_gate; W_up]
        wg, wu = w[:FFN], w[FFN:]
        out = torch.empty(M, FFN, device="cuda", dtype=torch.bfloat16)
        tmp = torch.empty(M, 2 * FFN, device="cuda", dtype=torch.bfloat16)
        flop = 2.0 * M * FFN * D
        cublas = bench(lambda: torch.matmul(x, wg.t(), out=out))

        def unfused():
            torch.matmul(x, w.t(), out=tmp)
            torch.mul(F.silu(tmp[:, :FFN]), tmp[:, FFN:], out=out)

        dense_sw = {"cuBLAS [W_gate; W_up] + silu * up": bench(unfused)}
        for cm in clusters:
            dense_sw[f"CuTe dense SwiGLU, cluster {cm}"] = bench(
                lambda cm=cm: m.run(2, x, wg, wu, None, None, out, FFN, 8, sms, cm))
        ref_rows = slice(0, 512)  # accuracy on the first rows against the float64 reference
        ones = torch.ones(M, 1, dtype=torch.bool, device="cuda")
        m.run(2, x, wg, wu, None, None, out, FFN, 8, sms, clusters[-1])
        err = rel_err(out[ref_rows], swiglu_ref(x[ref_rows].double(), wg.double(), wu.double(), ones[ref_rows], FFN))
        sw_best = min(dense_sw.values())
        add(dict(op="dense_swiglu", M=M, N=FFN, K=D, candidates_ms=dense_sw, rel_err=err, rel_err_cluster=clusters[-1]),
            f"M={M} cuBLAS gemm {cublas:.4f} ms ({flop / cublas / 1e9:.0f} TFLOP/s) | dense SwiGLU " +
            " | ".join(f"{k} {v:.4f} ms ({2 * flop / v / 1e9:.0f} TFLOP/s)" for k, v in dense_sw.items()) +
            f" | rel_err {err:.1e}")
        for G in (128, 512):
            for s in (0.0, 0.5):
                route = torch.rand(M, FFN // G, device="cuda", generator=g) >= s
                r = reorder(route)
                for op, opid, base_ms, base in (("gemm_mn", 0, cublas, "cuBLAS x @ w.T (torch.matmul)"),
                                                ("swiglu", 1, sw_best, min(dense_sw, key=dense_sw.get))):
                    w2 = wu if op == "swiglu" else None
                    line = f"M={M} G={G} s={s} {op} dense {base_ms:.4f} ms"
                    for cm in clusters:
                        ms = bench(lambda cm=cm: m.run(opid, x, wg, w2, r.index, r.counts, out, G, 8, sms, cm))
                        ref = (swiglu_ref(x[ref_rows].double(), wg.double(), wu.double(), route[ref_rows], G)
                               if op == "swiglu" else gemm_mn_ref(x[ref_rows].double(), wg.double(), route[ref_rows], G))
                        err = rel_err(out[ref_rows], ref)
                        line += f" | cluster {cm} {ms:.4f} ms {base_ms / ms:.3f}x err {err:.1e}"
                        records.append(dict(op=op, M=M, N=FFN, K=D, G=G, sparsity=s, cluster_m=cm, dense_ms=base_ms,
                                            wide_ms=ms, speedup=base_ms / ms, baseline=base, rel_err=err,
                                            timing="kernel only (reorder outside the timed region)"))
                    print(line, flush=True)
        del x, w, out, tmp
        torch.cuda.empty_cache()
    if args.out:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        meta = dict(gpu=torch.cuda.get_device_name(), commit=commit or "unknown",
                    date=datetime.date.today().isoformat(),
                    command="python3 benchmarks/kernels/gemm_cluster_ab.py " + " ".join(sys.argv[1:]))
        with open(args.out, "w") as f:
            json.dump([{**r, **meta} for r in records], f, indent=1)


if __name__ == "__main__":
    main()
