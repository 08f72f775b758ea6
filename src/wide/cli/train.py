"""``wide calibrate`` (stage 1) and ``wide lora`` (stage 2): the training commands and their ``--resume``."""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import sys
import time
from pathlib import Path

from wide.cli import common as C
from wide.config import FIT_TOKENS, HELDOUT_EVERY
from wide.errors import WideError

#: parsed names that are not options of a run: never saved with its state, nor taken from it on --resume
NOT_RUN_OPTIONS = ("command", "func", "argv", "output", "resume", "overwrite")
#: said (after the checks) when the logit shift is fitted on the training text
ONE_DOCUMENT = ("note: the text is one document, so nothing is held out of training: the logit shift is fitted on the "
                "training text (more documents, e.g. a .jsonl, give a held-out tenth)")
#: options that, given with --resume and unlike the saved run's, are refused before the model loads
RESUME_FIXED = ("sparsity", "alpha", "tau_start", "tau_end", "mode", "attn_group_size", "ffn_group_size", "rank",
                "routed", "method", "skipgpt_rank", "steps", "lr", "warmup_steps", "seed", "seq_len", "lora_r",
                "lora_alpha", "lora_dropout", "freeze_router", "sparsity_unit", "max_module_sparsity", "no_fit_bias")


def add_parsers(sub) -> None:
    """Add ``calibrate`` and ``lora`` to the ``wide`` subcommands."""
    cal = sub.add_parser("calibrate", help="stage 1: train the routers to a target sparsity (base frozen)")
    lora = sub.add_parser("lora", help="stage 2: LoRA recovery on a stage-1 checkpoint (peft, all 7 projections)")
    lora.add_argument("--wide", help="stage-1 checkpoint (a `wide calibrate` -o); required, except with --resume")
    for s, text, output in ((cal, "calibration text", "checkpoint directory"),
                            (lora, "training text", "output WIDE directory (routers, config, adapter/)")):
        C.add_model(s)
        s.add_argument("--text", help=f"{text}: .txt, .jsonl of 'text', datasets folder (default: boolq-passages, "
                                      "the BoolQ passages)")
        s.add_argument("--output", "-o", required=True, help=output)
        s.add_argument("--resume", action="store_true", help="continue the run in --output, with its options")
        s.add_argument("--overwrite", action="store_true", help="start a new run in a non-empty --output (the "
                       "earlier run's checkpoint, state and log are removed when training starts; other files stay)")
    C.add_method(cal)
    lora.add_argument("--freeze-router", action="store_true", help="keep the stage-1 routers fixed; train only LoRA")
    C.add_unit(lora.add_argument_group("sparsity objective"), inherited="the stage-1 checkpoint's")
    for s in (cal, lora):
        g = s.add_argument_group("exact realized sparsity (a logit shift fitted after training)")
        g.add_argument("--no-fit-bias", action="store_true", help="skip the fit: train on all of --text and keep "
                       "the routers as trained (the paper's argmax routing, which realizes a sparsity near S)")
        g.add_argument("--fit-tokens", type=int, default=FIT_TOKENS, help="held-out tokens the shift is fitted on "
                       f"(>= 2; default: {FIT_TOKENS}); one document in {HELDOUT_EVERY} of --text is held out of "
                       "training for it")
    g = lora.add_argument_group("LoRA (peft)")
    g.add_argument("--lora-r", type=int, default=16, help="LoRA rank r (default: 16)")
    g.add_argument("--lora-alpha", type=float, default=32.0, help="lora_alpha; peft scales by alpha / r (default: 32)")
    g.add_argument("--lora-dropout", type=float, default=0.1, help="LoRA input dropout in [0, 1) (default: 0.1)")
    for s, lr, func in ((cal, 5e-3, cmd_calibrate), (lora, 2e-4, cmd_lora)):
        C.add_train(s, lr=lr)
        g = s.add_argument_group("scaling out (FSDP2)")
        g.add_argument("--nproc", type=int, help="run as N local processes (one per GPU; without GPUs, "
                                                 "N CPU processes over gloo), as `torchrun --nproc-per-node N "
                                                 "-m wide ...`; --batch-size is per process")
        g.add_argument("--no-reshard-after-forward", dest="reshard_after_forward", action="store_false", help="keep "
                       "each layer's gathered weights from forward to backward (one all-gather a step, not two)")
        s.set_defaults(func=func)


