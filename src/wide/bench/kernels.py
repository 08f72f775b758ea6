"""Benchmark of the routed kernels against dense baselines on one GPU (issue 3).

Baselines run in the same process: cuBLAS (``x @ w.T``) for the GEMMs and SDPA's flash backend
for attention.  Every timing is the median over CUDA-graph replays, after warm-up (which also
runs the autotuner outside capture); when one input set is smaller than ~3x the L2 cache, the graph
rotates over several input sets and the time is divided by their number.  Masks are
Bernoulli(1 - s) per token and group.  The reorder cost is measured separately and added once
per routing decision, spread over the ops sharing it (3: Q / attention / O, or gate / up / down;
the fused SwiGLU stands for two of them).

Run:  ``PYTHONPATH=src python3 -m wide.bench.kernels [--quick] [--out-dir benchmarks/kernels]``
Outputs in ``--out-dir``: ``kernels_<tag>.json`` (list of records), ``kernels_<tag>.md`` (table)
and ``kernels_<tag>.png`` (speedup against M per sparsity with the ideal 1/(1-s)).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import statistics
import sys
import time
import zlib

from wide.bench._args import choice_list, float_above, group_list, int_at_least, int_list, report_only, sparsity_list

OPS = ("gemm_mn", "gemm_k", "swiglu", "attention_prefill", "attention_decode")
LLAMA = dict(hidden=4096, ffn=14336, hq=32, hk=8, d=128)


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the benchmark's options to ``parser`` (used by ``wide bench kernels``)."""
    parser.add_argument("--quick", action="store_true", help="small subset (a few minutes)")
    parser.add_argument("--ops", default=",".join(OPS), type=choice_list(*OPS),
                        help=f"comma-separated ops from {', '.join(OPS)} (default: all)")
    parser.add_argument("--M", default="1,2,4,16,64,256,1024,4096,16384", type=int_list(1),
                        help="row counts (default: 1,2,4,16,64,256,1024,4096,16384)")
    parser.add_argument("--G", default="32,64,128,256,512", type=group_list,
                        help="FFN group sizes (default: 32,64,128,256,512)")
    parser.add_argument("--sparsity", default="0,0.25,0.5,0.75", type=sparsity_list,
                        help="skip ratios s in [0, 1) (default: 0,0.25,0.5,0.75)")
    parser.add_argument("--T", default="1024,4096,16384", type=int_list(1),
                        help="attention lengths (default: 1024,4096,16384)")
    parser.add_argument("--decode-batch", default=16, type=int_at_least(1),
                        help="batch B of the decode-attention points (default: 16)")
    parser.add_argument("--tokens", default=16384, type=int_at_least(1),
                        help="B*T of the prefill-attention points: B = tokens / T sequences of T (default: 16384)")
    parser.add_argument("--out-dir", default="benchmarks/kernels", help="where results go (default: benchmarks/kernels)")
    parser.add_argument("--tag", default="h200", help="result file stem kernels_<tag> (default: h200)")
    parser.add_argument("--time-budget", default=520.0, type=float_above(0),
                        help="seconds; the sweep stops (keeping what it measured) past this")
    parser.add_argument("--report-only", action="store_true", help="only rebuild table and plot from the JSON")
    return parser


# ----------------------------------------------------------------------------------------------
# timing
# ----------------------------------------------------------------------------------------------


def _graph_time_ms(fns, target_ms=30.0):
    """Median time of one call, from CUDA-graph replays of ``fns`` (one call per input set)."""
    import torch

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            for f in fns:
                f()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fns:
            f()
    g.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    g.replay()
    torch.cuda.synchronize()
    one = max((time.perf_counter() - t0) * 1e3, 1e-3)
    n = int(min(200, max(7, target_ms / one)))
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
    for a, b in ev:
        a.record()
        g.replay()
        b.record()
    torch.cuda.synchronize()
    times = [a.elapsed_time(b) for a, b in ev]
    del g
    return statistics.median(times) / len(fns)


def _rel(out, ref):
    o = out.float()
    r = ref.float()
    if not bool(torch_isfinite_all(o)):
        return float("nan")
    nr = r.norm().item()
    return (o - r).norm().item() / nr if nr > 0 else (o.abs().max().item())


