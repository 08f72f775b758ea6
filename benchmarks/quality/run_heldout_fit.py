"""Exact realized sparsity on held-out text of the evaluated domain: the logit shift of one trained checkpoint fitted
on some WikiText-2 test windows, the sparsity realized on the others.

For every ``--targets`` S in each ``--units`` unit, :func:`wide.calibrate.fit_shifts` fits the routers' logit shift
(the serve-time dial of ``wide.load(..., sparsity=S)``) on every ``--fit-every``-th ``--ctx``-token window of
wiki.test.raw; argmax routing then runs over the first ``--eval-windows`` of the other windows, which the fit never
read, giving the realized sparsity in both units and the token perplexity. One record per (unit, S) in
``heldout_fit.json`` under ``--out``, written as the points finish (a cut run keeps them and ``--resume`` skips them).

The same fit on held-out calibration text of another domain is ``run_control.py``'s part ``exact``; this script
isolates what the fit's text contributes, with no training, so it also runs on a CPU:

    PYTHONPATH=src python3 benchmarks/quality/run_heldout_fit.py \\
        --wikitext ../shared/data/wikitext-2-raw/wiki.test.raw --out benchmarks/quality
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import shlex
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> None:
    from wide.cli.common import WideArgumentParser  # usage errors in one line

    p = WideArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", default=str(HERE / "checkpoints" / "smollm2-global-s50-g128"))
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--wikitext", required=True, help="WikiText-2's wiki.test.raw")
    p.add_argument("--targets", type=float, nargs="+", default=[0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7])
    p.add_argument("--units", nargs="+", choices=["groups", "flops"], default=["groups", "flops"])
    p.add_argument("--ctx", type=int, default=2048)
    p.add_argument("--fit-every", type=int, default=8, help="every n-th window is the fit's text")
    p.add_argument("--eval-windows", type=int, default=None, help="evaluated windows (default: every other one)")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--out", required=True)
    p.add_argument("--resume", action="store_true", help="keep the records already in the output file")
    a = p.parse_args()
    bad = [s for s in a.targets if not 0.0 <= s < 1.0]
    if bad:
        raise SystemExit(f"run_heldout_fit.py: error: target {bad[0]} is outside [0, 1)")
    if not Path(a.wikitext).is_file():
        raise SystemExit(f"run_heldout_fit.py: error: --wikitext {a.wikitext!r} not found")
    if a.fit_every < 2:
        raise SystemExit(f"run_heldout_fit.py: error: --fit-every {a.fit_every} must be >= 2 (some windows are "
                         "evaluated)")

    import torch

    import wide
    from wide.bench._args import source_commit
    from wide.calibrate import fit_shifts
    from wide.config import atomic_write_text
    from wide.data import load_texts, ppl_windows
    from wide.eval.perplexity import perplexity

    wm, tok = wide.load(a.checkpoint, model=a.model, tokenizer=True, calibrated=False)
    windows = ppl_windows(load_texts(a.wikitext), tok, a.ctx, None, a.wikitext)
    fit = torch.arange(len(windows)) % a.fit_every == 0
    fit_w, eval_w = windows[fit], windows[~fit][:a.eval_windows]
    device = next(wm.parameters()).device
    common = {
        "method": "wide", "stage": "router", "calibrated": True, "fit_on": "wikitext",
        "fit_windows": f"wiki.test.raw windows i % {a.fit_every} == 0 ({int(fit.sum())} x {a.ctx} tokens)",
        "eval_windows": f"the first {len(eval_w)} of the other windows",
        "dialed_from": wm.config.target_sparsity, "trained_unit": wm.config.sparsity_unit,
        "checkpoint": str(Path(a.checkpoint).resolve().relative_to(HERE.parents[1])) if Path(a.checkpoint).resolve()
        .is_relative_to(HERE.parents[1]) else a.checkpoint,
        "commit": source_commit()[0],
        "date": dt.date.today().isoformat(), "command": "python " + shlex.join(sys.argv),
        "gpu": torch.cuda.get_device_name() if device.type == "cuda" else f"cpu ({platform.processor() or 'x86_64'})",
    }
    out = Path(a.out) / "heldout_fit.json"
    records = json.loads(out.read_text()) if a.resume and out.is_file() else []
    done = {(r["unit"], round(r["target"], 6)) for r in records}
    for unit in a.units:
        for s in a.targets:
            if (unit, round(s, 6)) in done:
                continue
            t0 = time.time()
            wm.set_router_shifts(None)
            rec = fit_shifts(wm, fit_w, target=s, unit=unit, batch_size=a.batch_size)
            fit_s = time.time() - t0
            ev = perplexity(wm, eval_w, batch_size=a.batch_size, progress=False)
            realized = {"groups": ev["groups_sparsity"], "flops": ev["flops_sparsity"]}
            records.append({
                **common, "target": s, "unit": unit, "realized": realized[unit], "realized_groups": realized["groups"],
                "realized_flops": realized["flops"], "error": realized[unit] - s, "ppl": ev["ppl"],
                "ppl_tokens": ev["tokens"], "attn_sparsity": ev["attn_sparsity"], "ffn_sparsity": ev["ffn_sparsity"],
                "fit": {k: rec[k] for k in ("converged", "passes", "realized", "shifts", "heldout", "tolerance")},
                "fit_s": fit_s, "eval_s": time.time() - t0 - fit_s})
            atomic_write_text(out, json.dumps(records, indent=1) + "\n")
            print(f"{unit} S={s:g}: realized {realized[unit]:.4f} (error {realized[unit] - s:+.4f}) on "
                  f"{ev['tokens']:,} held-out tokens, ppl {ev['ppl']:.2f}; fit {rec['passes']} passes, "
                  f"{fit_s:.0f} s", flush=True)
    worst = max((abs(r["error"]) for r in records), default=float("nan"))
    print(f"largest |realized - target| over {len(records)} points: {worst:.4f}")


if __name__ == "__main__":
    main()
