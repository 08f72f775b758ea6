"""Shared pieces of the ``wide`` command line: the parser class, option groups, the checks that run before any
weight loads, and model loading."""

from __future__ import annotations

import argparse
import functools
import math
import os
import sys
import tempfile
from pathlib import Path

from wide.errors import WideError

#: what an option given as ``''`` should have been, by its dest
EMPTY_HINTS = {"output": "a directory", "json": "a file path", "dense_json": "a file path",
               "model": "a model folder, a .gguf file or 'smollm2-135m'", "wide": "a WIDE checkpoint directory",
               "text": "a text file, a .jsonl file or a datasets folder (or leave it out for the default text)",
               "wikitext": "the path of wiki.test.raw"}
#: the default --seq-len of ``wide calibrate`` and ``wide lora``
SEQ_LEN = 2048


class WideArgumentParser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line, ``<prog>: error: <message> (see <prog> --help)``, exit
    code 2, from the innermost subcommand; abbreviations are refused (``--mode`` is not ``--model``)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **{"allow_abbrev": False, **kwargs})

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def parse_args(self, args=None, namespace=None):
        ns, extra = self.parse_known_args(args, namespace)
        if extra:
            self.innermost(ns).error(f"unrecognized arguments: {' '.join(extra)}")
        self.refuse_empty(ns, sys.argv[1:] if args is None else list(args))
        return ns

    def refuse_empty(self, ns, raw: list[str]) -> None:
        """A usage error for an option given as ``''`` (a path, a name: ``--wide ''`` is not the current folder),
        naming the option as typed (``-o`` or ``--output``)."""
        parser = self.innermost(ns)
        for action in parser._actions:
            if action.option_strings and getattr(ns, action.dest, None) == "" and action.default != "":
                typed = [t.split("=", 1)[0] for t in raw if t.split("=", 1)[0] in action.option_strings]
                flag = typed[-1] if typed else max(action.option_strings, key=len)
                parser.error(f"{flag} '' is empty; give {EMPTY_HINTS.get(action.dest, 'a value, or leave it out')}")

    def innermost(self, ns) -> argparse.ArgumentParser:
        """The parser of the deepest subcommand chosen in ``ns``."""
        for action in self._actions:
            sub = isinstance(action, argparse._SubParsersAction) and action.choices.get(getattr(ns, action.dest, None))
            if sub:
                return sub.innermost(ns)
        return self


def add_model(p, device: bool = True) -> None:
    """``--model`` and ``--device`` (``device=False``: accepted and checked, not in the help)."""
    p.add_argument("--model", help="HF checkpoint folder, .gguf file, or 'smollm2-135m' (the default, bundled GGUF)")
    p.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda if available)" if device else argparse.SUPPRESS)


def add_method(p) -> None:
    """The WideConfig options of a training command: the objective (Eq. 6 / 22) and the router layout."""
    g = p.add_argument_group("WIDE method (WideConfig)")
    g.add_argument("--sparsity", "-S", type=float, default=0.5, help="target sparsity S in [0, 1) (default: 0.5)")
    g.add_argument("--alpha", type=float, default=20.0, help="sparsity-loss weight (>= 0; default 20.0)")
    g.add_argument("--tau-start", type=float, default=5.0, help="Gumbel temperature at step 1 (1e-3 to 1e3; default 5)")
    g.add_argument("--tau-end", type=float, default=0.5, help="final temperature, annealed linearly (default 0.5)")
    g.add_argument("--mode", choices=["global", "uniform"], default="global",
                   help="global = Eq. 6, uniform = Eq. 22 (attention and FFN each at S) (default: global)")
    add_unit(g)
    add_layout(g)


def add_unit(g, inherited: str | None = None) -> None:
    """``--sparsity-unit`` and ``--max-module-sparsity`` (``inherited``: where their defaults come from instead)."""
    g.add_argument("--sparsity-unit", choices=["groups", "flops"], default=None if inherited else "groups",
                   help="what S counts: groups = Eq. 6 / 22, the paper's; flops = the fraction of the routed compute "
                        "skipped (Q, O, gate, up, down and the attention core at --seq-len) (default: "
                        f"{inherited or 'groups'})")
    g.add_argument("--max-module-sparsity", type=float, default=None if inherited else 1.0,
                   help="bound on every attention / FFN module's skip rate, in (0, 1], so that no sublayer is removed "
                        f"entirely (default: {inherited or '1.0, no bound'})")


