"""Launch each kernel of the routed up projection once between ``cudaProfilerStart`` / ``Stop`` for Nsight Compute:
cuBLAS ``x @ w.T``, the CuTe routed ``gemm_mn`` and SwiGLU at the given skip ratio, and the dense fused CuTe SwiGLU
(Llama-3.1-8B up projection, 4096 -> 14336, bf16, Bernoulli masks).

    ncu --clock-control none --profile-from-start off --section SpeedOfLight --section WarpStateStats \\
        --section SchedulerStats --section MemoryWorkloadAnalysis \\
        python3 benchmarks/kernels/ncu_gemm_mn.py --M 4096 --G 512 --sparsity 0 0.5

Without ncu it only runs the kernels (a smoke test).
"""

import argparse

import torch

from wide.bench._args import int_at_least, sparsity_list
from wide.cli.common import WideArgumentParser
from wide.kernels import gemm_mn, reorder, swiglu
from wide.kernels.sm90 import dense_swiglu


def main() -> None:
    p = WideArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--M", type=int_at_least(1), default=4096)
    p.add_argument("--K", type=int_at_least(64), default=4096)
    p.add_argument("--N", type=int_at_least(128), default=14336)
    p.add_argument("--G", type=int_at_least(128), default=512, help="FFN group size, a multiple of 128 dividing N")
    p.add_argument("--sparsity", type=sparsity_list, nargs="+", default=[[0.0], [0.5]],
                   help="skip ratios in [0, 1), space- or comma-separated")
    a = p.parse_args()
    a.sparsity = [s for group in a.sparsity for s in group]
    if a.G % 128 or a.N % a.G or a.K % 64:
        p.error(f"--G {a.G}, --N {a.N}, --K {a.K}: G must be a multiple of 128 dividing N, K a multiple of 64")
    if not torch.cuda.is_available():
        p.exit(2, f"{p.prog}: needs a CUDA GPU (sm_90 for the CuTe kernels)\n")
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(a.M, a.K, device="cuda", dtype=torch.bfloat16, generator=gen)
    w, w2 = (torch.randn(a.N, a.K, device="cuda", dtype=torch.bfloat16, generator=gen) / a.K**0.5 for _ in range(2))
    runs = [("cublas", lambda: x @ w.T), ("dense_swiglu", lambda: dense_swiglu(x, w, w2))]
    for s in a.sparsity:
        route = torch.rand((a.M, a.N // a.G), generator=gen, device="cuda") < 1.0 - s
        r = reorder(route)
        runs += [(f"gemm_mn s={s}", lambda route=route, r=r: gemm_mn(x, w, route, a.G, reordered=r)),
                 (f"swiglu s={s}", lambda route=route, r=r: swiglu(x, w, w2, route, a.G, reordered=r))]
    for _, fn in runs:  # warm-up: builds, autotuning, first launches
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    for name, fn in runs:
        torch.cuda.profiler.start()
        fn()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
        print("profiled", name, flush=True)


if __name__ == "__main__":
    main()
