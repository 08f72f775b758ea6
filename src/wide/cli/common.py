"""Shared pieces of the ``wide`` command line: the parser class, the option groups, the input checks that run
before any weight loads, and model loading."""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

from wide.errors import WideError


class WideArgumentParser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line, ``<prog>: error: <message> (see <prog> --help)``, exit
    code 2, reported by the innermost subcommand; abbreviated options are refused (``--mode`` is not ``--model``)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def parse_args(self, args=None, namespace=None):
        ns, extra = self.parse_known_args(args, namespace)
        if extra:
            self.innermost(ns).error(f"unrecognized arguments: {' '.join(extra)}")
        return ns

    def innermost(self, ns) -> argparse.ArgumentParser:
        """The parser of the deepest subcommand chosen in ``ns`` (this one when none was)."""
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                sub = action.choices.get(getattr(ns, action.dest, None))
                if sub is not None:
                    return sub.innermost(ns) if isinstance(sub, WideArgumentParser) else sub
        return self


# --- option groups ---------------------------------------------------------------------------------
def add_model(p, device: bool = True) -> None:
    """``--model`` and ``--device`` (``device=False``: accepted and checked, but hidden from the help)."""
    p.add_argument("--model", default=None, help="local HF checkpoint dir, .gguf file, or 'smollm2-135m' "
                                                 "(default: the bundled SmolLM2-135M-Instruct GGUF)")
    p.add_argument("--device", default=None,
                   help="cpu, cuda or cuda:N (default: cuda if available)" if device else argparse.SUPPRESS)


def add_method(p) -> None:
    """The WideConfig options of a training command: the calibration objective and the router layout."""
    g = p.add_argument_group("WIDE method (WideConfig)")
    g.add_argument("--sparsity", "-S", type=float, default=0.5, help="target sparsity S in [0, 1) (default: 0.5)")
    g.add_argument("--alpha", type=float, default=20.0, help="sparsity-loss weight (>= 0; default 20.0)")
    g.add_argument("--tau-start", type=float, default=5.0,
                   help="Gumbel-softmax temperature at the first calibration step (1e-3 to 1e3; default 5.0)")
    g.add_argument("--tau-end", type=float, default=0.5,
                   help="temperature at the last step, annealed linearly (1e-3 to 1e3; default 0.5)")
    g.add_argument("--mode", choices=["global", "uniform"], default="global",
                   help="global = Eq. 6, uniform = Eq. 22 (attention and FFN each at S) (default: global)")
    add_layout(g)


def add_layout(g) -> None:
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


def add_train(p, steps: int | None = 500, batch: int = 8, seq_len: int | None = 2048, lr: float = 5e-3,
              auto: dict[str, str] | None = None) -> None:
    """The training options; ``auto`` maps ``steps`` / ``seq_len`` to the help of an automatic default (None)."""
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
    g.add_argument("--grad-checkpoint", action="store_true",
                   help="activation checkpointing: recompute each decoder layer in backward (less memory)")
    g.add_argument("--no-memory-check", dest="memory_check", action="store_false",
                   help="skip the check, before the first step, that one micro-batch's estimated training memory "
                        "fits in the memory available (RAM on CPU, free GPU memory on CUDA)")


def add_output(p, what: str, resume: bool) -> None:
    """``-o`` and ``--overwrite`` (and ``--resume`` for a training command)."""
    p.add_argument("--output", "-o", required=True, help=what)
    if resume:
        p.add_argument("--resume", action="store_true",
                       help="continue from the training state in --output (train_state.pt, or train_state.dcp of a "
                            "multi-process run); options not given take the saved run's values")
    p.add_argument("--overwrite", action="store_true",
                   help="start a new run in a non-empty --output: its old training state and log are removed "
                        "when training starts, its other files replaced as the new ones are saved")


# --- checks before any weight loads ----------------------------------------------------------------
def at_least(option: str, value, low: int) -> None:
    """Raise WideError ``<option> <value> must be >= <low>`` unless ``value`` is None or ``>= low``."""
    if value is not None and not value >= low:
        raise WideError(f"{option} {value} must be >= {low}")


