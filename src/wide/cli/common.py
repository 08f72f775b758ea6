"""Shared pieces of the ``wide`` command line: the parser class and option groups, the input checks that run
before any weight is loaded, model / checkpoint loading and the small printing helpers."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from wide.errors import WideError


class WideArgumentParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage errors are one line on stderr and exit code 2:
    ``<prog>: error: <message> (see <prog> --help)``, e.g. ``wide calibrate: error: argument --steps: invalid
    int value: 'x' (see wide calibrate --help)``, instead of the whole usage block.

    Subcommand parsers made through :meth:`add_subparsers` are of this class too, and an unrecognized argument
    is reported by the (innermost) subcommand it was given to.  Abbreviated long options are not accepted
    (``allow_abbrev=False``): ``wide eval-ppl --mode global`` would otherwise be read as ``--model global``.
    """

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        """Print ``<prog>: error: <message> (see <prog> --help)`` to stderr and exit with code 2.

        Raises:
            SystemExit: always, with code 2.
        """
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def parse_args(self, args=None, namespace=None):
        """As ``ArgumentParser.parse_args``; unrecognized arguments are reported by the subcommand's parser.

        Raises:
            SystemExit: code 2 on a usage error (one line, see :meth:`error`), code 0 after ``--help``.
        """
        ns, extra = self.parse_known_args(args, namespace)
        if extra:
            self._innermost(ns).error(f"unrecognized arguments: {' '.join(extra)}")
        return ns

    def _innermost(self, ns) -> argparse.ArgumentParser:
        """The parser of the deepest subcommand chosen in ``ns`` (this parser when none was)."""
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction) and action.dest != argparse.SUPPRESS:
                sub = action.choices.get(getattr(ns, action.dest, None))
                if sub is not None:
                    return sub._innermost(ns) if isinstance(sub, WideArgumentParser) else sub
        return self


# --- shared options --------------------------------------------------------------------------------
def _add_model(p: argparse.ArgumentParser, device: bool = True) -> None:
    """``--model`` and ``--device``; ``device=False`` keeps ``--device`` accepted (and checked) but out of the
    help, for a command that loads no weights."""
    p.add_argument("--model", default=None,
                   help="local HF checkpoint dir, .gguf file, or 'smollm2-135m' (default: the bundled SmolLM2-135M-Instruct GGUF)")
    p.add_argument("--device", default=None,
                   help="cpu, cuda or cuda:N (default: cuda if available)" if device else argparse.SUPPRESS)


def _add_method(p: argparse.ArgumentParser, sparsity_default: float = 0.5) -> None:
    """The WideConfig options of a training command: the calibration objective and the router layout."""
    g = p.add_argument_group("WIDE method (WideConfig)")
    g.add_argument("--sparsity", "-S", type=float, default=sparsity_default,
                   help=f"target sparsity S in [0, 1) (default: {sparsity_default})")
    g.add_argument("--alpha", type=float, default=20.0, help="sparsity-loss weight (>= 0; default 20.0)")
    g.add_argument("--tau-start", type=float, default=5.0,
                   help="Gumbel-softmax temperature at the first calibration step (1e-3 to 1e3; default 5.0)")
    g.add_argument("--tau-end", type=float, default=0.5,
                   help="temperature at the last step, annealed linearly (1e-3 to 1e3; default 0.5)")
    g.add_argument("--mode", choices=["global", "uniform"], default="global",
                   help="global = Eq. 6, uniform = Eq. 22 (attention and FFN each at S) (default: global)")
    _add_layout(g)


def _add_layout(g) -> None:
    """The options that decide the routers' shape and count (all ``wide info`` needs)."""
    g.add_argument("--attn-group-size", type=int, default=None,
                   help="attention G: multiple of head_dim dividing the attention width (default: the GQA group)")
    g.add_argument("--ffn-group-size", type=int, default=128,
                   help="FFN G: power of two >= 16 dividing the FFN size (default: 128)")
    g.add_argument("--rank", type=int, default=16, help="router bottleneck rank r (default: 16)")
    g.add_argument("--routed", choices=["both", "attn", "ffn"], default="both",
                   help="which sublayers get routers (default: both)")
    g.add_argument("--method", choices=["wide", "skipgpt"], default="wide",
                   help="wide = group routing (§3.1); skipgpt = the dynamic-depth baseline (§4.1): one router per "
                        "module, whole-module gates, rank raised to match the router parameters of WIDE with "
                        "--rank / --attn-group-size / --ffn-group-size")
    g.add_argument("--skipgpt-rank", type=int, default=None,
                   help="with --method skipgpt: use this router rank instead of the matched one")


