"""Sparsity control on SmolLM2-135M: the exact target, the FLOPs unit, the serve-time dial and the per-module bound.

Parts (``--parts``), each written to one current record file under ``--out``:

* ``exact`` (``exact.json``): router-only checkpoints trained at every ``--targets`` S in both units (``groups``,
  Eq. 6; ``flops``, the routed compute skipped), the logit shift fitted on held-out calibration text
  (:func:`wide.calibrate.fit_shifts`); WikiText-2 token perplexity and realized sparsity in both units, once with the
  fitted shifts (``calibrated`` true) and once without (the paper's routing).
* ``indomain`` (``indomain.json``): the checkpoints of ``exact`` with the logit shift fitted instead on held-out
  WikiText-2 windows (every ``--fit-every``-th 2048-token window of wiki.test.raw, the fit's text from the evaluated
  domain); realized sparsity and perplexity on the other windows, which the fit never read. Each record has
  ``fit_on`` ``"wikitext"`` (``exact``'s: ``"calibration"``).
* ``dial`` (``dial.json``): the ``--dial-from`` checkpoints (groups unit) loaded with ``wide.load(..., sparsity=X)``
  for every ``--dial-targets`` X; each record carries ``dialed_from`` and ``trained_ppl``, the calibrated perplexity
  of the checkpoint trained at X with the same budget (from ``exact``).
* ``bound`` (``bound.json``): S = 0.5 (groups) trained with ``--max-module-sparsity`` against the same run without
  it: perplexity, its cost, and the modules at >= 0.99 / <= 0.01 sparsity on WikiText-2.
* ``equal`` (``equal.json``): zero-shot accuracy (lm-eval, ``--limit`` documents per task) of dense, WIDE and SkipGPT
  (both calibrated to realize S) and static width pruning at S = ``--equal-targets``, so the comparison is at equal
  realized sparsity in the groups unit.

Every record has ``method``, ``target``, ``unit``, ``realized`` (in ``unit``), ``realized_groups``,
``realized_flops``, ``calibrated``, ``ppl``, ``commit``, ``date``, ``command``. Jobs run as separate processes,
several at once on the GPU (as ``run_parallel.py``): at most ``--max-train`` trainings, ``--workers`` jobs and
``--gpu-mem-gb`` of estimated memory; a job starts only if its estimated time fits before ``--hard-limit``, which
kills what still runs. Each job writes its records as it goes, so a cut call keeps what finished; a later call with
``--resume-dir`` skips the records already there (same steps, same limit).

GPU (one H200, the model and the data carried as in ``table.json``'s command):

    PYTHONPATH=src python3 benchmarks/quality/run_control.py --model /tmp/wide-model/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --calib .device/data/calibration/wiki_owt.jsonl --wikitext .device/data/wikitext-2-raw/wiki.test.raw \\
        --steps 150 --hard-limit 500 --resume-dir benchmarks/quality --out $OUT

CPU check of the driver (a few steps on a short text; not a measurement): ``--steps 2 --seq-len 64 --batch-size 2
--max-eval-tokens 512 --limit 2 --targets 0.25 0.5 --workers 2``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import os
import shlex
import subprocess
import sys
import tarfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PART_FILES = {"exact": "exact.json", "indomain": "indomain.json", "dial": "dial.json", "bound": "bound.json",
              "equal": "equal.json"}
TASK_KEYS = ["arc_easy", "arc_challenge", "boolq", "winogrande", "piqa", "openbookqa", "hellaswag"]
#: estimated GPU memory (GB) and wall time (s, several jobs at once on one H200, batch 8 x 2048) per job kind
MEM_GB = {"train": 28.0, "dial": 8.0, "zs": 12.0}
READY = "fitted.json"  #: written into a checkpoint once its logit shift is fitted and saved
FLAG_HIGH, FLAG_LOW = 0.99, 0.01  # a module at or above FLAG_HIGH is pruned away, at or below FLAG_LOW never pruned


def pct(s: float) -> int:
    return round(s * 100)


def train_key(method: str, unit: str, s: float, bound: float = 1.0) -> str:
    return f"{method}-{unit}-s{pct(s)}" + (f"-max{pct(bound)}" if bound < 1.0 else "")


# --- plan -----------------------------------------------------------------------------------------------------------
def plan_jobs(a) -> list[dict]:
    """The jobs of ``--parts`` in priority order: ``{"key", "kind": train|dial|zs, "needs": train key or None, ...}``;
    a train job is listed once even when several parts use it."""
    jobs: list[dict] = []

    def train(method, unit, s, bound=1.0):
        k = train_key(method, unit, s, bound)
        if not any(j["key"] == k for j in jobs):
            jobs.append({"key": k, "kind": "train", "needs": None, "method": method, "unit": unit, "target": s,
                         "bound": bound})
        return k

    first = [s for s in (*a.dial_from, *(a.equal_targets if "equal" in a.parts else ())) if s in a.targets]
    if "exact" in a.parts or "indomain" in a.parts or "dial" in a.parts:
        for s in [*first, *a.targets]:  # the dial sources first: their dial jobs start early
            train("wide", "groups", s)
    if "dial" in a.parts:  # before the later trainings: a dial job starts as soon as its source is fitted
        for s in a.dial_from:
            src = train("wide", "groups", s)
            jobs.append({"key": f"dial-{src}", "kind": "dial", "needs": src, "from": s, "unit": "groups",
                         "targets": [x for x in a.dial_targets if abs(x - s) > 1e-9]})
    if "exact" in a.parts or "indomain" in a.parts:
        for s in a.flops_targets:
            train("wide", "flops", s)
    if "bound" in a.parts:
        train("wide", "groups", 0.5)
        train("wide", "groups", 0.5, a.max_module_sparsity)
    if "equal" in a.parts:  # the trainings first (the longest path), the unrouted zero-shot jobs beside them
        srcs = {(m, s): train(m, "groups", s) for s in a.equal_targets for m in ("wide", "skipgpt")}
        jobs.append({"key": "zs-dense", "kind": "zs", "needs": None, "method": "dense", "target": 0.0})
        for s in a.equal_targets:
            jobs.append({"key": f"zs-static-s{pct(s)}", "kind": "zs", "needs": None, "method": "static", "target": s})
            for m in ("wide", "skipgpt"):
                jobs.append({"key": f"zs-{srcs[m, s]}", "kind": "zs", "needs": srcs[m, s], "method": m, "target": s})
    return jobs


def records_of(job: dict, part_records: dict[str, list[dict]], steps: int, limit) -> list[dict]:
    """The records of earlier calls that ``job`` would write (same steps / limit)."""
    def same(r):
        return r.get("steps") == steps or r.get("method") in ("dense", "static")
    if job["kind"] == "train":
        return [r for p in ("exact", "indomain", "bound") for r in part_records.get(p, []) if r.get("key") == job["key"]
                and same(r)]
    if job["kind"] == "dial":
        return [r for r in part_records.get("dial", []) if r.get("source_key") == job["needs"] and same(r)]
    return [r for r in part_records.get("equal", []) if r.get("key") == job["key"] and r.get("limit") == limit
            and same(r)]


def job_done(job: dict, earlier: list[dict], parts=()) -> bool:
    if job["kind"] == "train":
        fitted = {r.get("fit_on", "calibration") for r in earlier if r.get("calibrated")}
        return ({r.get("calibrated") for r in earlier} >= {True, False}
                and ("indomain" not in parts or job["method"] != "wide" or job["bound"] < 1.0 or "wikitext" in fitted))
    if job["kind"] == "dial":
        return {round(r["target"], 6) for r in earlier} >= {round(x, 6) for x in job["targets"]}
    return bool(earlier)


# --- worker ---------------------------------------------------------------------------------------------------------
class Worker:
    """One job in this process: the base model, the prepared token tensors and the record settings."""

    def __init__(self, a, job: dict) -> None:
        import torch

        from wide.hub import load_base_model

        self.a, self.job, self.torch = a, job, torch
        self.data = torch.load(Path(a.work) / "data.pt", weights_only=True)
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.base, self.tok, self.src = load_base_model(a.model, device=self.device)
        self.part = Path(a.work) / "parts" / f"{job['key']}.json"
        self.records: list[dict] = json.loads(self.part.read_text()) if self.part.is_file() else []
        self.common = {"commit": a.commit, "date": dt.date.today().isoformat(), "command": a.command,
                       "model": a.model, "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                       "steps": a.steps, "batch_size": a.batch_size, "seq_len": a.seq_len, "lr": a.lr,
                       "ctx": a.ctx, "calib_text": Path(a.calib).name, "eval_text": Path(a.wikitext).name}

    def emit(self, rec: dict) -> None:
        from wide.config import atomic_write_text

        rec = {**rec, **self.common}
        self.records.append(rec)
        atomic_write_text(self.part, json.dumps(self.records, indent=1) + "\n")
        print(json.dumps({k: v for k, v in rec.items() if k not in ("per_layer", "fit")}), flush=True)

    def ckpt(self, key: str) -> Path:
        return Path(self.a.runs) / key

    # routed models: train, fit, evaluate
    def train(self, job: dict) -> Path:
        """Train (unless done) and fit the logit shift (unless fitted) of a train job's checkpoint."""
        from wide.baselines.skipgpt import skipgpt_config
        from wide.checkpoint import CALIBRATION_NAME, load, save_calibration, save_wide
        from wide.config import WideConfig, atomic_write_text
        from wide.model import WideModel
        from wide.train.loop import CalibrationArgs, calibrate

        a, torch = self.a, self.torch
        out = self.ckpt(job["key"])
        if not (out / "done.json").is_file():
            cfg = WideConfig(ffn_group_size=a.ffn_group_size, router_rank=a.rank, target_sparsity=job["target"],
                             sparsity_unit=job["unit"], max_module_sparsity=job["bound"], seq_len=a.seq_len)
            if job["method"] == "skipgpt":
                cfg = skipgpt_config(self.base_dims(), cfg)
            torch.manual_seed(a.seed)
            wm = WideModel(self.base, cfg)
            args = CalibrationArgs(steps=a.steps, batch_size=a.batch_size, lr=a.lr, warmup_steps=a.steps // 20,
                                   save_every=a.steps, seed=a.seed, memory_check=False)  # the launcher budgets it
            t0 = time.time()
            log = calibrate(wm, self.data["blocks"], args, out, self.src.ref, progress=False)
            save_wide(wm, out, self.src.ref)
            atomic_write_text(out / "done.json", json.dumps({"train_wall_s": time.time() - t0, "final": log[-1]}))
            unhook(wm)
        if not (out / CALIBRATION_NAME).is_file():
            wm = load(out, model=self.base, calibrated=False)
            t0 = time.time()
            rec = self.fit(wm)
            rec["fit_wall_s"] = time.time() - t0
            save_calibration(out, rec)
            unhook(wm)
        atomic_write_text(out / READY, "{}")  # dial and zero-shot jobs may load it from now on
        return out

    def base_dims(self):
        from wide.model import dims_of

        return dims_of(self.base.config)

    def fit(self, wm) -> dict:
        from wide.calibrate import fit_shifts

        return fit_shifts(wm, self.data["fit_windows"], batch_size=self.a.batch_size)  # as wide calibrate

    def evaluate(self, wm, windows=None) -> dict:
        """WikiText-2 token perplexity and realized sparsity in both units over ``windows`` (default: all of
        WikiText-2's), with the modules at the flags."""
        from wide.eval.perplexity import perplexity
        from wide.routing import realized_sparsity

        t0 = time.time()
        windows = self.data["wikitext"] if windows is None else windows
        r = perplexity(wm, windows, batch_size=self.a.eval_batch_size, progress=False)
        layers = r["per_layer"]
        attn = [x["attn"] for x in layers if x["attn"] is not None]
        ffn = [x["ffn"] for x in layers if x["ffn"] is not None]
        both = realized_sparsity([1 - v for v in attn], [1 - v for v in ffn], wm.dims, wm.config)
        flags = {name: [f"{kind} {x['layer']}" for x in layers for kind in ("attn", "ffn")
                        if x[kind] is not None and test(x[kind])]
                 for name, test in (("modules_ge_099", lambda v: v >= FLAG_HIGH),
                                    ("modules_le_001", lambda v: v <= FLAG_LOW))}
        return {"ppl": r["ppl"], "ppl_tokens": r["tokens"], "realized_groups": both["groups"],
                "realized_flops": both["flops"], "attn_sparsity": both["attn"], "ffn_sparsity": both["ffn"],
                **flags, "per_layer": layers, "eval_s": time.time() - t0}

    def run_train(self, job: dict) -> None:
        from wide.checkpoint import load

        out = self.train(job)
        done = json.loads((out / "done.json").read_text())
        wm = load(out, model=self.base)  # calibrated: the fitted shifts of calibration.json
        fit = wm.calibration
        have = {r["calibrated"] for r in self.records if r.get("fit_on", "calibration") == "calibration"}
        for calibrated in (True, False):
            if calibrated in have:
                continue
            wm.set_router_shifts(fit["module_shifts"] if calibrated else None)
            ev = self.evaluate(wm)
            self.emit({"key": job["key"], "method": job["method"], "stage": "router", "target": job["target"],
                       "unit": job["unit"], "realized": ev[f"realized_{job['unit']}"], "calibrated": calibrated,
                       "fit_on": "calibration", "max_module_sparsity": job["bound"], **ev, "checkpoint": str(out),
                       "train_wall_s": done.get("train_wall_s"),
                       "fit": {k: fit[k] for k in ("converged", "passes", "realized", "uncalibrated", "shifts",
                                                   "heldout", "tolerance", "fit_wall_s") if k in fit}})
        if ("indomain" in self.a.parts and job["bound"] >= 1.0
                and not any(r.get("fit_on") == "wikitext" for r in self.records)):
            self.run_indomain(job, wm, out, done)
        unhook(wm)

    def run_indomain(self, job: dict, wm, out: Path, done: dict) -> None:
        """The shift fitted on the held-out WikiText-2 windows; realized sparsity and perplexity on the others."""
        from wide.calibrate import fit_shifts

        t0 = time.time()
        wm.set_router_shifts(None)
        fit = fit_shifts(wm, self.data["wikitext_fit"], batch_size=self.a.batch_size)
        fit_s = time.time() - t0
        ev = self.evaluate(wm, self.data["wikitext_eval"])
        self.emit({"key": job["key"], "method": job["method"], "stage": "router", "target": job["target"],
                   "unit": job["unit"], "realized": ev[f"realized_{job['unit']}"], "calibrated": True,
                   "fit_on": "wikitext", "fit_windows": f"wiki.test.raw windows i % {self.a.fit_every} == 0",
                   "max_module_sparsity": job["bound"], **ev, "checkpoint": str(out),
                   "train_wall_s": done.get("train_wall_s"),
                   "fit": {**{k: fit[k] for k in ("converged", "passes", "realized", "shifts", "heldout", "tolerance")
                              if k in fit}, "fit_wall_s": fit_s}})

    def run_dial(self, job: dict) -> None:
        import wide

        src = self.ckpt(job["needs"])
        done = {round(r["target"], 6) for r in self.records}
        for x in job["targets"]:
            if round(x, 6) in done:
                continue
            t0 = time.time()
            wm = wide.load(src, model=self.base, sparsity=x, sparsity_unit=job["unit"], text=self.a.calib)
            dial_s = time.time() - t0
            ev = self.evaluate(wm)
            fit = wm.calibration
            self.emit({"key": f"{job['needs']}-dial{pct(x)}", "source_key": job["needs"], "method": "wide",
                       "stage": "router", "target": x, "unit": job["unit"], "realized": ev[f"realized_{job['unit']}"],
                       "calibrated": True, "dialed_from": job["from"], "trained_ppl": None, **ev,
                       "dial_s": dial_s, "checkpoint": str(src),
                       "fit": {k: fit[k] for k in ("converged", "passes", "realized", "shifts", "heldout")
                               if k in fit}})
            unhook(wm)
            gc.collect()

    def run_zs(self, job: dict) -> None:
        from wide.eval.lm_eval import WideLM, evaluate

        a, torch = self.a, self.torch
        rec = {"key": job["key"], "method": job["method"], "stage": "router", "target": job["target"],
               "unit": "groups", "calibrated": job["method"] in ("wide", "skipgpt"), "limit": a.limit}
        wm = None
        if job["method"] in ("wide", "skipgpt"):
            from wide.checkpoint import load

            out = self.ckpt(job["needs"])
            wm = load(out, model=self.base)
            lm = WideLM(pretrained=wm.base, wide=wm, tokenizer=self.tok, batch_size=a.zs_batch_size,
                        max_length=a.max_length)
            rec["checkpoint"] = str(out)
        elif job["method"] == "static":
            from wide.baselines.static import param_count, prune, slice_model

            torch.manual_seed(a.seed)
            p = prune(self.base, self.data["blocks"][:a.static_blocks], job["target"],
                      ffn_group_size=a.ffn_group_size, batch_size=4)
            small = slice_model(self.base, p)
            rec.update({"realized": p.sparsity, "realized_groups": p.sparsity, "attn_sparsity": p.attn_sparsity,
                        "ffn_sparsity": p.ffn_sparsity, "params": param_count(small)})
            rec["realized_flops"] = self.static_flops(p.attn_sparsity, p.ffn_sparsity)
            lm = WideLM(pretrained=small, tokenizer=self.tok, batch_size=a.zs_batch_size, max_length=a.max_length)
        else:
            lm = WideLM(pretrained=self.base, tokenizer=self.tok, batch_size=a.zs_batch_size,
                        max_length=a.max_length)
        t0 = time.time()
        res = evaluate(lm, "zeroshot", limit=a.limit, bootstrap_iters=0)
        rec.update({**res["summary"], "lm_eval_s": time.time() - t0})
        sp = res["sparsity"]
        if sp and sp.get("tokens"):
            rec.update({f"tasks_{k}": sp[k] for k in ("attn_sparsity", "ffn_sparsity", "realized_sparsity", "tokens")})
        if wm is not None:
            ev = self.evaluate(wm)
            rec.update({**ev, "realized": ev["realized_groups"]})
            unhook(wm)
        else:
            from wide.eval.perplexity import perplexity

            model = lm.model
            rec["ppl"] = perplexity(model, self.data["wikitext"], batch_size=a.eval_batch_size, progress=False)["ppl"]
            rec.setdefault("realized", 0.0 if job["method"] == "dense" else None)
        self.emit(rec)

    def static_flops(self, attn: float, ffn: float) -> float:
        from wide.config import WideConfig
        from wide.routing import realized_sparsity

        return realized_sparsity([1 - attn], [1 - ffn], self.base_dims(), WideConfig(seq_len=self.a.seq_len))["flops"]