def add_layout(g) -> None:
    """The options that decide the routers' shape and count."""
    g.add_argument("--attn-group-size", type=int, help="attention G: multiple of head_dim dividing the attention width "
                                                       "(default: the GQA group)")
    g.add_argument("--ffn-group-size", type=int, default=128, help="FFN G: power of two >= 16 dividing the FFN size "
                                                                   "(default: 128)")
    g.add_argument("--rank", type=int, default=16, help="router bottleneck rank r (default: 16)")
    g.add_argument("--routed", choices=["both", "attn", "ffn"], default="both", help="sublayers routed (default: both)")
    g.add_argument("--method", choices=["wide", "skipgpt"], default="wide",
                   help="wide = group routing (§3.1); skipgpt = the dynamic-depth baseline (§4.1): one router per "
                        "module, whole-module gates, rank raised to match WIDE's router parameters")
    g.add_argument("--skipgpt-rank", type=int, help="with --method skipgpt: this router rank, not the matched one")


def add_train(p, batch: int = 8, lr: float = 5e-3, auto: dict[str, str] | None = None) -> None:
    """The training options; ``auto`` gives ``steps`` / ``seq_len`` an automatic default (None) and its help."""
    auto = auto or {}
    g = p.add_argument_group("calibration run")
    g.add_argument("--steps", type=int, default=None if auto else 500,
                   help=f"optimizer steps (>= 1; default: {auto.get('steps', 500)})")
    g.add_argument("--batch-size", type=int, default=batch, help=f"sequences per micro-batch (default: {batch})")
    g.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step (default: 1)")
    g.add_argument("--seq-len", type=int, default=None if auto else SEQ_LEN,
                   help=f"tokens per packed sequence (>= 2; default: {auto.get('seq_len', SEQ_LEN)})")
    g.add_argument("--lr", type=float, default=lr, help=f"peak learning rate (> 0, at most 1; default: {lr:g})")
    g.add_argument("--warmup-steps", type=int, help="linear warm-up steps (0 to --steps; default: 5%% of --steps)")
    g.add_argument("--seed", type=int, default=0, help="seed of data order, router init (0 to 2**32 - 1; default: 0)")
    g.add_argument("--save-every", type=int, default=100, help="checkpoint every N steps (default: 100)")
    g.add_argument("--max-blocks", type=int, help="use at most this many packed sequences (>= 1; default: all)")
    g.add_argument("--grad-checkpoint", action="store_true", help="recompute each decoder layer in backward")
    g.add_argument("--no-memory-check", dest="memory_check", action="store_false", help="skip the check, before the "
                   "first step, that one micro-batch's training memory fits (RAM on CPU, free GPU memory on CUDA)")


def at_least(args, **lows) -> None:
    """Raise WideError ``--<option> <value> must be >= <low>`` for the first option below its low (None passes)."""
    for dest, low in lows.items():
        if getattr(args, dest) is not None and not getattr(args, dest) >= low:
            raise WideError(f"--{dest.replace('_', '-')} {getattr(args, dest)} must be >= {low}")


def check_method_flags(args) -> None:
    """Refuse a WideConfig option outside its range as the command line gave it, ``--<option> <value> ...`` (the
    config's own checks name its fields, for Python callers); absent or None options pass."""
    from wide.config import TAU_MAX, TAU_MIN
    tau = (f"is outside [{TAU_MIN:g}, {TAU_MAX:g}] (the Gumbel-softmax temperature divides the router logits: below "
           f"{TAU_MIN:g} they overflow)")
    for dest, ok, allowed in (
            ("sparsity", lambda x: 0.0 <= x < 1.0, "is outside [0, 1): the target fraction of the routed groups (or, "
                                                   "with --sparsity-unit flops, of the routed compute) to skip"),
            ("alpha", lambda x: 0.0 <= x < math.inf, "must be >= 0 and finite"),
            ("tau_start", lambda x: TAU_MIN <= x <= TAU_MAX, tau), ("tau_end", lambda x: TAU_MIN <= x <= TAU_MAX, tau),
            ("max_module_sparsity", lambda x: 0.0 < x <= 1.0, "is outside (0, 1] (1.0: no bound)"),
            ("rank", lambda x: x >= 1, "must be >= 1"), ("skipgpt_rank", lambda x: x >= 1, "must be >= 1")):
        value = getattr(args, dest, None)
        if value is not None and not ok(value):
            raise WideError(f"--{dest.replace('_', '-')} {value!r} {allowed}")


def need_extra(module: str, what: str) -> None:
    """Raise WideError naming a missing optional package and the extra that installs it."""
    import importlib.util
    if importlib.util.find_spec(module) is None:
        raise WideError(f"{what} needs the '{module}' package, which is not installed: pip install 'wide[quality]' "
                        f"(or, in this repository, .venv/bin/pip install -e '.[quality]')")


