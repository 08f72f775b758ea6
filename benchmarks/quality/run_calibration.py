"""Stage-1 calibration of SmolLM2-135M at several target sparsities, evaluated on WikiText-2 test.

Writes ``calibration.json`` (a list of records) and ``calibration.md`` into ``--out``. Run on a GPU:

    PYTHONPATH=src python3 benchmarks/quality/run_calibration.py --model PATH.gguf \
        --calib ../shared/data/calibration/wiki_owt.jsonl --eval ../shared/data/wikitext-2-raw/wiki.test.raw \
        --sparsity 0.5 0.25 --steps 600 --out benchmarks/quality
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shlex
import sys
import time
from pathlib import Path

import torch

from wide.checkpoint import save_wide
from wide.config import WideConfig, atomic_write_text
from wide.data import load_texts, pack, ppl_windows
from wide.eval.perplexity import perplexity
from wide.model import WideModel, load_base_model
from wide.train.loop import CalibrationArgs, calibrate


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--calib", required=True)
    p.add_argument("--eval", required=True)
    p.add_argument("--sparsity", type=float, nargs="+", default=[0.5, 0.25])
    p.add_argument("--steps", type=int, nargs="+", default=[600], help="one value, or one per sparsity")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--lr", type=float, default=5e-3)
    p.add_argument("--ctx", type=int, default=2048)
    p.add_argument("--ffn-group-size", type=int, default=128)
    p.add_argument("--mode", default="global")
    p.add_argument("--runs", default="runs")
    p.add_argument("--out", default="benchmarks/quality")
    p.add_argument("--tag", default="calibration")
    a = p.parse_args()
    command = "PYTHONPATH=src python3 " + " ".join(shlex.quote(x) for x in sys.argv)
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    model, tok, src = load_base_model(a.model)
    win = ppl_windows(load_texts(a.eval), tok, a.ctx)
    blocks = pack(load_texts(a.calib), tok, a.seq_len)
    print(f"eval windows {tuple(win.shape)}, calibration blocks {tuple(blocks.shape)}", flush=True)
    dense = perplexity(model, win, batch_size=4, desc="dense")
    print(f"dense ppl {dense['ppl']:.3f}", flush=True)
    records = []
    steps_for = dict(zip(a.sparsity, a.steps if len(a.steps) == len(a.sparsity) else a.steps * len(a.sparsity)))
    for s in a.sparsity:
        steps = steps_for[s]
        cfg = WideConfig(target_sparsity=s, ffn_group_size=a.ffn_group_size, sparsity_mode=a.mode)
        torch.manual_seed(0)
        wm = WideModel(model, cfg)
        targs = CalibrationArgs(steps=steps, batch_size=a.batch_size, lr=a.lr, warmup_steps=steps // 20,
                                save_every=max(1, steps // 2))
        t0 = time.time()
        out_dir = Path(a.runs) / f"smollm2-{a.mode}-s{int(s * 100)}-g{a.ffn_group_size}"
        recs = calibrate(wm, blocks, targs, out_dir, src.ref, progress=False,
                         on_step=lambda r: print(json.dumps(r), flush=True) if r["step"] % 50 == 0 else None)
        wall = time.time() - t0
        res = perplexity(wm, win, batch_size=4, desc="wide")
        save_wide(wm, out_dir, src.ref)
        tokens = steps * a.batch_size * a.seq_len
        rec = {
            "method": "wide", "stage": "router", "model": "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized, bf16)",
            "target_sparsity": s, "sparsity_mode": a.mode,
            "G_attn": wm.config.attn_group_size, "G_ffn": wm.config.ffn_group_size,
            "realized_sparsity": res["realized_sparsity"], "attn_sparsity": res["attn_sparsity"],
            "ffn_sparsity": res["ffn_sparsity"], "flop_weighted_sparsity": res["flop_weighted_sparsity"],
            "ppl": res["ppl"], "dense_ppl": dense["ppl"], "ppl_ratio": res["ppl"] / dense["ppl"],
            "ctx": a.ctx, "eval_tokens": res["tokens"], "text": "wikitext-2-raw test",
            "calib_text": "wiki_owt.jsonl", "steps": steps, "batch_size": a.batch_size, "seq_len": a.seq_len,
            "lr": a.lr, "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
            "final_train_lm_loss": recs[-1]["lm_loss"],
            "per_layer": res["per_layer"], "gpu": gpu, "date": dt.date.today().isoformat(), "command": command,
        }
        records.append(rec)
        print(f"S={s}: ppl {res['ppl']:.3f} (dense {dense['ppl']:.3f}, x{rec['ppl_ratio']:.2f}), realized "
              f"{res['realized_sparsity']:.3f} (attn {res['attn_sparsity']:.3f}, ffn {res['ffn_sparsity']:.3f}), "
              f"{wall:.0f}s, {rec['tokens_per_s']:.0f} tok/s", flush=True)
        for h in wm._handles:
            h.remove()
        write(records, Path(a.out), a.tag, gpu, command)


def write(records: list[dict], out: Path, tag: str, gpu: str, command: str) -> None:
    atomic_write_text(out / f"{tag}.json", json.dumps(records, indent=2) + "\n")
    lines = ["| S | G_attn | G_ffn | realized | attn | FFN | FLOP-weighted | ppl | dense ppl | ratio | steps | tokens | wall s | tok/s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        lines.append(f"| {r['target_sparsity']} | {r['G_attn']} | {r['G_ffn']} | {r['realized_sparsity']:.3f} | "
                     f"{r['attn_sparsity']:.3f} | {r['ffn_sparsity']:.3f} | {r['flop_weighted_sparsity']:.3f} | "
                     f"{r['ppl']:.2f} | {r['dense_ppl']:.2f} | {r['ppl_ratio']:.2f} | {r['steps']} | {r['tokens']:,} | "
                     f"{r['wall_s']:.0f} | {r['tokens_per_s']:.0f} |")
    lines += ["", f"GPU: {gpu}; date {records[0]['date']}", "", "Command:", "", "```", command, "```"]
    atomic_write_text(out / f"{tag}.md", "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
