"""Figures of §4.3-4.4 from the kept results (runs on a CPU).

* Figure 9 analogue: layer-wise realized attention / FFN sparsity, from the ``per_layer`` field of a
  record in ``<out>/<tag>.json`` (``--profile KEY``) or measured now from a router checkpoint
  (``--checkpoint DIR`` + ``--wikitext``).
* Figure 10 analogue: token-level routing of one sentence, from a router checkpoint (``--checkpoint``)
  and the bundled base model.
* Figure 6 analogue: average zero-shot accuracy against target sparsity, per method and stage, from a
  sparsity-sweep record file (``--sweep FILE``).
* Figure 6 companion: WikiText-2 perplexity of checkpoints dialed to X with ``wide.load(..., sparsity=X)``
  beside checkpoints trained at X (``--dial dial.json --exact exact.json``), and realized against target
  sparsity with and without the fitted logit shift (``--exact``); ``run_control.py`` writes both files.
* Figure 5 analogue: WIDE at S = 0.5, average zero-shot accuracy and WikiText-2 token perplexity against
  the group size (G_ffn sweep at the default G_attn, G_attn sweep at G_ffn 128), from a group-sweep record
  file (``--group FILE``); planned points without a record are named under the plot.

    python benchmarks/quality/make_plots.py --results benchmarks/quality/table.json \
        --profile wide-global-s50-gagqa-gf128-router \
        --checkpoint benchmarks/quality/checkpoints/smollm2-global-s50-g128 \
        --sweep benchmarks/quality/sparsity.json --group benchmarks/quality/group.json --out benchmarks/quality
    python benchmarks/quality/make_plots.py --dial benchmarks/quality/dial.json --exact benchmarks/quality/exact.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

# the group plan of run_quality.py (GROUP_FFN, GROUP_ATTN; there the default G_attn, one GQA group, is None)
GROUP_FFN = [16, 32, 64, 128, 256, 512]
GROUP_ATTN = [64, 576]
DEFAULT_G_FFN = 128

SENTENCE = ("A boy is running down a track. The boy runs into a car and falls down, then gets up and "
            "keeps running toward the finish line.")


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path, rect=None) -> Path:
    """Lay out ``fig`` (within ``rect``: room for a note under the panels), write it to ``path``, close it."""
    fig.tight_layout(**({"rect": rect} if rect else {}))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    _plt().close(fig)
    return path


def sweep_plot(records: list[dict], path: Path) -> Path:
    """Figure 6 analogue, two panels against target sparsity S: average zero-shot accuracy (left) and
    WikiText-2 token perplexity (right, log scale), one line per method and stage, dense as a gray line."""
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(9.5, 3.4), dpi=150)
    dense = [r for r in records if r["method"] == "dense" and r["stage"] == "router" and r.get("avg_acc") is not None]
    series = {}
    for r in records:
        if r["method"] != "dense" and r.get("avg_acc") is not None:
            series.setdefault((r["method"], r["stage"]), []).append(r)
    for ax, field, label in ((axes[0], "avg_acc", "average zero-shot accuracy (%)"),
                             (axes[1], "ppl", "WikiText-2 perplexity (token, ctx 2048)")):
        scale = 100 if field == "avg_acc" else 1
        for (m, st), rs in sorted(series.items()):
            rs = sorted(rs, key=lambda r: r["target"])
            ax.plot([100 * r["target"] for r in rs], [scale * r[field] for r in rs], marker="o", ms=3,
                    ls="-" if st == "router" else "--", label=f"{m} ({'router' if st == 'router' else '+LoRA'})")
        if dense and dense[0].get(field) is not None:
            ax.axhline(scale * dense[0][field], color="gray", ls=":", label="dense")
        ax.set_xlabel("target sparsity S (%)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        if field == "ppl":
            ax.set_yscale("log")
    axes[0].legend(fontsize=7)
    return _save(fig, path)


def group_plot(records: list[dict], path: Path) -> Path:
    """Figure 5 analogue, two panels against the group size G (log scale): average zero-shot accuracy
    (left) and WikiText-2 token perplexity (right) of WIDE at S = 0.5, global loss. One line varies G_ffn at
    the default G_attn (key ``-gagqa-``: one GQA group), one varies G_attn at G_ffn 128; stage 1 solid,
    + LoRA dashed; dense as a gray line. Planned points of run_quality.py's group plan that have no
    record are listed under the panels."""
    plt = _plt()
    wide = [r for r in records if r["method"] == "wide" and r.get("target") == 0.5
            and r.get("sparsity_mode", "global") == "global" and r.get("avg_acc") is not None]
    dense = [r for r in records if r["method"] == "dense" and r["stage"] == "router" and r.get("avg_acc") is not None]
    if not wide:
        raise SystemExit("no WIDE S=0.5 record in the group file")
    default = [r for r in wide if "-gagqa-" in r.get("key", "")]
    g_attn0 = (default or wide)[0]["G_attn"]
    series = {}  # (knob, stage) -> {G: record}
    for r in wide:
        if r["G_attn"] == g_attn0:
            series.setdefault(("G_ffn", r["stage"]), {})[r["G_ffn"]] = r
        if r["G_ffn"] == DEFAULT_G_FFN:
            series.setdefault(("G_attn", r["stage"]), {})[r["G_attn"]] = r
    fig, axes = plt.subplots(1, 2, figsize=(9.5, 3.6), dpi=150)
    for ax, field, label in ((axes[0], "avg_acc", "average zero-shot accuracy (%)"),
                             (axes[1], "ppl", "WikiText-2 perplexity (token, ctx 2048)")):
        scale = 100 if field == "avg_acc" else 1
        for (knob, st), pts in sorted(series.items()):
            gs = sorted(pts)
            fixed = f"G_attn {g_attn0}" if knob == "G_ffn" else f"G_ffn {DEFAULT_G_FFN}"
            ax.plot(gs, [scale * pts[g][field] for g in gs], marker="o" if knob == "G_ffn" else "s",
                    ms=4 if knob == "G_ffn" else 6, ls="-" if st == "router" else "--",
                    color="C0" if knob == "G_ffn" else "C1",
                    label=f"vary {knob} ({fixed}, {'router' if st == 'router' else '+LoRA'})")
        if dense and dense[0].get(field) is not None:
            ax.axhline(scale * dense[0][field], color="gray", ls=":", label="dense")
        ax.set_xscale("log", base=2)
        ticks = sorted({g for pts in series.values() for g in pts} | set(GROUP_FFN))
        ax.set_xticks(ticks)
        crowded = any(b / a < 1.25 for a, b in zip(ticks, ticks[1:]))  # e.g. 512 and 576
        ax.set_xticklabels([str(t) for t in ticks], rotation=45 if crowded else 0)
        ax.set_xlabel("group size G (channels)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    stages = sorted({st for _, st in series})
    missing = [f"G_ffn {g}" for g in GROUP_FFN if g not in series.get(("G_ffn", "router"), {})]
    missing += [f"G_attn {g}" for g in GROUP_ATTN if g not in series.get(("G_attn", "router"), {})]
    note = f"WIDE, S = 0.5, {'/'.join(stages)} stage"
    if missing:
        note += "; not run: " + ", ".join(missing)
    fig.text(0.5, 0.01, note, ha="center", fontsize=8)
    return _save(fig, path, rect=(0, 0.05, 1, 1))


def dial_plot(dial: list[dict], exact: list[dict], path: Path) -> Path:
    """Figure 6 companion, two panels against the sparsity X realized on WikiText-2 (Eq. 6's groups): token
    perplexity (left, log scale) of the checkpoints trained at each X (calibrated, and with the paper's uncalibrated
    routing) and of the ones dialed from a trained S (``dial.json``, one line per S, its training point circled);
    right, the dialed perplexity over the trained one at the same target, with the 10 % band."""
    plt = _plt()
    unit = "groups"
    fig, axes = plt.subplots(1, 2, figsize=(9.5, 3.6), dpi=150)
    ax, rx = axes
    trained = {}
    for calibrated, style, label in ((True, "-", "trained at X (calibrated)"),
                                     (False, ":", "trained at S (uncalibrated, as the paper)")):
        rs = sorted((r for r in exact if r["method"] == "wide" and r["unit"] == unit and r["calibrated"] == calibrated
                     and r.get("max_module_sparsity", 1.0) == 1.0), key=lambda r: r["target"])
        if calibrated:
            trained = {round(r["target"], 6): r for r in rs}
        if rs:
            ax.plot([100 * r["realized_groups"] for r in rs], [r["ppl"] for r in rs], ls=style, marker="o", ms=3,
                    color="k" if calibrated else "gray", label=label)
    for i, (src, rs) in enumerate(sorted(_by(dial, "dialed_from").items())):
        rs = sorted(rs, key=lambda r: r["target"])
        color = f"C{i}"
        ax.plot([100 * r["realized_groups"] for r in rs], [r["ppl"] for r in rs], marker="s", ms=3, color=color,
                label=f"dialed from S = {src:g}")
        t = trained.get(round(src, 6))
        if t is not None:
            ax.plot([100 * t["realized_groups"]], [t["ppl"]], marker="o", ms=9, mfc="none", color=color)
        pts = [(r["target"], r["ppl"] / r["trained_ppl"]) for r in rs if r.get("trained_ppl")]
        if pts:
            rx.plot([100 * x for x, _ in pts], [y for _, y in pts], marker="s", ms=3, color=color,
                    label=f"dialed from S = {src:g}")
            rx.axvline(100 * src, color=color, lw=0.6, ls=":")
    rx.axhspan(0.9, 1.1, color="gray", alpha=0.15, label="within 10 %")
    rx.axhline(1.0, color="gray", lw=0.8)
    ax.set_yscale("log")
    ax.set_xlabel("realized sparsity on WikiText-2, Eq. 6 groups (%)")
    ax.set_ylabel("WikiText-2 perplexity (token, ctx 2048)")
    rx.set_xlabel("dialed target X (%)")
    rx.set_ylabel("ppl dialed / ppl trained at X")
    for a in axes:
        a.grid(alpha=0.3)
        a.legend(fontsize=7)
    steps = sorted({r.get("steps") for r in [*dial, *exact] if r.get("steps")})
    fig.text(0.5, 0.01, f"WIDE, router stage, {'/'.join(map(str, steps))} steps per checkpoint; dialed with "
             "wide.load(..., sparsity=X)", ha="center", fontsize=8)
    return _save(fig, path, rect=(0, 0.05, 1, 1))


def exact_plot(exact: list[dict], path: Path) -> Path:
    """Realized against target sparsity on WikiText-2, one panel per unit the checkpoints were trained in (Eq. 6's
    groups, the routed FLOPs): calibrated (the fitted logit shift) and uncalibrated (the paper's argmax routing),
    with the ±0.01 band around realized = target."""
    plt = _plt()
    units = [u for u in ("groups", "flops") if any(r["unit"] == u for r in exact)]
    fig, axes = plt.subplots(1, len(units), figsize=(4.8 * len(units), 3.6), dpi=150, squeeze=False)
    for ax, unit in zip(axes[0], units):
        for calibrated, color, label in ((True, "C0", "calibrated"), (False, "C3", "uncalibrated (paper)")):
            rs = sorted((r for r in exact if r["unit"] == unit and r["calibrated"] == calibrated
                         and r["method"] == "wide" and r.get("max_module_sparsity", 1.0) == 1.0),
                        key=lambda r: r["target"])
            if rs:
                ax.plot([100 * r["target"] for r in rs], [100 * (r["realized"] - r["target"]) for r in rs],
                        marker="o", ms=3, color=color, label=label)
        ax.axhspan(-1, 1, color="gray", alpha=0.15, label="±0.01")
        ax.axhline(0, color="gray", lw=0.8)
        ax.set_xlabel(f"target S, {unit} unit (%)")
        ax.set_ylabel(f"realized - target, WikiText-2 ({unit}, pts)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return _save(fig, path)


def _by(records: list[dict], field: str) -> dict:
    out: dict = {}
    for r in records:
        out.setdefault(r[field], []).append(r)
    return out


def main() -> None:
    from wide.cli.common import WideArgumentParser  # usage errors in one line

    p = WideArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results", default=None, help="a run_quality.py record file (for --profile)")
    p.add_argument("--profile", default=None,
                   help="record key (or index) whose per_layer sparsity to draw (Figure 9)")
    p.add_argument("--checkpoint", default=None, help="router checkpoint for Figure 10 (and 9 with --wikitext)")
    p.add_argument("--model", default=None, help="base model (default: the one recorded in the checkpoint)")
    p.add_argument("--wikitext", default=None, help="measure the Figure-9 profile of --checkpoint on this text")
    p.add_argument("--max-tokens", type=int, default=65536, help="tokens of --wikitext to measure on")
    p.add_argument("--sentence", default=SENTENCE)
    p.add_argument("--sweep", default=None, help="a sparsity-sweep record file (Figure 6)")
    p.add_argument("--group", default=None, help="a group-sweep record file (Figure 5)")
    p.add_argument("--dial", default=None, help="dial records (dial.json) for the dial curve, with --exact")
    p.add_argument("--exact", default=None, help="exact-target records (exact.json): realized against target, and "
                   "the trained checkpoints of the dial curve")
    p.add_argument("--out", default="benchmarks/quality")
    a = p.parse_args()
    out = Path(a.out)
    exact = json.loads(Path(a.exact).read_text()) if a.exact else []
    if a.exact:
        print(exact_plot(exact, out / "fig_exact_realized.png"))
    if a.dial:
        print(dial_plot(json.loads(Path(a.dial).read_text()), exact, out / "fig6_dial.png"))
    from wide.eval.perplexity import perplexity
    from wide.eval.plots import plot_layer_profile, plot_token_routing, token_routing

    if a.results and a.profile:
        allrecs = json.loads(Path(a.results).read_text())
        if a.profile.isdigit():  # an index, for record files without "key" (e.g. calibration.json)
            recs = allrecs[int(a.profile):int(a.profile) + 1]
        else:
            recs = [r for r in allrecs if r.get("key") == a.profile]
        if not recs or not recs[-1].get("per_layer"):
            raise SystemExit(f"no record {a.profile!r} with per_layer in {a.results}")
        r = recs[-1]
        name = r.get("key") or f"{Path(a.results).stem}{a.profile}"
        title = (f"{r.get('method', 'wide')} S={r['target']} G_attn={r['G_attn']} G_ffn={r['G_ffn']} "
                 f"({r.get('stage', 'router')}, {r.get('steps', '?')} steps): realized "
                 f"{100 * r['realized']:.1f}% on WikiText-2")
        print(plot_layer_profile(r["per_layer"], out / f"fig9_layer_sparsity_{name}.png", title,
                                 target=r["target"]))
    if a.checkpoint:
        import torch

        import wide

        wm, tok = wide.load(a.checkpoint, model=a.model, device="cpu", dtype=torch.float32, tokenizer=True)
        name = Path(a.checkpoint).name
        routing = token_routing(wm, tok, a.sentence)
        c = wm.config
        print(plot_token_routing(routing, out / f"fig10_token_routing_{name}.png",
                                 title=f"{c.method} S={c.target_sparsity} G_attn={c.attn_group_size} "
                                       f"G_ffn={c.ffn_group_size}: executed groups per token and layer"))
        if a.wikitext:
            from wide.data import load_texts, ppl_windows

            win = ppl_windows(load_texts(a.wikitext), tok, 2048, max_tokens=a.max_tokens)
            rep = perplexity(wm, win, progress=False)
            print(plot_layer_profile(rep["per_layer"], out / f"fig9_layer_sparsity_{name}.png",
                                     f"{name}: realized {100 * rep['realized_sparsity']:.1f}% on "
                                     f"{rep['tokens']:,} WikiText-2 tokens", target=c.target_sparsity))
    if a.sweep:
        print(sweep_plot(json.loads(Path(a.sweep).read_text()), out / "fig6_sparsity_sweep.png"))
    if a.group:
        print(group_plot(json.loads(Path(a.group).read_text()), out / "fig5_group_size.png"))


if __name__ == "__main__":
    main()