def unhook(wm) -> None:
    """Take a WideModel's hooks off the shared base model."""
    for h in getattr(wm, "_handles", []):
        h.remove()
    wm._handles = []


def worker_main(a) -> None:
    job = json.loads(a.job)
    w = Worker(a, job)
    getattr(w, f"run_{job['kind']}")(job)


# --- launcher -------------------------------------------------------------------------------------------------------
def prepare_data(a) -> None:
    """Tokenize once for every job: the training blocks (the calibration text less its held-out documents), the
    held-out windows of the fit, and the WikiText-2 windows; saved to ``<work>/data.pt``."""
    import torch

    from wide.calibrate import heldout_split, heldout_windows
    from wide.config import FIT_TOKENS
    from wide.data import load_texts, pack, ppl_windows
    from wide.hub import load_tokenizer, resolve_model

    path = Path(a.work) / "data.pt"
    if path.is_file():
        return
    tok = load_tokenizer(resolve_model(a.model))
    train_docs, held = heldout_split(load_texts(a.calib))
    wikitext = ppl_windows(load_texts(a.wikitext), tok, a.ctx, a.max_eval_tokens, a.wikitext)
    fit = torch.arange(len(wikitext)) % a.fit_every == 0  # the in-domain fit's windows; the rest are evaluated
    data = {"blocks": pack(train_docs, tok, a.seq_len, a.max_blocks, a.calib),
            "fit_windows": heldout_windows(held, tok, a.seq_len, a.fit_tokens or FIT_TOKENS),
            "wikitext": wikitext, "wikitext_fit": wikitext[fit], "wikitext_eval": wikitext[~fit]}
    torch.save(data, path)
    print("data: " + ", ".join(f"{k} {tuple(v.shape)}" for k, v in data.items()), flush=True)


