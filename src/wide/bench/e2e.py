"""End-to-end latency of the WIDE inference engine on one GPU (issue 5; paper §4.4, ELANA-style).

Metrics (all in one process, bf16):

* **TTFT**: one prefill of ``batch x prompt_len`` tokens (no padding), replayed from a CUDA graph;
* **TPOT**: one decode step at context ``prompt_len`` (the cache is reset to that length before every
  replay, so every run is the same step), replayed from a CUDA graph;

each the median over ``--runs`` replays (>= 50; long prefills use fewer, recorded in ``runs``) after warm-up
(which also compiles and autotunes the kernels).  Baselines: the dense Hugging Face model in eager mode
(``hf_eager_ms``; SDPA attention, DynamicCache) and the dense engine under CUDA graphs (``dense_ms``: cuBLAS
linears, SDPA flash prefill attention, the project's split-KV decode attention with every head active, the
same structure as the WIDE engine); ``speedup = dense_ms / wide_ms`` with ``wide_ms`` the WIDE engine running
every routed op through its Triton kernel.  ``wide_auto_ms`` / ``speedup_auto``: the
WIDE engine with ``kaxis``, ``naxis`` and ``attn`` set to ``"auto"`` (cuBLAS / SDPA for an op where the routed
kernel would be slower at the layer's measured activity, :meth:`wide.inference.Engine.measure_activity`; same
function).

Models: Llama-3.1-8B shapes with random weights and routers biased to the target sparsity (the paper's
split, attention 66 % / FFN 28.5 % at overall 47 % (§4.4), scaled to ``s``; or ``uniform``: both at ``s``);
then the bundled SmolLM2-135M with its calibrated routers (needs the ``gguf`` package).  Decode benchmarks fill
the cache with random K/V of the context length (attention time does not depend on the values).

Also a per-op trace of one decoder layer (each op captured in its own CUDA graph): routers, reorders, each GEMM,
attention, and the unrouted ops, plus embedding / final norm / lm_head, to compare with the paper's Amdahl bound.

Outputs in ``--out-dir``: ``e2e_<tag>.json`` (records, written after each point), ``e2e_<tag>_trace.json``,
``e2e_<tag>.png`` and ``e2e_<tag>.md``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import statistics
import sys
import time

from wide.bench._args import choice_list, float_above, group_list, int_at_least, int_list, report_only, sparsity_list

PAPER_SPLIT = (0.66, 0.285)  # attention / FFN sparsity at overall 0.4725 (§4.4)
LLAMA8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=131072,
               rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
               rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
ROUTED_OPS = ("q_proj", "qkv_proj", "attention", "o_proj", "gate_up", "down_proj")  # qkv_proj: decode, K/V inside
ROUTING_OPS = ("attn_router", "attn_reorder", "ffn_router", "ffn_reorder")
DEVICE = "cuda"  # the CPU self-test of this module swaps it (with _capture / _median_ms / _decode_runner)


def _strs(s):
    return [v for v in str(s).split(",") if v]


def _trace_points(s):
    out, items = [], _strs(s)
    if not items:
        raise argparse.ArgumentTypeError("empty list; give phase:batch:tokens points, e.g. prefill:1:2048")
    for item in items:
        try:
            phase, B, T = item.split(":")
            B, T = int(B), int(T)
        except ValueError:
            raise argparse.ArgumentTypeError(f"trace point {item!r} is not phase:batch:tokens") from None
        if phase not in ("prefill", "decode") or B < 1 or T < 1:
            raise argparse.ArgumentTypeError(f"trace point {item!r}: phase must be prefill or decode, "
                                             "batch and tokens >= 1")
        out.append((phase, B, T))
    return out


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Options of ``wide bench e2e``."""
    p.add_argument("--quick", action="store_true",
                   help="subset: prefill B=1 x {512,2048,16384}, decode B={1,16} x {512,2048} (+16384 at B=1, 2048 at B=4), "
                        "s={0,0.5}, G=128, paper split (+ uniform at prefill 16384 / 2048 and decode 2048), "
                        "trace, SmolLM2")
    p.add_argument("--batch", default="1,8,16,32", type=int_list(1), help="batch sizes (default: 1,8,16,32)")
    p.add_argument("--prompt", default="512,2048,16384", type=int_list(1),
                   help="prompt lengths in tokens (default: 512,2048,16384)")
    p.add_argument("--sparsity", default="0,0.25,0.5", type=sparsity_list,
                   help="overall target sparsities s in [0, 1) (default: 0,0.25,0.5)")
    p.add_argument("--G", default="64,128,256", type=group_list, help="FFN group sizes (default: 64,128,256)")
    p.add_argument("--split", default="paper,uniform", type=choice_list("paper", "uniform"),
                   help="attention/FFN split of s: paper, uniform (default: both)")
    p.add_argument("--phases", default="prefill,decode", type=choice_list("prefill", "decode"),
                   help="prefill, decode (default: both)")
    p.add_argument("--models", default="llama8b,smollm2", type=choice_list("llama8b", "smollm2"),
                   help="llama8b (Llama-3.1-8B shapes, random weights), smollm2 (the bundled model with its "
                        "calibrated routers) (default: both)")
    p.add_argument("--runs", default=50, type=int_at_least(5), help="timed replays per point; the median is reported "
                   "(default: 50; fewer, at least 5, where that many would take over ~6 s)")
    p.add_argument("--max-prefill-tokens", default=65536, type=int_at_least(1),
                   help="skip prefills with batch*prompt above (default: 65536)")
    p.add_argument("--max-kv-gb", default=40.0, type=float_above(0),
                   help="skip decode points whose KV cache is larger (default: 40)")
    p.add_argument("--no-hf", action="store_true", help="skip the dense HF eager baseline")
    p.add_argument("--no-trace", action="store_true", help="skip the per-op trace of one layer")
    p.add_argument("--trace-sparsity", default="0.5", type=sparsity_list,
                   help="sparsities at which one layer is traced op by op; only points of the sweep with the paper "
                        "split and G_ffn 128 are traced (default: 0.5)")
    p.add_argument("--trace-points", default="prefill:1:16384,decode:1:2048", type=_trace_points,
                   help="phase:batch:tokens points of the per-op trace (default: prefill:1:16384,decode:1:2048)")
    p.add_argument("--smollm2-ckpt", default="benchmarks/quality/checkpoints/smollm2-global-s50-g128",
                   help="WIDE checkpoint of the SmolLM2 points (default: the committed S = 0.5 routers)")
    p.add_argument("--smollm2-model", default=None,
                   help="base model of that checkpoint (a GGUF file or HF directory) when its bundled package is "
                        "not installed, e.g. on a GPU machine")
    p.add_argument("--smollm2-text", default=None,
                   help="text the auto engine measures SmolLM2's per-layer activity on (a --text spec of wide "
                        "calibrate, e.g. a .jsonl/.txt file; default: the bundled text)")
    p.add_argument("--out-dir", default="benchmarks/e2e", help="where results go (default: benchmarks/e2e)")
    p.add_argument("--tag", default="h200", help="result file stem e2e_<tag> (default: h200)")
    p.add_argument("--time-budget", default=1e9, type=float_above(0), help="seconds; stop starting new points past this")
    p.add_argument("--report-only", action="store_true", help="rebuild table and plot from the JSON")
    return p