def torch_isfinite_all(t):
    import torch

    return torch.isfinite(t).all().item()


def _n_sets(bytes_per_set, l2_bytes):
    return int(min(8, max(1, math.ceil(3 * l2_bytes / max(bytes_per_set, 1)))))


def _peak_extra_mb(fn):
    """Peak device memory allocated by one call beyond what was allocated before it (MiB)."""
    import torch

    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return peak / 2**20


# ----------------------------------------------------------------------------------------------
# benchmark cases
# ----------------------------------------------------------------------------------------------


class _Ctx:
    def __init__(self, args):
        import torch

        self.args = args
        self.gpu = torch.cuda.get_device_name()
        props = torch.cuda.get_device_properties(0)
        self.l2 = getattr(props, "L2_cache_size", 50 * 2**20) or 50 * 2**20
        self.date = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
        self.command = " ".join([os.path.basename(sys.executable), "-m", "wide.bench.kernels"] + sys.argv[1:])
        self.records = []
        self.dense_cache = {}
        self.reorder_cache = {}
        self.t_start = time.time()
        self.out_json = None

    def over_budget(self):
        return time.time() - self.t_start > self.args.time_budget

    def add(self, rec):
        rec.update(gpu=self.gpu, date=self.date, command=self.command)
        if rec.get("wide_ms"):
            rec["speedup"] = rec["dense_ms"] / rec["wide_ms"]
        s = rec.get("sparsity", 0.0)
        rec["ideal"] = 1.0 / (1.0 - s) if s < 1 else None
        if rec.get("speedup") and rec["ideal"]:
            rec["fraction_of_ideal"] = rec["speedup"] / rec["ideal"]
        self.records.append(rec)
        print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in rec.items()
                       if k not in ("gpu", "date", "command")), flush=True)
        if self.out_json:
            with open(self.out_json, "w") as f:
                json.dump(self.records, f, indent=1)


def _mask(torch, shape, s, gen):
    return torch.rand(shape, generator=gen, device="cuda") < (1.0 - s)


def _reorder_ms(ctx, shape, s, n_sets):
    import torch

    from wide.kernels import reorder

    key = (shape, s)
    if key not in ctx.reorder_cache:
        gen = torch.Generator(device="cuda").manual_seed(7)
        masks = [_mask(torch, shape, s, gen) for _ in range(n_sets)]
        ctx.reorder_cache[key] = _graph_time_ms([lambda m=m: reorder(m) for m in masks])
    return ctx.reorder_cache[key]


