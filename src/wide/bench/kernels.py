"""``wide bench kernels``: the routed kernels against their dense baselines on one GPU (Llama-3.1-8B shapes, bf16).

Per op, shape, group size G and sparsity s (Bernoulli(1 - s) routes per token and group): ``dense_ms`` of the
baseline and ``wide_ms`` of the routed op, timed in the same process as the median of
``triton.testing.do_bench_cudagraph`` (over several input sets where one set fits in L2); the reorder's time is added
once per routing decision, shared by its three ops (the fused SwiGLU counts for two).  Baselines: cuBLAS ``x @ w.T``
(``torch.matmul``) for gemm_mn / gemm_k; for the SwiGLU the faster of one cuBLAS GEMM on the stacked
``[W_gate; W_up]`` plus ``silu(a) * b`` and, on sm_90, the dense fused CuTe SwiGLU (both in
``baseline_candidates_ms``; ``backend`` names the kernel backend of the routed op); for attention the fastest SDPA
backend timed here (every backend that runs: ``baseline_candidates_ms``);
for ``o_proj`` / ``down_proj`` cuBLAS on the zero-filled input against the best routed path (:func:`bench_kaxis`).

Run: ``wide bench kernels [--quick] [--out-dir benchmarks/kernels]``; writes ``kernels_<tag>.json`` (records),
``kernels_<tag>.md`` (table) and ``kernels_<tag>.png`` (speedup against M or T per sparsity, ideal 1/(1-s) dashed).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import zlib

from wide.bench._args import (
    choice_list,
    file_stem,
    float_above,
    gpu_tag,
    group_list,
    int_at_least,
    int_list,
    provenance,
    report_only,
    sparsity_list,
)

OPS = ("gemm_mn", "gemm_k", "swiglu", "attention_prefill", "attention_decode", "o_proj", "down_proj")
LLAMA = dict(hidden=4096, ffn=14336, hq=32, hk=8, d=128)
UNIT = "s: Bernoulli probability that a (token, group) is skipped = expected fraction of the op's compute skipped"
GEMM_BASELINE = {"gemm_mn": "cuBLAS x @ w.T (torch.matmul)", "gemm_k": "cuBLAS x @ w.T (torch.matmul)",
                 "swiglu": "cuBLAS GEMM on the stacked [W_gate; W_up] (torch.matmul) + silu(a) * b"}
FUSED_SWIGLU = "dense fused SwiGLU, CuTe sm_90a (wide.kernels.sm90.dense_swiglu)"


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
    parser.add_argument("--out-dir", default="benchmarks/kernels", help="results folder (default: benchmarks/kernels)")
    parser.add_argument("--tag", type=file_stem,
                        help="result file stem kernels_<tag> (default: the GPU's model, e.g. h200 or h100; h200 with "
                             "--report-only)")
    parser.add_argument("--time-budget", default=520.0, type=float_above(0),
                        help="seconds; the sweep stops (keeping what it measured) past this (default: 520)")
    parser.add_argument("--report-only", action="store_true", help="only rebuild table and plot from the JSON")
    return parser


def time_ms(fns) -> float:
    """Median milliseconds of one call, from ``do_bench_cudagraph`` of ``fns`` (one call per input set) in turn; each
    runs once first (compiles and tunes the kernels outside the graph)."""
    import torch
    from triton.testing import do_bench_cudagraph

    for f in fns:
        f()
    torch.cuda.synchronize()
    return do_bench_cudagraph(lambda: [f() for f in fns], rep=30, return_mode="median") / len(fns)


def rel_err(out, ref) -> float:
    """Relative error ||out - ref|| / ||ref|| in float32 (the largest |out| where ref is all zero)."""
    nr = ref.float().norm().item()
    return (out.float() - ref.float()).norm().item() / nr if nr > 0 else out.float().abs().max().item()


class _Run:
    """The records of one sweep and what every record carries."""

    def __init__(self, args):
        import torch
        import triton

        self.args, self.t0, self.records, self.dense, self.reorders = args, time.time(), [], {}, {}
        self.l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 0) or 50 * 2**20
        self.out_json = os.path.join(args.out_dir, f"kernels_{args.tag}.json")
        self.meta = dict(unit=UNIT, gpu=torch.cuda.get_device_name(), **provenance("kernels", args),
                         backend=f"triton {triton.__version__}, torch {torch.__version__}, CUDA {torch.version.cuda}")

    def over_budget(self) -> bool:
        return time.time() - self.t0 > self.args.time_budget

    def add(self, rec: dict) -> None:
        rec.update(speedup=rec["dense_ms"] / rec["wide_ms"], ideal=1.0 / (1.0 - rec["sparsity"]),
                   **{k: v for k, v in self.meta.items() if k not in rec})  # a record's own backend stays
        self.records.append(rec)
        print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in rec.items()
                       if k not in self.meta and not isinstance(v, dict)), flush=True)
        with open(self.out_json, "w") as f:
            json.dump(self.records, f, indent=1)

    def reorder_ms(self, masks, s: float) -> float:
        from wide.kernels import reorder

        key = (tuple(masks[0].shape), s)
        if key not in self.reorders:
            self.reorders[key] = time_ms([lambda m=m: reorder(m) for m in masks])
        return self.reorders[key]


def bench_gemm(run: _Run, op: str, M: int, G: int, s: float) -> None:
    """One record of ``op`` (gemm_mn, swiglu or gemm_k) with M rows, group size G and sparsity s against its baseline
    (``rel_err`` against the fp32 reference up to 4096 rows)."""
    import torch
    import torch.nn.functional as F

    from wide.kernels import gemm_k, gemm_mn, reference, reorder, sm90, swiglu
    from wide.kernels.gemm_mn import LAST_BACKEND, uses_reorder

    D, Fd = LLAMA["hidden"], LLAMA["ffn"]
    N, K = (D, Fd) if op == "gemm_k" else (Fd, D)
    NG = (K if op == "gemm_k" else N) // G
    nw = 2 if op == "swiglu" else 1
    reordered = op != "gemm_k" and M > 4 and uses_reorder(M)
    n_sets = int(min(8, max(1, math.ceil(3 * run.l2 / (2 * (M * K + nw * N * K + M * N))))))
    gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(repr((op, M, G, s)).encode()))
    sets = []
    for _ in range(n_sets):
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=gen)
        w = torch.randn(nw * N, K, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02  # swiglu: [W_gate; W_up]
        route = torch.rand((M, NG), generator=gen, device="cuda") < (1.0 - s)
        sets.append(dict(x=x, w=w, route=route, r=reorder(route) if reordered else None,
                         o=torch.empty(M, N, device="cuda", dtype=torch.bfloat16),
                         t=torch.empty(M, nw * N, device="cuda", dtype=torch.bfloat16)))

    def dense(st):
        if op == "swiglu":
            torch.matmul(st["x"], st["w"].t(), out=st["t"])
            torch.mul(F.silu(st["t"][:, :N]), st["t"][:, N:], out=st["o"])
        else:
            torch.matmul(st["x"], st["w"].t(), out=st["o"])

    def wide(st):
        if op == "swiglu":
            swiglu(st["x"], st["w"][:N], st["w"][N:], st["route"], G, reordered=st["r"], out=st["o"])
        else:
            (gemm_mn if op == "gemm_mn" else gemm_k)(st["x"], st["w"], st["route"], G, reordered=st["r"], out=st["o"])

    if (op, M) not in run.dense:  # (fastest ms, its name, every candidate's ms)
        cands = {GEMM_BASELINE[op]: time_ms([lambda st=st: dense(st) for st in sets])}
        if op == "swiglu" and sm90.available(sets[0]["x"].device) and N % 128 == 0 and K % 64 == 0:
            cands[FUSED_SWIGLU] = time_ms([lambda st=st: sm90.dense_swiglu(st["x"], st["w"][:N], st["w"][N:],
                                                                           out=st["o"]) for st in sets])
        run.dense[(op, M)] = (min(cands.values()), min(cands, key=cands.get), cands)
    kernel_ms = time_ms([lambda st=st: wide(st) for st in sets])
    backend = LAST_BACKEND.get(op, "triton") if op != "gemm_k" else "triton"
    share = 2.0 / 3.0 if op == "swiglu" else 1.0 / 3.0
    reorder_ms = run.reorder_ms([st["route"] for st in sets], s) if reordered else 0.0
    dense_ms, baseline, cands = run.dense[(op, M)]
    rec = dict(op=op, M=M, N=N, K=K, G=G, sparsity=s, dense_ms=dense_ms, baseline=baseline,
               baseline_candidates_ms=cands, backend=f"{backend}; {run.meta['backend']}",
               wide_ms=kernel_ms + share * reorder_ms, kernel_ms=kernel_ms, reorder_ms=reorder_ms, reorder_share=share,
               n_input_sets=n_sets,  # realized fraction of the weight read: groups some row executes
               active=sum(float(st["route"].any(dim=0).float().mean()) for st in sets) / n_sets)
    launched = ([op] if backend == "cute" else []) + (["dense_swiglu"] if FUSED_SWIGLU in cands else [])
    if launched:  # the CuTe GEMMs' (cluster_m, group_m) of this run: the routed op's and the dense baseline's
        rec["cute_launch"] = {o: list(sm90.launch_shape(sets[0]["x"].device, o)) for o in launched}
    if M <= 4096:
        st = sets[0]
        wide(st)
        xf, wf = st["x"].float(), st["w"].float()
        ref = (reference.swiglu_ref(xf, wf[:N], wf[N:], st["route"], G) if op == "swiglu"
               else (reference.gemm_mn_ref if op == "gemm_mn" else reference.gemm_k_ref)(xf, wf, st["route"], G))
        rec["rel_err"] = rel_err(st["o"], ref)
    run.add(rec)
    del sets
    torch.cuda.empty_cache()


def bench_kaxis(run: _Run, op: str, M: int, G: int, s: float) -> None:
    """One record of a K-axis projection with M rows and sparsity s (Bernoulli(1 - s) per token and group, the skipped
    blocks of the input zero as the attention / SwiGLU leave them): ``o_proj`` (4096 -> 4096, N_G = 8 head groups of
    G = 512) or ``down_proj`` (14336 -> 4096, group size G).  Baseline: cuBLAS on the zero-filled input.  Candidates
    (``candidates_ms``): ``shared`` (token_order + o_proj over A gathered through the permutation, N_G <= 16; the sort
    counted in full, each tile config timed, ``U`` the union density at 64 rows, ``U_tile`` at the winner's row tile),
    ``shared_sorted_a`` (O only: the same with A handed over in the sorted order, as the engine's O reads it: its copy
    of the attention output to token rows, which the dense path makes too, writes them sorted), ``gemm_k_splitk`` and
    ``gemm_k_masked`` (select + cuBLAS), and ``shared_sorted_a_cute`` (O on an sm_90 GPU: the CuTe kernel on the
    sorted A); ``wide_ms`` is the best of them.  ``engine_path`` / ``engine_ms``: the path
    the engine's per-GPU table picks at this M and active fraction (cuBLAS where the kernels lose) and its time."""
    import torch

    from wide.inference.engine import kaxis_path
    from wide.kernels import gemm_k, reference, tuned_config
    from wide.kernels.o_proj import candidates as shared_candidates
    from wide.kernels.o_proj import cute_unsupported, o_proj
    from wide.kernels.o_proj import launch as shared_launch
    from wide.kernels.token_order import MAX_GROUPS, token_order, union_density

    D, Fd = LLAMA["hidden"], LLAMA["ffn"]
    N, K = (D, LLAMA["hq"] * LLAMA["d"]) if op == "o_proj" else (D, Fd)
    G = K // LLAMA["hk"] if op == "o_proj" else G
    NG = K // G
    n_sets = int(min(8, max(1, math.ceil(3 * run.l2 / (2 * (M * K + N * K + M * N))))))
    gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(repr((op, M, G, s)).encode()))
    sets = []
    for _ in range(n_sets):
        route = torch.rand((M, NG), generator=gen, device="cuda") < (1.0 - s)
        a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=gen)
        a = torch.where(reference.expand_route(route, G), a, torch.zeros((), dtype=a.dtype, device="cuda"))
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
        sets.append(dict(a=a, route=route, w=w, o=torch.empty(M, N, device="cuda", dtype=torch.bfloat16)))

    def each(fn):  # one call per input set
        return [lambda st=st: fn(st) for st in sets]

    if (op, M) not in run.dense:
        run.dense[(op, M)] = time_ms(each(lambda st: torch.matmul(st["a"], st["w"].t(), out=st["o"])))
    cands = {path: time_ms(each(lambda st, path=path: gemm_k(st["a"], st["w"], st["route"], G, path=path,
                                                              out=st["o"])))
             for path in ("splitk", "masked")}
    cands = {f"gemm_k_{k}": v for k, v in cands.items()}
    rec = dict(op=op, M=M, N=N, K=K, G=G, N_G=NG, sparsity=s, dense_ms=run.dense[(op, M)],
               baseline="cuBLAS on the zero-filled input (torch.matmul)", n_input_sets=n_sets)
    if NG <= MAX_GROUPS and M > 4:
        for st in sets:
            st["order"] = token_order(st["route"])
            st["a_sorted"] = st["a"][st["order"].perm.long()]
        sort_ms = time_ms(each(lambda st: token_order(st["route"])))
        variants = (("shared", "a", False),) + ((("shared_sorted_a", "a_sorted", True),) if op == "o_proj" else ())
        for variant, a_key, a_sorted in variants:
            by_cfg = {}
            for cfg in shared_candidates(G, M):
                name = ",".join(f"{k}={v}" for k, v in cfg.items())
                try:
                    by_cfg[name] = (cfg, time_ms(each(lambda st, cfg=cfg: shared_launch(
                        st[a_key], st["w"], st["order"], G, st["o"], cfg, True, a_sorted))))
                except Exception as e:  # a config that does not compile or launch here
                    print(f"o_proj config {name} failed: {type(e).__name__}: {e}", flush=True)
            best = min(by_cfg, key=lambda k: by_cfg[k][1])
            cands[variant] = sort_ms + by_cfg[best][1]
            rec[f"{variant}_kernel_ms"], rec[f"{variant}_config"] = by_cfg[best][1], best
            rec[f"{variant}_configs_ms"] = {k: v[1] for k, v in by_cfg.items()}
            bm = by_cfg[best][0]["BM"]
            rec[f"{variant}_U_tile"] = sum(union_density(st["order"], NG, max(64, bm)) for st in sets) / n_sets
        if op == "o_proj" and not cute_unsupported(sets[0]["a_sorted"], sets[0]["w"], G, sets[0]["o"], True, True):
            k_ms = time_ms(each(lambda st: o_proj(st["a_sorted"], st["w"], st["route"], G, order=st["order"],
                                                  zeroed=True, a_sorted=True, out=st["o"], backend="cute")))
            cands["shared_sorted_a_cute"] = sort_ms + k_ms
            rec["shared_sorted_a_cute_kernel_ms"] = k_ms
        rec.update(U=sum(union_density(st["order"], NG) for st in sets) / n_sets, sort_ms=sort_ms, sort_share=1.0)
    best = min(cands, key=cands.get)
    active = sum(float(st["route"].float().mean()) for st in sets) / n_sets
    engine = "gemm_k" if M <= 4 else kaxis_path(tuned_config()["engine"], op, M, active)
    engine = "dense" if engine == "shared" and "shared" not in cands else engine
    cute_engine = "shared_sorted_a_cute" in cands and tuned_config()["o_proj"]["cute"]  # what the engine's o_proj takes
    engine_ms = {"dense": rec["dense_ms"], "gemm_k": min(cands["gemm_k_splitk"], cands["gemm_k_masked"]),
                 "shared": cands.get(("shared_sorted_a_cute" if cute_engine else "shared_sorted_a") if op == "o_proj"
                                     else "shared")}[engine]
    rec.update(wide_ms=cands[best], wide_path=best, candidates_ms=cands, active=active, engine_path=engine,
               engine_ms=engine_ms, engine_speedup=rec["dense_ms"] / engine_ms)
    if M <= 4096:
        st = sets[0]
        ref = reference.gemm_k_ref(st["a"].float(), st["w"].float(), st["route"], G)
        errs = {}
        for path in ("splitk", "masked"):
            errs[f"gemm_k_{path}"] = rel_err(gemm_k(st["a"], st["w"], st["route"], G, path=path), ref)
        if "order" in st:
            errs["shared"] = rel_err(o_proj(st["a"], st["w"], st["route"], G, order=st["order"], zeroed=True), ref)
            if op == "o_proj":
                errs["shared_sorted_a"] = rel_err(o_proj(st["a_sorted"], st["w"], st["route"], G, order=st["order"],
                                                      zeroed=True, a_sorted=True, backend="triton"), ref)
            if "shared_sorted_a_cute" in cands:
                errs["shared_sorted_a_cute"] = rel_err(o_proj(st["a_sorted"], st["w"], st["route"], G,
                                                           order=st["order"], zeroed=True, a_sorted=True,
                                                           backend="cute"), ref)
        rec["rel_err"] = max(errs.values())
        rec["rel_err_by_path"] = errs
    run.add(rec)
    sets.clear()
    torch.cuda.empty_cache()