# ----------------------------------------------------------------------------------------------
# timing
# ----------------------------------------------------------------------------------------------


def _median_ms(fn, runs: int, before=None) -> float:
    """Median of ``runs`` timings of ``fn()`` with CUDA events (``before()`` runs untimed first)."""
    import torch

    times = []
    for _ in range(runs):
        if before is not None:
            before()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def _capture(fn, warmup: int = 2):
    """CUDA graph of ``fn`` (see :func:`wide.inference.graphs.capture`); has ``.replay()``."""
    from wide.inference.graphs import capture

    return capture(fn, warmup=warmup)


def _decode_runner(engine, cache):
    from wide.inference.graphs import DecodeRunner

    return DecodeRunner(engine, cache, graph=True)


def _runs_for(one_ms: float, runs: int, cap_s: float = 6.0) -> int:
    """``runs``, reduced (min 5) when ``runs`` replays would take longer than ``cap_s``."""
    return int(max(5, min(runs, cap_s * 1e3 / max(one_ms, 1e-3))))


def prefill_ms(engine, ids, runs: int = 50) -> tuple[float, int]:
    """TTFT of one prefill of ``ids`` through ``engine``: CUDA-graph replay, median, after 2 warm-up calls.

    Args:
        engine: a :class:`~wide.inference.engine.Engine` on CUDA.
        ids: int64 ``[B, T]`` token ids on the engine's device (no padding).
        runs: replays to time (fewer, at least 5, when they would take more than 6 s).

    Returns:
        ``(milliseconds, replays timed)``.

    Raises:
        WideError: no CUDA device (from :func:`wide.inference.graphs.capture`).
    """
    import torch

    cache = engine.new_cache(ids.shape[0], ids.shape[1])
    graph = _capture(lambda: engine.prefill(ids, None, cache), warmup=2)
    n = _runs_for(_median_ms(graph.replay, 1), runs)
    ms = _median_ms(graph.replay, n)
    del graph, cache
    torch.cuda.empty_cache()
    return ms, n


def decode_ms(engine, cache, context: int, vocab: int, runs: int = 50) -> float:
    """TPOT of one greedy decode step of every row of ``cache`` at ``context`` tokens of context.

    The step is a CUDA graph (:class:`~wide.inference.graphs.DecodeRunner`); before each timed replay the
    cache lengths are reset to ``context`` (untimed), so every step sees the same context.  Median of
    ``max(50, runs)`` replays.

    Args:
        engine: a :class:`~wide.inference.engine.Engine` on CUDA.
        cache: its :class:`~wide.inference.cache.StaticKVCache` with capacity > ``context``; its K/V
            content is what the step attends to.
        context: tokens already in the cache for every row.
        vocab: the vocabulary size (random first tokens).
        runs: replays to time (at least 50).

    Returns:
        Milliseconds per step.

    Raises:
        WideError: no CUDA device.
    """
    import torch

    ctxlen = torch.full((cache.batch,), context, dtype=torch.int64, device=cache.device)
    cache.lengths.copy_(ctxlen)
    runner = _decode_runner(engine, cache)
    # the same first tokens for every engine timed at this point: the routing (so the work skipped) depends on them
    runner.tokens.random_(0, vocab, generator=torch.Generator(device=cache.device).manual_seed(context))
    ms = _median_ms(runner.step, max(50, runs), before=lambda: cache.lengths.copy_(ctxlen))
    del runner
    return ms