def bench_gemm(ctx, op, M, G, s):
    """Time ``op`` (``"gemm_mn"``, ``"swiglu"`` or ``"gemm_k"``) on Llama-3.1-8B shapes with ``M`` rows, group
    size ``G`` and a Bernoulli(1 - ``s``) route against cuBLAS in the same process (CUDA-graph replay, median,
    ms; the reorder's time shared over the ops of one routing decision), check it against the fp32 reference up
    to 4096 rows (``rel_err``), and add one record (``op``, ``M``, ``N``, ``K``, ``G``, ``sparsity``, ``dense_ms``, ``wide_ms``, ``speedup``) to
    ``ctx``."""
    import torch
    import torch.nn.functional as F

    from wide.kernels import gemm_k, gemm_mn, reorder, swiglu

    D, Fd = LLAMA["hidden"], LLAMA["ffn"]
    if op == "gemm_k":
        N, K = D, Fd
        NG = K // G
    else:
        N, K = Fd, D
        NG = N // G
    nw = 2 if op == "swiglu" else 1
    if op == "gemm_k":
        from wide.kernels.gemm_k import uses_reorder as uses_k

        def uses_reorder(M):
            return uses_k(M, G)
    else:
        from wide.kernels.gemm_mn import uses_reorder
    bytes_set = 2 * (M * K + nw * N * K + M * N)
    R = _n_sets(bytes_set, ctx.l2)
    gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(repr((op, M, G, s)).encode()))
    sets = []
    for _ in range(R):
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=gen)
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
        w2 = torch.randn(N, K, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02 if nw == 2 else None
        route = _mask(torch, (M, NG), s, gen)
        r = reorder(route) if (uses_reorder(M) or (op == "gemm_k" and M >= 512)) else None  # forced sparse path
        sets.append(dict(x=x, w=w, w2=w2, route=route, r=r, o=torch.empty(M, N, device="cuda", dtype=torch.bfloat16),
                         t1=torch.empty(M, N, device="cuda", dtype=torch.bfloat16),
                         t2=torch.empty(M, N, device="cuda", dtype=torch.bfloat16)))

    def dense(st):
        if op == "swiglu":
            torch.matmul(st["x"], st["w"].t(), out=st["t1"])
            torch.matmul(st["x"], st["w2"].t(), out=st["t2"])
            torch.mul(F.silu(st["t1"]), st["t2"], out=st["o"])
        else:
            torch.matmul(st["x"], st["w"].t(), out=st["o"])

    def wide(st):
        if op == "gemm_mn":
            gemm_mn(st["x"], st["w"], st["route"], G, reordered=st["r"], out=st["o"])
        elif op == "gemm_k":
            gemm_k(st["x"], st["w"], st["route"], G, reordered=st["r"], out=st["o"])
        else:
            swiglu(st["x"], st["w"], st["w2"], st["route"], G, reordered=st["r"], out=st["o"])

    def unfused(st):
        gemm_mn(st["x"], st["w"], st["route"], G, reordered=st["r"], out=st["t1"])
        gemm_mn(st["x"], st["w2"], st["route"], G, reordered=st["r"], out=st["t2"])
        torch.mul(F.silu(st["t1"]), st["t2"], out=st["o"])

    dkey = (op, M)
    if dkey not in ctx.dense_cache:
        ctx.dense_cache[dkey] = _graph_time_ms([lambda st=st: dense(st) for st in sets])
    dense_ms = ctx.dense_cache[dkey]
    op_ms = _graph_time_ms([lambda st=st: wide(st) for st in sets])
    share = 2.0 / 3.0 if op == "swiglu" else 1.0 / 3.0
    re_ms = _reorder_ms(ctx, (M, NG), s, R) if (M > 4 and uses_reorder(M)) else 0.0
    rec = dict(op=op, M=M, N=N, K=K, G=G, sparsity=s, dense_ms=dense_ms, wide_ms=op_ms + share * re_ms,
               kernel_ms=op_ms, reorder_ms=re_ms, reorder_share=share, n_input_sets=R,
               # realized fraction of the weight that must be read: groups some row executes (the union over the
               # rows; at M = 1 one draw of N_G Bernoulli(1 - s) flags, which at G = 512 (28 groups) can stray
               # far from 1 - s), averaged over the input sets
               active=sum(float(st["route"].any(dim=0).float().mean()) for st in sets) / len(sets))
    if op == "gemm_k" and M >= 512:
        # each path forced (the reorder share is charged to the sparse path only: the others read no reorder)
        sparse_re = _reorder_ms(ctx, (M, NG), s, R)
        for path in ("sparse", "dense", "masked"):
            rec[f"{path}_path_ms"] = _graph_time_ms([
                lambda st=st, path=path: gemm_k(st["x"], st["w"], st["route"], G, reordered=st["r"], out=st["o"],
                                                path=path) for st in sets]) + (share * sparse_re if path == "sparse"
                                                                               else 0.0)
        # the masked path's select alone (all rows at once), for the two-numbers split of its time
        from wide.kernels.gemm_k import mask_select
        from wide.kernels.reference import gemm_k_ref as ref_gemm_k

        sel = torch.empty(M, K, device="cuda", dtype=torch.bfloat16)
        rec["select_ms"] = _graph_time_ms([lambda st=st: mask_select(st["x"], st["route"], G, sel) for st in sets])
        del sel
        # the masked path in place (overwrite_a=True: the inactive groups of a zeroed where they are, no copy), on
        # clones of the inputs, so the other timings above saw the random a (and dense_ms was timed before)
        xs = [st["x"].clone() for st in sets]
        rec["inplace_path_ms"] = _graph_time_ms([
            lambda st=st, x=x: gemm_k(x, st["w"], st["route"], G, out=st["o"], path="masked", overwrite_a=True)
            for st, x in zip(sets, xs)])
        rec["inplace_speedup"] = dense_ms / rec["inplace_path_ms"]
        rec["inplace_select_ms"] = _graph_time_ms([lambda st=st, x=x: mask_select(x, st["route"], G, x)
                                                   for st, x in zip(sets, xs)])
        st, x = sets[0], xs[0]
        o = st["o"]
        rec["inplace_rel_err"] = _rel(gemm_k(x, st["w"], st["route"], G, out=o, overwrite_a=True),
                                      ref_gemm_k(st["x"].float(), st["w"].float(), st["route"], G))
        if G == 128 and s in (0.0, 0.5):
            rec["inplace_peak_extra_mib"] = _peak_extra_mb(
                lambda: gemm_k(x, st["w"], st["route"], G, overwrite_a=True))
        del xs, x
    if op == "swiglu":
        rec["unfused_routed_ms"] = _graph_time_ms([lambda st=st: unfused(st) for st in sets]) + share * re_ms
    if M <= 4096:  # correctness of the tuned config at the real shape (fp32 reference)
        from wide.kernels import reference as ref_mod

        st = sets[0]
        wide(st)
        xf, wf = st["x"].float(), st["w"].float()
        if op == "gemm_mn":
            ref = ref_mod.gemm_mn_ref(xf, wf, st["route"], G)
        elif op == "gemm_k":
            ref = ref_mod.gemm_k_ref(xf, wf, st["route"], G)
        else:
            ref = ref_mod.swiglu_ref(xf, wf, st["w2"].float(), st["route"], G)
        rec["rel_err"] = _rel(st["o"], ref)
        del ref
    if M >= 1024 and G == 128 and s in (0.0, 0.5):
        st = sets[0]
        if op == "swiglu":
            rec["dense_peak_extra_mib"] = _peak_extra_mb(
                lambda: F.silu(st["x"] @ st["w"].t()) * (st["x"] @ st["w2"].t()))
            rec["wide_peak_extra_mib"] = _peak_extra_mb(lambda: swiglu(st["x"], st["w"], st["w2"], st["route"], G))
        else:
            fn = gemm_mn if op == "gemm_mn" else gemm_k
            rec["dense_peak_extra_mib"] = _peak_extra_mb(lambda: st["x"] @ st["w"].t())
            rec["wide_peak_extra_mib"] = _peak_extra_mb(lambda: fn(st["x"], st["w"], st["route"], G))
    ctx.add(rec)
    del sets
    torch.cuda.empty_cache()


def _sdpa(torch, q, k, v, causal, gqa):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        if gqa:
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)


