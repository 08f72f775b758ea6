"""``wide calibrate`` (stage 1) and ``wide lora`` (stage 2): the training commands, ``--resume`` and the saved run
options it checks."""

from __future__ import annotations

import argparse
import os
import shlex
import time
from pathlib import Path

from wide.cli.common import (
    _check_output,
    _config_from,
    _data_source,
    _fits_context,
    _load,
    _maybe_launch,
    _model_dims,
    _need_extra,
    _parser,
    _precheck_train,
    _print,
    _text_name,
    _train_args_from,
)
from wide.errors import WideError


def cmd_calibrate(args) -> int:
    """``wide calibrate``: stage-1 router calibration (Eq. 10-13), atomic checkpoints to ``-o``, ``--resume``
    from the last one; returns the exit code (0, or 2 after a one-line error)."""
    import torch

    import wide.train.fsdp as D
    from wide.data import load_texts, pack
    from wide.model import WideModel
    from wide.train.loop import calibrate

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

    def hf_check(hf, tok):  # on the config, before any weight is read (``fits`` ran already, before the tokenizer)
        pack_text(tok)  # a text too short for one sequence is named before the memory check speaks
        if targs.memory_check:  # a batch far too large fails here, not after the weights load
            from wide.memory import check_train_fits, train_memory_from_config
            from wide.model import default_device

            device = env.device if env.active else (args.device or default_device())
            procs = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if env.active else 1
            check_train_fits(train_memory_from_config(hf, cfg, device), targs.batch_size, args.seq_len,
                             device=device, grad_checkpoint=targs.grad_checkpoint, grad_accum=targs.grad_accum,
                             procs=procs)

    model, tok, src = _load(args, cfg, then=pack_text, env=env, hf_check=hf_check, pre=[fits])
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


#: parsed names that are not options of a training run: never stored with its state, nor taken from it on --resume
_NOT_RUN_OPTIONS = ("command", "func", "argv", "output", "resume", "overwrite")


#: options that enter a run's resume key as given (its WideConfig, CalibrationArgs, sequence length, LoRA settings):
#: given with --resume and unlike the saved run's value, they are refused before the model loads. The resume check
#: after loading compares everything else (the text's tokens, the base model's weights, the global batch).
_RESUME_FIXED = ("sparsity", "alpha", "tau_start", "tau_end", "mode", "attn_group_size", "ffn_group_size", "rank",
                 "routed", "method", "skipgpt_rank", "steps", "lr", "warmup_steps", "seed", "seq_len", "lora_r",
                 "lora_alpha", "lora_dropout", "freeze_router")


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
    from wide.data import DEFAULT_TEXT
    from wide.model import DEFAULT_MODEL

    opts = {k: v for k, v in vars(args).items() if k not in _NOT_RUN_OPTIONS}
    opts.update(model=_absolute(args.model, DEFAULT_MODEL), text=_absolute(args.text, DEFAULT_TEXT),
                nproc=env.world_size if env.active else None)
    if "wide" in opts:
        opts["wide"] = _absolute(args.wide)
    return opts


def _take_saved_options(args) -> None:
    """``--resume`` of ``calibrate`` / ``lora``: every option of the run that is not on the command line takes the
    saved run's value (the options kept with its training state, :func:`wide.train.loop.saved_options`), and one
    line names those that differ from their defaults, e.g. ``resuming with the saved settings: --sparsity 0.3
    --steps 4``. An option on the command line keeps its value: one that differs from the saved run is refused
    here, before the model loads, if it is one of ``_RESUME_FIXED`` (e.g. ``--sparsity``), else by the resume check
    after loading (or allowed where a run may change, e.g. ``--batch-size`` with the same global batch). "On the
    command line" is read from ``args.argv``, parsed again with every default suppressed, never from a value equal
    to the default. A state saved without options, an option it lacks, and a saved ``None`` (an automatic value)
    leave the option as parsed. The line comes from a process outside torchrun only (with ``--nproc``, the
    launcher).

    Raises:
        WideError: a corrupt training state (as :func:`wide.train.loop.load_train_state`); ``--resume: the run in
            <dir> was written with other settings: --sparsity: saved 0.3, now 0.5 (to continue it, ...)``.
    """
    if not getattr(args, "resume", False) or getattr(args, "overwrite", False) or not str(args.output).strip():
        return  # --resume with --overwrite or an empty -o: refused by _check_output
    from wide.train.fsdp import launched_by_torchrun
    from wide.train.loop import has_train_state, saved_options

    saved = saved_options(args.output) if os.path.isdir(args.output) and has_train_state(args.output) else None
    if not saved:
        return
    parser = _parser()
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
    import wide.train.fsdp as D
    from wide.checkpoint import load
    from wide.data import load_texts, pack
    from wide.lora import LoraSettings, check_stage1, recover

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
        from wide.checkpoint import read_config
        from wide.model import WideModel

        base, tok, _ = D.load_base(args.model or info["model"], env, config_check=fits)
        wm = load(args.wide, model=base) if env.is_main else WideModel(base, read_config(args.wide, base))
    else:
        wm, tok = load(args.wide, model=args.model, device=args.device, tokenizer=True, config_check=fits)
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