# ----------------------------------------------------------------------------------------------
# models
# ----------------------------------------------------------------------------------------------


def build_llama8b(layers: int | None = None):
    """Llama-3.1-8B-shaped ``LlamaForCausalLM`` with random bf16 weights on the GPU (SDPA attention)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    kw = dict(LLAMA8B)
    if layers:
        kw["num_hidden_layers"] = layers
    cfg = LlamaConfig(**kw)
    cfg.architectures = ["LlamaForCausalLM"]
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)
    model.eval().requires_grad_(False)
    return model


def split_sparsity(s: float, split: str) -> tuple[float, float]:
    """``(s_attn, s_ffn)`` for overall ``s``: the paper's measured ratio (66 % : 28.5 % at 47.25 %) or uniform."""
    if split == "uniform":
        return s, s
    a, f = PAPER_SPLIT
    mean = (a + f) / 2
    return min(s * a / mean, 0.99), min(s * f / mean, 0.99)


def bias_routers(engine, input_ids, s_attn: float, s_ffn: float) -> None:
    """Shift every router's bias so that, on ``input_ids`` (one prefill, layer by layer), layer ``i`` skips a
    fraction ``s_attn`` / ``s_ffn`` of its (token, group) decisions (argmax routing, Eq. 5).  ``s = 0`` makes
    every group execute on any input."""
    import torch

    orig = engine._route

    def route(kind, i, h, valid):
        routers = engine.attn_routers if kind == "attn" else engine.ffn_routers
        s = s_attn if kind == "attn" else s_ffn
        if routers is not None:
            r = routers[i]
            with torch.no_grad():
                lg = r(h)
                diff = (lg[..., 0] - lg[..., 1]).flatten().float()
                if s <= 0:
                    q = diff.min() - 1e4
                else:
                    sample = diff[torch.randperm(diff.numel(), device=diff.device)[:1_000_000]]
                    q = torch.quantile(sample, s)
                b = r.w2.bias.view(-1, 2)
                b[:, 0] -= q / 2
                b[:, 1] += q / 2
        return orig(kind, i, h, valid)

    engine._route = route
    try:
        engine.prefill(input_ids, None, engine.new_cache(input_ids.shape[0], input_ids.shape[1]))
    finally:
        del engine._route


# ----------------------------------------------------------------------------------------------
# benchmark points
# ----------------------------------------------------------------------------------------------


class _Ctx:
    def __init__(self, args):
        import torch

        self.args = args
        self.gpu = torch.cuda.get_device_name()
        self.date = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        self.command = "wide bench e2e " + " ".join(getattr(args, "argv", [])[2:] if hasattr(args, "argv") else [])
        if not hasattr(args, "argv"):
            self.command = "python -m wide.bench.e2e " + " ".join(sys.argv[1:])
        self.records: list = []
        self.t0 = time.time()
        self.out_json = os.path.join(args.out_dir, f"e2e_{args.tag}.json")
        self.versions = {"torch": torch.__version__}
        try:
            import transformers
            import triton

            self.versions.update(triton=triton.__version__, transformers=transformers.__version__)
        except Exception:
            pass

    def over(self) -> bool:
        return time.time() - self.t0 > self.args.time_budget

    def add(self, rec: dict) -> None:
        rec.update(gpu=self.gpu, date=self.date, command=self.command, **self.versions)
        self.records.append(rec)
        with open(self.out_json, "w") as f:
            json.dump(self.records, f, indent=1)
        keys = ("phase", "model", "split", "batch", "prompt_len", "sparsity", "G_ffn", "dense_ms", "wide_ms",
                "speedup", "hf_eager_ms", "realized_sparsity")
        print(" ".join(f"{k}={rec.get(k)}" for k in keys if k in rec), flush=True)


def _engine_pair(base, wm, fused: bool = True):
    """``(WIDE engine with every routed op as its kernel, dense engine)``.

    The WIDE engine carries ``.auto``, the same engine with ``kaxis``, ``naxis`` and ``attn`` set to ``"auto"``:
    O / down as cuBLAS GEMMs where gemm_k was measured slower; Q, gate + up and the prefill attention as
    cuBLAS / SDPA in the layers whose measured activity is above what the routed kernel needs to win (call
    ``.auto.measure_activity`` once the routers are final)."""
    from wide.inference.engine import Engine

    wide_eng = Engine(wm, track_sparsity=False, fused=fused, kaxis="kernel", naxis="kernel", attn="kernel")
    wide_eng.auto = Engine(wm, track_sparsity=False, fused=fused, kaxis="auto", naxis="auto", attn="auto")
    return wide_eng, Engine(base, ops="dense", track_sparsity=False, fused=fused)


def _variants(wide_eng, dense_eng):
    out = [("wide", wide_eng)]
    if getattr(wide_eng, "auto", None) is not None:
        out.append(("wide_auto", wide_eng.auto))
    return out + [("dense", dense_eng)]


def smoke(wide_eng, dense_eng, vocab: int) -> None:
    """One eager prefill (64 tokens) and decode step of each engine (compiles the kernels; raises on failure)."""
    import torch

    ids = torch.randint(0, vocab, (1, 64), device=DEVICE)
    for _, eng in _variants(wide_eng, dense_eng):
        c = eng.new_cache(1, 66)
        lg = eng.prefill(ids, None, c)
        eng.decode(lg.argmax(-1), c)