def need_extra(module: str, what: str) -> None:
    """Raise WideError naming a missing optional package and the extra that installs it."""
    import importlib.util

    if importlib.util.find_spec(module) is None:
        raise WideError(f"{what} needs the '{module}' package, which is not installed: "
                        f"pip install 'wide[quality]' (or, in this repository, .venv/bin/pip install -e '.[quality]')")


def hf_config(model):
    """``(source, Hugging Face config)`` of ``--model``, read from its config alone.

    Raises:
        WideError: the model is not found, its config is unreadable, or its architecture is not supported.
    """
    from wide.model import check_architecture, read_hf_config, resolve_model

    src = resolve_model(model)
    hf = read_hf_config(src)
    check_architecture(hf)
    return src, hf


def check_ffn_group_size(args, why: str = "") -> None:
    """An ``--ffn-group-size`` that is not a power of two >= 16 is named with the legal sizes of ``--model``."""
    g = args.ffn_group_size
    if g < 16 or g & (g - 1):
        from wide.model import dims_of

        src, hf = hf_config(args.model)
        raise WideError(dims_of(hf).ffn_group_size_error(g, f" of {src.ref}", why))


def config_from(args):
    """The WideConfig of the method / layout options; SkipGPT gets the rank matched to that layout (§4.1).

    Raises:
        WideError: a bad value, or ``--skipgpt-rank`` without ``--method skipgpt``.
    """
    from wide.config import WideConfig

    check_ffn_group_size(args)
    names = {"target_sparsity": "sparsity", "alpha": "alpha", "tau_start": "tau_start", "tau_end": "tau_end",
             "sparsity_mode": "mode"}
    objective = {k: getattr(args, a) for k, a in names.items() if hasattr(args, a)}
    cfg = WideConfig(attn_group_size=args.attn_group_size, ffn_group_size=args.ffn_group_size,
                     router_rank=args.rank, routed=args.routed, **objective)
    if objective:  # a training command: the temperatures must be in the trainable range
        cfg.check_training()
    if args.skipgpt_rank is not None and args.method != "skipgpt":
        raise WideError(f"--skipgpt-rank {args.skipgpt_rank} needs --method skipgpt")
    if args.method == "skipgpt":
        from wide.baselines.skipgpt import skipgpt_config
        from wide.model import dims_of

        cfg = skipgpt_config(dims_of(hf_config(args.model)[1]), cfg, rank=args.skipgpt_rank)
    return cfg