def part_of(r: dict) -> str:
    """The part file a record belongs to."""
    if r.get("fit_on") == "wikitext":
        return "indomain"
    if r.get("dialed_from") is not None:
        return "dial"
    if str(r.get("key", "")).startswith("zs-"):
        return "equal"
    return "bound" if r.get("max_module_sparsity", 1.0) < 1.0 else "exact"


def merge(a, earlier: dict[str, list[dict]]) -> dict[str, list[dict]]:
    """The part files: earlier records plus every job's; the dial records' ``trained_ppl`` (the calibrated record
    of the checkpoint trained at the dialed target, same unit and steps), the bound's unbounded reference (the
    S = 0.5 groups records) and ``ppl_cost``, the zero-shot ``retention``."""
    new = [r for f in sorted((Path(a.work) / "parts").glob("*.json")) for r in json.loads(f.read_text())]
    every: list[dict] = []
    seen = set()
    for r in [*(r for recs in earlier.values() for r in recs), *new]:
        i = (r.get("key"), r.get("calibrated"), r.get("fit_on") or "calibration", r.get("steps"), r.get("limit"))
        if i not in seen:
            seen.add(i)
            every.append(r)
    out = {part: [r for r in every if part_of(r) == part] for part in PART_FILES}
    trained = {(r["unit"], round(r["target"], 6), r["steps"]): r for r in out["exact"]
               if r.get("calibrated") and r["method"] == "wide"}
    for r in out["dial"]:
        t = trained.get((r["unit"], round(r["target"], 6), r["steps"]))
        r.update({"trained_ppl": t["ppl"] if t else None, "trained_realized": t["realized"] if t else None,
                  "ppl_ratio_to_trained": r["ppl"] / t["ppl"] if t else None})
    ref_key = train_key("wide", "groups", 0.5)
    refs = [r for r in out["exact"] if r.get("key") == ref_key]
    for r in out["bound"]:
        ref = next((x for x in refs if x["calibrated"] == r["calibrated"] and x["steps"] == r["steps"]), None)
        r.update({"unbounded_ppl": ref["ppl"] if ref else None,
                  "ppl_cost": r["ppl"] / ref["ppl"] - 1.0 if ref else None})
    if out["bound"]:
        out["bound"] += refs
    dense = {r.get("limit"): r["avg_acc"] for r in out["equal"] if r["method"] == "dense" and r.get("avg_acc")}
    for r in out["equal"]:
        d = dense.get(r.get("limit"))
        r["retention"] = r["avg_acc"] / d if d and r.get("avg_acc") is not None else None
    return out


