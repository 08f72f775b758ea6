"""``wide bench e2e``: end-to-end latency of the inference engine against the dense engine on one GPU (paper §4.4).

TTFT: one prefill of ``batch x prompt_len`` random tokens; TPOT: one greedy decode step at ``prompt_len`` tokens of
context (the lengths reset before each step); medians of ``triton.testing.do_bench_cudagraph``, bf16.  ``dense_ms``:
the dense engine; ``wide_ms``: every routed op as its kernel; ``wide_auto_ms``: the default dispatch;
``hf_eager_ms``: the Hugging Face model, eager.  Models: Llama-3.1-8B shapes with random weights and routers biased
to the target sparsity (the §4.4 split or uniform), and the bundled SmolLM2-135M with its trained routers dialed to
each ``--sparsity`` (:func:`wide.calibrate.dial`).  Every record's ``realized_sparsity`` gives both units: ``groups``
(Eq. 6, also ``overall``) and ``flops`` (the routed compute skipped at the point's context).  Writes
``e2e_<tag>.json`` (records), ``.md``, ``.png`` and ``_trace.json`` (one layer's GPU time per op, Amdahl's bound).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

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

PAPER_SPLIT = (0.66, 0.285)  # attention / FFN sparsity at overall 0.4725 (§4.4)
LLAMA8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=131072,
               rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
               rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
ROUTED_OPS = ("q_proj", "qkv_gemv", "attend", "o_proj", "gate_up_dense", "gate_up", "down_proj")
ROUTING_OPS = ("attn_router", "attn_reorder", "ffn_router", "ffn_reorder")
UNIT = "Eq. 6 group rate: mean of the attention and FFN skipped-group fractions"
DEVICE = "cuda"  # the CPU dry run of the tests swaps it, with gpu_ms
BASELINE = ("dense engine in the same process (cuBLAS projections, gate / up as the fused CuTe SwiGLU on sm_90 from "
            "the tuned config's fused_swiglu_min_rows, SDPA prefill attention, split-KV decode attention, CUDA graphs);"
            " speedup = every routed op as its kernel, speedup_auto = the default dispatch")


def _trace_points(s):
    out = []
    for item in [v for v in str(s).split(",") if v] or [""]:
        try:
            phase, B, T = item.split(":")
            out.append((phase, int(B), int(T)))
        except ValueError:
            raise argparse.ArgumentTypeError(f"trace point {item!r} is not phase:batch:tokens, e.g. prefill:1:2048") \
                from None
        if phase not in ("prefill", "decode") or min(out[-1][1:]) < 1:
            raise argparse.ArgumentTypeError(f"trace point {item!r}: phase must be prefill or decode, batch and "
                                             "tokens >= 1")
    return out


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--quick", action="store_true", help="subset: prefill B=1 x {512,2048,16384}, decode B={1,16} x "
                   "{512,2048} (+16384 at B=1, 2048 at B=4), s={0,0.5}, G=128, paper split (+ uniform at prefill "
                   "16384 / 2048 and decode 2048), trace, SmolLM2")
    p.add_argument("--batch", default="1,8,16,32", type=int_list(1), help="batch sizes (default: 1,8,16,32)")
    p.add_argument("--prompt", default="512,2048,16384", type=int_list(1),
                   help="prompt lengths in tokens (default: 512,2048,16384)")
    p.add_argument("--sparsity", default="0,0.25,0.5", type=sparsity_list,
                   help="overall target sparsities s in [0, 1): the routers' bias targets of the Llama shapes, and the "
                        "values the SmolLM2 routers are dialed to (default: 0,0.25,0.5)")
    p.add_argument("--sparsity-unit", default=None, choices=["groups", "flops"], help="unit of the SmolLM2 dial: "
                   "groups (Eq. 6) or flops (the routed compute skipped) (default: the checkpoint's)")
    p.add_argument("--G", default="64,128,256", type=group_list, help="FFN group sizes (default: 64,128,256)")
    p.add_argument("--split", default="paper,uniform", type=choice_list("paper", "uniform"),
                   help="attention/FFN split of s: paper, uniform (default: both)")
    p.add_argument("--phases", default="prefill,decode", type=choice_list("prefill", "decode"),
                   help="prefill, decode (default: both)")
    p.add_argument("--models", default="llama8b,smollm2", type=choice_list("llama8b", "smollm2"), help="llama8b "
                   "(Llama-3.1-8B shapes, random weights), smollm2 (the bundled model with its calibrated routers) "
                   "(default: both)")
    p.add_argument("--runs", default=50, type=int_at_least(5), help="calls timed per point, at least 5, over 10 "
                   "CUDA-graph replays (default: 50; fewer where a replay would take over ~0.6 s)")
    p.add_argument("--max-prefill-tokens", default=65536, type=int_at_least(1),
                   help="skip prefills with batch*prompt above (default: 65536)")
    p.add_argument("--max-kv-gb", default=40.0, type=float_above(0),
                   help="skip decode points whose KV cache is larger (default: 40)")
    p.add_argument("--no-hf", action="store_true", help="skip the dense HF eager baseline")
    p.add_argument("--no-trace", action="store_true", help="skip the per-op trace of one layer")
    p.add_argument("--trace-sparsity", default="0.5", type=sparsity_list, help="sparsities at which one layer is "
                   "traced op by op; only points of the sweep with the paper split and G_ffn 128 (default: 0.5)")
    p.add_argument("--trace-points", default="prefill:1:16384,decode:1:2048", type=_trace_points,
                   help="phase:batch:tokens points of the per-op trace (default: prefill:1:16384,decode:1:2048)")
    p.add_argument("--smollm2-ckpt", default="benchmarks/quality/checkpoints/smollm2-global-s50-g128",
                   help="WIDE checkpoint of the SmolLM2 points (default: the committed S = 0.5 routers)")
    p.add_argument("--smollm2-model", default=None, help="base model of that checkpoint (a GGUF file or HF "
                   "directory) when its bundled package is not installed, e.g. on a GPU machine")
    p.add_argument("--smollm2-text", default=None, help="text the auto engine measures SmolLM2's per-layer activity "
                   "on (a --text spec of wide calibrate, e.g. a .jsonl/.txt file; default: the bundled text)")
    p.add_argument("--out-dir", default="benchmarks/e2e", help="where results go (default: benchmarks/e2e)")
    p.add_argument("--tag", type=file_stem, help="result file stem e2e_<tag> (default: the GPU's model, e.g. h200 or "
                                                 "h100; h200 with --report-only)")
    p.add_argument("--time-budget", default=1e9, type=float_above(0), help="seconds; no new point past this")
    p.add_argument("--report-only", action="store_true", help="rebuild table and plot from the JSON")
    return p


# --- timing and models -----------------------------------------------------------------------------------------------
def gpu_ms(fn, runs: int) -> float:
    """Median milliseconds of one ``fn()`` (``triton.testing.do_bench_cudagraph``: 10 CUDA-graph replays of about
    ``runs / 10`` calls each, fewer where a replay would take over ~0.6 s), after a call that compiles the kernels."""
    import torch
    from triton.testing import do_bench_cudagraph

    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    rep = min((time.perf_counter() - t) * 1e3 * runs / 10, 600.0)
    return do_bench_cudagraph(fn, rep=rep, return_mode="median")


def prefill_fn(engine, ids):
    """One prefill of ``ids [B, T]`` (no padding) into a cache of its own."""
    cache = engine.new_cache(*ids.shape)
    return lambda: engine.prefill(ids, None, cache)


def decode_fn(engine, cache, context: int, tokens):
    """One greedy decode step of every row of ``cache`` at ``context`` tokens, feeding back its argmax."""
    import torch

    ctx = torch.full((cache.batch,), context, dtype=torch.int64, device=cache.device)

    def step():
        cache.lengths.copy_(ctx)
        tokens.copy_(engine.decode(tokens, cache).argmax(-1))
    return step


def build_llama8b(layers: int | None = None):
    """A Llama-3.1-8B-shaped ``LlamaForCausalLM`` with random bf16 weights on the GPU (SDPA attention)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**{**LLAMA8B, **({"num_hidden_layers": layers} if layers else {})})
    cfg.architectures, cfg._attn_implementation = ["LlamaForCausalLM"], "sdpa"
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    return model.eval().requires_grad_(False)


