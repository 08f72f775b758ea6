"""Exact realized sparsity under argmax routing (Eq. 5): a logit shift fitted on held-out calibration text.

A shift ``t`` added to a router's margin ``R0 - R1`` (folded into its ``w2`` bias, :meth:`WideModel.set_router_shifts`)
makes it execute more groups for ``t > 0``. The fit finds one shift for every router (global mode, Eq. 6) or one per
module class (uniform mode, Eq. 22) such that the sparsity realized over the held-out tokens, in the config's unit
(Eq. 6's groups or the routed FLOPs, :func:`wide.routing.module_weights`), is the target within :data:`TOLERANCE`;
with ``max_module_sparsity < 1`` a router whose own rate would pass the bound gets the extra shift that holds it
there. Every pass is a full forward pass, so later layers see the masks of earlier ones. Each pass records every
router's margins; the next shift solves the target on them (exact for a router's own rate; the change of later
layers' inputs scales the step by a gain the last step measured), kept inside the bracket of the passes so far.
"""

from __future__ import annotations

import hashlib
import math
import numbers
import os
import warnings

import torch

from wide.config import FIT_TOKENS as FIT_TOKENS  # held-out tokens of the fit after training
from wide.config import HELDOUT_EVERY, SPARSITY_UNITS
from wide.errors import WideError, WideWarning
from wide.model import WideModel
from wide.routing import module_weights, realized_sparsity

TOLERANCE = 0.002  #: |realized - target| the fit stops at, in the unit fitted
MAX_PASSES = 16  #: forward passes over the held-out text at most
CURVE_POINTS = 128  #: stored margin quantiles per router, which start a later re-fit (:func:`dial`)
DIAL_TOKENS = 1024  #: held-out tokens of a serve-time dial
FORMAT = "wide-calibration-v1"


