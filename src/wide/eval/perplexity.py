"""Token perplexity (``exp(mean NLL)`` over non-overlapping windows) and realized sparsity (paper §4.1): the
skipped fraction of groups over valid tokens, per layer and module, as attention / FFN / overall (the mean over the
2N routed modules, Eq. 6) and FLOP-weighted, where per token and layer an attention group of ``G_a`` channels costs
``2·D·G_a + G_a·(ctx + 1)`` MACs (Q, O; QK, PV) and an FFN group of ``G_f`` channels ``3·D·G_f``."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn
from tqdm.auto import tqdm

from wide.model import WideModel


@dataclass
class SparsityMeter:
    """Kept / total group-token counts per layer (``kind -> [L]`` floats), per module kind (``"attn"`` / ``"ffn"``)."""

    num_layers: int
    kept: dict = field(default_factory=dict)
    total: dict = field(default_factory=dict)

    def add(self, kind: str, kept: list[float], total: float) -> None:
        """Add ``kept[i]`` kept group-tokens out of ``total`` to every layer ``i`` of ``kind``."""
        k = self.kept.setdefault(kind, [0.0] * self.num_layers)
        t = self.total.setdefault(kind, [0.0] * self.num_layers)
        for i, v in enumerate(kept):
            k[i] += v
            t[i] += total

    def update(self, wm: WideModel, n_valid: int) -> None:
        """Add the routing of ``wm``'s last forward pass over ``n_valid`` valid tokens."""
        for kind, keeps, n in (("attn", wm.record.attn_keep, wm.n_attn_groups),
                               ("ffn", wm.record.ffn_keep, wm.n_ffn_groups)):
            if keeps:
                self.add(kind, [float(keep) * n_valid * n for keep in keeps], n_valid * n)

    def report(self, wm: WideModel, ctx: int) -> dict:
        """``attn_sparsity``, ``ffn_sparsity``, ``realized_sparsity``, ``flop_weighted_sparsity`` and
        ``per_layer`` (``[{"layer", "attn", "ffn"}]``, None for a kind without routers)."""
        attn, ffn = ([1.0 - k / t if t else 0.0 for k, t in zip(self.kept.get(kind, []), self.total.get(kind, []))]
                     for kind in ("attn", "ffn"))  # the skipped fraction per layer; [] for a kind without routers
        d, L, cfg = wm.dims.hidden_size, wm.dims.num_layers, wm.config
        cost_a = (2 * d * cfg.attn_group_size + cfg.attn_group_size * (ctx + 1)) * wm.n_attn_groups
        cost_f = 3 * d * cfg.ffn_group_size * wm.n_ffn_groups
        total = cost_a * len(attn) + cost_f * len(ffn)
        mods = [*attn, *ffn]
        return {
            "attn_sparsity": sum(attn) / len(attn) if attn else 0.0,
            "ffn_sparsity": sum(ffn) / len(ffn) if ffn else 0.0,
            "realized_sparsity": sum(mods) / len(mods) if mods else 0.0,
            "flop_weighted_sparsity": (cost_a * sum(attn) + cost_f * sum(ffn)) / total if total else 0.0,
            "per_layer": [{"layer": i, "attn": attn[i] if attn else None, "ffn": ffn[i] if ffn else None}
                          for i in range(L)],
        }


@torch.no_grad()
def perplexity(model: nn.Module, windows: torch.Tensor, batch_size: int = 1, progress: bool = True,
               desc: str = "perplexity") -> dict:
    """Token perplexity of a HF causal LM or a :class:`WideModel` (argmax routing) over int64 ``windows``
    ``[N, ctx]``, ``batch_size`` windows a pass: ``{"ppl", "nll" (nats/token), "tokens", "ctx"}``, plus
    :meth:`SparsityMeter.report` for a WideModel."""
    device, is_wide, was_training = next(model.parameters()).device, isinstance(model, WideModel), model.training
    model.eval()
    if is_wide:
        model.stochastic = False
        meter = SparsityMeter(model.dims.num_layers)
    nll, count = 0.0, 0
    for b in tqdm(range(0, windows.shape[0], batch_size), desc=desc, disable=not progress, dynamic_ncols=True):
        ids = windows[b:b + batch_size].to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = model(ids).logits
        nll += float(nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten(),
                                                 reduction="sum"))
        count += ids[:, 1:].numel()
        if is_wide:
            meter.update(model, ids.numel())
    model.train(was_training)
    out = {"ppl": math.exp(nll / count), "nll": nll / count, "tokens": count, "ctx": windows.shape[1]}
    if is_wide:
        out.update(meter.report(model, windows.shape[1]))
    return out


def format_layer_table(report: dict) -> str:
    """The per-layer sparsity table of a :meth:`SparsityMeter.report` as plain text."""
    def cell(v, width):
        return f"{'-' if v is None else f'{v:.3f}':>{width}}"
    rows = [f"{r['layer']:>5}  {cell(r['attn'], 13)}  {cell(r['ffn'], 12)}" for r in report["per_layer"]]
    return "\n".join(["layer  attn_sparsity  ffn_sparsity", *rows])