def _realized(engine, ids):
    engine.track_sparsity = True
    engine.reset_stats()
    engine.prefill(ids, None, engine.new_cache(ids.shape[0], ids.shape[1]))
    engine.track_sparsity = False
    return {k: round(v, 4) for k, v in engine.realized_sparsity().items()}


def bench_prefill(ctx, model_name, base, wide_eng, dense_eng, B, T, extra):
    """Time one prefill point: ``B`` random prompts of ``T`` tokens through the dense engine, the WIDE engine
    (every op as its kernel) and the auto engine (CUDA events, median of ``--runs`` after warm-up, ms), plus HF
    eager unless ``--no-hf``; adds one record (``phase="prefill"``, ``dense_ms``, ``wide_ms``, ``speedup`` =
    dense / WIDE, ``wide_auto_ms``, ``speedup_auto``, ``hf_eager_ms``, ``realized_sparsity``, ``extra``) to
    ``ctx``.  Raises what the engines raise (the caller records the point as failed and goes on)."""
    import torch

    g = torch.Generator(device=DEVICE).manual_seed(B * 100003 + T)
    ids = torch.randint(0, base.config.vocab_size, (B, T), device=DEVICE, generator=g)
    out = {}
    for name, eng in _variants(wide_eng, dense_eng):
        out[name], out[name + "_runs"] = prefill_ms(eng, ids, ctx.args.runs)
    rec = dict(phase="prefill", model=model_name, batch=B, prompt_len=T, dense_ms=round(out["dense"], 4),
               wide_ms=round(out["wide"], 4), speedup=round(out["dense"] / out["wide"], 4),
               runs=min(out["wide_runs"], out["dense_runs"]), **extra)
    if "wide_auto" in out:
        rec.update(wide_auto_ms=round(out["wide_auto"], 4), speedup_auto=round(out["dense"] / out["wide_auto"], 4))
    if not ctx.args.no_hf:
        with torch.no_grad():
            f = lambda: base(input_ids=ids, use_cache=False, logits_to_keep=1)  # noqa: E731
            f()
            one = _median_ms(f, 1)
            rec["hf_eager_ms"] = round(_median_ms(f, _runs_for(one, ctx.args.runs, 4.0)), 4)
    rec["realized_sparsity"] = _realized(wide_eng, ids[:, : min(T, 4096)]) if wide_eng.ops == "routed" else {}
    ctx.add(rec)


def bench_decode(ctx, model_name, base, wide_eng, dense_eng, B, T, extra):
    """Time one decode point: one step of ``B`` rows over a KV cache of ``T`` random keys / values, replayed
    from each engine's CUDA graph (median of at least 50 replays, ms), plus HF eager with a ``DynamicCache`` of
    the same keys unless ``--no-hf``; adds one ``phase="decode"`` record with the fields of
    :func:`bench_prefill` to ``ctx``.  Raises what the engines raise (the caller records the point as failed)."""
    import torch

    cache = wide_eng.new_cache(B, T + 8)
    torch.manual_seed(T)
    cache.k.normal_(0, 1)
    cache.v.normal_(0, 1)
    ctxlen = torch.full((B,), T, dtype=torch.int64, device=DEVICE)
    out = {}
    for name, eng in _variants(wide_eng, dense_eng):
        out[name] = decode_ms(eng, cache, T, base.config.vocab_size, ctx.args.runs)
    rec = dict(phase="decode", model=model_name, batch=B, prompt_len=T, dense_ms=round(out["dense"], 4),
               wide_ms=round(out["wide"], 4), speedup=round(out["dense"] / out["wide"], 4),
               runs=max(50, ctx.args.runs), **extra)
    if "wide_auto" in out:
        rec.update(wide_auto_ms=round(out["wide_auto"], 4), speedup_auto=round(out["dense"] / out["wide_auto"], 4))
    if not ctx.args.no_hf:
        from transformers import DynamicCache

        with torch.no_grad():
            hfc = DynamicCache(config=base.config)
            S = cache.max_len
            for layer in range(cache.k.shape[0]):
                hfc.update(cache.k[layer, :, :, S - T:], cache.v[layer, :, :, S - T:], layer)
            tok = torch.randint(0, base.config.vocab_size, (B, 1), device=DEVICE)
            pos = torch.full((B, 1), T, device=DEVICE)

            def step():
                base(input_ids=tok, past_key_values=hfc, position_ids=pos, use_cache=True)

            def crop():
                hfc.crop(T)

            step()
            crop()
            rec["hf_eager_ms"] = round(_median_ms(step, max(50, ctx.args.runs), before=crop), 4)
            del hfc
    # realized sparsity of decode rows: one eager step with statistics
    wide_eng.track_sparsity = True
    wide_eng.reset_stats()
    cache.lengths.copy_(ctxlen)
    if wide_eng.ops == "routed":
        wide_eng.decode(torch.randint(0, base.config.vocab_size, (B,), device=DEVICE), cache)
        rec["realized_sparsity"] = {k: round(v, 4) for k, v in wide_eng.realized_sparsity().items()}
    wide_eng.track_sparsity = False
    del cache
    torch.cuda.empty_cache()
    ctx.add(rec)