def heldout_split(docs: list[str]) -> tuple[list[str], list[str]]:
    """``(training documents, held-out documents)``: one document in :data:`HELDOUT_EVERY` by a content hash, or,
    where that leaves a side empty, the last tenth of the documents; a single document is not split (nothing held
    out: the fit then reads the training text, :func:`fit_text`)."""
    if len(docs) < 2:
        return list(docs), []
    train, held = [], []
    for d in docs:
        (held if int(hashlib.sha256(b"wide-heldout:" + d.encode()).hexdigest()[:8], 16) % HELDOUT_EVERY == 0
         else train).append(d)
    if train and held:
        return train, held
    k = max(1, len(docs) // HELDOUT_EVERY)
    return docs[:-k], docs[-k:]


def fit_text(docs: list[str]) -> tuple[list[str], bool]:
    """The documents the shift is fitted on: the held-out ones, else (a single document) the text itself; and
    whether they are held out."""
    held = heldout_split(docs)[1]
    return (held, True) if held else (list(docs), False)


def heldout_windows(docs: list[str], tokenizer, ctx: int, max_tokens: int) -> torch.Tensor:
    """The first ``max_tokens`` tokens of ``docs`` (joined by blank lines) cut into int64 windows ``[N, W]``, ``W =
    min(ctx, tokens)``. Raises WideError for fewer than 2 tokens."""
    text, chars = [], 0
    for d in docs:  # enough characters for max_tokens tokens, not the whole text
        text.append(d)
        chars += len(d)
        if chars > 16 * max_tokens:
            break
    ids = tokenizer("\n\n".join(text), add_special_tokens=False)["input_ids"][:max_tokens]
    width = min(ctx, len(ids))
    if width < 2:
        raise WideError(f"the held-out calibration text has {len(ids)} token(s); the logit-shift fit needs at least 2")
    n = len(ids) // width
    return torch.tensor(ids[: n * width], dtype=torch.long).view(n, width)


def _keys(wm: WideModel) -> list[tuple[str, int]]:
    return [(kind, i) for kind, mods in (("attn", wm.attn_routers), ("ffn", wm.ffn_routers)) for i in range(len(mods))]


@torch.no_grad()
def router_margins(wm: WideModel, windows: torch.Tensor, batch_size: int = 1) -> dict[tuple[str, int], torch.Tensor]:
    """Every router's margins ``R0 - R1`` (float32 logits, as Eq. 5 compares them) over all tokens and groups of
    int64 ``windows`` ``[N, W]`` under argmax routing with the current shifts: ``{(kind, layer): sorted float64
    [N W N_G]}`` (CPU); a group is skipped where its margin is ``< 0``."""
    store: dict = {}
    handles = []
    for kind, i in _keys(wm):
        r = (wm.attn_routers if kind == "attn" else wm.ffn_routers)[i]
        handles.append(r.register_forward_hook(
            lambda mod, args, out, key=(kind, i): store.setdefault(key, []).append(
                (out[..., 0] - out[..., 1]).flatten().double().cpu())))
    device, was_training, stochastic = next(wm.parameters()).device, wm.training, wm.stochastic
    wm.eval()
    wm.stochastic = False
    try:
        for b in range(0, windows.shape[0], batch_size):
            ids = windows[b:b + batch_size].to(device)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                wm(ids, use_cache=False, logits_to_keep=1)
    finally:
        for h in handles:
            h.remove()
        wm.train(was_training)
        wm.stochastic = stochastic
    return {k: torch.sort(torch.cat(v)).values for k, v in store.items()}


def _rate(sorted_margins: torch.Tensor, shift: float) -> float:
    """Skip rate of a router whose margins (sorted) grow by ``shift``: the fraction ``< -shift``."""
    n = sorted_margins.numel()
    return int(torch.searchsorted(sorted_margins, torch.tensor([-shift], dtype=sorted_margins.dtype))) / n


def _hold(sorted_margins: torch.Tensor, bound: float) -> float:
    """A shift at which the router skips at most ``bound`` of its margins (``-inf``: any), midway between two
    margins so that rounding does not flip a decision."""
    n = sorted_margins.numel()
    k = math.floor(bound * n)
    if bound >= 1.0 or k >= n:
        return -math.inf
    k = int(torch.searchsorted(sorted_margins, sorted_margins[k:k + 1]))  # below a run of equal margins
    return -float(sorted_margins[0]) + 1.0 if k == 0 else -0.5 * float(sorted_margins[k - 1] + sorted_margins[k])


class _Objective:
    """The fitted classes (``"global"``, or ``"attn"`` / ``"ffn"``), each module's class and weight, the bound."""

    def __init__(self, wm: WideModel, unit: str, mode: str, bound: float, ctx: int) -> None:
        self.keys = _keys(wm)
        w = module_weights(wm.dims, wm.config, unit if mode == "global" else "groups", seq_len=ctx)
        self.weight = dict(zip(self.keys, w))
        self.cls = {k: "global" if mode == "global" else k[0] for k in self.keys}
        self.classes = list(dict.fromkeys(self.cls.values()))
        self.bound = bound

    def realized(self, rates: dict) -> dict[str, float]:
        out = {}
        for c in self.classes:
            ks = [k for k in self.keys if self.cls[k] == c]
            out[c] = sum(self.weight[k] * rates[k] for k in ks) / sum(self.weight[k] for k in ks)
        return out

    def totals(self, raw: dict, deltas: dict[str, float]) -> dict:
        """Each module's total shift: its class's shift, plus what holds it at the bound."""
        return {k: max(deltas[self.cls[k]], _hold(raw[k], self.bound)) for k in self.keys}

    def solve(self, raw: dict, targets: dict[str, float]) -> dict[str, float]:
        """Each class's shift at which the predicted rates (``raw``: unshifted margins) realize its target."""
        out = {}
        for c in self.classes:
            target = targets[c]
            ks = [k for k in self.keys if self.cls[k] == c]
            span = max(float(raw[k].abs().max()) for k in ks) + 1.0
            hold = {k: _hold(raw[k], self.bound) for k in ks}
            wsum = sum(self.weight[k] for k in ks)

            def f(d):
                return sum(self.weight[k] * _rate(raw[k], max(d, hold[k])) for k in ks) / wsum

            lo, hi = -span, span
            f_lo = f(lo)
            if f_lo <= target:  # not reachable: as sparse as the bound allows
                out[c] = lo
                continue
            f_hi = f(hi)
            for _ in range(64):
                mid = 0.5 * (lo + hi)
                f_mid = f(mid)
                if f_mid > target:
                    lo, f_lo = mid, f_mid
                else:
                    hi, f_hi = mid, f_mid
            # the middle of the chosen side's flat step, so that rounding does not flip a decision
            side, value, far = (lo, f_lo, -span) if abs(f_lo - target) < abs(f_hi - target) else (hi, f_hi, span)
            near = side
            for _ in range(64):
                mid = 0.5 * (near + far)
                if f(mid) == value:
                    near = mid
                else:
                    far = mid
            out[c] = 0.5 * (side + near)
        return out


def _as_lists(wm: WideModel, totals: dict) -> dict[str, list[float]]:
    return {kind: [float(totals[(kind, i)]) for i in range(len(mods))]
            for kind, mods in (("attn", wm.attn_routers), ("ffn", wm.ffn_routers)) if len(mods)}


def _curve(raw: dict) -> dict[str, list[list[float]]]:
    out: dict = {}
    for (kind, _i), m in sorted(raw.items()):
        idx = ((torch.arange(CURVE_POINTS, dtype=torch.float64) + 0.5) / CURVE_POINTS * m.numel()).long()
        out.setdefault(kind, []).append([float(f"{x:.6g}") for x in m[idx.clamp_max(m.numel() - 1)].tolist()])
    return out


def check_target(sparsity, what: str = "sparsity") -> float:
    """``sparsity`` as a float in ``[0, 1)``; WideError naming the value and the range otherwise."""
    if isinstance(sparsity, bool) or not isinstance(sparsity, numbers.Real):
        raise WideError(f"{what} {sparsity!r} must be a number (got {type(sparsity).__name__}): the fraction of "
                        f"the routed groups (or FLOPs) to skip, in [0, 1), e.g. 0.5")
    if not (math.isfinite(sparsity) and 0.0 <= sparsity < 1.0):
        raise WideError(f"{what} {sparsity!r} is outside [0, 1): give the fraction of the routed groups (or FLOPs) "
                        f"to skip, e.g. 0.5")
    return float(sparsity)


def check_reachable(target: float, bound: float, unit: str = "groups", target_name: str = "target_sparsity",
                    bound_name: str = "max_module_sparsity", fix: str | None = None) -> None:
    """Raises WideError (one line naming ``target_name`` and ``bound_name``, then ``fix``, default: lower the one or
    raise the other) when the target sparsity cannot be reached with every module's skip rate at most ``bound``: in
    either unit (Eq. 6's mean of the group rates, Eq. 22's per class, or the routed compute skipped) the sparsity is
    a weighted mean of the module rates, so it is at most ``bound``."""
    if target > bound:
        what = ("the routed compute skipped (flops unit) is a weighted mean of the module rates" if unit == "flops"
                else "the groups sparsity (Eq. 6 / Eq. 22) is a mean of the module rates")
        fix = fix or f"give {target_name} {bound:g} or less, or {bound_name} {target:g} or more"
        raise WideError(f"{target_name} {target:g} cannot be reached under {bound_name} {bound:g}: {what}, so it "
                        f"is at most {bound:g}; {fix}")


def check_unit(unit) -> str:
    if unit not in SPARSITY_UNITS:
        raise WideError(f"sparsity unit {unit!r} is not one of {', '.join(SPARSITY_UNITS)}")
    return unit


def fit_shifts(wm: WideModel, windows: torch.Tensor, target: float | None = None, unit: str | None = None,
               tol: float = TOLERANCE, batch_size: int = 1, curve: dict | None = None,
               max_passes: int = MAX_PASSES, held_out: bool = True) -> dict:
    """Fit and apply the logit shifts (module docstring) that make argmax routing realize ``target`` (default the
    config's ``S``) in ``unit`` (default the config's) over int64 ``windows`` ``[N, W]``; the mode and the bound are
    the config's. ``curve`` (a stored record's) predicts the first shift without a pass at zero. ``held_out``:
    whether ``windows`` were held out of training (False: a one-document text, fitted on the training text).

    Returns the record that :func:`wide.checkpoint.save_calibration` stores: ``unit``, ``mode``, ``target``,
    ``max_module_sparsity``, ``tolerance``, ``converged``, ``passes``, ``realized`` (both units,
    :func:`wide.routing.realized_sparsity`, on the held-out tokens), ``uncalibrated`` (the same at zero shift, when
    measured), ``shifts`` (per class), ``module_shifts`` (``{"attn": [L], "ffn": [L]}``), ``history`` (each pass's
    class shifts and realized value), ``heldout`` (the windows' count, width, tokens and ``held_out``) and
    ``curve`` (each router's unshifted margin quantiles).
    Warns WideWarning with the value reached when the tolerance is not met."""
    cfg = wm.config
    target = cfg.target_sparsity if target is None else target
    unit = unit or cfg.sparsity_unit
    obj = _Objective(wm, unit, cfg.sparsity_mode, cfg.max_module_sparsity, int(windows.shape[1]))
    zero = {k: 0.0 for k in obj.keys}
    if curve:
        raw = {(kind, i): torch.tensor(q, dtype=torch.float64) for kind, rows in curve.items()
               for i, q in enumerate(rows)}
        deltas = obj.solve(raw, dict.fromkeys(obj.classes, target))
        totals = obj.totals(raw, deltas)
    else:
        deltas, totals = {c: 0.0 for c in obj.classes}, dict(zero)
    bracket = {c: [-math.inf, math.inf] for c in obj.classes}
    best, uncalibrated, passes, stalled, last, history = None, None, 0, 0, None, []
    for passes in range(1, max_passes + 1):
        wm.set_router_shifts(_as_lists(wm, totals))
        margins = router_margins(wm, windows, batch_size)
        rates = {k: _rate(margins[k], 0.0) for k in obj.keys}
        real = obj.realized(rates)
        # a bound holds within the tolerance or one decision of the router, whichever is larger
        over = max(max(0.0, rates[k] - obj.bound - max(tol, 1.0 / margins[k].numel())) for k in obj.keys)
        score = (over, max(abs(real[c] - target) for c in obj.classes))
        raw = {k: margins[k] - totals[k] for k in obj.keys}
        history.append({"shifts": dict(deltas), "realized": dict(real)})
        if all(v == 0.0 for v in totals.values()):
            uncalibrated = rates
        stalled = 0 if best is None or score < best[0] and best[0][1] - score[1] > tol / 10 else stalled + 1
        if best is None or score < best[0]:
            best = (score, dict(totals), dict(deltas), rates, raw)
        if score[0] == 0.0 and score[1] <= tol or stalled >= 3:
            break
        for c in obj.classes:
            side = 0 if real[c] > target else 1
            bracket[c][side] = deltas[c]
            if bracket[c][0] >= bracket[c][1]:  # the other class moved this one's curve (uniform mode): start over
                bracket[c][1 - side] = math.inf if side == 0 else -math.inf
        # the margins predict a router's own rate; later layers' inputs change too, by a gain the last step measured
        aim = dict.fromkeys(obj.classes, target)
        for c in obj.classes:
            if last is not None and abs(last[1][c] - last[0][c]) > tol / 4:
                gain = min(max((real[c] - last[0][c]) / (last[1][c] - last[0][c]), 0.25), 4.0)
                aim[c] = min(max(real[c] + (target - real[c]) / gain, 0.0), 1.0)
        last = (real, aim)
        new = obj.solve(raw, aim)
        for c in obj.classes:
            lo, hi = bracket[c]
            if not lo < new[c] < hi and math.isfinite(lo) and math.isfinite(hi):
                new[c] = 0.5 * (lo + hi)
        new_totals = obj.totals(raw, new)
        if new_totals == totals:  # nothing left to move: the target is out of reach
            break
        deltas, totals = new, new_totals
    (over, err), totals, deltas, rates, raw = best
    converged = over == 0.0 and err <= tol
    wm.set_router_shifts(_as_lists(wm, totals))

    def report(r):
        keep = {kind: [1.0 - r[(kind, i)] for i in range(n)] for kind, n in
                (("attn", len(wm.attn_routers)), ("ffn", len(wm.ffn_routers)))}
        return realized_sparsity(keep["attn"], keep["ffn"], wm.dims, cfg, seq_len=int(windows.shape[1]))

    rec = {"format": FORMAT, "unit": unit, "mode": cfg.sparsity_mode, "target": float(target),
           "max_module_sparsity": cfg.max_module_sparsity, "tolerance": tol, "converged": converged,
           "passes": passes, "history": history, "realized": report(rates),
           **({"uncalibrated": report(uncalibrated)} if uncalibrated is not None else {}),
           "shifts": {c: float(d) for c, d in deltas.items()}, "module_shifts": _as_lists(wm, totals),
           "heldout": {"windows": int(windows.shape[0]), "ctx": int(windows.shape[1]), "tokens": int(windows.numel()),
                       "held_out": bool(held_out)},
           "curve": _curve(raw)}
    wm.calibration = rec
    if not converged:
        reached = obj.realized(rates)
        got = ", ".join(f"{c} {v:.4f}" for c, v in reached.items())
        warnings.warn(f"the logit-shift fit reached {got} ({unit}, {cfg.sparsity_mode} mode) for the target "
                      f"{target:g} after {passes} forward pass(es) over {fitted_tokens(rec)}, "
                      f"outside the tolerance {tol:g}" + (f" (max module sparsity {cfg.max_module_sparsity:g} "
                                                          f"caps it)" if cfg.max_module_sparsity < 1 else ""),
                      WideWarning, stacklevel=2)
    return rec


def dial(wm: WideModel, sparsity: float, tokenizer, unit: str | None = None, text: str | None = None,
         max_tokens: int = DIAL_TOKENS, batch_size: int = 1) -> dict:
    """Re-fit the shifts of a trained model for ``sparsity`` in ``[0, 1)`` in ``unit`` (default the config's)
    without training: on the held-out part of ``text`` (a ``--text`` spec; default the text of the stored fit when
    it is still there, else the bundled calibration text), its first ``max_tokens`` tokens, starting from the stored
    curve of ``wm.calibration`` when there is one.
    Returns :func:`fit_shifts`'s record with ``dialed`` True. Raises WideError for a value out of range or above the
    config's ``max_module_sparsity`` (:func:`check_reachable`)."""
    from wide.data import DEFAULT_TEXT, load_texts

    sparsity = check_target(sparsity)
    unit = check_unit(unit or wm.config.sparsity_unit)
    check_reachable(sparsity, wm.config.max_module_sparsity, unit, "sparsity", "the routers' max_module_sparsity",
                    f"give sparsity {wm.config.max_module_sparsity:g} or less")
    if text is None:
        stored = (wm.calibration or {}).get("text")
        text = stored if isinstance(stored, str) and os.path.exists(stored) else None
    held, held_out = fit_text(load_texts(text, split="calib"))
    windows = heldout_windows(held, tokenizer, min(wm.config.seq_len or max_tokens, max_tokens), max_tokens)
    curve = (wm.calibration or {}).get("curve")
    rec = fit_shifts(wm, windows, sparsity, unit, batch_size=batch_size, curve=curve, held_out=held_out)
    rec.update(dialed=True, text=text or DEFAULT_TEXT)
    return rec


def fitted_tokens(rec: dict) -> str:
    """What a record's shift was fitted on: ``N held-out tokens``, or (a one-document text) the training text's."""
    h = rec["heldout"]
    return (f"{h['tokens']:,} held-out tokens" if h.get("held_out", True) else
            f"{h['tokens']:,} tokens of the training text (one document: nothing held out)")


def calibration_line(rec: dict) -> str:
    """One line on a fitted record: what was asked, what was realized in both units, and the shifts."""
    r = rec["realized"]
    shifts = ", ".join(f"{c} {v:+.3f}" for c, v in rec["shifts"].items())
    before = rec.get("uncalibrated")
    was = f"; uncalibrated {before['groups']:.4f} groups / {before['flops']:.4f} flops" if before else ""
    bound = (f", max module sparsity {rec['max_module_sparsity']:g}" if rec["max_module_sparsity"] < 1 else "")
    return (f"{'dialed' if rec.get('dialed') else 'calibrated'} routing to S={rec['target']:g} ({rec['unit']}, "
            f"{rec['mode']}{bound}): realized {r['groups']:.4f} groups / {r['flops']:.4f} flops (attn "
            f"{r['attn']:.3f}, ffn {r['ffn']:.3f}) on {fitted_tokens(rec)}{was}; logit "
            f"shift {shifts}")
