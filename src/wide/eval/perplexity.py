"""Perplexity and realized-sparsity accounting (paper §4.1 metrics).

Token perplexity: ``exp(mean NLL)`` over every predicted token of non-overlapping ``ctx``-token windows.

Realized sparsity is counted over valid (non-padding) tokens, per layer and per module, and reported
as attention / FFN / overall (the mean over the 2N routed modules, as in Eq. 6), plus FLOP-weighted:
the fraction of prunable FLOPs skipped. Per token and layer, one attention group of ``G_a`` channels
costs ``2·D·G_a`` MACs in Q and O projections plus ``2·G_a·L`` MACs in QK and PV (``L`` = mean causal
key length, ``(ctx + 1) / 2``); one FFN group costs ``3·D·G_f`` MACs (gate, up, down).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from wide.model import WideModel


@dataclass
class SparsityMeter:
    """Accumulates kept/total group counts per layer and module over valid tokens."""

    num_layers: int
    kept: dict = field(default_factory=dict)   # kind -> [L] float64 kept group-token counts
    total: dict = field(default_factory=dict)  # kind -> [L] float64 group-token counts

    def update(self, wm: WideModel, n_valid: int) -> None:
        """Add the routing of ``wm``'s last forward over ``n_valid`` valid tokens."""
        for kind, keeps, n_groups in (("attn", wm.record.attn_keep, wm.n_attn_groups),
                                      ("ffn", wm.record.ffn_keep, wm.n_ffn_groups)):
            if not keeps:
                continue
            k = self.kept.setdefault(kind, [0.0] * self.num_layers)
            t = self.total.setdefault(kind, [0.0] * self.num_layers)
            for i, keep in enumerate(keeps):
                k[i] += float(keep) * n_valid * n_groups
                t[i] += n_valid * n_groups

    def layer_sparsity(self, kind: str) -> list[float]:
        """Skipped fraction of the routing groups of each layer for ``kind`` (``"attn"`` / ``"ffn"``) over the
        valid tokens seen, one float in [0, 1] per layer; ``[]`` when that kind has no routers."""
        if kind not in self.total:
            return []
        return [1.0 - k / t if t else 0.0 for k, t in zip(self.kept[kind], self.total[kind])]

    def report(self, wm: WideModel, ctx: int) -> dict:
        """``{"attn_sparsity", "ffn_sparsity", "realized_sparsity", "flop_weighted_sparsity", "per_layer"}``."""
        attn, ffn = self.layer_sparsity("attn"), self.layer_sparsity("ffn")
        mods = [*attn, *ffn]
        d, L = wm.dims.hidden_size, wm.dims.num_layers
        ga, gf = wm.config.attn_group_size, wm.config.ffn_group_size
        cost_a = (2 * d * ga + 2 * ga * (ctx + 1) / 2) * wm.n_attn_groups
        cost_f = 3 * d * gf * wm.n_ffn_groups
        skipped = sum(s * cost_a for s in attn) + sum(s * cost_f for s in ffn)
        total = (cost_a * L if attn else 0.0) + (cost_f * L if ffn else 0.0)
        return {
            "attn_sparsity": sum(attn) / len(attn) if attn else 0.0,
            "ffn_sparsity": sum(ffn) / len(ffn) if ffn else 0.0,
            "realized_sparsity": sum(mods) / len(mods) if mods else 0.0,
            "flop_weighted_sparsity": skipped / total if total else 0.0,
            "per_layer": [{"layer": i, "attn": attn[i] if attn else None, "ffn": ffn[i] if ffn else None}
                          for i in range(L)],
        }


@torch.no_grad()
def perplexity(model: nn.Module, windows: torch.Tensor, batch_size: int = 1, progress: bool = True,
               desc: str = "perplexity") -> dict:
    """Token perplexity of ``model`` over ``windows`` and, for a :class:`WideModel`, realized sparsity.

    Args:
        model: a Hugging Face causal LM or a :class:`WideModel` (argmax routing is used).
        windows: int64 ``[N, ctx]`` token windows (see :func:`wide.data.ppl_windows`).
        batch_size: windows per forward pass.

    Returns:
        ``{"ppl", "nll" (nats/token), "tokens", "ctx"}`` plus the :meth:`SparsityMeter.report` fields
        for a WideModel.
    """
    from tqdm.auto import tqdm

    device = next(model.parameters()).device
    is_wide = isinstance(model, WideModel)
    was_training = model.training
    model.eval()
    if is_wide:
        model.stochastic = False
        meter = SparsityMeter(model.dims.num_layers)
    nll_sum, count = 0.0, 0
    ctx = windows.shape[1]
    use_amp = device.type == "cuda"
    for b in tqdm(range(0, windows.shape[0], batch_size), desc=desc, disable=not progress, dynamic_ncols=True):
        ids = windows[b:b + batch_size].to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_amp):
            logits = model(ids).logits
        nll = torch.nn.functional.cross_entropy(
            logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten(), reduction="sum")
        nll_sum += float(nll)
        count += ids[:, 1:].numel()
        if is_wide:
            meter.update(model, ids.numel())
    model.train(was_training)
    out = {"ppl": math.exp(nll_sum / count), "nll": nll_sum / count, "tokens": count, "ctx": ctx}
    if is_wide:
        out.update(meter.report(model, ctx))
    return out


def format_layer_table(report: dict) -> str:
    """A plain-text per-layer sparsity table."""
    lines = ["layer  attn_sparsity  ffn_sparsity"]
    for row in report["per_layer"]:
        a = "-" if row["attn"] is None else f"{row['attn']:.3f}"
        f = "-" if row["ffn"] is None else f"{row['ffn']:.3f}"
        lines.append(f"{row['layer']:>5}  {a:>13}  {f:>12}")
    return "\n".join(lines)