def trace_layer(engine, B: int, T: int, phase: str, runs: int = 30, rep: int | None = None) -> dict:
    """Per-op time (ms) of decoder layer 0 and of the model's head/tail ops, each op in its own CUDA graph.

    Each graph holds ``rep`` back-to-back calls of the op (default 10 for decode, 1 for prefill) and the time
    is divided by ``rep``, so the ~8 µs launch floor of a single graph replay does not swamp small ops.

    Returns ``{"ops": {name: ms}, "layer_ms": sum, "embed_ms", "head_ms" (final norm + lm_head),
    "full_ms" (whole forward, one graph), "layers": L}``."""
    import torch

    vocab = engine.base.config.vocab_size
    cache = engine.new_cache(B, T + 8)
    ids = torch.randint(0, vocab, (B, T if phase == "prefill" else 1), device=DEVICE)
    res = {"ops": {}}
    if phase == "prefill":
        pad = torch.zeros(B, dtype=torch.int64, device=DEVICE)
        st = {"pos": torch.arange(T, device=DEVICE).view(1, T).expand(B, T), "valid": None, "cache": cache,
              "pad": pad, "slots": cache.prefill_slots(pad, T), "padded": False}
    else:
        cache.k.normal_()
        cache.v.normal_()
        cache.lengths.fill_(T)
        st = {"pos": cache.lengths.view(B, 1), "valid": None, "cache": cache, "slot": cache.max_len - 1 - cache.lengths}
    st["h"] = engine.embed(ids)
    engine.begin(st)  # RoPE cos/sin once per forward, as in a real pass

    rep = rep or (10 if phase == "decode" else 1)
    res["rep"] = rep

    def timed(fn):
        def many():
            for _ in range(rep):
                fn()
        gr = _capture(many, warmup=2)
        one = _median_ms(gr.replay, 1)
        return _median_ms(gr.replay, _runs_for(one, runs, 3.0)) / rep, gr

    keep = []
    res["embed_ms"], gr = timed(lambda: engine.embed(ids))
    keep.append(gr)
    for name, fn in engine.layer_steps(0, st, phase):
        if engine.ops == "dense" and name in ROUTING_OPS:  # no routing in the dense engine: nothing to time
            fn(st)
            res["ops"][name] = 0.0
            continue
        ms, gr = timed(lambda fn=fn: fn(st))
        keep.append(gr)
        res["ops"][name] = ms
    hlast = st["h"][:, -1].contiguous()
    res["head_ms"], gr = timed(lambda: engine.lm_head(engine._norm(engine.norm, hlast, None)[1]))
    keep.append(gr)
    del keep
    res["layer_ms"] = sum(res["ops"].values())
    if phase == "prefill":
        full = _capture(lambda: engine.prefill(ids, None, cache), warmup=1)
    else:
        cache.lengths.fill_(T)
        tok = ids.view(B)
        full = _capture(lambda: engine.decode(tok, cache), warmup=1)
    reset = (lambda: cache.lengths.fill_(T)) if phase == "decode" else None
    res["full_ms"] = _median_ms(full.replay, 20, before=reset)
    res["layers"] = len(engine.layers)
    del full, cache
    torch.cuda.empty_cache()
    return res


def amdahl(wide_tr: dict, dense_tr: dict) -> dict:
    """Attribution of one layer (x L) + head/tail: routed ops, routing overhead, unrouted ops; the bound
    ``dense_total / (unrouted + routed_dense / ideal)`` with ``ideal`` the routed ops' measured speedup."""
    L = wide_tr["layers"]

    def parts(tr):
        ops = tr["ops"]
        routed = sum(ops.get(k, 0.0) for k in ROUTED_OPS) * L
        routing = sum(ops.get(k, 0.0) for k in ROUTING_OPS) * L
        unrouted = (tr["layer_ms"] * L - routed - routing) + tr["embed_ms"] + tr["head_ms"]
        return routed, routing, unrouted

    wr, wo, wu = parts(wide_tr)
    dr, _, du = parts(dense_tr)
    total_d, total_w = dr + du, wr + wo + wu
    return {
        "dense_routed_ms": dr, "dense_unrouted_ms": du, "dense_unrouted_fraction": du / total_d,
        "wide_routed_ms": wr, "wide_routing_overhead_ms": wo, "wide_unrouted_ms": wu,
        "routed_path_speedup": dr / wr if wr else None,
        "predicted_speedup_sum_of_ops": total_d / total_w,
        "amdahl_bound_no_overhead": total_d / (du + wr),
        "measured_full_speedup": dense_tr["full_ms"] / wide_tr["full_ms"],
        "per_op_ratio": {k: dense_tr["ops"][k] / v for k, v in wide_tr["ops"].items()
                         if v > 0 and dense_tr["ops"].get(k, 0.0) > 0},
    }


def _fixed_mask_logits(wm, masks: dict, ids, mask):
    """WideModel's masking path with the given per-layer masks (``{(kind, layer): [bool [B, t, N_G], ...]}``,
    concatenated along t) instead of its routers: logits ``[B, T, V]`` (float32)."""
    import torch

    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    fixed = {}
    for kind in ("attn", "ffn"):
        layers = sorted(i for (k, i) in masks if k == kind)
        if layers:
            fixed[kind] = torch.stack([torch.cat(masks[(kind, i)], dim=1) for i in layers])
    with wm.masks_fixed(attn=fixed.get("attn"), ffn=fixed.get("ffn")):
        return wm(ids, attention_mask=mask, position_ids=pos).logits.float()