def _add_train(p: argparse.ArgumentParser, steps: int | None = 500, batch: int = 8, seq_len: int | None = 2048,
               lr: float = 5e-3, auto: dict[str, str] | None = None, grad_checkpoint: bool = False) -> None:
    """The training options; ``auto`` maps ``"steps"`` / ``"seq_len"`` to the help text of an automatic default
    (the option then defaults to ``None``, shown as ``auto``); ``grad_checkpoint`` adds ``--grad-checkpoint``
    here (commands with ``--nproc`` get it from :func:`_add_dist`)."""
    auto = auto or {}

    def default(name: str, value) -> str:
        return f"default: auto, {auto[name]}" if name in auto else f"default: {value}"

    g = p.add_argument_group("calibration run")
    g.add_argument("--steps", type=int, default=None if "steps" in auto else steps,
                   help=f"optimizer steps (>= 1; {default('steps', steps)})")
    g.add_argument("--batch-size", type=int, default=batch, help=f"sequences per micro-batch (default: {batch})")
    g.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step (default: 1)")
    g.add_argument("--seq-len", type=int, default=None if "seq_len" in auto else seq_len,
                   help=f"tokens per packed sequence (>= 2; {default('seq_len', seq_len)})")
    g.add_argument("--lr", type=float, default=lr, help=f"peak learning rate (> 0, at most 1; default: {lr:g})")
    g.add_argument("--warmup-steps", type=int, default=None,
                   help="linear warm-up steps (0 to --steps; default: 5%% of --steps)")
    g.add_argument("--seed", type=int, default=0,
                   help="random seed of data order and router init (0 to 2**32 - 1; default: 0)")
    g.add_argument("--save-every", type=int, default=100, help="checkpoint every N steps (default: 100)")
    g.add_argument("--max-blocks", type=int, default=None,
                   help="use at most this many packed sequences (>= 1; default: all)")
    if grad_checkpoint:
        g.add_argument("--grad-checkpoint", action="store_true",
                       help="activation checkpointing: recompute each decoder layer in backward (less memory)")
    g.add_argument("--no-memory-check", dest="memory_check", action="store_false",
                   help="skip the check, before the first step, that one micro-batch's estimated training memory "
                        "fits in the memory available (RAM on CPU, free GPU memory on CUDA)")


