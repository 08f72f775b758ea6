"""``wide demo``: the main job on the bundled model and text (dense perplexity, a short stage-1 calibration, WIDE
perplexity, the per-layer table), one result line per stage."""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from wide.cli import common as C
from wide.cli.train import check_bound, data_source, done_line, overwrite_note, run_options

#: automatic settings (ctx, seq_len, steps, eval_tokens) on a CPU and on a GPU; micro-batch and learning rate
CPU = {"ctx": 512, "seq_len": 256, "steps": 80, "eval_tokens": 12288}
GPU = {"ctx": 2048, "seq_len": 2048, "steps": 300, "eval_tokens": None}
BATCH, LR = 4, 1e-2


def add_parser(sub) -> None:
    """Add ``demo`` to the ``wide`` subcommands."""
    s = sub.add_parser("demo", help="dense ppl, short calibration to S=0.5, WIDE ppl, per-layer table, save")
    C.add_model(s)
    s.add_argument("--text", help="text for calibration and evaluation, used whole for both (default: "
                                  "boolq-passages, the BoolQ passages, disjoint calibration / evaluation splits)")
    s.add_argument("--output", "-o", default="runs/demo", help="checkpoint folder, also gets demo_result.json "
                                                               "(default: runs/demo); empty or new unless --overwrite")
    s.add_argument("--overwrite", action="store_true", help="write into a non-empty --output (an earlier run's "
                                                             "files are removed when calibration starts; other "
                                                             "files stay)")
    s.add_argument("--ctx", type=int, help="evaluation window in tokens (>= 2; default: auto, 512 on CPU, 2048 on GPU)")
    s.add_argument("--eval-tokens", type=int, help="evaluate at most N tokens (>= 2; default: auto, 12288 on CPU, "
                                                   "all on GPU)")
    C.add_method(s)
    C.add_train(s, BATCH, LR, {"steps": "auto, 80 on CPU, 300 on GPU", "seq_len": "auto, 256 on CPU, 2048 on GPU"})
    save = next(a for a in s._actions if a.dest == "save_every")
    save.default = None
    save.help = ("checkpoint every N steps (>= 1; default: auto, a quarter of --steps, 20 on CPU, 75 on GPU: an "
                 "interrupted demo leaves a state that `wide calibrate -o DIR --resume` finishes)")
    s.set_defaults(func=cmd_demo)