def check_engine(wm, base, ids, mask, new_tokens: int = 8) -> dict:
    """Self-check of the engine against WideModel's masking path on a left-padded batch (run on the GPU, bf16).

    * ``*_fixed_masks``: the masking path is given the engine's own routing decisions, so the logits must agree
      to bf16 rounding (max |diff| / max |logit| over real tokens), for the prefill and for ``new_tokens``
      teacher-forced decode steps over the static cache;
    * ``free_routing_mask_agreement_*``: both route on their own; with routers biased to a quantile many
      decisions sit at the threshold, so bf16 differences flip some of them and the flips cascade (reported,
      not a correctness criterion);
    * ``graph_vs_eager_*``: one decode step replayed from the CUDA graph vs the same step eagerly.
    """
    import torch

    from wide.inference.engine import Engine
    from wide.inference.graphs import DecodeRunner

    eng = Engine(wm)
    wm.install_hooks()
    out = {}
    try:
        with torch.no_grad():
            B, T = ids.shape
            v = mask.bool()
            eng.record_masks = True
            cache = eng.new_cache(B, T + new_tokens)
            lg = eng.prefill(ids, mask, cache, all_logits=True).float()
            masks = {k: [m] for k, m in eng.masks.items()}
            pos = (mask.cumsum(-1) - 1).clamp_min(0)
            wm.record_masks = True
            wm(ids, attention_mask=mask, position_ids=pos)
            agree = {k: (m[v] == wm.record.masks[k][v]).float().mean().item() for k, m in eng.masks.items()}
            wm.record_masks = False
            ref = _fixed_mask_logits(wm, masks, ids, mask)
            out["prefill_logits_max_rel_err_fixed_masks"] = ((lg - ref)[v].abs().max() / ref[v].abs().max()).item()
            out["free_routing_mask_agreement_min"] = min(agree.values())
            out["free_routing_mask_agreement_mean"] = sum(agree.values()) / len(agree)
            out["free_routing_mask_agreement_layer0"] = min(a for (k, i), a in agree.items() if i == 0)
            toks = lg[:, -1].argmax(-1)
            first = toks.clone()
            full_ids, full_mask, errs = ids, mask, []
            for _ in range(new_tokens):
                step = eng.decode(toks, cache).float()
                for k in masks:
                    masks[k].append(eng.masks[k])
                full_ids = torch.cat([full_ids, toks[:, None]], 1)
                full_mask = torch.cat([full_mask, torch.ones_like(toks[:, None])], 1)
                r = _fixed_mask_logits(wm, masks, full_ids, full_mask)[:, -1]
                errs.append(((step - r).abs().max() / r.abs().max()).item())
                toks = step.argmax(-1)
            out["decode_logits_max_rel_err_fixed_masks"] = max(errs)
            out["decode_steps"] = new_tokens
            eng.record_masks = False
            if DEVICE == "cuda":
                ce, cg = eng.new_cache(B, T + 2), eng.new_cache(B, T + 2)
                runner = DecodeRunner(eng, cg, graph=True)
                eng.prefill(ids, mask, ce)
                eng.prefill(ids, mask, cg)
                runner.tokens.copy_(first)
                runner.step()
                e = eng.decode(first, ce).float()
                out["graph_vs_eager_max_abs_diff"] = (runner.logits.float() - e).abs().max().item()
                out["graph_vs_eager_tokens_equal"] = bool(torch.equal(runner.tokens, e.argmax(-1)))
    finally:
        for h in wm._handles:
            h.remove()
        wm._handles = []
        wm.record_masks = eng.record_masks = False
    return out


def bench_smollm2(ctx):
    """The bundled SmolLM2-135M with its calibrated routers (prefill and decode points)."""
    import torch

    import wide

    args = ctx.args
    wm, tok = wide.load(args.smollm2_ckpt, model=args.smollm2_model, device=DEVICE, dtype=torch.bfloat16,
                        tokenizer=True)
    for h in wm._handles:  # HF eager baseline without routing hooks
        h.remove()
    wide_eng, dense_eng = _engine_pair(wm.base, wm)
    from wide.data import load_texts, pack

    sample = pack(load_texts(args.smollm2_text)[:64], tok, 2048, max_blocks=1).to(DEVICE)
    wide_eng.auto.measure_activity(sample)
    extra = dict(sparsity=wm.config.target_sparsity, G_ffn=wm.config.ffn_group_size, split="calibrated",
                 checkpoint=args.smollm2_ckpt)
    for T in [t for t in args.prompt if t <= 8192]:
        if not ctx.over():
            bench_prefill(ctx, "smollm2-135m", wm.base, wide_eng, dense_eng, 1, T, extra)
    for B in [b for b in args.batch if b <= 16]:
        if not ctx.over():
            bench_decode(ctx, "smollm2-135m", wm.base, wide_eng, dense_eng, B, 2048, extra)


# ----------------------------------------------------------------------------------------------
# report
# ----------------------------------------------------------------------------------------------