def split_sparsity(s: float, split: str) -> tuple[float, float]:
    """``(s_attn, s_ffn)`` of overall ``s``: the paper's ratio (66 % : 28.5 % at 47.25 %) or uniform."""
    if split == "uniform":
        return s, s
    a, f = PAPER_SPLIT
    return min(s * a / ((a + f) / 2), 0.99), min(s * f / ((a + f) / 2), 0.99)


def bias_routers(engine, input_ids, s_attn: float, s_ffn: float) -> None:
    """Shift every router's bias so that, in one prefill of ``input_ids``, layer ``i`` skips the fraction ``s_attn`` /
    ``s_ffn`` of its (token, group) decisions (Eq. 5); ``s = 0`` executes every group on any input."""
    import torch

    def biased(layer, route):
        def run(kind, h, f, add=None):
            r, s = (layer.attn_router, s_attn) if kind == "attn" else (layer.ffn_router, s_ffn)
            if r is not None:
                lg = r(h if add is None else h + add)
                diff = (lg[..., 0] - lg[..., 1]).flatten().float()
                sample = diff[torch.randperm(diff.numel(), device=diff.device)[:1_000_000]]
                q = diff.min() - 1e4 if s <= 0 else torch.quantile(sample, s)
                r.w2.bias.view(-1, 2).add_(torch.stack([-q / 2, q / 2]))
            return route(kind, h, f, add)
        return run

    for layer in engine.layers:
        layer.route = biased(layer, layer.route)
    try:
        with torch.no_grad():
            engine.prefill(input_ids, None, engine.new_cache(*input_ids.shape))
    finally:
        for layer in engine.layers:
            del layer.route