def demo_settings(args, gpu: bool) -> dict:
    """``{ctx, seq_len, steps, eval_tokens, save_every}``: the options given, else the automatic ones (a save every
    quarter of the steps)."""
    auto = {k: v if getattr(args, k) is None else getattr(args, k) for k, v in (GPU if gpu else CPU).items()}
    auto["save_every"] = max(1, auto["steps"] // 4) if args.save_every is None else args.save_every
    return auto


def cmd_demo(args) -> int:
    """``wide demo``: dense perplexity, a short stage-1 calibration, WIDE perplexity and the per-layer table,
    saved to ``-o``. Bad counts or paths, a ``--ctx`` past the model's context and a micro-batch that does not fit
    in memory are refused before the dense evaluation."""
    import torch

    import wide.train.fsdp as D
    from wide.checkpoint import save_wide
    from wide.config import atomic_write_text
    from wide.data import DEFAULT_TEXT, load_texts, pack, ppl_windows
    from wide.eval.perplexity import format_layer_table, perplexity
    from wide.model import WideModel
    from wide.train.loop import DEMO_RESULT_NAME, calibrate
    say = C.say
    C.at_least(args, ctx=2, eval_tokens=2, steps=1, seq_len=2, save_every=1)  # None = automatic
    check_bound(args)
    gpu = (args.device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
    auto = demo_settings(args, gpu)
    ctx, seq_len, steps = auto["ctx"], auto["seq_len"], auto["steps"]
    args.save_every = auto["save_every"]
    targs = C.train_args_from(args, steps)
    cfg = C.config_from(argparse.Namespace(**{**vars(args), "seq_len": seq_len}))  # both reports' flops at seq_len
    out = Path(args.output)
    C.check_output(args)
    texts = {split: load_texts(args.text, split=split) for split in ("eval", "calib")}
    torch.manual_seed(0)
    t_all = time.time()
    if not gpu and not os.environ.get("OMP_NUM_THREADS"):  # a thread count set by the user stays
        torch.set_num_threads(os.cpu_count() or 1)
    data, source = {}, C.text_name(args.text)
    def prepare(hf, tok):  # the texts checked against the tokenizer, then the first line, then the weights
        data["win"] = ppl_windows(texts["eval"], tok, ctx, auto["eval_tokens"], source)
        data["blocks"] = pack(texts["calib"], tok, seq_len, args.max_blocks, source)
        say(f"[1/5] loading {args.model or 'the bundled SmolLM2-135M-Instruct (GGUF)'} on {'cuda' if gpu else 'cpu'}")
    model, tok, src = C.load(args, cfg, pre=[C.fits_context("--ctx", ctx)], hf_check=prepare)
    win, blocks = data["win"], data["blocks"]
    wm = WideModel(model, cfg)
    if targs.memory_check:  # before the dense evaluation, not minutes later when calibration starts
        from wide.memory import check_train_memory
        check_train_memory(wm, targs.batch_size, seq_len, grad_checkpoint=targs.grad_checkpoint,
                           grad_accum=targs.grad_accum)
    d, c = wm.dims, wm.config
    say(f"      {d.num_layers} layers, hidden {d.hidden_size}, heads {d.num_heads}/{d.num_kv_heads} KV, head_dim "
        f"{d.head_dim}, FFN {d.intermediate_size}; G_attn={c.attn_group_size} G_ffn={c.ffn_group_size}; "
        f"{wm.router_param_count():,} router parameters")
    evaluated = ("held-out tokens (the evaluation split of the default text)" if source == DEFAULT_TEXT else
                 f"tokens of {args.text} (the calibration text too, not held-out)")
    say(f"[2/5] dense perplexity on {win.numel():,} {evaluated} ({win.shape[0]} x {win.shape[1]})")
    with wm.masks_fixed(attn=True, ffn=True):
        dense = perplexity(wm, win, args.batch_size)
    say(f"      dense ppl {dense['ppl']:.3f}")
    say(f"[3/5] calibrating routers to S={cfg.target_sparsity}: {steps} steps x {args.batch_size} x {seq_len} "
        f"tokens ({blocks.shape[0]} calibration sequences)")
    t0 = time.time()
    # kept with the state, so that `wide calibrate -o OUT --resume` alone finishes an interrupted demo
    options = run_options(argparse.Namespace(**{**vars(args), "steps": steps, "seq_len": seq_len}), D.current())
    with overwrite_note(args) as on_clear:
        recs = calibrate(wm, blocks, targs, out, src.ref, data_source=data_source(args), options=options,
                         on_clear=on_clear)
    args.calibrated = True  # an interrupt from here on needs no --resume (see wide.cli.main)
    say(f"      {done_line(recs, t0)}")
    say("[4/5] WIDE perplexity (argmax routing)")
    wide = perplexity(wm, win, args.batch_size)
    say(format_layer_table(wide))
    say(C.summary_line("dense", dense))
    say(C.summary_line("wide", wide))
    say(f"ppl ratio wide/dense: {wide['ppl'] / dense['ppl']:.3f}")
    say(f"[5/5] saving checkpoint to {out}")
    save_wide(wm, out, src.ref)
    result = {"model": src.ref, "target_sparsity": cfg.target_sparsity, "steps": steps, "seq_len": seq_len,
              "ctx": int(win.shape[1]), "dense_ppl": dense["ppl"], "ppl": wide["ppl"],
              **{k: v for k, v in wide.items() if k != "ppl"}, "wall_s": time.time() - t_all}
    atomic_write_text(out / DEMO_RESULT_NAME, json.dumps(result, indent=2) + "\n")
    say(f"done in {time.time() - t_all:.0f}s; results in {out / DEMO_RESULT_NAME}")
    return 0