def hf_config(model):
    """``(source, Hugging Face config)`` of ``--model``, from its config alone (WideError: not found, unreadable,
    or an unsupported architecture)."""
    from wide.hub import read_hf_config, resolve_model
    from wide.model import check_architecture
    src = resolve_model(model)
    hf = read_hf_config(src)
    check_architecture(hf)
    return src, hf


def check_ffn_group_size(args) -> None:
    """Refuse an ``--ffn-group-size`` that is not a power of two >= 16, naming the legal sizes of ``--model``."""
    g = args.ffn_group_size
    if g < 16 or g & (g - 1):
        from wide.model import dims_of
        src, hf = hf_config(args.model)
        raise WideError(dims_of(hf).ffn_group_size_error(g, f" of {src.ref}"))


def check_attn_group_size(args) -> None:
    """Refuse an ``--attn-group-size`` below 1, naming the legal sizes of ``--model`` (a size that does not
    divide is refused, with them, when the config resolves against the model)."""
    g = args.attn_group_size
    if g is not None and g < 1:
        from wide.model import dims_of
        src, hf = hf_config(args.model)
        raise WideError(dims_of(hf).attn_group_size_error(g, f" of {src.ref}"))


def config_from(args):
    """The WideConfig of the method / layout options, SkipGPT's rank matched to that layout (§4.1); WideError for
    a bad value or ``--skipgpt-rank`` without ``--method skipgpt``."""
    from wide.config import WideConfig
    check_method_flags(args)
    check_ffn_group_size(args)
    check_attn_group_size(args)
    names = {"target_sparsity": "sparsity", "alpha": "alpha", "tau_start": "tau_start", "tau_end": "tau_end",
             "sparsity_mode": "mode", "sparsity_unit": "sparsity_unit", "max_module_sparsity": "max_module_sparsity"}
    objective = {k: getattr(args, a) for k, a in names.items() if hasattr(args, a)}
    if objective and isinstance(getattr(args, "seq_len", None), int) and args.seq_len >= 2:
        objective["seq_len"] = args.seq_len  # the context of the flops unit (refused below 2 by the run's checks)
    cfg = WideConfig(attn_group_size=args.attn_group_size, ffn_group_size=args.ffn_group_size,
                     router_rank=args.rank, routed=args.routed, **objective)
    if objective:  # a training command: the temperatures must be trainable
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
    at_least(args, seq_len=2, max_blocks=1)
    warm = args.warmup_steps if args.warmup_steps is not None else max(0, steps // 20)
    a = CalibrationArgs(steps=steps, batch_size=args.batch_size, grad_accum=args.grad_accum, lr=args.lr,
                        warmup_steps=warm, seed=args.seed, save_every=args.save_every,
                        grad_checkpoint=args.grad_checkpoint, memory_check=args.memory_check,
                        reshard_after_forward=getattr(args, "reshard_after_forward", True))
    a.validate()
    return a


def check_writable(option: str, path, file: bool = False, folder: str | None = None) -> None:
    """Refuse a path below a file, or whose nearest existing folder takes no new entry (probed: root too), or for a
    ``file`` (``--json``; None passes) a folder, or for a ``folder`` (the hint that ends the message: what the folder
    is for) a file."""
    if path is None:
        return
    if folder is not None and os.path.exists(path) and not os.path.isdir(path):
        raise WideError(f"{option} {str(path)!r} is a file; give a directory {folder}")
    if file and os.path.isdir(path):
        raise WideError(f"{option} {str(path)!r} is a directory; give a file path")
    target = Path(os.path.abspath(path))
    parent = next(p for p in ([target] if target.is_dir() else []) + list(target.parents) if p.exists())
    if not parent.is_dir():
        raise WideError(f"{option} {str(path)!r}: {str(parent)!r} is a file, not a directory")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".wide-write-check-", dir=parent))
    except OSError as e:
        raise WideError(f"{option} {str(path)!r}: nothing can be written in {str(parent)!r} ({e.strerror or e})") \
            from None


#: the options whose files or folders a command reads, which an output of it must not write into
INPUTS = (("--wide", "wide"), ("--model", "model"), ("--text", "text"), ("--dense-json", "dense_json"),
          ("--wikitext", "wikitext"))