def write_report(records: list, out_dir: str, tag: str) -> None:
    """Markdown table and plot from the records: the auto engine's speedup against prompt tokens (prefill) and
    batch size (decode), colour = s, marker = G_ffn."""
    rows = ["| phase | model | split | B | prompt | s | G | realized attn / ffn / overall | HF eager ms | "
            "dense (graph) ms | WIDE ms | speedup | WIDE auto ms | speedup auto |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        rs = dict(r.get("realized_sparsity") or {})
        if "attn" in rs and "ffn" in rs:  # Eq. 6: mean over the routed modules (files written before this fix
            rs["overall"] = (rs["attn"] + rs["ffn"]) / 2  # hold a group-count-weighted "overall")
        real = " / ".join(f"{rs[k]:.3f}" for k in ("attn", "ffn", "overall") if k in rs)
        rows.append(f"| {r['phase']} | {r['model']} | {r.get('split', '')} | {r['batch']} | {r['prompt_len']} | "
                    f"{r['sparsity']} | {r['G_ffn']} | {real} | {r.get('hf_eager_ms', '')} | "
                    f"{r['dense_ms']} | {r['wide_ms']} | {r['speedup']} | {r.get('wide_auto_ms', '')} | "
                    f"{r.get('speedup_auto', '')} |")
    with open(os.path.join(out_dir, f"e2e_{tag}.md"), "w") as f:
        f.write("\n".join(rows) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:
        return
    # the quoted number: the default (auto-dispatch) engine's speedup; colour = s, marker = G_ffn, line style =
    # the other axis (prefill: batch, x = tokens B x T; decode: context, x = batch)
    colors = {0.0: "tab:gray", 0.25: "tab:blue", 0.5: "tab:red", 0.75: "tab:purple"}
    markers = {64: "^", 128: "o", 256: "s"}
    styles = ["-", "--", ":", "-."]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, phase in zip(axes, ("prefill", "decode")):
        rs = [r for r in records if r["phase"] == phase and r["model"] == "llama8b-shapes"]
        other = sorted({r["batch"] if phase == "prefill" else r["prompt_len"] for r in rs})
        series = {}
        for r in rs:
            o = r["batch"] if phase == "prefill" else r["prompt_len"]
            x = r["batch"] * r["prompt_len"] if phase == "prefill" else r["batch"]
            series.setdefault((r["sparsity"], r.get("split"), r["G_ffn"], o), []).append(
                (x, r.get("speedup_auto", r["speedup"])))
        for (sp, split, G, o), pts in sorted(series.items(), key=lambda kv: str(kv[0])):
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], color=colors.get(sp, "k"), marker=markers.get(G, "x"),
                    ls=styles[other.index(o) % len(styles)], alpha=0.8 if split != "uniform" else 0.45, ms=5,
                    label=f"s={sp} G={G} {split} " + (f"B={o}" if phase == "prefill" else f"ctx={o}"))
        ax.axhline(1.0, color="k", lw=0.6)
        ax.axhline(1.75 if phase == "prefill" else 1.65, color="r", ls="--", lw=0.8, label="goal (s=0.5)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("prompt tokens (batch x prompt length)" if phase == "prefill" else "batch size")
        ax.set_ylabel("speedup vs dense CUDA graph (auto engine)")
        ax.set_title(f"{phase}: Llama-3.1-8B shapes, bf16", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=5.5, ncol=2, loc="best")
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, f"e2e_{tag}.png"), dpi=110)