def bench_attention(ctx, T, s, decode=False):
    """Time routed prefill attention over ``T`` tokens (or, with ``decode``, split-KV decode attention over a
    ``T``-key cache) with head-group routes of sparsity ``s`` against SDPA's flash backend in the same process
    (CUDA-graph replay, median, ms), check it against the fp32 reference where that fits in memory
    (``rel_err``), and add one record (``op`` = ``attention_prefill`` / ``attention_decode``) to ``ctx``."""
    import torch

    from wide.kernels import reorder, routed_attention

    Hq, Hk, d = LLAMA["hq"], LLAMA["hk"], LLAMA["d"]
    G = Hq // Hk * d
    if decode:
        B, Tq, Tk = ctx.args.decode_batch, 1, T
    else:
        B = max(1, ctx.args.tokens // T)
        Tq = Tk = T
    gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(repr((T, s, decode)).encode()))
    q = torch.randn(B, Hq, Tq, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(B, Hk, Tk, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn(B, Hk, Tk, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    route = _mask(torch, (B, Tq, Hk), s, gen)
    r = reorder(route) if not decode else None
    out = torch.empty_like(q)
    causal = not decode
    try:
        _sdpa(torch, q, k, v, causal, True)
        gqa = True
        kd, vd = k, v
    except Exception:
        gqa = False
        kd, vd = k.repeat_interleave(Hq // Hk, 1), v.repeat_interleave(Hq // Hk, 1)
    dense_ms = _graph_time_ms([lambda: _sdpa(torch, q, kd, vd, causal, gqa)])
    op_ms = _graph_time_ms([lambda: routed_attention(q, k, v, route, causal, reordered=r, out=out)])
    re_ms = 0.0 if decode else _reorder_ms(ctx, (B, Tq, Hk), s, 1)
    rec = dict(op="attention_decode" if decode else "attention_prefill", M=B * Tq, N=Hq * d, K=d, G=G, B=B, T=T,
               Tq=Tq, Tk=Tk, causal=causal, sparsity=s, dense_ms=dense_ms, wide_ms=op_ms + re_ms / 3.0,
               kernel_ms=op_ms, reorder_ms=re_ms, reorder_share=1.0 / 3.0, sdpa_gqa=gqa)
    if decode or B * Hq * Tq * Tk <= 2**29:
        from wide.kernels.reference import attention_ref

        routed_attention(q, k, v, route, causal, reordered=r, out=out)
        rec["rel_err"] = _rel(out, attention_ref(q.float(), k.float(), v.float(), route, causal))
    rec["active"] = float(route.float().mean())  # realized: B * Tq * N_G Bernoulli(1 - s) draws
    if decode:
        from wide.kernels import decode_attention

        ones = torch.ones_like(route)
        rec["dense_own_ms"] = _graph_time_ms([lambda: routed_attention(q, k, v, ones, False, out=out)])
        rec["speedup_vs_own_dense"] = rec["dense_own_ms"] / op_ms
        # the fixed split count per head pack (wave=1), in the same run: what the default split rule gains
        rec["fixed_split_ms"] = _graph_time_ms([lambda: decode_attention(q, k, v, route, out=out, wave=1)])
    ctx.add(rec)
    torch.cuda.empty_cache()


# ----------------------------------------------------------------------------------------------
# report
# ----------------------------------------------------------------------------------------------


def write_report(records, out_dir, tag):
    """Markdown table and PNG plot (speedup vs M per sparsity, ideal 1/(1-s) dashed)."""
    md = [f"# Routed kernels vs dense ({tag})", "",
          "| op | M | B x T | N | K | G | s | dense ms | wide ms | speedup | ideal | of ideal | active |",
          "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in sorted(records, key=lambda r: (r["op"], r["G"], r["sparsity"], r["M"], r.get("T", 0))):
        bt = f"{r['B']} x {r['T']}" if "B" in r and "T" in r else "-"  # attention: batch x sequence length
        md.append(f"| {r['op']} | {r['M']} | {bt} | {r['N']} | {r['K']} | {r['G']} | {r['sparsity']:.2f} | "
                  f"{r['dense_ms']:.4f} | {r['wide_ms']:.4f} | {r['speedup']:.3f} | {r['ideal']:.2f} | "
                  f"{r.get('fraction_of_ideal', float('nan')):.2f} | "
                  f"{format(r['active'], '.3f') if 'active' in r else '-'} |")
    ks = sorted((r for r in records if "inplace_path_ms" in r), key=lambda r: (r["G"], r["sparsity"], r["M"]))
    if ks:  # gemm_k's masked path with a scratch copy of a and in place (overwrite_a=True), from 512 rows
        md += ["", "gemm_k masked path: scratch copy (`masked_path_ms`, select into the copy `select_ms`) against in "
               "place (`overwrite_a=True`: `inplace_path_ms`, the zeroing alone `inplace_select_ms`); speedups vs "
               "dense; peak = extra device memory of one call (MiB, G = 128, s = 0 / 0.5)", "",
               "| M | G | s | dense ms | masked ms | select ms | in place ms | in-place select ms | masked speedup | "
               "in-place speedup | peak dense | peak masked | peak in place |",
               "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        fmt = lambda r, k, spec=".1f": format(r[k], spec) if k in r else "-"  # noqa: E731
        for r in ks:
            md.append(f"| {r['M']} | {r['G']} | {r['sparsity']:.2f} | {r['dense_ms']:.4f} | "
                      f"{fmt(r, 'masked_path_ms', '.4f')} | {fmt(r, 'select_ms', '.4f')} | {r['inplace_path_ms']:.4f} | "
                      f"{fmt(r, 'inplace_select_ms', '.4f')} | {r['dense_ms'] / r['masked_path_ms']:.3f} | "
                      f"{r['inplace_speedup']:.3f} | {fmt(r, 'dense_peak_extra_mib')} | {fmt(r, 'wide_peak_extra_mib')} | "
                      f"{fmt(r, 'inplace_peak_extra_mib')} |")
    with open(os.path.join(out_dir, f"kernels_{tag}.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:
        print("matplotlib missing: no plot", file=sys.stderr)
        return
    ops = [o for o in OPS if any(r["op"] == o for r in records)]
    if not ops:
        return
    fig, axes = plt.subplots(1, len(ops), figsize=(4.2 * len(ops), 3.8), squeeze=False)
    colors = {0.0: "tab:gray", 0.25: "tab:blue", 0.5: "tab:green", 0.75: "tab:red"}
    for ax, op in zip(axes[0], ops):
        rs = [r for r in records if r["op"] == op]
        if op.startswith("gemm") or op == "swiglu":
            gsel = 128 if any(r["G"] == 128 for r in rs) else rs[0]["G"]
            rs = [r for r in rs if r["G"] == gsel]
            title = f"{op} (G={gsel})"
            xkey = "M"
        else:
            title = op
            xkey = "T"
        for s in sorted({r["sparsity"] for r in rs}):
            pts = sorted((r[xkey], r["speedup"]) for r in rs if r["sparsity"] == s)
            c = colors.get(s, None)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=c, label=f"s={s:g}")
            ax.axhline(1.0 / (1.0 - s), color=c, ls="--", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel(xkey)
        ax.set_ylabel("speedup vs dense")
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, f"kernels_{tag}.png"), dpi=110)


def run(args) -> int:
    """Run the sweep described by ``args`` (see :func:`add_arguments`); returns an exit code."""
    out_json = os.path.join(args.out_dir, f"kernels_{args.tag}.json")
    if args.report_only:
        return report_only(out_json, write_report, args.out_dir, args.tag)
    os.makedirs(args.out_dir, exist_ok=True)
    import torch

    if not torch.cuda.is_available():
        print("wide bench kernels needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    ctx = _Ctx(args)
    ctx.out_json = out_json
    ops = list(args.ops)
    Ms, Gs, Ss, Ts = args.M, args.G, args.sparsity, args.T
    if args.quick:
        Ms, Gs, Ss, Ts = [1, 4, 64, 4096], [128], [0.0, 0.5], [4096]
    # goal points first, then the rest of the grid (the sweep stops at --time-budget)
    gemm_points = []
    for G in Gs:
        for s in Ss:
            for M in Ms:
                gemm_points.append((0 if (G in (128, 512) and s in (0.0, 0.5)) else 1, G, s, M))
    gemm_points.sort(key=lambda p: (p[0], p[1] != 128, p[1], p[2], p[3]))
    for T in Ts:
        for s in Ss:
            if "attention_prefill" in ops:
                bench_attention(ctx, T, s, decode=False)
            if "attention_decode" in ops:
                bench_attention(ctx, T, s, decode=True)
    for _, G, s, M in gemm_points:
        for op in ("gemm_mn", "gemm_k", "swiglu"):
            if op not in ops:
                continue
            if ctx.over_budget():
                print(f"time budget reached: skipping {op} M={M} G={G} s={s}", flush=True)
                continue
            try:
                bench_gemm(ctx, op, M, G, s)
            except Exception as e:  # keep the sweep going; the error is reported
                print(f"FAILED {op} M={M} G={G} s={s}: {type(e).__name__}: {e}", flush=True)
    write_report(ctx.records, args.out_dir, args.tag)
    print(f"wrote {len(ctx.records)} records to {out_json} in {time.time() - ctx.t_start:.0f} s")
    return 0


def main(argv=None) -> int:
    p = add_arguments(argparse.ArgumentParser(prog="python -m wide.bench.kernels", description=__doc__.split("\n")[0]))
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