def engines(base, wm):
    """``{"wide": every routed op as its kernel, "wide_auto": the default dispatch, "dense": the dense engine}``."""
    from wide.inference.engine import Engine

    return {"wide": Engine(wm, track_sparsity=False, kaxis="kernel", naxis="kernel", attn="kernel"),
            "wide_auto": Engine(wm, track_sparsity=False), "dense": Engine(base, ops="dense", track_sparsity=False)}


# --- points ------------------------------------------------------------------------------------------------------
class Run:
    """Where the records of one run go, and what every record carries."""

    def __init__(self, args):
        import torch
        import transformers
        import triton

        self.args, self.t0, self.records = args, time.time(), []
        self.out_json = os.path.join(args.out_dir, f"e2e_{args.tag}.json")
        self.meta = dict(baseline=BASELINE, unit=UNIT, gpu=torch.cuda.get_device_name(), **provenance("e2e", args),
                         backend=f"triton {triton.__version__}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
                                 f"transformers {transformers.__version__}")

    def over(self) -> bool:
        return time.time() - self.t0 > self.args.time_budget

    def add(self, rec: dict) -> None:
        d, w, a = rec["dense_ms"], rec["wide_ms"], rec["wide_auto_ms"]
        rec.update(speedup=round(d / w, 4), speedup_auto=round(d / a, 4), **self.meta)
        self.records.append(rec)
        with open(self.out_json, "w") as f:
            json.dump(self.records, f, indent=1)
        keys = ("phase", "model", "split", "batch", "prompt_len", "sparsity", "dense_ms", "wide_auto_ms",
                "speedup_auto")
        print(" ".join(f"{k}={rec.get(k)}" for k in keys), flush=True)