def _prechecks(args, stage: str = "router"):
    """The checks that need no model (options, ``-o``, the text); returns the CalibrationArgs, the training
    documents and the held-out ones (None with ``--no-fit-bias``; empty for a one-document text, whose shift is
    fitted on the training text, :data:`ONE_DOCUMENT`)."""
    from wide.calibrate import heldout_split
    from wide.data import load_texts
    targs = C.train_args_from(args)
    C.at_least(args, fit_tokens=2)
    C.check_output(args, stage)
    docs = load_texts(args.text, split="calib")
    if args.no_fit_bias:
        return targs, docs, None
    return (targs, *heldout_split(docs))


def check_bound(args) -> None:
    """Refuse, before anything loads, a ``-S`` that ``--max-module-sparsity`` makes unreachable (one line naming
    both, :func:`wide.calibrate.check_reachable`); bad values of either are named first."""
    from wide.calibrate import check_reachable
    C.check_method_flags(args)
    check_reachable(args.sparsity, args.max_module_sparsity, args.sparsity_unit, "-S/--sparsity",
                    "--max-module-sparsity")


@contextlib.contextmanager
def overwrite_note(args):
    """Around a training run: yields the ``on_clear`` of :func:`wide.train.loop.train`. When ``--overwrite``
    removed an earlier run's files from ``-o`` and an interrupt comes before the new run's first save, one line on
    stderr says so (the CLI's "interrupted" line follows)."""
    removed: list[str] = []
    try:
        yield removed.extend
    except KeyboardInterrupt:
        from wide.train.loop import has_train_state
        if removed and args.overwrite and not has_train_state(args.output):
            print(f"wide {args.command}: --overwrite removed the earlier checkpoint in {str(args.output)!r} "
                  f"({', '.join(removed)}) when training started; the new run was interrupted before its first "
                  f"save", file=sys.stderr, flush=True)
        raise


def _launch(args, precheck) -> int | None:
    """``--nproc N`` outside torchrun: run ``precheck`` here, then N workers; else None."""
    import wide.train.fsdp as D
    if args.nproc is None or D.launched_by_torchrun():
        return None
    C.at_least(args, nproc=1)
    precheck()
    return D.launch(args.nproc, args.command, D.strip_nproc(args.argv))


def data_source(args) -> str:
    """How a run's text was given, for a later ``--resume`` message."""
    text = f"--text {os.path.abspath(args.text)!r}" if args.text else "no --text (the default text)"
    return text + (f" --max-blocks {args.max_blocks}" if args.max_blocks is not None else "")


def run_options(args, env) -> dict:
    """The options of a run as its training state keeps them for ``--resume``: existing paths absolute,
    ``nproc`` the number of processes that ran it (None without torchrun)."""
    from wide.data import DEFAULT_TEXT
    from wide.hub import DEFAULT_MODEL
    def absolute(spec, reserved=None):
        exists = spec is not None and spec != reserved and os.path.exists(os.path.expanduser(spec))
        return os.path.abspath(os.path.expanduser(spec)) if exists else spec
    opts = {k: v for k, v in vars(args).items() if k not in NOT_RUN_OPTIONS}
    opts.update(model=absolute(args.model, DEFAULT_MODEL), text=absolute(args.text, DEFAULT_TEXT),
                nproc=env.world_size if env.active else None)
    if "wide" in opts:
        opts["wide"] = absolute(args.wide)
    return opts