def check_not_input(option: str, path, args, inside: bool = True) -> None:
    """Refuse an output ``path`` that is an input file or folder of ``args`` (:data:`INPUTS`) or, with ``inside``,
    lies within an input folder: writing there would change what this command (or a later one) reads."""
    if path is None:
        return
    target = os.path.realpath(os.path.expanduser(str(path)))
    for flag, dest in INPUTS:
        given = getattr(args, dest, None)
        if not isinstance(given, (str, os.PathLike)) or not os.path.exists(os.path.expanduser(given)):
            continue
        src = os.path.realpath(os.path.expanduser(given))
        if target == src:
            raise WideError(f"{option} {str(path)!r} is the {flag} {'folder' if os.path.isdir(src) else 'file'} this "
                            f"command reads: write {'the results' if option == '--json' else 'it'} elsewhere")
        if inside and os.path.isdir(src) and os.path.commonpath([target, src]) == src:
            raise WideError(f"{option} {str(path)!r} is inside the {flag} folder {str(given)!r}, which this command "
                            f"reads: write the results elsewhere")


def check_json(args) -> None:
    """``--json`` (None passes): a file path that can be written, outside the folders and files the command
    reads (``--json CKPT/base_model.json`` would overwrite the checkpoint being evaluated)."""
    check_writable("--json", args.json, file=True)
    check_not_input("--json", args.json, args)


def check_output(args, stage: str | None = "router") -> None:
    """``-o`` must be a writable folder or new; with ``--resume`` it holds a training state, else it is empty
    unless ``--overwrite`` (which a stage-1 run refuses over a LoRA adapter). WideError otherwise."""
    from wide.lora import ADAPTER_DIR
    from wide.train.loop import has_train_state
    out = str(args.output)
    if not out.strip():
        raise WideError(f"-o {out!r} is empty; give a directory for the checkpoint")
    check_writable("-o", out, folder="for the checkpoint")
    resume = getattr(args, "resume", False)
    if resume and args.overwrite:
        raise WideError(f"--resume and --overwrite exclude each other: --resume continues the run in {out!r}, "
                        "--overwrite replaces it")
    if resume and not has_train_state(out):
        raise WideError(f"--resume: no train_state.dcp in {out!r}")
    if resume or not os.path.isdir(out) or not any(os.scandir(out)):
        return
    if not args.overwrite:
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


def load(args, cfg=None, pre=(), hf_check=None, env=None):
    """``(model, tokenizer, source)`` of ``--model``. Before the tokenizer loads, ``cfg`` is resolved against the
    model's dims and each ``pre(hf_config)`` runs; before the weights, ``hf_check(hf_config, tokenizer)``. Under
    torchrun (``env`` active) only rank 0 reads the weights."""
    from wide.hub import load_base_model
    from wide.model import dims_of
    def config_check(hf):
        if cfg is not None:
            d = dims_of(hf)
            if cfg.method != "skipgpt":  # the flags' own messages, ahead of the library's for the same sizes
                bad = d.ffn_group_size_error(cfg.ffn_group_size) or (
                    None if cfg.attn_group_size is None else d.attn_group_size_error(cfg.attn_group_size))
                if bad:
                    raise WideError(bad)
            cfg.resolve(d)
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


say = functools.partial(print, flush=True)


def sparsity_text(r: dict) -> str:
    """The realized sparsities of a report (:meth:`wide.eval.perplexity.SparsityMeter.report`): both units, named,
    and each class."""
    return (f"groups {r['groups_sparsity']:.3f} (Eq. 6)  flops {r['flops_sparsity']:.3f} (T={r['flops_context']})  "
            f"attn {r['attn_sparsity']:.3f}  ffn {r['ffn_sparsity']:.3f}")


def check_sparsity(args, option: str = "--sparsity") -> None:
    """Refuse a serve-time ``--sparsity`` outside ``[0, 1)`` or without ``--wide``, in one line."""
    import math
    x = getattr(args, "sparsity", None)
    if x is None:
        return
    if not (math.isfinite(x) and 0.0 <= x < 1.0):
        raise WideError(f"{option} {x:g} is outside [0, 1): the fraction of the routed groups (or, with "
                        f"--sparsity-unit flops, of the routed compute) to skip, e.g. 0.5")
    if not getattr(args, "wide", None):
        raise WideError(f"{option} {x:g} dials the routers of a WIDE checkpoint: give --wide")


def summary_line(name: str, r: dict) -> str:
    """``<name> ppl <ppl>`` and, for a routed model, its realized sparsities."""
    return f"{name:<6} ppl {r['ppl']:8.3f}" + (f"   sparsity {sparsity_text(r)}" if "realized_sparsity" in r else "")