def train_args_from(args, steps: int | None = None):
    """Validated CalibrationArgs of the training options (``steps``: the resolved automatic value)."""
    from wide.train.loop import CalibrationArgs

    steps = args.steps if steps is None else steps
    at_least("--seq-len", args.seq_len, 2)
    at_least("--max-blocks", args.max_blocks, 1)
    warm = args.warmup_steps if args.warmup_steps is not None else max(0, steps // 20)
    a = CalibrationArgs(steps=steps, batch_size=args.batch_size, grad_accum=args.grad_accum, lr=args.lr,
                        warmup_steps=warm, seed=args.seed, save_every=args.save_every,
                        grad_checkpoint=args.grad_checkpoint, memory_check=args.memory_check,
                        reshard_after_forward=getattr(args, "reshard_after_forward", True))
    a.validate()
    return a


def check_writable(option: str, path) -> None:
    """Refuse a path below a file, or whose nearest existing folder takes no new entry (probed, so root too)."""
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


def check_output_file(option: str, path) -> None:
    """An output file (``--json``) must not be a folder and must be writable; its folders are made later."""
    if path is None:
        return
    if os.path.isdir(path):
        raise WideError(f"{option} {str(path)!r} is a directory; give a file path")
    check_writable(option, path)


def check_output(args, stage: str | None = "router") -> None:
    """``-o``: a folder or new, writable; with ``--resume`` it holds a readable training state, else it is empty
    unless ``--overwrite`` (which a stage-1 run refuses over a LoRA adapter).

    Raises:
        WideError: as above, before the model loads.
    """
    from wide.lora import ADAPTER_DIR
    from wide.train.loop import STATE_NAME, has_train_state, load_train_state

    out = str(args.output)
    if not out.strip():
        raise WideError(f"-o {out!r} is empty; give a directory for the checkpoint")
    if os.path.exists(out) and not os.path.isdir(out):
        raise WideError(f"-o {out!r} is a file; give a directory for the checkpoint")
    check_writable("-o", out)
    resume, overwrite = getattr(args, "resume", False), args.overwrite
    if resume and overwrite:
        raise WideError(f"--resume and --overwrite exclude each other: --resume continues the run in {out!r}, "
                        "--overwrite replaces it")
    if resume and not has_train_state(out):
        raise WideError(f"--resume: no train_state.pt or train_state.dcp in {out!r}")
    if resume and os.path.isfile(os.path.join(out, STATE_NAME)):
        load_train_state(Path(out) / STATE_NAME, mmap=True)  # a corrupt state fails here
    if resume or not os.path.isdir(out) or not any(os.scandir(out)):
        return
    if not overwrite:
        use = "--resume to continue that run or --overwrite" if hasattr(args, "resume") else "--overwrite"
        raise WideError(f"output {out!r} exists and is not empty (use {use} to write over it: the files this "
                        "command writes are replaced, any others are left as they are)")
    if stage == "router" and os.path.exists(os.path.join(out, ADAPTER_DIR)):
        raise WideError(f"--overwrite: {out!r} holds a stage-2 LoRA adapter ({ADAPTER_DIR}/) that a stage-1 run "
                        f"would leave in place; give another -o")


def fits_context(option: str, tokens: int):
    """A check ``f(hf_config)``: ``tokens`` per sequence must not exceed ``max_position_embeddings``."""
    def check(hf) -> None:
        limit = getattr(hf, "max_position_embeddings", None)
        if isinstance(limit, int) and tokens > limit:
            raise WideError(f"{option} {tokens} is longer than the model's context of {limit} tokens "
                            f"(max_position_embeddings of its config); use {option} {limit} or less")
    return check


# --- loading and printing --------------------------------------------------------------------------
def load(args, cfg=None, pre=(), hf_check=None, env=None):
    """``(model, tokenizer, source)`` of ``--model``. Before the tokenizer: ``cfg`` is resolved against the
    model's dims and each ``pre(hf_config)`` runs; before the weights: ``hf_check(hf_config, tokenizer)``.
    Under torchrun (``env`` active) only rank 0 reads the weights."""
    from wide.model import dims_of, load_base_model

    def config_check(hf):
        if cfg is not None:
            cfg.resolve(dims_of(hf))
        for f in pre:
            f(hf)

    if env is not None and env.active:
        from wide.train.fsdp import load_base

        return load_base(args.model, env, check=hf_check, config_check=config_check)
    return load_base_model(args.model, device=args.device, check=hf_check, config_check=config_check)


def text_name(spec) -> str:
    """The ``--text`` as given, or the default text's name."""
    from wide.data import DEFAULT_TEXT

    return DEFAULT_TEXT if spec is None else str(spec)


def data_source(args) -> str:
    """How a run's text was given, for a later ``--resume`` message."""
    text = f"--text {os.path.abspath(args.text)!r}" if args.text else "no --text (the default text)"
    return text + (f" --max-blocks {args.max_blocks}" if args.max_blocks is not None else "")


def say(msg: str = "") -> None:
    print(msg, flush=True)


def summary_line(name: str, r: dict) -> str:
    """``<name> ppl <ppl>`` and, for a routed model, its realized sparsities."""
    s = f"{name:<6} ppl {r['ppl']:8.3f}"
    if "realized_sparsity" in r:
        s += (f"   sparsity attn {r['attn_sparsity']:.3f}  ffn {r['ffn_sparsity']:.3f}  overall "
              f"{r['realized_sparsity']:.3f}  flop-weighted {r['flop_weighted_sparsity']:.3f}")
    return s