def take_saved_options(parser, args) -> None:
    """``--resume``: each run option not on the command line (``args.argv`` parsed again without defaults) takes
    the saved run's value, and one line names those taken; WideError for a corrupt training state, or a
    :data:`RESUME_FIXED` option given unlike the saved run's."""
    if not getattr(args, "resume", False) or args.overwrite or not str(args.output).strip():
        return  # refused by check_output
    from wide.train.fsdp import launched_by_torchrun
    from wide.train.loop import has_train_state, saved_options
    saved = saved_options(args.output) if os.path.isdir(args.output) and has_train_state(args.output) else None
    if not saved:
        return
    sub = parser.innermost(args)
    actions = {a.dest: a for a in sub._actions if a.option_strings and a.dest not in NOT_RUN_OPTIONS}
    for a in sub._actions:
        a.default = argparse.SUPPRESS
    given = set(vars(parser.parse_args(args.argv)))
    def flag(dest):  # its long form
        return next(o for o in actions[dest].option_strings if o.startswith("--"))
    differ = [f"{flag(d)}: saved {saved[d]!r}, now {getattr(args, d)!r}" for d in RESUME_FIXED
              if d in given and d in actions and saved.get(d) is not None and saved[d] != getattr(args, d)]
    if differ:
        raise WideError(f"--resume: the run in {str(args.output)!r} was written with other settings: "
                        f"{'; '.join(differ)} (to continue it, drop the options that differ and the saved run's own "
                        f"are reused; or start over with --overwrite)")
    taken = []
    if "no_fit_bias" in actions and "no_fit_bias" not in saved and "no_fit_bias" not in given:
        saved = {**saved, "no_fit_bias": True}  # a run saved without this option (the demo's) held nothing out
    for dest, value in saved.items():
        if dest in actions and dest not in given and value is not None and value != getattr(args, dest, None):
            setattr(args, dest, value)
            taken.append(flag(dest) if actions[dest].nargs == 0 else f"{flag(dest)} {shlex.quote(str(value))}")
    if taken and not launched_by_torchrun():
        C.say(f"resuming with the saved settings: {' '.join(taken)}")


def _fit_bias(args, env, wm, held, model_ref: str, held_out: bool = True) -> None:
    """After training: fit the routers' logit shift on the windows ``held`` (``held_out`` False: of the training
    text) and store it in ``-o`` (one process; under torchrun rank 0 loads the saved checkpoint alone), unless
    ``--no-fit-bias`` or already stored."""
    from wide.calibrate import calibration_line, fit_shifts
    from wide.checkpoint import CALIBRATION_NAME, load, save_calibration
    if held is None or not env.is_main or (Path(args.output) / CALIBRATION_NAME).is_file():
        return
    if env.active:  # the trained model is sharded over the processes
        wm = load(args.output, model=model_ref, device=env.device, calibrated=False)
    rec = fit_shifts(wm, held, batch_size=args.batch_size, held_out=held_out)
    rec["text"] = C.text_name(args.text if args.text is None else os.path.abspath(args.text))
    save_calibration(args.output, rec)
    C.say(calibration_line(rec))


def _train(env, what: str, blocks, targs, fit, saved: str, after=None, held_out: bool = True) -> int:
    """Say what is trained (and when the text gives fewer sequences than one global batch, or ``held_out`` is
    False: :data:`ONE_DOCUMENT`), run ``fit()`` and close with its result (rank 0 speaks), then ``after()``."""
    say = C.say if env.is_main else (lambda *_: None)
    n, batch = int(blocks.shape[0]), targs.batch_size * targs.grad_accum * env.world_size
    say(f"{what}: {n} sequences x {blocks.shape[1]} tokens, {targs.steps} steps, {env.world_size} process(es), "
        f"global batch {batch}")
    if n < batch:
        say(f"note: the text gives {n} sequence{'s' if n != 1 else ''} of {int(blocks.shape[1])} tokens, fewer "
            f"than the global batch of {batch}: every step repeats some of them (more text, a smaller --seq-len or "
            f"a smaller --batch-size avoids it)")
    if not held_out:
        say(ONE_DOCUMENT)
    t0 = time.time()
    recs = fit()
    if recs:  # none: --resume of a finished run, nothing written
        say(done_line(recs, t0))
        say(units_line(recs))
    if after is not None:
        after()
    if recs:
        say(saved)
    return 0


