"""Routing pictures of the paper's §4.4: the layer-wise realized sparsity profile (Figure 9) and a
token-level routing map of one sentence (Figure 10), as PNG files (matplotlib, Agg backend).

* :func:`layer_profile` measures per-layer attention / FFN sparsity of a checkpoint on text (argmax
  routing, over all tokens); :func:`plot_layer_profile` draws it (or any ``per_layer`` list, e.g. from
  a ``benchmarks/quality`` record).
* :func:`token_routing` runs one sentence and returns, per layer and token, the fraction of attention
  head groups and FFN channel groups executed; :func:`plot_token_routing` draws both as heat maps with
  the tokens as column labels.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from wide.errors import WideError


def _plt():
    try:
        import matplotlib
    except ImportError:
        raise WideError("plots need matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


@torch.no_grad()
def layer_profile(wm, windows: torch.Tensor, batch_size: int = 1) -> dict:
    """Per-layer realized sparsity of a :class:`wide.model.WideModel` on token windows (Figure 9).

    Args:
        wm: the routed model (argmax routing is used).
        windows: int64 ``[N, ctx]`` (:func:`wide.data.ppl_windows`).
        batch_size: windows per forward pass.

    Returns:
        :func:`wide.eval.perplexity.perplexity`'s dict: ``per_layer`` (``[{"layer", "attn", "ffn"}]``, skipped
        fraction of groups per module), ``attn_sparsity``, ``ffn_sparsity``, ``realized_sparsity``, ``ppl``.
    """
    from wide.eval.perplexity import perplexity

    return perplexity(wm, windows, batch_size=batch_size, progress=False, desc="profile")


def plot_layer_profile(per_layer: list[dict], path: str | os.PathLike, title: str = "",
                       target: float | None = None) -> Path:
    """Draw the attention and FFN sparsity of every layer (Figure 9) into a PNG.

    Args:
        per_layer: ``[{"layer": int, "attn": float | None, "ffn": float | None}]``, fractions in [0, 1].
        path: output ``.png`` file (folders are created).
        title: figure title.
        target: optional target sparsity ``S`` drawn as a dashed line.

    Returns:
        the written path.

    Raises:
        WideError: empty ``per_layer`` or a path that does not end in ``.png``.
    """
    if not per_layer:
        raise WideError("per_layer is empty: nothing to plot")
    path = Path(path)
    if path.suffix.lower() != ".png":
        raise WideError(f"plot path {str(path)!r} must end in .png")
    plt = _plt()
    layers = [r["layer"] for r in per_layer]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.22 * len(layers) + 2), 3.2), dpi=150)
    for key, color, label in (("attn", "tab:blue", "attention"), ("ffn", "tab:orange", "FFN")):
        vals = [r.get(key) for r in per_layer]
        if any(v is not None for v in vals):
            xs = [x for x, v in zip(layers, vals) if v is not None]
            ys = [100 * v for v in vals if v is not None]
            ax.plot(xs, ys, marker="o", ms=3, color=color,
                    label=f"{label} (mean {sum(ys) / len(ys):.1f}%)")
    if target is not None:
        ax.axhline(100 * target, color="gray", ls="--", lw=1, label=f"target S = {100 * target:.0f}%")
    ax.set_xlabel("layer")
    ax.set_ylabel("realized sparsity (%)")
    ax.set_ylim(0, 100)
    ax.set_xlim(min(layers) - 0.5, max(layers) + 0.5)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    if title:
        ax.set_title(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


@torch.no_grad()
def token_routing(wm, tokenizer, text: str) -> dict:
    """Route one sentence and report, per layer and token, the fraction of groups executed (Figure 10).

    Args:
        wm: a :class:`wide.model.WideModel` (argmax routing).
        tokenizer: its tokenizer.
        text: the sentence (no special tokens are added).

    Returns:
        ``{"tokens": [str] (T), "attn": float32 [L, T] | None, "ffn": float32 [L, T] | None}``: executed
        fraction of groups (1.0 = everything ran).

    Raises:
        WideError: text that tokenizes to nothing.
    """
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if not ids:
        raise WideError(f"text {text[:40]!r} gives no tokens")
    device = next(wm.parameters()).device
    was, wm.record_masks, wm.stochastic = wm.record_masks, True, False
    try:
        wm.eval()
        wm(torch.tensor([ids], device=device))
        rec = dict(wm.record.masks)
    finally:
        wm.record_masks = was
    out = {"tokens": [tokenizer.decode([i]) for i in ids]}
    for kind in ("attn", "ffn"):
        rows = [rec[(kind, i)][0].float().mean(-1).cpu() for i in range(wm.dims.num_layers) if (kind, i) in rec]
        out[kind] = torch.stack(rows) if rows else None
    return out


def plot_token_routing(routing: dict, path: str | os.PathLike, title: str = "") -> Path:
    """Draw :func:`token_routing` output as two heat maps (layers x tokens) into a PNG.

    Args:
        routing: ``{"tokens", "attn", "ffn"}`` as returned by :func:`token_routing`.
        path: output ``.png`` file.
        title: figure title.

    Returns:
        the written path.

    Raises:
        WideError: no routed module in ``routing`` or a path not ending in ``.png``.
    """
    path = Path(path)
    if path.suffix.lower() != ".png":
        raise WideError(f"plot path {str(path)!r} must end in .png")
    panels = [(k, routing[k]) for k in ("attn", "ffn") if routing.get(k) is not None]
    if not panels:
        raise WideError("routing holds neither attention nor FFN masks: nothing to plot")
    plt = _plt()
    toks = [t.replace("\n", "\\n") for t in routing["tokens"]]
    T, L = len(toks), panels[0][1].shape[0]
    fig, axes = plt.subplots(len(panels), 1, figsize=(max(6.0, 0.38 * T + 1.5), 0.16 * L * len(panels) + 2.2),
                             dpi=150, squeeze=False)
    for ax, (kind, m) in zip(axes[:, 0], panels):
        im = ax.imshow(100 * m.numpy(), aspect="auto", cmap="viridis", vmin=0, vmax=100, interpolation="nearest")
        ax.set_ylabel("layer")
        ax.set_title(f"{'attention head groups' if kind == 'attn' else 'FFN channel groups'} executed (%)",
                     fontsize=9)
        ax.set_xticks(range(T))
        ax.set_xticklabels(toks, rotation=60, ha="right", fontsize=7)
        step = max(1, L // 8)
        ax.set_yticks(range(0, L, step))
        fig.colorbar(im, ax=ax, fraction=0.02, pad=0.01)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
