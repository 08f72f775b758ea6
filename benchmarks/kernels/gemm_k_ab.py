"""Interleaved A/B of ``gemm_k``'s masked path against cuBLAS at the Llama-3.1-8B down shape (N = 4096, K = 14336).

The grid in ``wide.bench.kernels`` times the dense GEMM once per M and reuses it for every (G, s) point, so a
point timed minutes later (the card warmer, its clock lower) is compared with an earlier dense time; two timings
of one function there differ by 5-10 %.  This probe times, per (M, G, s), ``rounds`` rounds of

* ``dense``: cuBLAS ``x @ w.T`` on the random ``a``,
* ``auto``: ``gemm_k`` as users call it (``path="auto"``: from 512 rows the masked path, below it the autotuned
  choice of the split-K kernel, the dense-order kernel and the masked path),
* ``masked``: ``gemm_k(path="masked")`` (the inactive groups selected into a scratch copy, then cuBLAS),
* ``inplace``: ``gemm_k(overwrite_a=True)`` (auto; the masked path zeroes ``a`` in place, no copy; on a clone of
  ``a``),

back to back (each a CUDA-graph replay median over several input sets), and reports the median over the rounds
of each op's time and of the per-round ratios dense / op.  ``same`` re-times ``dense`` within each round: the
spread of dense / dense is the noise floor of the ratios.

GPU (~60 s for the default grid on an H200)::

    PYTHONPATH=src python3 benchmarks/kernels/gemm_k_ab.py --out $OUT/ab

writes ``$OUT/ab/gemm_k_ab.json`` and ``.md``.  Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import zlib


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="output folder (created)")
    p.add_argument("--M", default="1024,4096,16384", help="comma-separated row counts")
    p.add_argument("--G", default="64,128,512", help="comma-separated group sizes (dividing 14336)")
    p.add_argument("--sparsity", default="0,0.5", help="comma-separated sparsities s in [0, 1)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds per point (median)")
    p.add_argument("--budget", type=float, default=240.0, help="seconds after which pending points are skipped")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    import torch

    if not torch.cuda.is_available():
        print("gemm_k_ab.py needs a CUDA GPU", file=sys.stderr)
        return 2
    from wide.bench.kernels import LLAMA, _graph_time_ms, _n_sets, _rel
    from wide.kernels import gemm_k
    from wide.kernels.reference import gemm_k_ref

    os.makedirs(args.out, exist_ok=True)
    N, K = LLAMA["hidden"], LLAMA["ffn"]
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    rows, t0 = [], time.time()
    points = [(M, G, s) for M in map(int, args.M.split(",")) for G in map(int, args.G.split(","))
              for s in map(float, args.sparsity.split(","))]
    for M, G, s in points:
        if time.time() - t0 > args.budget:
            print(f"[ab] budget spent: skipped M={M} G={G} s={s}", flush=True)
            continue
        gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(repr(("gemm_k_ab", M, G, s)).encode()))
        R = _n_sets(2 * (M * K + N * K + M * N), l2)
        sets = []
        for _ in range(R):
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=gen)
            sets.append(dict(x=x, xi=x.clone(), w=torch.randn(N, K, device="cuda", dtype=torch.bfloat16,
                                                              generator=gen) * 0.02,
                             route=torch.rand(M, K // G, generator=gen, device="cuda") < (1.0 - s),
                             o=torch.empty(M, N, device="cuda", dtype=torch.bfloat16)))
        ops = {
            "dense": [lambda st=st: torch.matmul(st["x"], st["w"].t(), out=st["o"]) for st in sets],
            "auto": [lambda st=st: gemm_k(st["x"], st["w"], st["route"], G, out=st["o"]) for st in sets],
            "masked": [lambda st=st: gemm_k(st["x"], st["w"], st["route"], G, out=st["o"], path="masked")
                       for st in sets],
            "inplace": [lambda st=st: gemm_k(st["xi"], st["w"], st["route"], G, out=st["o"], overwrite_a=True)
                        for st in sets],
        }
        times = {k: [] for k in ("dense", "auto", "masked", "inplace", "same")}
        for _ in range(args.rounds):
            for k in ("dense", "auto", "masked", "inplace"):
                times[k].append(_graph_time_ms(ops[k]))
            times["same"].append(_graph_time_ms(ops["dense"]))
        st = sets[0]
        err = _rel(gemm_k(st["xi"], st["w"], st["route"], G, overwrite_a=True),
                   gemm_k_ref(st["x"].float(), st["w"].float(), st["route"], G))
        ratio = {k: statistics.median(d / t for d, t in zip(times["dense"], times[k]))
                 for k in ("auto", "masked", "inplace", "same")}
        row = dict(op="gemm_k", M=M, N=N, K=K, G=G, sparsity=s, rounds=args.rounds, n_input_sets=R,
                   dense_ms=statistics.median(times["dense"]), auto_ms=statistics.median(times["auto"]),
                   auto_speedup=ratio["auto"], masked_ms=statistics.median(times["masked"]),
                   inplace_ms=statistics.median(times["inplace"]), masked_speedup=ratio["masked"],
                   inplace_speedup=ratio["inplace"], dense_over_dense=ratio["same"],
                   dense_over_dense_range=[min(d / t for d, t in zip(times["dense"], times["same"])),
                                           max(d / t for d, t in zip(times["dense"], times["same"]))],
                   times_ms=times, inplace_rel_err=err, gpu=torch.cuda.get_device_name(0),
                   date=time.strftime("%Y-%m-%d"), command="python3 " + " ".join(sys.argv))
        rows.append(row)
        print(f"[ab] M={M} G={G} s={s}: dense {row['dense_ms']:.4f} ms, auto x{ratio['auto']:.3f}, "
              f"masked x{ratio['masked']:.3f}, "
              f"in place x{ratio['inplace']:.3f}, dense/dense x{ratio['same']:.3f}, rel err {err:.1e}", flush=True)
        del sets, ops
        torch.cuda.empty_cache()
    with open(os.path.join(args.out, "gemm_k_ab.json"), "w") as f:
        json.dump(rows, f, indent=1)
    md = ["# gemm_k masked path, interleaved A/B against cuBLAS (down shape)", "",
          f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}; per point {args.rounds} rounds of dense, "
          "auto (gemm_k as called by default), masked (path='masked', scratch copy), in place (overwrite_a=True), "
          "dense again; ratios = median over rounds of dense / op; `dense/dense` = the same cuBLAS call timed twice "
          "per round (noise floor).", "",
          "| M | G | s | dense ms | auto ms | masked ms | in place ms | auto x | masked x | in place x | "
          "dense/dense x (range) |",
          "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        lo, hi = r["dense_over_dense_range"]
        md.append(f"| {r['M']} | {r['G']} | {r['sparsity']:.2f} | {r['dense_ms']:.4f} | {r['auto_ms']:.4f} | "
                  f"{r['masked_ms']:.4f} | {r['inplace_ms']:.4f} | {r['auto_speedup']:.3f} | "
                  f"{r['masked_speedup']:.3f} | {r['inplace_speedup']:.3f} | "
                  f"{r['dense_over_dense']:.3f} ({lo:.3f}-{hi:.3f}) |")
    with open(os.path.join(args.out, "gemm_k_ab.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