def done_line(recs: list[dict], t0: float) -> str:
    """The closing line of a training run: wall time, last LM loss and sparsities."""
    r = recs[-1]
    return (f"done in {time.time() - t0:.0f}s: lm_loss {r['lm_loss']:.3f}, attn sparsity {r['attn_sparsity']:.3f}, "
            f"ffn sparsity {r['ffn_sparsity']:.3f}")


def units_line(recs: list[dict]) -> str:
    """The last step's sparsity in both units (of its Gumbel training masks)."""
    r = recs[-1]
    return (f"sparsity of the last step's training masks: groups {r['groups_sparsity']:.3f} (Eq. 6), flops "
            f"{r['flops_sparsity']:.3f} (the routed compute skipped)")


def cmd_calibrate(args) -> int:
    """``wide calibrate``: stage-1 router calibration (Eq. 10-13) into ``-o``, ``--resume`` from its last save."""
    import torch

    import wide.train.fsdp as D
    from wide.calibrate import heldout_windows
    from wide.data import pack
    from wide.hub import default_device
    from wide.model import WideModel
    from wide.train.loop import calibrate
    check_bound(args)
    cfg = C.config_from(args)
    launched = _launch(args, lambda: _prechecks(args))
    if launched is not None:
        return launched
    targs, docs, held = _prechecks(args)
    env = D.init(args.device)
    packed = {}
    def hf_check(hf, tok):  # before any weight is read: the text first, then a batch far too large
        packed["blocks"] = pack(docs, tok, args.seq_len, max_blocks=args.max_blocks, source=C.text_name(args.text))
        packed["held"] = None if held is None else heldout_windows(held or docs, tok, args.seq_len, args.fit_tokens)
        if targs.memory_check:
            from wide.memory import check_train_fits, train_memory_from_config
            device = env.device if env.active else (args.device or default_device())
            procs = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if env.active else 1
            check_train_fits(train_memory_from_config(hf, cfg, device), targs.batch_size, args.seq_len,
                             device=device, grad_checkpoint=targs.grad_checkpoint, grad_accum=targs.grad_accum,
                             procs=procs)
    model, tok, src = C.load(args, cfg, pre=[C.fits_context("--seq-len", args.seq_len)], hf_check=hf_check, env=env)
    blocks = packed["blocks"]
    torch.manual_seed(args.seed)  # identical router initialization on every rank
    wm = WideModel(model, cfg)
    with overwrite_note(args) as on_clear:
        return _train(env, f"calibrating {src.ref} to S={cfg.target_sparsity}, G_attn={wm.config.attn_group_size}, "
                           f"G_ffn={wm.config.ffn_group_size}", blocks, targs,
                      lambda: calibrate(wm, blocks, targs, Path(args.output), src.ref, resume=args.resume,
                                        data_source=data_source(args), options=run_options(args, env),
                                        extra_info={"fit_bias": held is not None}, on_clear=on_clear),
                      f"saved WIDE checkpoint to {args.output}",
                      lambda: _fit_bias(args, env, wm, packed.get("held"), src.ref, held_out=held != []),
                      held_out=held != [])


