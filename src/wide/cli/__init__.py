"""The ``wide`` command line: ``info``, ``calibrate``, ``lora``, ``eval-ppl``, ``eval``, ``lm-eval``,
``prune-static``, ``demo``, ``generate`` (and ``bench``).

Bad input ends with one line on stderr naming the bad value and what is allowed, and exit code 2.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import sys
import warnings

from wide.cli.common import (  # noqa: F401  (re-exported: the tests import them from wide.cli)
    WideArgumentParser,
    _add_dist,
    _add_layout,
    _add_method,
    _add_model,
    _add_train,
    _demo_settings,
    _hf_config,
    _need_extra,
    check_device,
)
from wide.cli.demo import cmd_demo
from wide.cli.evaluate import cmd_eval, cmd_eval_ppl, cmd_info, cmd_prune_static
from wide.cli.train import _take_saved_options, cmd_calibrate, cmd_lora
from wide.errors import WideError


# --- parser ----------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    """The ``wide`` parser; every (sub)command parser is a :class:`WideArgumentParser` (one-line usage errors)."""
    p = WideArgumentParser(prog="wide", description="WIDE: token-level dynamic width pruning for LLMs")
    from wide import __version__

    p.add_argument("--version", action="version", version=f"wide {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("info", help="model dims, legal group sizes and router parameter count",
                       description="Read --model's config (no weights) and print its dims, maximum context, the legal "
                                   "attention / FFN group sizes, and the router parameter count of the layout "
                                   "given by the options below.")
    _add_model(s, device=False)  # --device is still accepted (and checked), but info loads no weights
    _add_layout(s.add_argument_group("router layout (WideConfig)"))
    s.set_defaults(func=cmd_info)

    s = sub.add_parser("calibrate", help="stage 1: train the routers to a target sparsity (base frozen)")
    _add_model(s)
    s.add_argument("--text", default=None, help="calibration text: .txt, .jsonl with 'text', datasets folder "
                                                "(default: BoolQ Wikipedia passages, calibration split)")
    s.add_argument("--output", "-o", required=True, help="checkpoint directory")
    s.add_argument("--resume", action="store_true",
                   help="continue from the training state in --output (train_state.pt, or train_state.dcp of a "
                        "multi-process run); options not given take the saved run's values")
    s.add_argument("--overwrite", action="store_true",
                   help="start a new run in a non-empty --output: its old training state and log are removed "
                        "when training starts, its other files replaced as the new ones are saved")
    _add_method(s)
    _add_train(s)
    _add_dist(s)
    s.set_defaults(func=cmd_calibrate)

    s = sub.add_parser("lora", help="stage 2: LoRA recovery on top of a stage-1 checkpoint (peft, all 7 projections)")
    _add_model(s)
    s.add_argument("--wide", default=None, help="stage-1 WIDE checkpoint directory (`wide calibrate` output); "
                                                "required, except with --resume (the saved run's)")
    s.add_argument("--text", default=None, help="training text (default: BoolQ passages, calibration split)")
    s.add_argument("--output", "-o", required=True, help="output WIDE directory (routers, config, adapter/)")
    s.add_argument("--resume", action="store_true", help="continue from the training state in --output; options "
                                                          "not given take the saved run's values")
    s.add_argument("--overwrite", action="store_true",
                   help="start a new run in a non-empty --output: its old training state and log are removed "
                        "when training starts, its other files replaced as the new ones are saved")
    s.add_argument("--freeze-router", action="store_true", help="keep the stage-1 routers fixed; train only LoRA")
    g = s.add_argument_group("LoRA (peft)")
    g.add_argument("--lora-r", type=int, default=16, help="LoRA rank r")
    g.add_argument("--lora-alpha", type=float, default=32.0, help="lora_alpha; peft scales by alpha / r")
    g.add_argument("--lora-dropout", type=float, default=0.1,
                   help="dropout on the LoRA input, in [0, 1) (default: 0.1)")
    _add_train(s, lr=2e-4)
    _add_dist(s)
    s.set_defaults(func=cmd_lora)

    s = sub.add_parser("eval-ppl", help="token perplexity, dense and WIDE side by side, with realized sparsity")
    _add_model(s)
    s.add_argument("--wide", default=None, help="WIDE checkpoint directory (omit for dense only)")
    s.add_argument("--text", default=None, help="evaluation text (default: BoolQ passages, evaluation split)")
    s.add_argument("--ctx", type=int, default=2048,
                   help="tokens per window (>= 2, at most the model's max_position_embeddings; default: 2048)")
    s.add_argument("--batch-size", type=int, default=1, help="windows per forward pass (>= 1; default: 1)")
    s.add_argument("--max-tokens", type=int, default=None,
                   help="evaluate at most this many tokens: the first N of the text, in windows of --ctx (one "
                        "shorter window when N < --ctx) (>= 2; default: all)")
    s.add_argument("--layers", action="store_true", help="print the per-layer sparsity table")
    s.add_argument("--json", default=None, help="write results to this JSON file")
    s.add_argument("--no-memory-check", dest="memory_check", action="store_false",
                   help="skip the check, before the weights load, that the weights and one forward pass (the "
                        "--batch-size x --ctx x vocabulary logits in float32 are the big term) fit in the memory "
                        "available (RAM on CPU, free GPU memory on CUDA)")
    s.set_defaults(func=cmd_eval_ppl)

    s = sub.add_parser("eval", help="zero-shot accuracy (lm-eval, offline tasks) and, with --tasks all, WikiText-2 "
                                    "word perplexity")
    _add_model(s)
    s.add_argument("--wide", default=None, help="WIDE / SkipGPT checkpoint directory (omit for the dense --model)")
    s.add_argument("--tasks", default="zeroshot",
                   help="comma list: zeroshot (the seven zero-shot tasks, offline), all (zeroshot + wikitext, "
                        "needs wiki.test.raw: --wikitext), arc_easy, arc_challenge, boolq, hellaswag, piqa, "
                        "winogrande, openbookqa, wikitext (default: zeroshot)")
    s.add_argument("--batch-size", type=int, default=8, help="requests per forward pass (>= 1; default: 8)")
    s.add_argument("--limit", type=float, default=None,
                   help="at most N documents per task (a whole number >= 1), or a fraction in (0, 1) (default: all)")
    s.add_argument("--dtype", default=None, help="bfloat16, float16 or float32 (default: bf16 on GPU, fp32 on CPU)")
    s.add_argument("--max-length", type=int, default=None, help="context limit (default: the model's)")
    s.add_argument("--wikitext", default=None, help="wiki.test.raw (default: $WIDE_WIKITEXT or shared/data)")
    s.add_argument("--keep-lora", action="store_true", help="keep a stage-2 adapter as peft layers (default: merge)")
    s.add_argument("--bootstrap-iters", type=int, default=1000, help="lm-eval stderr bootstrap (0 = none)")
    s.add_argument("--json", default=None, help="write the summary and lm-eval's results to this JSON file")
    s.set_defaults(func=cmd_eval)

    s = sub.add_parser("lm-eval", help="lm-eval's own command line with the `wide` model type and our tasks "
                                       "(e.g. wide lm-eval --model wide --model_args wide=CKPT --tasks wide_zeroshot)")
    s.add_argument("lm_eval_args", nargs=argparse.REMAINDER)
    s.set_defaults(func=lambda a: __import__("wide.eval.lm_eval", fromlist=["x"]).lm_eval_main(a.lm_eval_args))

    s = sub.add_parser("prune-static", help="static width baseline: remove the same head groups / FFN groups for "
                                            "every token, scored on calibration text; saves a smaller HF model")
    _add_model(s)
    s.add_argument("--sparsity", "-S", type=float, default=None,
                   help="target S in [0, 1): mean over attention and FFN modules of the removed fraction, split "
                        "between them by the calibration loss (or give --attn-sparsity and --ffn-sparsity instead)")
    s.add_argument("--output", "-o", required=True, help="output directory (a HF checkpoint usable as --model)")
    s.add_argument("--text", default=None, help="calibration text (default: BoolQ passages, calibration split)")
    s.add_argument("--attn-group-size", type=int, default=None, help="a multiple of the GQA group H_q/H_k x head_dim (default: the GQA group)")
    s.add_argument("--ffn-group-size", type=int, default=128,
                   help="FFN G: power of two >= 16 dividing the FFN size (default: 128)")
    s.add_argument("--attn-sparsity", type=float, default=None, help="fix the attention fraction (with --ffn-sparsity)")
    s.add_argument("--ffn-sparsity", type=float, default=None, help="fix the FFN fraction (with --attn-sparsity)")
    s.add_argument("--calib-blocks", type=int, default=32,
                   help="calibration sequences to score on (>= 1; default: 32)")
    s.add_argument("--seq-len", type=int, default=2048, help="tokens per calibration sequence (>= 2; default: 2048)")
    s.add_argument("--batch-size", type=int, default=4, help="sequences per forward pass (>= 1; default: 4)")
    s.add_argument("--overwrite", action="store_true", help="write into a non-empty --output")
    s.add_argument("--no-memory-check", dest="memory_check", action="store_false",
                   help="skip the check, before the weights load, that the weights and one scoring pass of "
                        "--batch-size x --seq-len tokens fit in the memory available (RAM on CPU, free GPU memory "
                        "on CUDA)")
    s.set_defaults(func=cmd_prune_static)

    s = sub.add_parser("demo", help="dense ppl, short calibration to S=0.5, WIDE ppl, per-layer table, save")
    _add_model(s)
    s.add_argument("--text", default=None,
                   help="text for calibration and evaluation: .txt, .jsonl with 'text', datasets folder, used whole "
                        "for both (default: BoolQ Wikipedia passages, disjoint calibration / evaluation splits)")
    s.add_argument("--output", "-o", default="runs/demo",
                   help="checkpoint directory; also gets demo_result.json (default: runs/demo); must be empty "
                        "or new unless --overwrite")
    s.add_argument("--overwrite", action="store_true",
                   help="replace the checkpoint in a non-empty --output (`make demo` passes it)")
    s.add_argument("--ctx", type=int, default=None,
                   help="evaluation window in tokens (>= 2; default: auto, 512 on CPU, 2048 on GPU)")
    s.add_argument("--eval-tokens", type=int, default=None,
                   help="evaluate at most this many tokens (>= 2; default: auto, 12288 on CPU, all on GPU)")
    _add_method(s)
    _add_train(s, batch=4, lr=1e-2, auto={"steps": "80 on CPU, 300 on GPU", "seq_len": "256 on CPU, 2048 on GPU"},
               grad_checkpoint=True)
    s.set_defaults(func=cmd_demo)

    try:
        from wide.bench import cli as bench_cli
    except ImportError:
        bench_cli = None
    if bench_cli is not None:
        bench_cli.register(sub)
    from wide.cli.generate import register as register_generate

    register_generate(sub)
    return p


@contextlib.contextmanager
def _one_line_warnings(command: str):
    """While the command runs, show each :class:`~wide.errors.WideWarning` as one line on stderr,
    ``wide <command>: warning: <message>`` (no file name, line number or source line); other warnings keep
    Python's format."""
    from wide.errors import WideWarning

    with warnings.catch_warnings():  # puts the original showwarning back afterwards
        python_show = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None):
            if issubclass(category, WideWarning):
                print(f"wide {command}: warning: {message}", file=sys.stderr, flush=True)
            else:
                python_show(message, category, filename, lineno, file, line)

        warnings.showwarning = show
        yield


