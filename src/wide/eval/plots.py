"""Routing pictures of the paper's §4.4 as PNG files (matplotlib): the per-layer realized sparsity (Figure 9,
from :func:`wide.eval.perplexity.perplexity`'s ``per_layer``) and a token-level routing map (Figure 10)."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from wide.errors import WideError


def _plt():
    """``matplotlib.pyplot`` on the Agg backend (WideError naming the package when it is missing)."""
    try:
        import matplotlib
    except ImportError:
        raise WideError("plots need matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _png(path) -> Path:
    if Path(path).suffix.lower() != ".png":
        raise WideError(f"plot path {str(path)!r} must end in .png")
    return Path(path)


def _save(plt, fig, path: Path) -> Path:
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_layer_profile(per_layer: list[dict], path: str | os.PathLike, title: str = "",
                       target: float | None = None) -> Path:
    """Draw the attention and FFN sparsity of every layer (Figure 9, ``per_layer`` ``[{"layer", "attn", "ffn"}]``,
    fractions or None) into the PNG ``path``, the target ``S`` dashed; WideError for no layer or another suffix."""
    if not per_layer:
        raise WideError("per_layer is empty: nothing to plot")
    path, plt = _png(path), _plt()
    layers = [r["layer"] for r in per_layer]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.22 * len(layers) + 2), 3.2), dpi=150)
    for key, color, label in (("attn", "tab:blue", "attention"), ("ffn", "tab:orange", "FFN")):
        points = [(r["layer"], 100 * r[key]) for r in per_layer if r.get(key) is not None]
        if points:
            xs, ys = zip(*points)
            ax.plot(xs, ys, marker="o", ms=3, color=color, label=f"{label} (mean {sum(ys) / len(ys):.1f}%)")
    if target is not None:
        ax.axhline(100 * target, color="gray", ls="--", lw=1, label=f"target S = {100 * target:.0f}%")
    ax.set(xlabel="layer", ylabel="realized sparsity (%)", ylim=(0, 100), xlim=(min(layers) - 0.5, max(layers) + 0.5))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    ax.set_title(title, fontsize=9)
    return _save(plt, fig, path)


@torch.no_grad()
def token_routing(wm, tokenizer, text: str) -> dict:
    """Route one sentence (no special tokens) through a WideModel, argmax routing (Figure 10): ``{"tokens": [str],
    "attn": float32 [L, T] | None, "ffn": ...}``, the executed fraction of groups per layer and token; WideError
    for a text of no tokens."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if not ids:
        raise WideError(f"text {text[:40]!r} gives no tokens")
    was, wm.record_masks, wm.stochastic = wm.record_masks, True, False
    try:
        wm.eval()
        wm(torch.tensor([ids], device=next(wm.parameters()).device))
        rec = dict(wm.record.masks)
    finally:
        wm.record_masks = was
    out = {"tokens": [tokenizer.decode([i]) for i in ids]}
    for kind in ("attn", "ffn"):
        rows = [rec[(kind, i)][0].float().mean(-1).cpu() for i in range(wm.dims.num_layers) if (kind, i) in rec]
        out[kind] = torch.stack(rows) if rows else None
    return out


def plot_token_routing(routing: dict, path: str | os.PathLike, title: str = "") -> Path:
    """Draw :func:`token_routing`'s output as heat maps (layers x tokens) into the PNG ``path``; WideError for no
    routed module or another suffix."""
    panels = [(k, routing[k]) for k in ("attn", "ffn") if routing.get(k) is not None]
    if not panels:
        raise WideError("routing holds neither attention nor FFN masks: nothing to plot")
    path, plt = _png(path), _plt()
    toks = [t.replace("\n", "\\n") for t in routing["tokens"]]
    T, L = len(toks), panels[0][1].shape[0]
    fig, axes = plt.subplots(len(panels), 1, figsize=(max(6.0, 0.38 * T + 1.5), 0.16 * L * len(panels) + 2.2),
                             dpi=150, squeeze=False)
    for ax, (kind, m) in zip(axes[:, 0], panels):
        im = ax.imshow(100 * m.numpy(), aspect="auto", cmap="viridis", vmin=0, vmax=100, interpolation="nearest")
        what = "attention head groups" if kind == "attn" else "FFN channel groups"
        ax.set_title(f"{what} executed (%)", fontsize=9)
        ax.set(ylabel="layer", xticks=range(T), yticks=range(0, L, max(1, L // 8)))
        ax.set_xticklabels(toks, rotation=60, ha="right", fontsize=7)
        fig.colorbar(im, ax=ax, fraction=0.02, pad=0.01)
    fig.suptitle(title, fontsize=10)
    return _save(plt, fig, path)
