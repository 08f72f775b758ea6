"""The CuTe prefill attention's launch options against cuDNN attention, in one process on an sm_90 GPU: ping-pong of
the two consumer warpgroups on / off, and one CTA per 128-row tile (grid 0) or a persistent grid of one CTA per SM.
Causal GQA 32 / 8 heads, d = 128, one sequence of T = 4096 / 16384 tokens, Bernoulli head-group routes at s = 0 and
0.5; medians of ``triton.testing.do_bench_cudagraph``.  Prints one line per T; ``--out`` also writes the records.

    python3 benchmarks/kernels/attention_launch_ab.py --out benchmarks/kernels/attention_launch_h100.json

The tuned config's ``attention.cute_pingpong`` / ``cute_persistent`` take the winner.
"""

import json

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from wide.bench._args import doc_summary, require_sm90, run_provenance
from wide.cli.common import WideArgumentParser
from wide.kernels import reorder


def main() -> None:
    p = WideArgumentParser(description=doc_summary(__doc__))
    p.add_argument("--out", help="JSON file for the records")
    args = p.parse_args()
    m = require_sm90(p)
    import triton.testing as tt
    sdpa = torch.nn.functional.scaled_dot_product_attention
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    records = []
    for T in (4096, 16384):
        g = torch.Generator(device="cuda").manual_seed(T)
        q = torch.randn(1, 32, T, 128, device="cuda", dtype=torch.bfloat16, generator=g)
        k, v = (torch.randn(1, 8, T, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            dense = tt.do_bench_cudagraph(lambda: sdpa(q, k, v, is_causal=True, enable_gqa=True), rep=300)
        line = f"T={T} cuDNN {dense:.4f} ms ({4 * 32 * T * T * 128 / 2 / dense / 1e9:.0f} TFLOP/s)"
        for s in (0.0, 0.5):
            route = torch.rand(1, T, 8, device="cuda", generator=g) >= s
            r = reorder(route)
            out = torch.empty_like(q)
            for pp in (False, True):
                for grid in (0, sms):
                    ms = tt.do_bench_cudagraph(lambda: m.attention(q, k, v, r.index, r.counts, None, out, True,
                                                                   128 ** -0.5, pp, grid), rep=200)
                    line += f" | s={s} pp={int(pp)} grid={grid} {ms:.4f} ms {dense / ms:.3f}x"
                    records.append(dict(op="attention_prefill", T=T, B=1, sparsity=s, pingpong=pp, grid_ctas=grid,
                                        dense_ms=dense, wide_ms=ms, speedup=dense / ms,
                                        baseline="SDPA CUDNN_ATTENTION"))
        print(line, flush=True)
    if args.out:
        meta = dict(gpu=torch.cuda.get_device_name(),
                    **run_provenance("python3 benchmarks/kernels/attention_launch_ab.py --out " + args.out))
        with open(args.out, "w") as f:
            json.dump([{**r, **meta} for r in records], f, indent=1)


if __name__ == "__main__":
    main()