@contextlib.contextmanager
def _term_as_interrupt():
    """While the command runs, SIGTERM (``timeout``, ``kill``, a batch scheduler) raises KeyboardInterrupt in
    the main thread like Ctrl-C, so the same cleanup and ``interrupted`` line follow; yields a dict whose
    ``"signal"`` is set to ``SIGTERM`` when that happened. The previous handler is put back afterwards. Outside
    the main thread (no signal handlers there) nothing changes."""
    import signal
    import threading

    got: dict = {"signal": None}
    if threading.current_thread() is not threading.main_thread():
        yield got
        return

    def handler(signum, frame):
        got["signal"] = signum
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield got
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``wide`` command: parse ``argv`` (default ``sys.argv[1:]``), run the subcommand and
    return its exit code (2 with one ``wide <command>: error: ...`` line for bad input)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raw = list(sys.argv[1:] if argv is None else argv)
    if raw[:1] == ["lm-eval"]:  # pass everything through untouched (argparse would eat lm-eval's options)
        try:
            _need_extra("lm_eval", "wide lm-eval")
        except WideError as e:
            print(f"wide lm-eval: error: {e}", file=sys.stderr)
            return 2
        from wide.eval.lm_eval import lm_eval_main

        try:
            return lm_eval_main(raw[1:])  # lm-eval's own errors come back as one line and exit 2
        except KeyboardInterrupt:
            print("wide lm-eval: interrupted", file=sys.stderr)
            return 130
    args = build_parser().parse_args(argv)
    args.argv = raw
    from wide.train.fsdp import launched_by_torchrun

    if launched_by_torchrun():  # a torchrun worker: any rank's error ends the job with one line, no hang
        import wide.train.fsdp as D

        ok = False
        try:
            _take_saved_options(args)
            check_device(getattr(args, "device", None))
            with _one_line_warnings(args.command):
                rc = args.func(args)
            ok = True
            return rc
        except (Exception, KeyboardInterrupt) as e:  # noqa: BLE001
            return D.report_error(args.command, e)
        finally:
            D.shutdown(synchronize=ok)
    term: dict = {"signal": None}
    try:
        _take_saved_options(args)  # --resume: the options not given are the saved run's (device included)
        check_device(getattr(args, "device", None))  # every command with --device, before any work
        with _one_line_warnings(args.command), _term_as_interrupt() as term:
            return args.func(args)
    except WideError as e:
        print(f"wide {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        hint = ""
        from wide.train.loop import has_train_state

        if args.command == "demo" and getattr(args, "calibrated", False):
            hint = (f"; the calibration was complete and is saved in {str(args.output)!r}: `wide eval-ppl --wide "
                    f"{shlex.quote(str(args.output))}` evaluates it")
        elif args.command == "demo" and has_train_state(args.output):
            hint = (f"; the calibration's last saved state is in {str(args.output)!r}: `wide calibrate -o "
                    f"{shlex.quote(str(args.output))} --resume` finishes it (then `wide eval-ppl --wide "
                    f"{shlex.quote(str(args.output))}`)")
        if args.command in ("calibrate", "lora"):
            hint = (f"; the last state saved (every --save-every {args.save_every} steps) is in "
                    f"{str(args.output)!r}: add --resume to continue from it" if has_train_state(args.output)
                    else f"; nothing was saved yet (the first save is at step "
                         f"{min(args.save_every, args.steps)}), so there is nothing to resume")
        if term["signal"] is not None:  # SIGTERM: exit 128 + 15 as a shell reports a terminated command
            print(f"wide {args.command}: interrupted (SIGTERM){hint}", file=sys.stderr)
            return 128 + int(term["signal"])
        print(f"wide {args.command}: interrupted{hint}", file=sys.stderr)
        return 130


__all__ = ["build_parser", "check_device", "cmd_calibrate", "cmd_demo", "cmd_eval", "cmd_eval_ppl", "cmd_info",
           "cmd_lora", "cmd_prune_static", "main"]