def run(args) -> int:
    """Run the sweep (see :func:`add_arguments`); returns the exit code.

    Raises:
        WideError: no CUDA GPU (the benchmark measures CUDA-graph latency).
    """
    from wide.errors import WideError

    if args.report_only:
        return report_only(os.path.join(args.out_dir, f"e2e_{args.tag}.json"), write_report, args.out_dir, args.tag)
    import torch

    if not torch.cuda.is_available():
        raise WideError("wide bench e2e measures CUDA-graph latency and needs a CUDA GPU; none is available")
    from wide import WideConfig
    from wide.model import WideModel

    os.makedirs(args.out_dir, exist_ok=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    ctx = _Ctx(args)
    a = args
    if a.quick:
        prefill_pts = [(1, T) for T in (16384, 2048, 512)]  # goal point first
        decode_pts = [(1, 2048), (4, 2048), (1, 512), (1, 16384), (16, 2048), (16, 512)]
        grid = [(0.5, 128, "paper"), (0.0, 128, "paper"), (0.5, 128, "uniform")]  # goal points first
        uniform_pts = {("prefill", 1, 16384), ("prefill", 1, 2048), ("decode", 1, 2048)}
    else:
        prefill_pts = [(B, T) for B in a.batch for T in a.prompt if B * T <= a.max_prefill_tokens]
        decode_pts = [(B, T) for B in a.batch for T in a.prompt]
        grid = [(s, G, sp) for sp in a.split for s in a.sparsity for G in a.G if not (s == 0 and sp != a.split[0])]
        uniform_pts = None
    traces = {}
    if not a.no_trace and not ("llama8b" in a.models and any(
            s in a.trace_sparsity and G == 128 and sp == "paper" for s, G, sp in grid)):
        print(f"note: no per-op trace in this run: it traces Llama-3.1-8B-shaped points of the sweep with the paper "
              f"split, G_ffn 128 and a sparsity in --trace-sparsity {a.trace_sparsity}", flush=True)
    if "llama8b" in a.models:
        base = build_llama8b()
        kv_per_tok = 2 * base.config.num_hidden_layers * base.config.num_key_value_heads * 128 * 2
        print(f"built Llama-3.1-8B-shaped model in {time.time() - ctx.t0:.0f} s", flush=True)
        calib = torch.randint(0, base.config.vocab_size, (1, 2048), device=DEVICE)
        checked = smoked = False
        fused = True
        for s, G, split in grid:
            if ctx.over():
                break
            sa, sf = split_sparsity(s, split)
            wm = WideModel(base, WideConfig(ffn_group_size=G, target_sparsity=max(s, 0.0)), init_keep=0.5)
            for h in wm._handles:  # the engine calls the routers itself; keep the HF baseline hook-free
                h.remove()
            wide_eng, dense_eng = _engine_pair(base, wm, fused=fused)
            bias_routers(wide_eng, calib, sa, sf)
            wide_eng.auto.measure_activity(calib)  # per-layer activity for the auto engine's dispatch
            if fused and not smoked:
                smoked = True
                try:
                    smoke(wide_eng, dense_eng, base.config.vocab_size)
                except Exception as e:  # noqa: BLE001  (fall back to the model's own PyTorch norm / RoPE ops)
                    import traceback

                    traceback.print_exc()
                    print(f"fused unrouted kernels failed ({type(e).__name__}); using the PyTorch ops", flush=True)
                    fused = False
                    wide_eng, dense_eng = _engine_pair(base, wm, fused=False)
            if not checked and s > 0:
                checked = True
                try:
                    cids = torch.randint(0, base.config.vocab_size, (2, 128), device=DEVICE)
                    cmask = torch.ones_like(cids)
                    cmask[1, :28] = 0
                    chk = check_engine(wm, base, cids, cmask)
                    chk.update(model="llama8b-shapes", sparsity=s, G_ffn=G, split=split, gpu=ctx.gpu, date=ctx.date)
                    with open(os.path.join(a.out_dir, f"e2e_{a.tag}_check.json"), "w") as f:
                        json.dump(chk, f, indent=1)
                    print(f"check: {json.dumps(chk)}", flush=True)
                except Exception as e:  # noqa: BLE001
                    import traceback

                    traceback.print_exc()
                    print(f"check failed: {type(e).__name__}: {e}", flush=True)
            extra = dict(sparsity=s, G_ffn=G, split=split, target_attn=round(sa, 4), target_ffn=round(sf, 4),
                         fused_unrouted=fused)
            for phase in a.phases:
                pts = prefill_pts if phase == "prefill" else decode_pts
                for B, T in pts:
                    if uniform_pts is not None and split == "uniform" and (phase, B, T) not in uniform_pts:
                        continue
                    if phase == "decode" and B * (T + 8) * kv_per_tok / 1e9 > a.max_kv_gb:
                        print(f"skip decode B={B} T={T}: KV cache over --max-kv-gb", flush=True)
                        continue
                    if ctx.over():
                        print(f"time budget reached: skipping {phase} B={B} T={T} s={s} G={G} {split}", flush=True)
                        continue
                    try:
                        fn = bench_prefill if phase == "prefill" else bench_decode
                        fn(ctx, "llama8b-shapes", base, wide_eng, dense_eng, B, T, extra)
                    except Exception as e:  # noqa: BLE001  (keep the points measured so far)
                        import traceback

                        traceback.print_exc()
                        print(f"FAILED {phase} B={B} T={T} s={s} G={G} {split}: {type(e).__name__}: "
                              f"{str(e).splitlines()[0] if str(e) else ''}", flush=True)
                        torch.cuda.empty_cache()
            if not a.no_trace and s in a.trace_sparsity and G == 128 and split == "paper" and not ctx.over():
                for phase, B, T in a.trace_points:
                    key = f"{phase}_B{B}_T{T}" + ("" if s == 0.5 else f"_s{s:g}")
                    try:
                        tw = trace_layer(wide_eng, B, T, phase)
                        td = trace_layer(dense_eng, B, T, phase)
                        ta = trace_layer(wide_eng.auto, B, T, phase)
                        traces[key] = {"wide": tw, "dense": td, "amdahl": amdahl(tw, td),
                                       "wide_auto": ta, "amdahl_auto": amdahl(ta, td),
                                       "sparsity": s, "G_ffn": G, "split": split,
                                       "gpu": ctx.gpu, "date": ctx.date, "command": ctx.command}
                        with open(os.path.join(a.out_dir, f"e2e_{a.tag}_trace.json"), "w") as f:
                            json.dump(traces, f, indent=1)
                        print(f"trace {key}: {json.dumps(traces[key]['amdahl'])}", flush=True)
                    except Exception as e:  # keep the sweep's results
                        print(f"trace {key} failed: {type(e).__name__}: {e}", flush=True)
            del wm, wide_eng, dense_eng
            torch.cuda.empty_cache()
        del base
        torch.cuda.empty_cache()
    if "smollm2" in a.models and not ctx.over():
        try:
            bench_smollm2(ctx)
        except (WideError, ImportError, OSError) as e:
            print(f"SmolLM2 part skipped: {str(e).splitlines()[0]}", flush=True)
    write_report(ctx.records, a.out_dir, a.tag)
    print(f"wrote {len(ctx.records)} records to {ctx.out_json} in {time.time() - ctx.t0:.0f} s", flush=True)
    return 0


def main(argv=None) -> int:
    p = add_arguments(argparse.ArgumentParser(prog="python -m wide.bench.e2e", description=__doc__.split("\n")[0]))
    try:
        return run(p.parse_args(argv))
    except Exception as e:  # noqa: BLE001
        from wide.errors import WideError

        if isinstance(e, WideError):
            print(f"wide bench e2e: error: {e}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    raise SystemExit(main())