def launcher_main(a, argv: list[str]) -> None:
    t0 = time.time()
    work, out = Path(a.work), Path(a.out)
    (work / "parts").mkdir(parents=True, exist_ok=True)
    (work / "logs").mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    earlier = {}
    for part, name in PART_FILES.items():
        f = Path(a.resume_dir) / name if a.resume_dir else None
        earlier[part] = json.loads(f.read_text()) if f and f.is_file() else []
    jobs = plan_jobs(a)
    todo = [j for j in jobs if not job_done(j, records_of(j, earlier, a.steps, a.limit), a.parts)]
    if "equal" in a.parts and importlib_missing("lm_eval"):
        print("lm-eval is not installed: the zero-shot jobs of part equal are skipped", flush=True)
        todo = [j for j in todo if j["kind"] != "zs"]
    print(f"{len(todo)} of {len(jobs)} job(s) to do: {[j['key'] for j in todo]}", flush=True)
    # a train job already recorded but needed by a dial / zs job must still have its checkpoint
    need = {j["needs"] for j in todo if j["needs"]}
    todo_keys = {j["key"] for j in todo}
    for j in jobs:
        if j["key"] in need and j["key"] not in todo_keys and not (Path(a.runs) / j["key"] / READY).is_file():
            todo.insert(0, j)
            todo_keys.add(j["key"])
    if todo:
        prepare_data(a)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false",
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2"),
           "PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")}
    est = {"train": a.train_est_s, "dial": a.dial_est_s, "zs": a.zs_est_s}
    pending, running, finished, failed = list(todo), {}, [], set()
    while pending or running:
        now = time.time() - t0
        for key, (proc, job, t_start, log) in list(running.items()):
            if proc.poll() is not None:
                log.close()
                del running[key]
                if proc.returncode != 0:
                    failed.add(key)
                finished.append({"key": key, "rc": proc.returncode, "wall_s": round(time.time() - t_start, 1)})
                print(f"[{now:5.0f}s] done {key} rc={proc.returncode} in {time.time() - t_start:.0f}s", flush=True)
        if now > a.hard_limit:
            for key, (proc, job, t_start, log) in running.items():
                proc.kill()
                proc.wait()
                log.close()
                finished.append({"key": key, "rc": "killed at the hard limit", "wall_s": round(time.time() - t_start)})
                print(f"[{now:5.0f}s] killed {key}", flush=True)
            running.clear()
            break
        for job in list(pending):
            gone = job["needs"] is not None and job["needs"] not in running and job["needs"] not in {
                j["key"] for j in pending} and not (Path(a.runs) / job["needs"] / READY).is_file()
            if job["needs"] in failed or gone:
                pending.remove(job)
                failed.add(job["key"])
                finished.append({"key": job["key"], "rc": f"not run: {job['needs']} did not finish"})
            elif now + est[job["kind"]] > a.hard_limit:
                pending.remove(job)
                finished.append({"key": job["key"], "rc": "not started: would not finish before the hard limit"})
        mem = sum(MEM_GB[j["kind"]] for _, j, _, _ in running.values())
        n_train = sum(1 for _, j, _, _ in running.values() if j["kind"] == "train")
        for job in list(pending):
            if len(running) >= a.workers:
                break
            if job["needs"] is not None and not (Path(a.runs) / job["needs"] / READY).is_file():
                continue
            if job["kind"] == "train" and n_train >= a.max_train:
                continue
            if mem + MEM_GB[job["kind"]] > a.gpu_mem_gb:
                continue
            cmd = [sys.executable, str(Path(__file__).resolve()), *argv, "--job", json.dumps(job)]
            log = open(work / "logs" / f"{job['key']}.log", "w")
            running[job["key"]] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env), job,
                                   time.time(), log)
            pending.remove(job)
            mem += MEM_GB[job["kind"]]
            n_train += job["kind"] == "train"
            print(f"[{now:5.0f}s] start {job['key']}", flush=True)
        time.sleep(0.5)
    merged = merge(a, earlier)
    summary = {"command": a.command, "wall_s": round(time.time() - t0, 1), "jobs": finished,
               **{p: len(r) for p, r in merged.items()}}
    from wide.config import atomic_write_text

    for part, recs in merged.items():
        if recs:
            atomic_write_text(out / PART_FILES[part], json.dumps(recs, indent=1) + "\n")
    (work / "jobs.json").write_text(json.dumps(summary, indent=1) + "\n")
    with tarfile.open(out / "control_logs.tgz", "w:gz") as tar:
        tar.add(work / "jobs.json", arcname="jobs.json")
        tar.add(work / "logs", arcname="logs")
    keep = [Path(a.runs) / k for k in a.keep_routers if (Path(a.runs) / k / "routers.safetensors").is_file()]
    if keep:
        with tarfile.open(out / "control_routers.tar", "w") as tar:
            for d in keep:
                for name in ("routers.safetensors", "wide_config.json", "base_model.json", "calibration.json",
                             "train_log.jsonl"):
                    if (d / name).is_file():
                        tar.add(d / name, arcname=f"{d.name}/{name}")
    print(json.dumps({k: v for k, v in summary.items() if k != "jobs"}), flush=True)