def _realized(engine, run, context: int):
    """The engine's realized sparsity over one ``run()``: ``attn``, ``ffn``, ``overall`` = ``groups`` (Eq. 6) and
    ``flops`` (the routed compute skipped at ``context`` tokens, :func:`wide.routing.realized_sparsity`)."""
    from wide.config import WideConfig
    from wide.routing import realized_sparsity

    engine.track_sparsity = True
    engine.reset_stats()
    run()
    engine.track_sparsity = False
    out = engine.realized_sparsity()
    if out:
        keep = {k: [1.0 - out[k]] if k in out else [] for k in ("attn", "ffn")}
        both = realized_sparsity(keep["attn"], keep["ffn"], engine.dims, WideConfig(), seq_len=context)
        out.update(groups=both["groups"], flops=both["flops"])
    return {**{k: round(v, 4) for k, v in out.items()}, "flops_context": context}


def bench_prefill(run: Run, model: str, base, engs: dict, B: int, T: int, extra: dict) -> None:
    """Time one prefill of ``B`` random prompts of ``T`` tokens through each engine (and HF eager unless ``--no-hf``)
    and add its record."""
    import torch
    from triton.testing import do_bench

    g = torch.Generator(device=DEVICE).manual_seed(B * 100003 + T)
    ids = torch.randint(0, base.config.vocab_size, (B, T), device=DEVICE, generator=g)
    rec = dict(op="e2e", phase="prefill", model=model, batch=B, prompt_len=T, **extra)
    for name, eng in engs.items():
        rec[f"{name}_ms"] = round(gpu_ms(prefill_fn(eng, ids), run.args.runs), 4)
        torch.cuda.empty_cache()
    if not run.args.no_hf:
        with torch.no_grad():
            rec["hf_eager_ms"] = round(do_bench(lambda: base(input_ids=ids, use_cache=False, logits_to_keep=1),
                                                return_mode="median"), 4)
    rec["realized_sparsity"] = _realized(engs["wide"], prefill_fn(engs["wide"], ids[:, :4096]), min(T, 4096))
    run.add(rec)


def bench_decode(run: Run, model: str, base, engs: dict, B: int, T: int, extra: dict) -> None:
    """Time one decode step of ``B`` rows over a cache of ``T`` random keys / values through each engine (and HF
    eager with a ``DynamicCache`` of the same keys unless ``--no-hf``) and add its record."""
    import torch
    from triton.testing import do_bench

    cache = engs["dense"].new_cache(B, T + 8)
    torch.manual_seed(T)
    cache.k.normal_(0, 1)
    cache.v.normal_(0, 1)
    first = torch.randint(0, base.config.vocab_size, (B,), device=DEVICE,
                          generator=torch.Generator(device=DEVICE).manual_seed(T))
    rec = dict(op="e2e", phase="decode", model=model, batch=B, prompt_len=T, **extra)
    for name, eng in engs.items():  # the same first tokens for every engine: the routing depends on them
        rec[f"{name}_ms"] = round(gpu_ms(decode_fn(eng, cache, T, first.clone()), run.args.runs), 4)
    if not run.args.no_hf:
        from transformers import DynamicCache

        with torch.no_grad():
            hfc = DynamicCache(config=base.config)
            for layer in range(cache.k.shape[0]):
                hfc.update(cache.k[layer, :, :, -T:], cache.v[layer, :, :, -T:], layer)
            tok, pos = first.view(B, 1), torch.full((B, 1), T, device=DEVICE)

            def step():
                hfc.crop(T)
                base(input_ids=tok, past_key_values=hfc, position_ids=pos, use_cache=True)
            rec["hf_eager_ms"] = round(do_bench(step, return_mode="median"), 4)
            del hfc
    rec["realized_sparsity"] = _realized(engs["wide"], decode_fn(engs["wide"], cache, T, first.clone()), T)
    del cache
    torch.cuda.empty_cache()
    run.add(rec)


