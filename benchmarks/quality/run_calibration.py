"""Stage-1 calibration at several target sparsities, evaluated on WikiText-2 test (``calibration.json``).

Each sparsity is one ``wide calibrate`` run into ``--runs`` followed by ``wide eval-ppl`` of its checkpoint
(dense and WIDE token perplexity in ``--ctx`` windows, realized sparsity); one record per run goes to
``<out>/<tag>.json``. On a GPU:

    python benchmarks/quality/run_calibration.py --model PATH.gguf --calib wiki_owt.jsonl \\
        --eval wikitext-2-raw/wiki.test.raw --sparsity 0.25 0.5 --steps 600 2000 --out benchmarks/quality
"""

from __future__ import annotations

import datetime as dt
import json
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

UNIT = ("Eq. 6 group rate: mean over the 2N routed modules of the fraction of groups skipped, over the evaluation "
        "tokens; flop_weighted_sparsity = fraction of prunable compute skipped")


def wide(*args) -> None:
    """Run one ``wide`` command (the CLI of the interpreter running this script); stop on failure."""
    cmd = [sys.executable, "-m", "wide", *map(str, args)]
    print("+", shlex.join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def main() -> None:
    from wide.cli.common import WideArgumentParser  # usage errors in one line

    p = WideArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--calib", required=True, help="calibration text (a --text of wide calibrate)")
    p.add_argument("--eval", required=True, help="evaluation text, e.g. WikiText-2's wiki.test.raw")
    p.add_argument("--sparsity", type=float, nargs="+", default=[0.5, 0.25])
    p.add_argument("--steps", type=int, nargs="+", default=[600], help="one value, or one per sparsity")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--lr", type=float, default=5e-3)
    p.add_argument("--ctx", type=int, default=2048)
    p.add_argument("--ffn-group-size", type=int, default=128)
    p.add_argument("--mode", default="global", choices=["global", "uniform"])
    p.add_argument("--runs", default="runs")
    p.add_argument("--out", default="benchmarks/quality")
    p.add_argument("--tag", default="calibration")
    a = p.parse_args()
    if len(a.steps) not in (1, len(a.sparsity)):
        p.error("--steps takes one value or one per --sparsity")
    steps_of = dict(zip(a.sparsity, a.steps * len(a.sparsity) if len(a.steps) == 1 else a.steps))
    command = "python " + shlex.join(sys.argv)
    from wide.bench._args import source_commit

    commit = source_commit()[0]
    import torch

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    records = []
    for s in a.sparsity:
        steps = steps_of[s]
        run = Path(a.runs) / f"smollm2-{a.mode}-s{round(s * 100)}-g{a.ffn_group_size}"
        t0 = time.time()
        wide("calibrate", "-o", run, "--overwrite", "--model", a.model, "--text", a.calib, "-S", s, "--mode", a.mode,
             "--ffn-group-size", a.ffn_group_size, "--steps", steps, "--batch-size", a.batch_size,
             "--seq-len", a.seq_len, "--lr", a.lr)
        wall = time.time() - t0
        wide("eval-ppl", "--wide", run, "--model", a.model, "--text", a.eval, "--ctx", a.ctx, "--batch-size", 4,
             "--json", run / "eval_ppl.json")
        res = json.loads((run / "eval_ppl.json").read_text())
        dense, w = res["dense"], res["wide"]
        log = [json.loads(line) for line in (run / "train_log.jsonl").read_text().splitlines() if line.strip()]
        cfg = json.loads((run / "wide_config.json").read_text())
        records.append({
            "method": "wide", "stage": "router", "target": s, "unit": UNIT, "realized": w["realized_sparsity"],
            "ppl": w["ppl"], "commit": commit, "date": dt.date.today().isoformat(), "command": command,
            "model": a.model, "sparsity_mode": a.mode, "G_attn": cfg["attn_group_size"], "G_ffn": cfg["ffn_group_size"],
            "attn_sparsity": w["attn_sparsity"], "ffn_sparsity": w["ffn_sparsity"],
            "flop_weighted_sparsity": w["flop_weighted_sparsity"], "dense_ppl": dense["ppl"],
            "ppl_ratio": w["ppl"] / dense["ppl"], "ctx": a.ctx, "eval_tokens": w["tokens"], "steps": steps,
            "batch_size": a.batch_size, "seq_len": a.seq_len, "lr": a.lr, "tokens": steps * a.batch_size * a.seq_len,
            "calibrate_wall_s": wall, "tokens_per_s": statistics.median(r["tokens_per_s"] for r in log),
            "final_train_lm_loss": log[-1]["lm_loss"], "per_layer": w["per_layer"], "gpu": gpu, "checkpoint": str(run),
        })
        (out / f"{a.tag}.json").write_text(json.dumps(records, indent=1) + "\n")
        print(f"S={s}: ppl {w['ppl']:.3f} (dense {dense['ppl']:.3f}), realized {w['realized_sparsity']:.3f}",
              flush=True)


if __name__ == "__main__":
    main()