def cmd_lora(args) -> int:
    """``wide lora``: stage-2 LoRA recovery (peft, all 7 projections) on a stage-1 checkpoint, ``--resume``."""
    import dataclasses

    import wide.train.fsdp as D
    from wide.calibrate import check_reachable, heldout_windows
    from wide.checkpoint import check_stage1, load
    from wide.config import WideConfig
    from wide.data import pack
    from wide.lora import LoraSettings
    from wide.model import dims_of
    from wide.train.loop import recover
    if args.wide is None:  # not required by the parser: --resume takes it from the saved run
        raise WideError("--wide is required: the stage-1 checkpoint directory (the -o of `wide calibrate`); "
                        "only a --resume of a run that saved it may leave it out")
    settings = LoraSettings(r=args.lora_r, alpha=args.lora_alpha, dropout=args.lora_dropout)
    info, objective = {}, {}
    def precheck():
        C.need_extra("peft", "wide lora")
        C.at_least(args, lora_r=1)  # worded as every count option
        settings.validate()
        info.update(check_stage1(args.wide))
        objective.update({k: v for k, v in (("sparsity_unit", args.sparsity_unit),
                                            ("max_module_sparsity", args.max_module_sparsity)) if v is not None})
        C.check_method_flags(args)  # a bad --max-module-sparsity is named before any weight loads
        WideConfig(**objective)
        s1 = WideConfig.load(args.wide)
        bound = objective.get("max_module_sparsity", s1.max_module_sparsity)
        check_reachable(s1.target_sparsity, bound, objective.get("sparsity_unit", s1.sparsity_unit),
                        "the stage-1 checkpoint's -S", "--max-module-sparsity" + (
                            "" if "max_module_sparsity" in objective else " (the stage-1 checkpoint's)"),
                        f"give --max-module-sparsity {s1.target_sparsity:g} or more (stage 2 keeps stage 1's -S)")
        settings.check_dims(dims_of(C.hf_config(args.model or info["model"])[1]))
        if Path(args.wide).resolve() == Path(args.output).resolve():
            raise WideError(f"-o {str(args.output)!r} must differ from the stage-1 checkpoint --wide {args.wide!r}")
        return _prechecks(args, stage="lora")
    launched = _launch(args, precheck)
    if launched is not None:
        return launched
    targs, docs, held = precheck()
    fits = C.fits_context("--seq-len", args.seq_len)
    env = D.init(args.device)
    if env.active:  # rank 0 holds the weights (CPU) and checks the checkpoint; the others only the structure
        from wide.checkpoint import read_config
        from wide.model import WideModel
        base, tok, _ = D.load_base(args.model or info["model"], env, config_check=fits)
        wm = (load(args.wide, model=base, calibrated=False) if env.is_main
              else WideModel(base, read_config(args.wide, base)))
    else:
        wm, tok = load(args.wide, model=args.model, device=args.device, tokenizer=True, config_check=fits,
                       calibrated=False)
    wm.config = dataclasses.replace(wm.config, **objective)
    blocks = pack(docs, tok, args.seq_len, max_blocks=args.max_blocks, source=C.text_name(args.text))
    held_windows = None if held is None else heldout_windows(held or docs, tok, args.seq_len, args.fit_tokens)
    with overwrite_note(args) as on_clear:
        return _train(env, f"LoRA recovery on {args.wide} ({info['model']}) with r={settings.r} "
                           f"alpha={settings.alpha} dropout={settings.dropout}, routers "
                           f"{'frozen' if args.freeze_router else 'trained'}", blocks, targs,
                      lambda: recover(wm, blocks, targs, Path(args.output), args.model or info["model"],
                                      settings=settings, freeze_router=args.freeze_router, stage1=args.wide,
                                      resume=args.resume, data_source=data_source(args),
                                      options=run_options(args, env), extra_info={"fit_bias": held is not None},
                                      on_clear=on_clear),
                      f"saved WIDE checkpoint with LoRA adapter to {args.output}",
                      lambda: _fit_bias(args, env, wm, held_windows, args.model or info["model"],
                                        held_out=held != []),
                      held_out=held != [])
