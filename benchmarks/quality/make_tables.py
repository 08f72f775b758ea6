"""Tables 1-2 analogue with accuracy above chance, rendered as markdown from run records (runs on a CPU).

Reads record files of ``run_quality.py`` (``table.json``) or ``run_control.py`` (``equal.json``): per method,
target S and stage the realized sparsity in both units (Eq. 6's groups and the routed FLOPs skipped, the latter
recomputed from each record's per-layer rates with :func:`wide.routing.realized_sparsity`; static pruning: its
removed fractions), WikiText-2 token perplexity, the average zero-shot accuracy with its retention, the average
without BoolQ with its retention, and the above-chance ratio ``(acc - chance) / (dense - chance)`` per task and of
the average (:func:`wide.eval.chance.above_chance`, against the dense record of the same ``limit``).

The chance level of each task is the mean over its evaluated documents (the first ``limit``) of ``1 / number of
choices``, from the offline task data (:func:`wide.eval.chance.task_chance_levels`; needs lm-eval and the task
data) or, when present with the same ``limit``, from ``--chance`` (``chance.json``, written here with
``--write-chance``), so no model runs again.

    python benchmarks/quality/make_tables.py --records benchmarks/quality/table.json --write-chance
    python benchmarks/quality/make_tables.py --records benchmarks/quality/equal.json
    python benchmarks/quality/make_tables.py --control   # the part files of run_control.py
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shlex
import sys
from pathlib import Path

from wide.eval.chance import BOOLQ, above_chance

HERE = Path(__file__).resolve().parent
TASKS = [("arc_easy", "ARC-e"), ("arc_challenge", "ARC-c"), ("boolq", "BoolQ"), ("winogrande", "WinoG"),
         ("piqa", "PIQA"), ("openbookqa", "OBQA"), ("hellaswag", "HellaS")]
METHOD_ORDER = {"dense": 0, "wide": 1, "skipgpt": 2, "static": 3}
METHOD_NAME = {"dense": "dense", "wide": "WIDE", "skipgpt": "SkipGPT", "static": "static width"}


def chance_levels(limits: set, path: Path, write: bool) -> dict:
    """``{limit: {key: {"task", "chance", "docs"}}}`` for every ``limit`` of the records: from ``path``'s record
    when it has that limit, else from the task data (and written to ``path`` with ``write``)."""
    have = {}
    if path.is_file():
        have = {rec["limit"]: rec["tasks"] for rec in json.loads(path.read_text())}
    missing = [lim for lim in limits if lim not in have]
    if missing:
        from wide.eval.chance import task_chance_levels

        for lim in missing:
            have[lim] = task_chance_levels("zeroshot", limit=None if lim is None else int(lim))
        if write:
            from wide.bench._args import source_commit

            commit = source_commit()[0]
            recs = [{"limit": lim, "unit": "accuracy of a uniform guess: mean over the first `limit` evaluated "
                     "documents of 1 / number of choices", "tasks": tasks, "commit": commit,
                     "date": dt.date.today().isoformat(), "command": "python " + shlex.join(sys.argv)}
                    for lim, tasks in sorted(have.items(), key=lambda kv: -1 if kv[0] is None else kv[0])]
            path.write_text(json.dumps(recs, indent=1) + "\n")
    return have


def flops_of(rec: dict, dims) -> float | None:
    """The record's realized sparsity in the FLOPs unit: from its per-layer rates (routed models) or its removed
    attention / FFN fractions (static pruning), at its training context ``seq_len``; None without either."""
    from wide.config import WideConfig
    from wide.routing import realized_sparsity

    if rec.get("realized_flops") is not None:
        return rec["realized_flops"]
    cfg = WideConfig(seq_len=rec.get("seq_len") or 2048)
    if rec["method"] == "static" and rec.get("attn_sparsity") is not None:
        attn, ffn = [rec["attn_sparsity"]], [rec["ffn_sparsity"]]
    elif rec.get("per_layer"):
        attn = [r["attn"] for r in rec["per_layer"] if r["attn"] is not None]
        ffn = [r["ffn"] for r in rec["per_layer"] if r["ffn"] is not None]
    else:
        return None
    return realized_sparsity([1 - a for a in attn], [1 - f for f in ffn], dims, cfg)["flops"]


def _f(v, fmt: str, none: str = "-") -> str:
    return none if v is None else format(v, fmt)


def render(records: list[dict], chance: dict, dims, title: str) -> str:
    """The markdown of one record file: a summary table per stage, then the per-task table above chance."""
    dense = {r.get("limit"): r for r in records if r["method"] == "dense" and r.get("stage", "router") == "router"
             and r.get("avg_acc") is not None}
    rows = [r for r in records if r.get("avg_acc") is not None and r.get("limit") in dense]
    rows.sort(key=lambda r: (r.get("stage", "router") != "router", METHOD_ORDER.get(r["method"], 9),
                             r.get("target") or 0.0, r.get("key", "")))
    out = [f"### {title}", ""]
    below = set()
    for r in rows:
        lim = r.get("limit")
        ch = {k: v["chance"] for k, v in chance[lim].items()}
        r["_above"] = above_chance(r, ch, dense[lim])
        below |= set(r["_above"]["dense_below_chance"])
    limits = sorted({r.get("limit") for r in rows}, key=lambda x: -1 if x is None else x)
    lim_text = ", ".join("all documents" if lim is None else f"the first {int(lim)} documents" for lim in limits)
    out += [f"Zero-shot accuracy (%) on {lim_text} of each task; WikiText-2 token perplexity (ctx 2048). "
            "Realized sparsity on WikiText-2: Eq. 6's groups / the routed FLOPs skipped. Retention: average "
            "accuracy over dense's. Above chance: (acc - chance) / (dense - chance) of the average over the tasks "
            "where dense is above chance.", ""]
    stage_name = {"router": "stage 1 (routers only; Table 1 analogue)", "lora": "+ LoRA (Table 2 analogue)"}
    for stage in ("router", "lora"):
        srows = [r for r in rows if r.get("stage", "router") == stage]
        if not srows:
            continue
        out += [f"**{stage_name[stage]}**", "",
                "| method | target S | realized (groups / FLOPs) | WikiText-2 ppl | avg acc (retention) | "
                "avg w/o BoolQ (retention) | above chance |", "|---|---|---|---|---|---|---|"]
        for r in srows:
            a = r["_above"]
            realized = ("-" if r["method"] == "dense" else
                        f"{_f(r.get('realized'), '.3f')} / {_f(flops_of(r, dims), '.3f')}")
            out.append(f"| {METHOD_NAME.get(r['method'], r['method'])} | {_f(r.get('target'), 'g')} | {realized} | "
                       f"{_f(r.get('ppl'), ',.2f')} | {100 * a['avg_acc']:.2f} ({100 * a['retention']:.1f} %) | "
                       f"{100 * a['avg_acc_without_boolq']:.2f} ({100 * a['retention_without_boolq']:.1f} %) | "
                       f"{_f(a['avg_above_chance'], '.3f')} |")
        out.append("")
    lim = limits[0]
    d = dense[lim]
    noisy = [k for k, _ in TASKS if k not in below and d.get(f"{k}_stderr")
             and d[k] - chance[lim][k]["chance"] < 2 * d[f"{k}_stderr"]]
    head = [f"{name}{'*' if key in below else ''}{'+' if key in noisy else ''} "
            f"({100 * chance[lim][key]['chance']:.1f})" for key, name in TASKS]
    out += ["Per task: accuracy (%), and in brackets the share of dense's margin over chance kept, (acc - chance) "
            "/ (dense - chance); the chance level of each task in the header.", "",
            "| method | stage | S | " + " | ".join(head) + " |", "|---|---|---|" + "---|" * len(TASKS)]
    for r in rows:
        a = r["_above"]
        cells = []
        for key, _ in TASKS:
            ratio = a["above_chance"].get(key)
            cells.append(f"{100 * r[key]:.1f}" + (f" ({ratio:.2f})" if ratio is not None and r is not d else ""))
        out.append(f"| {METHOD_NAME.get(r['method'], r['method'])} | {r.get('stage', 'router')} | "
                   f"{_f(r.get('target'), 'g')} | " + " | ".join(cells) + " |")
    if below:
        names = ", ".join(f"{dict(TASKS)[k]} ({100 * d[k]:.1f} against a chance level of "
                          f"{100 * chance[lim][k]['chance']:.1f})" for k in sorted(below))
        also = " (and BoolQ from the average w/o BoolQ)" if BOOLQ in below else ""
        out += ["", f"\\* Dense is at or below chance on {names}: the ratio is not defined there, and the task is "
                f"left out of the above-chance average{also}."]
    if noisy:
        names = ", ".join(f"{dict(TASKS)[k]} ({100 * (d[k] - chance[lim][k]['chance']):.1f} points, standard error "
                          f"{100 * d[f'{k}_stderr']:.1f})" for k in noisy)
        out += ["", f"\\+ Dense is less than two standard errors above chance on {names}: there the ratio divides "
                "by a margin within the noise of the measurement, so its values swing widely (the above-chance "
                "average weighs each task by dense's margin)."]
    return "\n".join(out) + "\n"


def _fit_table(recs: list[dict], title: str, what: str) -> list[str]:
    """Markdown lines of records whose logit shift was fitted on held-out WikiText-2 windows: realized sparsity and
    perplexity per target and unit on the other windows, and the largest |realized - target|."""
    units = [u for u in ("groups", "flops") if any(r["unit"] == u for r in recs)]
    out = [f"### {title}", "",
           f"The logit shift fitted on held-out WikiText-2 test windows ({recs[0].get('fit_windows', '')}); realized "
           f"sparsity and token perplexity on {recs[0].get('eval_windows', 'the other windows')}, which the fit never "
           "read.", "", "| target S | " + " | ".join(f"{u}: realized (ppl)" for u in units) + " |",
           "|---|" + "---|" * len(units)]
    by = {(r["unit"], round(r["target"], 6)): r for r in recs}
    for t in sorted({round(r["target"], 6) for r in recs}):
        cells = [f"{_f(r and r['realized'], '.3f')} ({_f(r and r['ppl'], '.2f')})"
                 for r in (by.get((u, t)) for u in units)]
        out.append(f"| {t:g} | " + " | ".join(cells) + " |")
    worst = max(abs(r["realized"] - r["target"]) for r in recs)
    return out + ["", f"Largest |realized - target|: {worst:.4f} over {len(recs)} {what}.", ""]


def render_control(exact: list[dict], dial: list[dict], bound: list[dict], indomain: list[dict] = (),
                   heldout: list[dict] = ()) -> str:
    """Markdown of ``run_control.py``'s records: realized sparsity against the target in both units with and without
    the fitted logit shift (fitted on the calibration text, and on held-out WikiText-2 windows); the dial beside the
    checkpoints trained at each X; the per-module bound."""
    out = []
    if exact:
        units = [u for u in ("groups", "flops") if any(r["unit"] == u for r in exact)]
        head = " | ".join(f"{u}: realized calibrated / uncalibrated (ppl calibrated / uncalibrated)" for u in units)
        out += ["### Exact realized sparsity (WikiText-2, router stage)", "",
                "Realized in the unit trained for; in brackets WikiText-2 token perplexity. Calibrated: the logit "
                "shift fitted on held-out calibration text (`wide.load` default); uncalibrated: the routers as "
                "trained (the paper's argmax routing).", "", f"| target S | {head} |", "|---|" + "---|" * len(units)]
        by = {(r["unit"], round(r["target"], 6), r["calibrated"]): r for r in exact if r["method"] == "wide"}
        for t in sorted({round(r["target"], 6) for r in exact}):
            cells = []
            for u in units:
                c, n = by.get((u, t, True)), by.get((u, t, False))
                cells.append(f"{_f(c and c['realized'], '.3f')} / {_f(n and n['realized'], '.3f')} "
                             f"({_f(c and c['ppl'], '.2f')} / {_f(n and n['ppl'], '.2f')})")
            out.append(f"| {t:g} | " + " | ".join(cells) + " |")
        worst = [abs(r["realized"] - r["target"]) for r in exact if r["calibrated"] and r["method"] == "wide"]
        if worst:
            out += ["", f"Largest |realized - target| calibrated: {max(worst):.4f} over {len(worst)} checkpoints."]
        out.append("")
    if indomain:
        out += _fit_table(indomain, "Exact realized sparsity, the shift fitted on WikiText-2 ([indomain.json]"
                          "(indomain.json))", "checkpoints trained at each S")
    if heldout:
        r0 = heldout[0]
        out += _fit_table(heldout, "One checkpoint fitted to every target on WikiText-2 ([heldout_fit.json]"
                          "(heldout_fit.json))", f"targets, one checkpoint ({r0.get('checkpoint', '')}, trained at "
                          f"S = {r0.get('dialed_from', 0):g} in the {r0.get('trained_unit', 'groups')} unit) "
                          "with its shift refitted per target")
    if dial:
        sources = sorted({r["dialed_from"] for r in dial})
        out += ["### Serve-time dial (`wide.load(..., sparsity=X)`, groups unit)", "",
                "WikiText-2 token perplexity of a checkpoint trained at S and dialed to X, beside the checkpoint "
                "trained at X with the same budget (calibrated); in brackets dialed / trained.", "",
                "| X | trained at X | " + " | ".join(f"dialed from {s:g}" for s in sources) + " |",
                "|---|---|" + "---|" * len(sources)]
        by = {(r["dialed_from"], round(r["target"], 6)): r for r in dial}
        for x in sorted({round(r["target"], 6) for r in dial}):
            tp = next((r["trained_ppl"] for r in dial if round(r["target"], 6) == x and r.get("trained_ppl")), None)
            cells = []
            for s in sources:
                r = by.get((s, x))
                cells.append("-" if r is None else f"{r['ppl']:.2f}" + (f" ({r['ppl'] / tp:.3f})" if tp else "")
                             + f", realized {r['realized']:.3f}")
            out.append(f"| {x:g} | {_f(tp, '.2f')} | " + " | ".join(cells) + " |")
        out.append("")
    if bound:
        out += ["### Per-module bound (S = 0.5, groups)", "",
                "| max module sparsity | calibrated | realized | WikiText-2 ppl | ppl cost | modules >= 0.99 | "
                "modules <= 0.01 |", "|---|---|---|---|---|---|---|"]
        for r in sorted(bound, key=lambda r: (-r.get("max_module_sparsity", 1.0), not r["calibrated"])):
            cost = r.get("ppl_cost")
            out.append(f"| {r.get('max_module_sparsity', 1.0):g} | {'yes' if r['calibrated'] else 'no'} | "
                       f"{r['realized']:.3f} | {r['ppl']:.2f} | {'-' if cost is None else f'{100 * cost:+.1f} %'} | "
                       f"{', '.join(r.get('modules_ge_099') or []) or 'none'} | "
                       f"{len(r.get('modules_le_001') or [])} |")
        out.append("")
    return "\n".join(out)


def main() -> None:
    from wide.cli.common import WideArgumentParser  # usage errors in one line

    p = WideArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--records", nargs="+", default=[str(HERE / "table.json")], help="record files to render")
    p.add_argument("--chance", default=str(HERE / "chance.json"), help="stored chance levels (read, and written "
                   "with --write-chance)")
    p.add_argument("--write-chance", action="store_true", help="store the chance levels computed from the task data")
    p.add_argument("--model", default="smollm2-135m", help="the records' base model (its dims give the FLOPs unit)")
    p.add_argument("--out", default=None, help="also write the markdown to this file")
    p.add_argument("--control", nargs="*", default=None, metavar="FILE", help="render run_control.py's exact.json, "
                   "indomain.json, dial.json and bound.json and run_heldout_fit.py's heldout_fit.json instead "
                   "(default: those beside this script)")
    a = p.parse_args()
    if a.control is not None:
        files = [Path(f) for f in a.control] or [HERE / n for n in ("exact.json", "indomain.json", "dial.json",
                                                                     "bound.json", "heldout_fit.json")]
        recs = {f.stem: json.loads(f.read_text()) for f in files if f.is_file()}
        md = render_control(recs.get("exact", []), recs.get("dial", []), recs.get("bound", []),
                            recs.get("indomain", []), recs.get("heldout_fit", []))
        print(md)
        if a.out:
            Path(a.out).write_text(md)
        return
    from wide.hub import read_hf_config, resolve_model
    from wide.model import dims_of

    dims = dims_of(read_hf_config(resolve_model(a.model)))
    files = [(Path(f), json.loads(Path(f).read_text())) for f in a.records]
    limits = {r.get("limit") for _, recs in files for r in recs if r.get("avg_acc") is not None}
    chance = chance_levels(limits, Path(a.chance), a.write_chance)
    md = "\n".join(render(recs, chance, dims, f"Zero-shot quality above chance ([{f.name}]({f.name}))")
                   for f, recs in files)
    print(md)
    if a.out:
        Path(a.out).write_text(md)


if __name__ == "__main__":
    main()