def trace(engine, B: int, T: int, phase: str) -> dict:
    """GPU time per op of one layer (``torch.profiler`` over 3 eager forwards, ms per layer), the whole forward's
    kernel time (``total_ms``) and its CUDA-graph time (``full_ms``)."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile, record_function

    ids = torch.randint(0, engine.base.config.vocab_size, (B, T), device=engine.device)
    if phase == "prefill":
        fn = prefill_fn(engine, ids)
    else:
        cache = engine.new_cache(B, T + 8)
        cache.k.normal_()
        cache.v.normal_()
        fn = decode_fn(engine, cache, T, ids[:, 0].clone())
    fn()
    cuda = engine.device.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        for _ in range(3):
            with record_function("forward"):
                fn()
        if cuda:
            torch.cuda.synchronize()
    events = prof.key_averages()
    ms = {e.key: (e.device_time_total if cuda else e.cpu_time_total) / 3e3 for e in events}
    if cuda:  # every kernel's time
        ms["forward"] = sum(e.self_device_time_total for e in events if e.device_type == DeviceType.CUDA) / 3e3
    L = len(engine.layers)
    return {"ops": {k: ms[k] / L for k in ROUTED_OPS + ROUTING_OPS if k in ms}, "layers": L,
            "total_ms": ms["forward"], "full_ms": gpu_ms(fn, 20) if cuda else None}


def amdahl(w: dict, d: dict) -> dict:
    """Routed ops, routing and unrouted rest of WIDE against dense, and the bound ``dense / (unrouted + routed)``."""
    def parts(tr):
        routed = sum(tr["ops"].get(k, 0.0) for k in ROUTED_OPS) * tr["layers"]
        routing = sum(tr["ops"].get(k, 0.0) for k in ROUTING_OPS) * tr["layers"]
        return routed, routing, tr["total_ms"] - routed - routing

    wr, wo, wu = parts(w)
    dr, _, du = parts(d)
    out = {"dense_routed_ms": dr, "dense_unrouted_ms": du, "dense_unrouted_fraction": du / d["total_ms"],
           "wide_routed_ms": wr, "wide_routing_overhead_ms": wo, "wide_unrouted_ms": wu,
           "routed_path_speedup": dr / wr if wr else None,
           "predicted_speedup_sum_of_ops": d["total_ms"] / w["total_ms"],
           "amdahl_bound_no_overhead": d["total_ms"] / (du + wr)}
    if d.get("full_ms") and w.get("full_ms"):
        out["measured_full_speedup"] = d["full_ms"] / w["full_ms"]
    return out


def bench_smollm2(run: Run) -> None:
    """The bundled SmolLM2-135M with its trained routers dialed to each ``--sparsity`` (a logit shift fitted on the
    held-out calibration text): prefill (batch 1) and decode (context 2048) points."""
    import torch

    import wide
    from wide.calibrate import calibration_line, dial
    from wide.data import load_texts, pack

    a = run.args
    wm, tok = wide.load(a.smollm2_ckpt, model=a.smollm2_model, device="cuda", dtype=torch.bfloat16, tokenizer=True)
    sample = pack(load_texts(a.smollm2_text)[:64], tok, 2048, max_blocks=1).to("cuda")
    for s in a.sparsity:
        if run.over():
            break
        wm.install_hooks()  # the dial runs the model's own routed forward pass
        rec = dial(wm, s, tok, unit=a.sparsity_unit, text=a.smollm2_text)
        print(f"smollm2-135m: {' '.join(calibration_line(rec).split())}", flush=True)
        for h in wm._handles:  # the engines call the routers themselves: the HF baseline runs without hooks
            h.remove()
        engs = engines(wm.base, wm)
        engs["wide_auto"].measure_activity(sample)
        extra = dict(sparsity=s, G_ffn=wm.config.ffn_group_size, split="dialed", checkpoint=a.smollm2_ckpt,
                     trained_sparsity=wm.config.target_sparsity, dial_unit=rec["unit"],
                     dial_realized={k: round(rec["realized"][k], 4) for k in ("groups", "flops")})
        for T in (t for t in a.prompt if t <= 8192 and not run.over()):
            bench_prefill(run, "smollm2-135m", wm.base, engs, 1, T, extra)
        for B in (b for b in a.batch if b <= 16 and not run.over()):
            bench_decode(run, "smollm2-135m", wm.base, engs, B, 2048, extra)
        del engs
        torch.cuda.empty_cache()


# --- report and run --------------------------------------------------------------------------------------------------
def write_report(records: list, out_dir: str, tag: str) -> None:
    """A Markdown table and a plot of the default engine's speedup against prompt tokens (prefill) and batch size
    (decode); colour = s, marker = G_ffn."""
    rows = ["| phase | model | split | B | prompt | s | G | realized attn / ffn / groups / flops | HF eager ms | "
            "dense ms | WIDE ms | speedup | WIDE auto ms | speedup auto |", "|" + "---|" * 14]
    for r in records:
        rs = r.get("realized_sparsity") or {}
        real = " / ".join(f"{rs[k]:.3f}" for k in ("attn", "ffn", "overall", "flops") if k in rs)
        rows.append(f"| {r['phase']} | {r['model']} | {r.get('split', '')} | {r['batch']} | {r['prompt_len']} | "
                    f"{r['sparsity']} | {r['G_ffn']} | {real} | {r.get('hf_eager_ms', '')} | {r['dense_ms']} | "
                    f"{r['wide_ms']} | {r['speedup']} | {r.get('wide_auto_ms', '')} | {r.get('speedup_auto', '')} |")
    with open(os.path.join(out_dir, f"e2e_{tag}.md"), "w") as f:
        f.write("\n".join(rows) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    colors, markers = {0.0: "tab:gray", 0.25: "tab:blue", 0.5: "tab:red", 0.75: "tab:purple"}, {64: "^", 256: "s"}
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, phase in zip(axes, ("prefill", "decode")):
        series: dict = {}
        for r in (r for r in records if r["phase"] == phase and r["model"] == "llama8b-shapes"):
            B, T = r["batch"], r["prompt_len"]
            other, x = (B, B * T) if phase == "prefill" else (T, B)
            series.setdefault((r["sparsity"], r.get("split"), r["G_ffn"], other), []).append(
                (x, r.get("speedup_auto", r["speedup"])))
        for (sp, split, G, other), pts in sorted(series.items(), key=lambda kv: str(kv[0])):
            ax.plot(*zip(*sorted(pts)), color=colors.get(sp, "k"), marker=markers.get(G, "o"), ms=5,
                    ls="--" if split == "uniform" else "-",
                    label=f"s={sp} G={G} {split} " + (f"B={other}" if phase == "prefill" else f"ctx={other}"))
        ax.axhline(1.0, color="k", lw=0.6)
        ax.set_xscale("log", base=2)
        ax.set(xlabel="prompt tokens (batch x prompt length)" if phase == "prefill" else "batch size",
               ylabel="speedup vs dense CUDA graph (default engine)")
        ax.set_title(f"{phase}: Llama-3.1-8B shapes, bf16", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=5.5, ncol=2, loc="best")
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, f"e2e_{tag}.png"), dpi=110)


def _sweep(run: Run, base, traces: dict) -> None:
    """The Llama-3.1-8B-shaped points of the sweep, with the per-op traces."""
    import torch

    from wide import WideConfig
    from wide.model import WideModel

    a = run.args
    if a.quick:
        prefill_pts, decode_pts = [(1, 16384), (1, 2048), (1, 512)], [(1, 2048), (4, 2048), (1, 512), (1, 16384),
                                                                      (16, 2048), (16, 512)]
        grid = [(0.5, 128, "paper"), (0.0, 128, "paper"), (0.5, 128, "uniform")]
        uniform_pts = {("prefill", 1, 16384), ("prefill", 1, 2048), ("decode", 1, 2048)}
    else:
        prefill_pts = [(B, T) for B in a.batch for T in a.prompt if B * T <= a.max_prefill_tokens]
        decode_pts = [(B, T) for B in a.batch for T in a.prompt]
        grid = [(s, G, sp) for sp in a.split for s in a.sparsity for G in a.G if not (s == 0 and sp != a.split[0])]
        uniform_pts = None
    kv_per_tok = 2 * base.config.num_hidden_layers * base.config.num_key_value_heads * 128 * 2
    calib = torch.randint(0, base.config.vocab_size, (1, 2048), device="cuda")
    for s, G, split in grid:
        if run.over():
            break
        sa, sf = split_sparsity(s, split)
        wm = WideModel(base, WideConfig(ffn_group_size=G, target_sparsity=s), init_keep=0.5)
        for h in wm._handles:  # the engines call the routers themselves: the HF baseline runs without hooks
            h.remove()
        engs = engines(base, wm)
        bias_routers(engs["wide"], calib, sa, sf)
        engs["wide_auto"].measure_activity(calib)
        extra = dict(sparsity=s, G_ffn=G, split=split, target_attn=round(sa, 4), target_ffn=round(sf, 4))
        for phase in a.phases:
            for B, T in prefill_pts if phase == "prefill" else decode_pts:
                if uniform_pts is not None and split == "uniform" and (phase, B, T) not in uniform_pts:
                    continue
                if phase == "decode" and B * (T + 8) * kv_per_tok / 1e9 > a.max_kv_gb:
                    print(f"skip decode B={B} T={T}: KV cache over --max-kv-gb", flush=True)
                    continue
                if run.over():
                    print(f"time budget reached: skipping {phase} B={B} T={T} s={s} G={G} {split}", flush=True)
                    continue
                try:
                    (bench_prefill if phase == "prefill" else bench_decode)(run, "llama8b-shapes", base, engs, B, T,
                                                                            extra)
                except Exception as e:  # noqa: BLE001  (keep the points measured so far)
                    print(f"FAILED {phase} B={B} T={T} s={s} G={G} {split}: {type(e).__name__}: {e}", flush=True)
                    torch.cuda.empty_cache()
        if not a.no_trace and s in a.trace_sparsity and G == 128 and split == "paper" and not run.over():
            for phase, B, T in a.trace_points:
                key = f"{phase}_B{B}_T{T}" + ("" if s == 0.5 else f"_s{s:g}")
                try:
                    tr = {name: trace(eng, B, T, phase) for name, eng in engs.items()}
                    traces[key] = dict(tr, amdahl=amdahl(tr["wide"], tr["dense"]),
                                       amdahl_auto=amdahl(tr["wide_auto"], tr["dense"]), sparsity=s, G_ffn=G,
                                       split=split, **run.meta)
                    with open(os.path.join(a.out_dir, f"e2e_{a.tag}_trace.json"), "w") as f:
                        json.dump(traces, f, indent=1)
                    print(f"trace {key}: {json.dumps(traces[key]['amdahl_auto'])}", flush=True)
                except Exception as e:  # noqa: BLE001  (keep the sweep's results)
                    print(f"trace {key} failed: {type(e).__name__}: {e}", flush=True)
        del wm, engs
        torch.cuda.empty_cache()


def run(args) -> int:
    """Run the sweep of :func:`add_arguments` on the GPU (``--report-only``: rebuild the table and plot)."""
    if args.report_only:
        args.tag = args.tag or "h200"
        return report_only(os.path.join(args.out_dir, f"e2e_{args.tag}.json"), write_report, args.out_dir, args.tag)
    import torch

    from wide.errors import WideError

    if not torch.cuda.is_available():
        print("wide bench e2e needs a CUDA GPU", file=sys.stderr)
        return 2
    args.tag = args.tag or gpu_tag()
    os.makedirs(args.out_dir, exist_ok=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    run, traces = Run(args), {}
    if "llama8b" in args.models:
        base = build_llama8b()
        _sweep(run, base, traces)
        del base
        torch.cuda.empty_cache()
    if "smollm2" in args.models and not run.over():
        try:
            bench_smollm2(run)
        except (WideError, ImportError, OSError) as e:
            print(f"SmolLM2 part skipped: {str(e).splitlines()[0]}", flush=True)
    write_report(run.records, args.out_dir, args.tag)
    print(f"wrote {len(run.records)} records to {run.out_json} in {time.time() - run.t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":  # python -m wide.bench.e2e: the same as wide bench e2e
    from wide.cli import main

    raise SystemExit(main(["bench", "e2e", *__import__("sys").argv[1:]]))
