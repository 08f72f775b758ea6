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

from wide.kernels import gemm_mn, reorder, swiglu
from wide.kernels.sm90 import dense_swiglu


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--M", type=int, default=4096)
    p.add_argument("--K", type=int, default=4096)
    p.add_argument("--N", type=int, default=14336)
    p.add_argument("--G", type=int, default=512)
    p.add_argument("--sparsity", type=float, nargs="+", default=[0.0, 0.5])
    a = p.parse_args()
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
