"""``wide demo``: the main job on the bundled model and text (dense perplexity, a short stage-1 calibration, WIDE
perplexity, the per-layer table)."""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from wide.cli.common import (
    _at_least,
    _check_output,
    _config_from,
    _data_source,
    _demo_settings,
    _fits_context,
    _load,
    _parser,
    _print,
    _summary_line,
    _text_name,
    _train_args_from,
)
from wide.cli.train import _NOT_RUN_OPTIONS, _run_options


def _demo_calibrate_options(args, steps: int, seq_len: int) -> dict:
    """The ``wide calibrate`` options that run the demo's calibration, kept with its training state so that
    ``wide calibrate -o DIR --resume`` alone continues an interrupted demo (:func:`_run_options`): calibrate's
    defaults, every option the demo shares with it as the demo ran it, ``--steps`` / ``--seq-len`` as resolved."""
    import wide.train.fsdp as D

    ns = _parser().parse_args(["calibrate", "-o", str(args.output)])
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

    from wide.checkpoint import save_wide
    from wide.config import atomic_write_text
    from wide.data import DEFAULT_TEXT, load_texts, pack, ppl_windows
    from wide.eval.perplexity import format_layer_table, perplexity
    from wide.model import WideModel
    from wide.train.loop import calibrate

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

    model, tok, src = _load(args, cfg, then=prepare, pre=[_fits_context("--ctx", ctx)])
    win, blocks = data["win"], data["blocks"]
    wm = WideModel(model, cfg)
    targs = _train_args_from(argparse.Namespace(**{**vars(args), "steps": steps, "seq_len": seq_len}))
    if targs.memory_check:  # before the dense evaluation, not minutes later when calibration starts
        from wide.memory import check_train_memory

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
    args.calibrated = True  # an interrupt from here on needs no --resume (see wide.cli.main)
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
