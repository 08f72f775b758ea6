"""The engine's dense gate / up with a route, three ways, in one process on an sm_90 GPU: the fused CuTe SwiGLU followed
by a masking pass over its output, the fused SwiGLU that zeroes the skipped groups in its epilogue, and the routed
CuTe SwiGLU (its reorder included); the fused SwiGLU without a route as the floor.  Llama-3.1-8B gate / up (4096 ->
14336), G = 128, M = 4096 / 16384 rows, Bernoulli routes at s = 0, 0.1 and 0.3 (the dense path runs layers whose
FFN is busy); medians of ``wide.bench.kernels.time_ms`` (``do_bench_cudagraph``).  Each variant's output is checked
against the float64 reference on its first rows, and its skipped blocks for exact zeros.

    python3 benchmarks/kernels/swiglu_route_ab.py --out benchmarks/kernels/swiglu_route_h200.json

The config's ``engine.fused_swiglu_route`` turns the epilogue path on where it wins.
"""

import json
import sys

import torch

from wide.bench._args import doc_summary, int_list, require_sm90, run_provenance
from wide.bench.kernels import rel_err, time_ms
from wide.cli.common import WideArgumentParser
from wide.kernels import reorder, sm90, swiglu
from wide.kernels.reference import expand_route, swiglu_ref

D, FFN, G = 4096, 14336, 128
CHECK_ROWS = 512


def main() -> None:
    p = WideArgumentParser(description=doc_summary(__doc__))
    p.add_argument("--out", help="JSON file for the records")
    p.add_argument("--M", default=[4096, 16384], type=int_list(1), help="row counts (default: 4096,16384)")
    args = p.parse_args()
    require_sm90(p)
    dev = torch.device("cuda")
    meta = dict(G=G, unit="sparsity s: Bernoulli probability that a (token, group) is skipped",
                gpu=torch.cuda.get_device_name(), cute_launch={o: list(sm90.launch_shape(dev, o))
                                                              for o in ("swiglu", "dense_swiglu")},
                **run_provenance("python3 benchmarks/kernels/swiglu_route_ab.py " + " ".join(sys.argv[1:])))
    records = []
    for M in args.M:
        g = torch.Generator(device="cuda").manual_seed(M)
        x = torch.randn(M, D, device="cuda", dtype=torch.bfloat16, generator=g)
        wg = torch.randn(FFN, D, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
        wu = torch.randn(FFN, D, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
        out = torch.empty(M, FFN, device="cuda", dtype=torch.bfloat16)
        floor = time_ms([lambda: sm90.dense_swiglu(x, wg, wu, out=out)])
        for s in (0.0, 0.1, 0.3):
            route = torch.rand((M, FFN // G), generator=g, device="cuda") >= s

            def masked_pass():
                sm90.dense_swiglu(x, wg, wu, out=out)
                out.view(M, -1, G).mul_(route.unsqueeze(-1))

            ref = swiglu_ref(x[:CHECK_ROWS].double(), wg.double(), wu.double(), route[:CHECK_ROWS], G)
            skipped = ~expand_route(route, G)
            variants = {"fused SwiGLU + masking pass": masked_pass,
                        "fused SwiGLU, route in the epilogue": lambda: sm90.dense_swiglu(x, wg, wu, out=out,
                                                                                         route=route),
                        "routed CuTe SwiGLU + reorder": lambda: swiglu(x, wg, wu, route, G, reordered=reorder(route),
                                                                       out=out, backend="cute")}
            ms, errs, zeros = {}, {}, True
            for name, fn in variants.items():  # each variant's own output checked after its timing
                out.fill_(float("nan"))
                ms[name] = time_ms([fn])
                errs[name] = rel_err(out[:CHECK_ROWS], ref)
                zeros = zeros and bool((out[skipped] == 0).all())
            err = max(errs.values())
            gain = ms["fused SwiGLU + masking pass"] / ms["fused SwiGLU, route in the epilogue"]
            rec = dict(op="dense_swiglu_route", M=M, N=FFN, K=D, sparsity=s, floor_ms=floor, times_ms=ms,
                       epilogue_speedup_over_pass=gain, rel_err=errs, skipped_exact_zero=zeros, **meta)
            records.append(rec)
            print(f"M={M} s={s} floor {floor:.4f} ms | " + " | ".join(f"{k} {v:.4f}" for k, v in ms.items())
                  + f" | epilogue over pass {gain:.3f}x err {err:.1e} zeros {zeros}", flush=True)
            if args.out:
                with open(args.out, "w") as f:
                    json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
