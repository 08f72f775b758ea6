"""The CuTe GEMM kernels with clusters of 1 and 2 CTAs along M (a pair shares each weight tile by TMA multicast),
in one process on an sm_90 GPU, against cuBLAS and the dense SwiGLU baselines.  Llama-3.1-8B up / gate shapes
(4096 -> 14336), M = 4096 / 16384 rows, G = 128 / 512, Bernoulli routes at s = 0 and 0.5 reordered outside the timed
region (kernel time only); medians of ``wide.bench.kernels.time_ms`` (``do_bench_cudagraph``).  The routed SwiGLU
is compared with the fastest dense SwiGLU of the run (cuBLAS on [W_gate; W_up] plus the activation, or the CuTe dense
SwiGLU at either cluster size).  ``--group-m 4,8,16`` also times the row tiles per band of the persistent tile order.
Prints one line per launch; ``--out`` also writes the records, after each one.

    python3 benchmarks/kernels/gemm_cluster_ab.py --out benchmarks/kernels/gemm_cluster_h200.json

The tuned config's ``cute_launch`` takes the winner per op (``gemm_mn``, ``swiglu``, ``dense_swiglu``): the pair with
the lowest geometric mean time over the op's points.
"""

import json
import sys

import torch
import torch.nn.functional as F

from wide.bench._args import choice_list, doc_summary, int_list, require_sm90, run_provenance
from wide.bench.kernels import rel_err, time_ms
from wide.cli.common import WideArgumentParser
from wide.kernels import reorder, sm90
from wide.kernels.reference import gemm_mn_ref, swiglu_ref

D, FFN = 4096, 14336
CHECK_ROWS = 512  # rows checked against the float64 reference per point


def sweep_rows(M: int, variants: list[tuple[int, int]]):
    """Yields the records of one row count M as they are measured: the dense SwiGLU candidates, then gemm_mn and the
    routed SwiGLU per G, s and variant (cluster size, group_m: row tiles per band of the persistent order).  Each
    launch's point is printed before it runs, so a run that stops names the launch it stopped in."""
    m = sm90.module(torch.device("cuda"))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    g = torch.Generator(device="cuda").manual_seed(M)
    x = torch.randn(M, D, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(2 * FFN, D, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02  # [W_gate; W_up]
    wg, wu = w[:FFN], w[FFN:]
    out = torch.empty(M, FFN, device="cuda", dtype=torch.bfloat16)
    tmp = torch.empty(M, 2 * FFN, device="cuda", dtype=torch.bfloat16)
    xc = x[:CHECK_ROWS].double()
    flop = 2.0 * M * FFN * D
    cublas = time_ms([lambda: torch.matmul(x, wg.t(), out=out)])

    def unfused():
        torch.matmul(x, w.t(), out=tmp)
        torch.mul(F.silu(tmp[:, :FFN]), tmp[:, FFN:], out=out)

    dense_sw = {"cuBLAS [W_gate; W_up] + silu * up": time_ms([unfused])}
    records = []
    for cm, gm in variants:
        name = f"CuTe dense SwiGLU, cluster {cm}" + (f", group_m {gm}" if len({v[1] for v in variants}) > 1 else "")
        dense_sw[name] = time_ms([lambda cm=cm, gm=gm: m.run(2, x, wg, wu, None, None, None, out, FFN, gm, sms, cm)])
        ones = torch.ones(CHECK_ROWS, 1, dtype=torch.bool, device="cuda")
        err = rel_err(out[:CHECK_ROWS], swiglu_ref(xc, wg.double(), wu.double(), ones, FFN))
        records.append(dict(op="dense_swiglu", M=M, N=FFN, K=D, cluster_m=cm, group_m=gm, wide_ms=dense_sw[name],
                            rel_err=err))
    sw_ms = min(dense_sw.values())
    sw_base = min(dense_sw, key=dense_sw.get)
    print(f"M={M} cuBLAS {cublas:.4f} ms ({flop / cublas / 1e9:.0f} TFLOP/s) | dense SwiGLU " +
          " | ".join(f"{k} {v:.4f} ms ({2 * flop / v / 1e9:.0f} TFLOP/s)" for k, v in dense_sw.items()), flush=True)
    for r in records:
        r.update(dense_ms=sw_ms, baseline=sw_base, speedup=sw_ms / r["wide_ms"], baseline_candidates_ms=dense_sw)
        yield r
    for G in (128, 512):
        for s in (0.0, 0.5):
            route = torch.rand(M, FFN // G, device="cuda", generator=g) >= s
            r = reorder(route)
            rc = route[:CHECK_ROWS]
            for op, opid, base_ms, base in (("gemm_mn", 0, cublas, "cuBLAS x @ w.T (torch.matmul)"),
                                            ("swiglu", 1, sw_ms, sw_base)):
                w2 = wu if op == "swiglu" else None
                ref = (swiglu_ref(xc, wg.double(), wu.double(), rc, G) if op == "swiglu"
                       else gemm_mn_ref(xc, wg.double(), rc, G))
                for cm, gm in variants:
                    print(f"M={M} G={G} s={s} {op} cluster {cm} group_m {gm}: ", end="", flush=True)
                    ms = time_ms([lambda cm=cm, gm=gm: m.run(opid, x, wg, w2, r.index, r.counts, None, out, G, gm,
                                                             sms, cm)])
                    err = rel_err(out[:CHECK_ROWS], ref)
                    print(f"{ms:.4f} ms, {base_ms / ms:.3f}x of dense {base_ms:.4f} ms, err {err:.1e}", flush=True)
                    yield dict(op=op, M=M, N=FFN, K=D, G=G, sparsity=s, cluster_m=cm, group_m=gm, dense_ms=base_ms,
                               wide_ms=ms, speedup=base_ms / ms, baseline=base, rel_err=err)


def main() -> None:
    p = WideArgumentParser(description=doc_summary(__doc__))
    p.add_argument("--out", help="JSON file for the records")
    p.add_argument("--M", default=[4096, 16384], type=int_list(1), help="row counts (default: 4096,16384)")
    p.add_argument("--clusters", default=["1", "2"], type=choice_list("1", "2"),
                   help="cluster sizes along M to time, 1 and / or 2 (default: 1,2)")
    p.add_argument("--group-m", type=int_list(1),
                   help="row tiles per band of the persistent tile order to time, comma-separated (default: those of "
                        "the GPU config's cute_launch for gemm_mn, swiglu and dense_swiglu)")
    args = p.parse_args()
    require_sm90(p)
    dev = torch.device("cuda")
    group_m = args.group_m or sorted({sm90.launch_shape(dev, op)[1] for op in ("gemm_mn", "swiglu", "dense_swiglu")})
    variants = [(int(cm), gm) for gm in group_m for cm in args.clusters]

    meta = dict(unit="sparsity s: fraction of (row, group) pairs skipped, Bernoulli",
                timing="kernel only (the reorder outside the timed region)", gpu=torch.cuda.get_device_name(),
                **run_provenance("python3 benchmarks/kernels/gemm_cluster_ab.py " + " ".join(sys.argv[1:])))
    records = []
    for M in args.M:
        for rec in sweep_rows(M, variants):
            records.append(rec)
            if args.out:  # after each point, so a cut run keeps what it measured
                with open(args.out, "w") as f:
                    json.dump([{**r, **meta} for r in records], f, indent=1)


if __name__ == "__main__":
    main()
