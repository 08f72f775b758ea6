"""The ``wide`` command line: the parser (from each command module's ``add_parser``) and :func:`main`, which
dispatches; bad input ends with one line on stderr naming the value and what is allowed, and exit code 2."""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import sys
import warnings

from wide.cli import bench, demo, evaluate, generate, train
from wide.cli.common import WideArgumentParser


def build_parser() -> WideArgumentParser:
    """The ``wide`` parser with every subcommand."""
    from wide import __version__
    p = WideArgumentParser(prog="wide", description="WIDE: token-level dynamic width pruning for LLMs")
    p.add_argument("--version", action="version", version=f"wide {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    evaluate.add_info(sub)
    train.add_parsers(sub)
    evaluate.add_parsers(sub)
    demo.add_parser(sub)
    bench.register(sub)
    generate.register(sub)
    return p


@contextlib.contextmanager
def _one_line_warnings(command: str):
    """Show each WideWarning as one line ``wide <command>: warning: <message>``; others keep Python's format."""
    from wide.errors import WideWarning
    with warnings.catch_warnings():
        show = warnings.showwarning
        warnings.showwarning = lambda message, category, *a, **k: (
            print(f"wide {command}: warning: {message}", file=sys.stderr, flush=True)
            if issubclass(category, WideWarning) else show(message, category, *a, **k))
        yield


@contextlib.contextmanager
def _term_as_interrupt():
    """SIGTERM raises KeyboardInterrupt in the main thread, as Ctrl-C does; yields ``{"signal": SIGTERM or None}``
    and puts the previous handler back afterwards (outside the main thread nothing changes)."""
    import signal
    import threading
    got: dict = {"signal": None}
    def handler(signum, frame):
        got["signal"] = signum
        raise KeyboardInterrupt
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, handler) if main_thread else None
    try:
        yield got
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)


def _resume_hint(args) -> str:
    """What an interrupted command left behind and how to continue it."""
    from wide.train.loop import has_train_state
    out = str(getattr(args, "output", ""))
    q, saved = shlex.quote(out), args.command in ("demo", "calibrate", "lora") and has_train_state(out)
    if args.command == "demo" and getattr(args, "calibrated", False):
        return f"; the calibration was complete and is saved in {out!r}: `wide eval-ppl --wide {q}` evaluates it"
    if args.command == "demo":
        return (f"; the calibration's last saved state is in {out!r}: `wide calibrate -o {q} --resume` finishes it "
                f"(then `wide eval-ppl --wide {q}`)") if saved else ""
    if args.command in ("calibrate", "lora"):
        return (f"; the last state saved (every --save-every {args.save_every} steps) is in {out!r}: add --resume "
                f"to continue from it" if saved else f"; nothing was saved yet (the first save is at step "
                f"{min(args.save_every, args.steps)}), so there is nothing to resume")
    return ""


def main(argv: list[str] | None = None) -> int:
    """Run ``wide <argv>`` (default ``sys.argv[1:]``) and return its exit code."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raw = list(sys.argv[1:] if argv is None else argv)
    name = "wide"
    try:  # Ctrl-C while the command line is parsed or torch imports (about half a second): the same one line
        parser = build_parser()
        if raw[:1] == ["lm-eval"]:  # lm-eval parses its own options
            args = argparse.Namespace(command="lm-eval", func=evaluate.cmd_lm_eval, parser=parser)
        else:
            args = parser.parse_args(raw)
        args.argv = raw
        name = f"wide {args.command}"
        from wide.hub import check_device
        from wide.kernels._common import env_backend
        from wide.train.fsdp import launched_by_torchrun
    except KeyboardInterrupt:
        print(f"{name}: interrupted", file=sys.stderr)
        return 130
    def run():
        train.take_saved_options(parser, args)  # --resume: options not given are the saved run's (device too)
        check_device(getattr(args, "device", None), "--device")  # every command with --device, before any work
        for var in ("WIDE_GEMM_BACKEND", "WIDE_ATTN_BACKEND"):  # read by the kernels, checked before any work
            env_backend(var)
        with _one_line_warnings(args.command):
            return args.func(args)
    if launched_by_torchrun():  # a torchrun worker: any rank's error ends the job with one line, no hang
        import wide.train.fsdp as D
        ok = False
        try:
            rc = run()
            ok = True
            return rc
        except (Exception, KeyboardInterrupt) as e:  # noqa: BLE001
            return D.report_error(args.command, e)
        finally:
            D.shutdown(synchronize=ok)
    term: dict = {"signal": None}
    try:
        with _term_as_interrupt() as term:
            return run()
    except ValueError as e:  # bad input: a ValueError of ours (WideError, the kernels' KernelArgumentError)
        if not any(c.__module__.split(".")[0] == "wide" for c in type(e).__mro__):
            raise
        sub = getattr(args, "bench", None) if args.command == "bench" else None  # wide bench <name>: its own prefix
        print(f"wide {args.command}{'' if sub is None else ' ' + sub}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        how = " (SIGTERM)" if term["signal"] is not None else ""
        print(f"wide {args.command}: interrupted{how}{_resume_hint(args)}", file=sys.stderr)
        return 128 + int(term["signal"]) if term["signal"] is not None else 130
