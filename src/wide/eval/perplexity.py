"""Token perplexity (``exp(mean NLL)`` over non-overlapping windows) and realized sparsity (paper §4.1): the
skipped fraction of groups over valid tokens, per layer and module, as attention / FFN and in both units of
:func:`wide.routing.realized_sparsity`: ``groups`` (the mean over the 2N routed modules, Eq. 6) and ``flops`` (the
routed compute skipped, at the checkpoint's training context, else the evaluation's)."""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field

import torch
from torch import nn
from tqdm.auto import tqdm

from wide.model import WideModel
from wide.routing import realized_sparsity


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
        """``groups_sparsity`` (Eq. 6), ``flops_sparsity`` (the routed compute skipped at ``flops_context`` tokens:
        the config's ``seq_len``, else ``ctx``), ``attn_sparsity``, ``ffn_sparsity``, ``realized_sparsity`` and
        ``flop_weighted_sparsity`` (the same two units under their earlier names), ``per_layer`` (``[{"layer",
        "attn", "ffn"}]``, None for a kind without routers) and, for a calibrated or dialed model,
        ``calibration`` (its unit, target and the realized sparsity on its held-out text)."""
        attn, ffn = ([k / t if t else 1.0 for k, t in zip(self.kept.get(kind, []), self.total.get(kind, []))]
                     for kind in ("attn", "ffn"))  # the kept fraction per layer; [] for a kind without routers
        r = realized_sparsity(attn, ffn, wm.dims, wm.config, seq_len=ctx)
        skip_a, skip_f = r["per_module"]["attn"], r["per_module"]["ffn"]
        out = {
            "groups_sparsity": r["groups"], "flops_sparsity": r["flops"], "flops_context": r["flops_context"],
            "attn_sparsity": r["attn"], "ffn_sparsity": r["ffn"],
            "realized_sparsity": r["groups"], "flop_weighted_sparsity": r["flops"],
            "per_layer": [{"layer": i, "attn": skip_a[i] if skip_a else None, "ffn": skip_f[i] if skip_f else None}
                          for i in range(wm.dims.num_layers)],
        }
        if wm.calibration is not None:
            c = wm.calibration
            out["calibration"] = {"unit": c["unit"], "target": c["target"], "dialed": bool(c.get("dialed")),
                                  "heldout_realized": {k: c["realized"][k] for k in ("groups", "flops")}}
        return out


def bar_intervals() -> dict:
    """tqdm's ``mininterval`` / ``maxinterval`` (seconds between refreshes): its defaults 0.1 / 10 on a terminal or in
    a notebook, 30 / 30 where stderr is a file or a pipe (a log gets a line per 30 s, not ten per second)."""
    tty = sys.stderr.isatty() or "ipykernel" in sys.modules
    return {"mininterval": 0.1, "maxinterval": 10.0} if tty else {"mininterval": 30.0, "maxinterval": 30.0}


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
    for b in tqdm(range(0, windows.shape[0], batch_size), desc=desc, disable=not progress, dynamic_ncols=True,
                  **bar_intervals()):
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


#: a module at or above PRUNED_AWAY sparsity is flagged as removed, at or below NEVER_PRUNED as never pruned
PRUNED_AWAY, NEVER_PRUNED = 0.99, 0.01


def format_layer_table(report: dict) -> str:
    """The per-layer sparsity table of a :meth:`SparsityMeter.report` as plain text; each module at or above
    :data:`PRUNED_AWAY` is flagged ``pruned away``, at or below :data:`NEVER_PRUNED` ``never pruned``, and a last line
    counts them."""
    def cell(v, width):
        return f"{'-' if v is None else f'{v:.3f}':>{width}}"

    def flags(r):
        out = [f"{kind} {'pruned away' if r[kind] >= PRUNED_AWAY else 'never pruned'}" for kind in ("attn", "ffn")
               if r[kind] is not None and (r[kind] >= PRUNED_AWAY or r[kind] <= NEVER_PRUNED)]
        return f"  {', '.join(out)}" if out else ""
    rows = [f"{r['layer']:>5}  {cell(r['attn'], 13)}  {cell(r['ffn'], 12)}{flags(r)}" for r in report["per_layer"]]
    values = [r[k] for r in report["per_layer"] for k in ("attn", "ffn") if r[k] is not None]
    away, never = sum(v >= PRUNED_AWAY for v in values), sum(v <= NEVER_PRUNED for v in values)
    return "\n".join(["layer  attn_sparsity  ffn_sparsity", *rows,
                      f"modules pruned away (>= {PRUNED_AWAY}): {away}; never pruned (<= {NEVER_PRUNED}): {never}"])