def _add_dist(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("scaling out (FSDP2)")
    g.add_argument("--nproc", type=int, default=None,
                   help="run on N local processes / GPUs through torch.distributed.run (same as "
                        "`torchrun --nproc-per-node N -m wide ...`); --batch-size is per process")
    g.add_argument("--grad-checkpoint", action="store_true",
                   help="activation checkpointing: recompute each decoder layer in backward (less memory)")
    g.add_argument("--no-reshard-after-forward", dest="reshard_after_forward", action="store_false",
                   help="FSDP2: keep each decoder layer's gathered weights from forward to backward (one "
                        "all-gather of the base a step instead of two; every GPU then holds the whole base)")


def _config_from(args):
    """The WideConfig of the ``_add_method`` / ``_add_layout`` options (the objective's options that a command
    lacks, e.g. ``wide info``'s, keep the WideConfig defaults).

    Raises:
        WideError: a bad value (see :meth:`wide.config.WideConfig.validate`; for a training command also
            :meth:`~wide.config.WideConfig.check_training`), or ``--skipgpt-rank`` without ``--method skipgpt``.
            An ``--ffn-group-size`` that is not a power of two >= 16 is named with the legal sizes of ``--model``
            (read from its config, as ``wide info`` lists them).
    """
    from wide.config import WideConfig

    _check_ffn_group_size(args)
    objective = {k: getattr(args, a) for k, a in (("target_sparsity", "sparsity"), ("alpha", "alpha"),
                                                  ("tau_start", "tau_start"), ("tau_end", "tau_end"),
                                                  ("sparsity_mode", "mode")) if hasattr(args, a)}
    cfg = WideConfig(attn_group_size=args.attn_group_size, ffn_group_size=args.ffn_group_size,
                     router_rank=args.rank, routed=args.routed, **objective)
    if hasattr(args, "tau_start"):  # a training command: the temperatures must be in the trainable range
        cfg.check_training()
    method = getattr(args, "method", "wide")
    if getattr(args, "skipgpt_rank", None) is not None and method != "skipgpt":
        raise WideError(f"--skipgpt-rank {args.skipgpt_rank} needs --method skipgpt")
    if method == "skipgpt":  # §4.1: SkipGPT's rank matches the router capacity of this WIDE config
        from wide.baselines.skipgpt import skipgpt_config

        cfg = skipgpt_config(_model_dims(args.model), cfg, rank=args.skipgpt_rank)
    return cfg


def _check_ffn_group_size(args) -> None:
    """An ``--ffn-group-size`` that is not a power of two >= 16: the message lists the legal sizes of ``--model``
    (read from its config alone), from the helper ``wide info`` uses
    (:meth:`wide.config.ModelDims.ffn_group_size_error`). Other values are left to the command's own checks.

    Raises:
        WideError: as above, or the model's config cannot be read (:func:`_hf_config`).
    """
    g = getattr(args, "ffn_group_size", None)
    if isinstance(g, int) and not isinstance(g, bool) and (g < 16 or g & (g - 1)) and hasattr(args, "model"):
        from wide.model import dims_of

        src, hf = _hf_config(args.model)
        bad = dims_of(hf).ffn_group_size_error(g, f" of {src.ref}")
        if bad:
            raise WideError(bad)


def _hf_config(model):
    """``(source, Hugging Face config)`` of ``--model``, read from its config alone (no weights).

    Raises:
        WideError: the model is not found, its config cannot be read (a truncated GGUF is named as such), or its
            architecture is not supported.
    """
    from wide.model import check_architecture, read_hf_config, resolve_model

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    src = resolve_model(model)
    hf = read_hf_config(src)
    check_architecture(hf)
    return src, hf


def _model_dims(model):
    """ModelDims of ``--model`` read from its config alone (no weights)."""
    from wide.model import dims_of

    return dims_of(_hf_config(model)[1])


def _need_extra(module: str, what: str) -> None:
    """Raise WideError naming the missing optional package and the extra that installs it."""
    import importlib.util

    if importlib.util.find_spec(module) is None:
        raise WideError(f"{what} needs the '{module}' package, which is not installed: "
                        f"pip install 'wide[quality]' (or, in this repository, .venv/bin/pip install -e '.[quality]')")


def _at_least(option: str, value, low: int) -> None:
    """Raise WideError ``"<option> <value> must be >= <low>"`` unless ``value`` is ``None`` or ``>= low``."""
    if value is not None and not value >= low:
        raise WideError(f"{option} {value} must be >= {low}")


def check_device(device) -> None:
    """``--device`` must be ``cpu``, ``cuda`` or ``cuda:N`` naming a GPU of this machine (None = automatic).

    Shared by every subcommand that takes ``--device`` (:func:`main` runs it before the command); the check
    itself is :func:`wide.model.check_device`, which :func:`wide.load` runs too.

    Raises:
        WideError: an unknown device string, CUDA without a CUDA GPU, or ``cuda:N`` past the last GPU.
    """
    from wide.model import check_device as check

    check(device, "--device")


def _check_ancestors(option: str, path) -> None:
    """Raise WideError if ``path`` could not be written: its nearest existing parent is a file, or a directory in
    which nothing can be created (read-only, ``/proc``; probed by creating and removing a temporary directory
    there, so the check holds for root too).  Runs before the model loads."""
    import tempfile

    target = Path(os.path.abspath(path))
    for parent in ([target] if target.is_dir() else []) + list(target.parents):
        if parent.exists():
            if not parent.is_dir():
                raise WideError(f"{option} {str(path)!r}: {str(parent)!r} is a file, not a directory")
            try:
                os.rmdir(tempfile.mkdtemp(prefix=".wide-write-check-", dir=parent))
            except OSError as e:
                raise WideError(f"{option} {str(path)!r}: nothing can be written in {str(parent)!r} "
                                f"({e.strerror or e})") from None
            return


def _check_output_file(option: str, path) -> None:
    """An output file written at the end of a command (e.g. ``--json``) must be writable as a file: not an
    existing directory, not below a file. Missing parent directories are created when it is written."""
    if path is None:
        return
    if os.path.isdir(path):
        raise WideError(f"{option} {str(path)!r} is a directory; give a file path")
    _check_ancestors(option, path)


def _check_output_dir(option: str, path) -> None:
    """An output directory must be a non-empty path, a directory or not exist yet, and not lie below a file."""
    if not str(path).strip():
        raise WideError(f"{option} {str(path)!r} is empty; give a directory for the checkpoint")
    if os.path.exists(path) and not os.path.isdir(path):
        raise WideError(f"{option} {str(path)!r} is a file; give a directory for the checkpoint")
    _check_ancestors(option, path)


def _train_args_from(args):
    """CalibrationArgs from the ``_add_train`` options, validated (WideError on a bad value)."""
    from wide.train.loop import CalibrationArgs

    _at_least("--seq-len", args.seq_len, 2)
    _at_least("--max-blocks", args.max_blocks, 1)
    warm = args.warmup_steps if args.warmup_steps is not None else max(0, args.steps // 20)
    a = CalibrationArgs(steps=args.steps, batch_size=args.batch_size, grad_accum=args.grad_accum, lr=args.lr,
                        warmup_steps=warm, seed=args.seed, save_every=args.save_every,
                        grad_checkpoint=bool(getattr(args, "grad_checkpoint", False)),
                        reshard_after_forward=bool(getattr(args, "reshard_after_forward", True)),
                        memory_check=bool(getattr(args, "memory_check", True)))
    a.validate()
    return a


def _print(msg: str = "") -> None:
    print(msg, flush=True)


def _summary_line(name: str, r: dict) -> str:
    s = f"{name:<6} ppl {r['ppl']:8.3f}"
    if "realized_sparsity" in r:
        s += (f"   sparsity attn {r['attn_sparsity']:.3f}  ffn {r['ffn_sparsity']:.3f}  overall "
              f"{r['realized_sparsity']:.3f}  flop-weighted {r['flop_weighted_sparsity']:.3f}")
    return s


def _load(args, cfg=None, then=None, env=None, hf_check=None, pre=()):
    """Load ``--model``; validate ``cfg`` against its dims and run each ``pre(hf_config)`` on the config alone,
    before the tokenizer loads (a GGUF tokenizer takes seconds to build, so a bad option fails at once); then run
    ``hf_check(hf_config, tokenizer)`` and ``then(tokenizer)`` before the weights load.

    Under torchrun (``env`` active) only rank 0 reads the weights; see :func:`wide.train.fsdp.load_base`.

    Returns:
        ``(model, tokenizer, source)`` as :func:`wide.model.load_base_model`.

    Raises:
        WideError: from loading, ``cfg.resolve``, ``pre``, ``hf_check`` or ``then``.
    """
    from wide.model import dims_of, load_base_model

    def config_check(hf):
        if cfg is not None:
            cfg.resolve(dims_of(hf))
        for f in pre:
            f(hf)

    def check(hf, tok):
        if hf_check is not None:
            hf_check(hf, tok)
        if then is not None:
            then(tok)

    if env is not None and env.active:
        from wide.train.fsdp import load_base

        return load_base(args.model, env, check=check, config_check=config_check)
    return load_base_model(args.model, device=args.device, check=check, config_check=config_check)


def _maybe_launch(args, command: str, precheck) -> int | None:
    """``--nproc N`` outside torchrun: check cheap inputs here, then start N workers; else None."""
    import wide.train.fsdp as D

    if args.nproc is None or D.launched_by_torchrun():
        return None
    _at_least("--nproc", args.nproc, 1)
    precheck()
    return D.launch(args.nproc, command, D.strip_nproc(args.argv))


def _precheck_train(args, cfg=None, stage: str = "router"):
    from wide.data import load_texts

    _train_args_from(args)
    if cfg is not None:
        cfg.validate()
    _check_output(args, stage)
    load_texts(args.text, split="calib")


def _check_output(args, stage: str | None = "router") -> None:
    """``-o`` must be a directory or not exist yet (not below a file). With ``--resume`` it must hold a training
    state (a ``train_state.pt`` must be readable); without it, it must be empty unless ``--overwrite`` is given
    (the new run then writes into it: the old training state and log are removed when training starts, each other
    file replaced atomically when its new version is complete; a stage-1 run (``stage="router"``) refuses a
    directory holding a LoRA adapter). Commands without ``--resume`` (demo, prune-static) get the same checks."""
    from wide.lora import ADAPTER_DIR
    from wide.train.loop import STATE_NAME, has_train_state, load_train_state

    out = str(args.output)
    _check_output_dir("-o", out)
    overwrite = bool(getattr(args, "overwrite", False))
    resumable = hasattr(args, "resume")
    resume = bool(getattr(args, "resume", False))
    if resume and overwrite:
        raise WideError("--resume and --overwrite exclude each other: --resume continues the run in "
                        f"{out!r}, --overwrite replaces it")
    if resume and not has_train_state(out):
        raise WideError(f"--resume: no train_state.pt or train_state.dcp in {out!r}")
    if resume and os.path.isfile(os.path.join(out, STATE_NAME)):
        load_train_state(Path(out) / STATE_NAME, mmap=True)  # a corrupt state fails here, before the model loads
    if resume or not os.path.isdir(out) or not any(os.scandir(out)):
        return
    if not overwrite:
        use = "--resume to continue that run or --overwrite" if resumable else "--overwrite"
        raise WideError(f"output {out!r} exists and is not empty (use {use} to write over it: the files this "
                        "command writes are replaced, any others are left as they are)")
    if stage == "router" and os.path.exists(os.path.join(out, ADAPTER_DIR)):
        raise WideError(f"--overwrite: {out!r} holds a stage-2 LoRA adapter ({ADAPTER_DIR}/) that a stage-1 run "
                        f"would leave in place; give another -o")


def _data_source(args) -> str:
    """How a training run's text was given, for a later ``--resume`` message: ``--text '<absolute path>'``
    (or ``no --text (the default text)``), with ``--max-blocks`` when set."""
    text = f"--text {os.path.abspath(args.text)!r}" if args.text else "no --text (the default text)"
    return text + (f" --max-blocks {args.max_blocks}" if args.max_blocks is not None else "")


def _text_name(spec) -> str:
    """The ``--text`` as given (the default text's name when none was), for messages about it."""
    from wide.data import DEFAULT_TEXT

    return DEFAULT_TEXT if spec is None else str(spec)


def _fits_context(option: str, tokens: int):
    """A load-time check ``f(hf_config)`` on the config alone (see :func:`_load`'s ``pre``):
    ``tokens`` per window must not exceed the model's context, ``max_position_embeddings`` of its config (a config
    without it is not checked).

    Raises (when called):
        WideError: ``<option> <tokens> is longer than the model's context of <limit> tokens ...``.
    """
    def check(hf) -> None:
        limit = getattr(hf, "max_position_embeddings", None)
        if isinstance(limit, int) and tokens > limit:
            raise WideError(f"{option} {tokens} is longer than the model's context of {limit} tokens "
                            f"(max_position_embeddings of its config); use {option} {limit} or less")
    return check


def _demo_settings(args, gpu: bool) -> tuple[int, int, int, int | None]:
    """``(ctx, seq_len, steps, eval_tokens)`` of ``wide demo``: the options given, else the automatic defaults
    (CPU: 512, 256, 80, 12288; GPU: 2048, 2048, 300, all)."""
    ctx = args.ctx if args.ctx is not None else (2048 if gpu else 512)
    seq_len = args.seq_len if args.seq_len is not None else (2048 if gpu else 256)
    steps = args.steps if args.steps is not None else (300 if gpu else 80)
    eval_tokens = args.eval_tokens if args.eval_tokens is not None else (None if gpu else 12288)
    return ctx, seq_len, steps, eval_tokens


def _parser() -> argparse.ArgumentParser:
    """The ``wide`` parser of :func:`wide.cli.build_parser` (imported at call time: :mod:`wide.cli` imports this
    module's siblings, which use it to read option defaults)."""
    from wide.cli import build_parser

    return build_parser()