def importlib_missing(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is None


def parser() -> argparse.ArgumentParser:
    from wide.cli.common import WideArgumentParser  # usage errors in one line

    p = WideArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", nargs="+", choices=list(PART_FILES), default=list(PART_FILES))
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--calib", required=True, help="calibration text (.jsonl with 'text'); one document in ten is "
                   "held out for the logit-shift fit")
    p.add_argument("--wikitext", required=True, help="WikiText-2's wiki.test.raw")
    p.add_argument("--targets", type=float, nargs="+", default=[0.1, 0.2, 0.25, 0.3, 0.4, 0.5, 0.6, 0.7],
                   help="trained S in the groups unit (the dial sources and their comparison points)")
    p.add_argument("--flops-targets", type=float, nargs="+", default=[0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7],
                   help="trained S in the flops unit")
    p.add_argument("--dial-from", type=float, nargs="+", default=[0.5, 0.25])
    p.add_argument("--dial-targets", type=float, nargs="+", default=[0.1, 0.2, 0.25, 0.3, 0.4, 0.5, 0.6, 0.7])
    p.add_argument("--max-module-sparsity", type=float, default=0.9)
    p.add_argument("--equal-targets", type=float, nargs="+", default=[0.25, 0.5])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--max-blocks", type=int, default=2000, help="calibration sequences packed")
    p.add_argument("--lr", type=float, default=5e-3)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--ffn-group-size", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fit-tokens", type=int, default=None, help="held-out tokens of the logit-shift fit (default: "
                   "wide.calibrate.FIT_TOKENS, as wide calibrate)")
    p.add_argument("--ctx", type=int, default=2048, help="WikiText-2 window")
    p.add_argument("--fit-every", type=int, default=8, help="part indomain: every n-th WikiText-2 window is the "
                   "logit-shift fit's text, the others are evaluated")
    p.add_argument("--max-eval-tokens", type=int, default=None, help="WikiText-2 tokens evaluated (default: all)")
    p.add_argument("--eval-batch-size", type=int, default=4)
    p.add_argument("--limit", type=int, default=1000, help="zero-shot documents per task")
    p.add_argument("--zs-batch-size", type=int, default=64)
    p.add_argument("--max-length", type=int, default=4096)
    p.add_argument("--static-blocks", type=int, default=32)
    p.add_argument("--workers", type=int, default=10, help="jobs at once")
    p.add_argument("--max-train", type=int, default=4, help="training jobs at once")
    p.add_argument("--gpu-mem-gb", type=float, default=136.0, help="sum of the running jobs' MEM_GB allowed")
    p.add_argument("--train-est-s", type=float, default=120.0, help="a train job starts only this long before "
                   "--hard-limit")
    p.add_argument("--dial-est-s", type=float, default=45.0)
    p.add_argument("--zs-est-s", type=float, default=180.0)
    p.add_argument("--hard-limit", type=float, default=500.0, help="seconds: kill what still runs, then merge")
    p.add_argument("--resume-dir", default=None, help="folder with the part files of earlier calls")
    p.add_argument("--keep-routers", nargs="*", default=[train_key("wide", u, s) for u in ("groups", "flops")
                                                         for s in (0.25, 0.5)])
    p.add_argument("--runs", default="/tmp/wide-control/runs")
    p.add_argument("--work", default="/tmp/wide-control/work")
    p.add_argument("--out", required=True)
    p.add_argument("--job", default=None, help=argparse.SUPPRESS)
    p.add_argument("--command", default=None, help=argparse.SUPPRESS)
    p.add_argument("--commit", default=None, help=argparse.SUPPRESS)
    return p


def main() -> None:
    argv = sys.argv[1:]
    a = parser().parse_args(argv)
    bad = [s for s in (*a.targets, *a.flops_targets, *a.dial_from, *a.dial_targets, *a.equal_targets)
           if not 0.0 <= s < 1.0]
    if bad:
        raise SystemExit(f"run_control.py: error: sparsity {bad[0]} is outside [0, 1)")
    if a.job is None:
        for path, what in ((a.calib, "--calib"), (a.wikitext, "--wikitext")):
            if not Path(path).is_file():
                raise SystemExit(f"run_control.py: error: {what} {path!r} not found")
        a.command = "python " + shlex.join([sys.argv[0], *argv])
        from wide.bench._args import source_commit

        a.commit = source_commit()[0]
        launcher_main(a, [*argv, "--command", a.command, "--commit", str(a.commit)])
    else:
        worker_main(a)


if __name__ == "__main__":
    main()