def bench_attention(run: _Run, T: int, s: float, decode: bool = False) -> None:
    """One record of routed prefill attention over T tokens (``decode``: split-KV decode over a T-key cache) with head
    group routes of sparsity s, against the fastest SDPA backend (each backend that runs is timed)."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from wide.kernels import reorder, routed_attention
    from wide.kernels.attention import LAST_BACKEND
    from wide.kernels.reference import attention_ref

    Hq, Hk, d = LLAMA["hq"], LLAMA["hk"], LLAMA["d"]
    B, Tq = (run.args.decode_batch, 1) if decode else (max(1, run.args.tokens // T), T)
    gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(repr((T, s, decode)).encode()))
    q = torch.randn(B, Hq, Tq, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(B, Hk, T, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    route = torch.rand((B, Tq, Hk), generator=gen, device="cuda") < (1.0 - s)
    r = None if decode else reorder(route)
    out = torch.empty_like(q)
    cands = {}
    sdpa = torch.nn.functional.scaled_dot_product_attention
    kx, vx = k.repeat_interleave(Hq // Hk, 1), v.repeat_interleave(Hq // Hk, 1)
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                    SDPBackend.MATH):
        if backend == SDPBackend.MATH and B * Hq * Tq * T * 4 > 8 * 2**30:
            continue  # its score matrix alone would pass 8 GiB
        for name, kk, vv, gqa in ((backend.name, k, v, True), (backend.name + " (K/V repeated)", kx, vx, False)):
            try:
                with sdpa_kernel([backend]):
                    cands[name] = time_ms([lambda kk=kk, vv=vv, gqa=gqa: sdpa(q, kk, vv, is_causal=not decode,
                                                                               enable_gqa=gqa)])
                break
            except RuntimeError:  # this backend does not run this case
                torch.cuda.empty_cache()
    best = min(cands, key=cands.get)
    kernel_ms = time_ms([lambda: routed_attention(q, k, v, route, not decode, reordered=r, out=out)])
    reorder_ms = 0.0 if decode else run.reorder_ms([route], s)
    rec = dict(op="attention_decode" if decode else "attention_prefill", M=B * Tq, N=Hq * d, K=d, G=Hq // Hk * d, B=B,
               T=T, Tq=Tq, Tk=T, sparsity=s, dense_ms=cands[best], wide_ms=kernel_ms + reorder_ms / 3.0,
               baseline=f"SDPA {best}, the fastest SDPA backend timed here", baseline_candidates_ms=cands,
               kernel_ms=kernel_ms, reorder_ms=reorder_ms, reorder_share=1.0 / 3.0, active=float(route.float().mean()),
               backend="decode" if decode else LAST_BACKEND.get("attention_prefill"))
    if decode or B * Hq * Tq * T <= 2**29:
        routed_attention(q, k, v, route, not decode, reordered=r, out=out)
        rec["rel_err"] = rel_err(out, attention_ref(q.float(), k.float(), v.float(), route, not decode))
    run.add(rec)
    torch.cuda.empty_cache()


def crossovers(records) -> dict:
    """The engine's dispatch tables from benchmark records: per shape, the executed fraction ``p = 1 - s`` above which
    the routed op is slower than its dense baseline.  ``{"attention_prefill": {T: p}, "gemm_mn": {M: {G: p}},
    "swiglu": {M: {G: p}}}`` with string keys, the layout of the tuned config's ``attn_crossover`` and
    ``naxis_crossover`` (M from 1024 rows, as the engine reads it).  A sweep is the records of one run (commit,
    backend, run date) of one shape (op, M or T, G, N, K, B); per shape the sweep with the latest run date and two or
    more sparsities counts (several records at one sparsity: their mean margin).  Its margin ``wide_ms - dense_ms`` is
    interpolated linearly in ``p`` between neighbouring measured fractions (extrapolated from the end segments) and
    ``p`` is its first rise through zero, clipped to [0, 1]: 1 where the routed op wins with every group executed, 0
    where it loses at every fraction."""
    sweeps: dict = {}  # shape -> run -> p -> margins
    for r in records:
        attn = r["op"] == "attention_prefill"
        if not attn and (r["op"] not in ("gemm_mn", "swiglu") or r["M"] < 1024):
            continue
        shape = (r["op"], str(r["T"] if attn else r["M"]), None if attn else str(r["G"]), r["N"], r["K"], r.get("B"))
        run = (r.get("run_date") or r.get("date") or "", r.get("commit"), r.get("backend"))
        margin = r["wide_ms"] - r["dense_ms"]
        if math.isfinite(margin):
            sweeps.setdefault(shape, {}).setdefault(run, {}).setdefault(1.0 - r["sparsity"], []).append(margin)
    out: dict = {}
    for (op, size, g, *_), runs in sweeps.items():
        full = [run for run, by_p in runs.items() if len(by_p) >= 2]
        if not full:
            continue
        by_p = runs[max(full, key=lambda run: run[0])]  # the latest run date (ties: the first listed)
        pts = sorted((p, sum(ms) / len(ms)) for p, ms in by_p.items())
        # the first segment that ends above zero (else the last): interpolated inside it, extrapolated past the ends
        (p0, m0), (p1, m1) = next((sg for sg in zip(pts, pts[1:]) if sg[1][1] > 0), (pts[-2], pts[-1]))
        if m1 > m0:
            cross = p0 - m0 * (p1 - p0) / (m1 - m0)
        else:  # not rising: the routed op wins up to that segment's end if it wins there, else nowhere
            cross = 1.0 if m1 <= 0 else 0.0
        p = round(min(1.0, max(0.0, cross)), 3)
        if g is None:
            out.setdefault(op, {})[size] = p
        else:
            out.setdefault(op, {}).setdefault(size, {})[g] = p

    def by_size(table: dict) -> dict:
        return {k: by_size(v) if isinstance(v, dict) else v
                for k, v in sorted(table.items(), key=lambda kv: int(kv[0]))}

    return {op: by_size(table) for op, table in sorted(out.items())}


def write_report(records, out_dir: str, tag: str) -> None:
    """``kernels_<tag>.md`` (one row per record) and ``kernels_<tag>.png`` (speedup per sparsity, ideal dashed)."""
    md = [f"# Routed kernels against their dense baselines ({tag})", "",
          "| op | M | B x T | N | K | G | s | dense ms | wide ms | speedup | ideal | baseline |",
          "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in sorted(records, key=lambda r: (r["op"], r["G"], r["sparsity"], r["M"], r.get("T", 0))):
        bt = f"{r['B']} x {r['T']}" if "B" in r and "T" in r else "-"
        md.append(f"| {r['op']} | {r['M']} | {bt} | {r['N']} | {r['K']} | {r['G']} | {r['sparsity']:.2f} | "
                  f"{r['dense_ms']:.4f} | {r['wide_ms']:.4f} | {r['speedup']:.3f} | {r['ideal']:.2f} | "
                  f"{r['baseline']} |")
    cross = crossovers(records)
    if cross:
        md += ["", "## Crossovers", "",
               "Executed fraction above which the dense baseline is faster, from these records "
               "(`wide.bench.kernels.crossovers`: per shape the latest sweep, with the backend it ran), in the layout "
               "of the tuned config's `engine.attn_crossover` (attention_prefill, per T) and "
               "`engine.naxis_crossover` (per M, then G):", "",
               "```json", json.dumps(cross), "```"]
    with open(os.path.join(out_dir, f"kernels_{tag}.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot", file=sys.stderr)
        return
    ops = [o for o in OPS if any(r["op"] == o for r in records)]
    if not ops:
        return
    fig, axes = plt.subplots(1, len(ops), figsize=(4.2 * len(ops), 3.8), squeeze=False)
    for ax, op in zip(axes[0], ops):
        rs = [r for r in records if r["op"] == op]
        xkey = "T" if op.startswith("attention") else "M"
        if xkey == "M":
            g = 128 if any(r["G"] == 128 for r in rs) else rs[0]["G"]
            rs = [r for r in rs if r["G"] == g]
        for s in sorted({r["sparsity"] for r in rs}):
            pts = sorted((r[xkey], r["speedup"]) for r in rs if r["sparsity"] == s)
            line = ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=f"s={s:g}")[0]
            ax.axhline(1.0 / (1.0 - s), color=line.get_color(), ls="--", lw=0.8)
        ax.set(xscale="log", xlabel=xkey, ylabel="speedup vs dense", title=op if xkey == "T" else f"{op} (G={g})")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, f"kernels_{tag}.png"), dpi=110)


def run(args) -> int:
    """Run the sweep described by ``args`` (see :func:`add_arguments`); returns an exit code."""
    if args.report_only:
        args.tag = args.tag or "h200"
        return report_only(os.path.join(args.out_dir, f"kernels_{args.tag}.json"), write_report, args.out_dir,
                           args.tag)
    import torch

    if not torch.cuda.is_available():
        print("wide bench kernels needs a CUDA GPU", file=sys.stderr)
        return 2
    args.tag = args.tag or gpu_tag()
    out_json = os.path.join(args.out_dir, f"kernels_{args.tag}.json")
    os.makedirs(args.out_dir, exist_ok=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    bench = _Run(args)
    Ms, Gs, Ss, Ts = (args.M, args.G, args.sparsity, args.T) if not args.quick else ([1, 4, 64, 4096], [128],
                                                                                      [0.0, 0.5], [4096])
    for T in Ts:
        for s in Ss:
            for decode in (False, True):
                if f"attention_{'decode' if decode else 'prefill'}" in args.ops:
                    bench_attention(bench, T, s, decode)
    # the points quoted most first (G = 128 / 512, s = 0 / 0.5), then the rest of the grid until --time-budget
    order = sorted((G not in (128, 512) or s not in (0.0, 0.5), G != 128, G, s, M) for G in Gs for s in Ss for M in Ms)
    gemms = [(bench_gemm, op, M, G, s) for *_, G, s, M in order for op in ("gemm_mn", "gemm_k", "swiglu")
             if op in args.ops]
    # the K-axis projections: O (N_G = 8, its own G) once per M and s, down per G
    kaxis = [(bench_kaxis, "o_proj", M, 0, s) for s in Ss for M in Ms] * ("o_proj" in args.ops) + [
        (bench_kaxis, "down_proj", M, G, s) for G in Gs for s in Ss for M in Ms] * ("down_proj" in args.ops)
    for fn, op, M, G, s in gemms + kaxis:
        if bench.over_budget():
            print(f"time budget reached: skipping {op} M={M} G={G} s={s}", flush=True)
            continue
        try:
            fn(bench, op, M, G, s)
        except Exception as e:  # keep the sweep going; the error is reported
            print(f"FAILED {op} M={M} G={G} s={s}: {type(e).__name__}: {e}", flush=True)
    write_report(bench.records, args.out_dir, args.tag)
    print(f"wrote {len(bench.records)} records to {out_json} in {time.time() - bench.t0:.0f} s")
    return 0


if __name__ == "__main__":  # python -m wide.bench.kernels [options] runs wide bench kernels [options]
    args = add_arguments(argparse.ArgumentParser(prog="python -m wide.bench.kernels")).parse_args()
    args.argv = ["bench", "kernels", *sys.argv[1:]]
    sys.exit(run(args))
