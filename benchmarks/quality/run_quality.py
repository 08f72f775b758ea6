"""Quality suite of the WIDE paper on SmolLM2-135M (Tables 1-2, Figure 5 / 6 analogues, uniform variant).

Runs methods (dense, wide, skipgpt, static) x target sparsities x stages (router = stage 1 only,
lora = + stage-2 LoRA recovery), evaluates each model with lm-evaluation-harness on the seven zero-shot
tasks (offline copies, `wide.eval.tasks`) plus WikiText-2 word perplexity, and our token perplexity /
realized sparsity on WikiText-2 (ctx 2048). Appends one record per run to ``<out>/<tag>.json`` (``method``,
``stage``, ``target``, ``unit``, ``realized``, ``ppl``, the task accuracies, ``commit``, ``date``, ``command``, ...);
runs already recorded with the same settings are skipped, so an interrupted plan resumes.

Plans (``--plan``):
  table     methods x --sparsity x --stages                          (Tables 1-2)
  group     WIDE at S=0.5: G_ffn in 16..512 (G_attn 192), G_attn in {64, 192, 576} (G_ffn 128)   (Fig. 5)
  sparsity  wide, skipgpt, static at S = 0.1 .. 0.7, router stage     (Fig. 6)
  uniform   WIDE at S=0.5 with the uniform loss (Eq. 22)              (Table 4)

GPU example (one H200; several plans at once over every GPU: ``run_parallel.py``):

    python benchmarks/quality/run_quality.py --plan table --model smollm2-135m \
        --calib data/calibration/wiki_owt.jsonl --wikitext data/wikitext-2-raw/wiki.test.raw \
        --sparsity 0.5 0.25 --stages router lora --steps 300 --lora-steps 200 --out benchmarks/quality

Every run's checkpoint lives under ``--runs`` (not committed); ``--keep-routers`` appends the WIDE / SkipGPT
router checkpoints (small) to one archive, ``<out>/<tag>_routers.tar``, so the plots can be redrawn on a CPU
(``tar xf ... -C benchmarks/quality/checkpoints``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import shlex
import sys
import time
from pathlib import Path

import torch

from wide.checkpoint import load, save_wide
from wide.config import WideConfig, atomic_write_text
from wide.data import load_texts, pack, ppl_windows
from wide.eval.perplexity import perplexity
from wide.hub import load_base_model
from wide.model import WideModel, dims_of, fingerprint, router_param_count

TASK_KEYS = ["arc_easy", "arc_challenge", "boolq", "winogrande", "piqa", "openbookqa", "hellaswag"]
GROUP_FFN = [16, 32, 64, 128, 256, 512]
GROUP_ATTN = [64, None, 576]  # None: one GQA group (192 channels on SmolLM2), the default run
SWEEP_S = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7]


# --- plan -----------------------------------------------------------------------------------------
def plan_runs(a) -> list[dict]:
    """The runs of ``--plan`` as dicts ``{method, stage, S, G_attn, G_ffn, mode}``."""
    base = {"G_attn": None, "G_ffn": a.ffn_group_size, "mode": "global"}
    runs = []
    if a.plan == "table":
        for m in a.methods:
            if m == "dense":
                runs += [{**base, "method": "dense", "stage": st, "S": 0.0} for st in a.stages]
                continue
            for s in a.sparsity:
                runs += [{**base, "method": m, "stage": st, "S": s} for st in a.stages]
    elif a.plan == "group":
        runs += [{**base, "method": "dense", "stage": "router", "S": 0.0}]
        for g in GROUP_FFN:
            runs += [{**base, "method": "wide", "stage": st, "S": 0.5, "G_ffn": g} for st in a.stages]
        for g in GROUP_ATTN:
            runs += [{**base, "method": "wide", "stage": st, "S": 0.5, "G_attn": g} for st in a.stages]
    elif a.plan == "sparsity":
        runs += [{**base, "method": "dense", "stage": "router", "S": 0.0}]
        for m in [x for x in a.methods if x != "dense"]:
            for s in SWEEP_S:
                runs += [{**base, "method": m, "stage": st, "S": s} for st in a.stages]
    elif a.plan == "uniform":
        runs += [{**base, "method": "dense", "stage": "router", "S": 0.0}]
        runs += [{**base, "method": "wide", "stage": st, "S": 0.5, "mode": "uniform"} for st in a.stages]
    seen, out = set(), []
    for r in runs:
        k = run_key(r)
        if k not in seen:
            seen.add(k)
            out.append(r)
    return out


def run_key(r: dict) -> str:
    g_attn = "gqa" if r["G_attn"] is None else r["G_attn"]
    return f"{r['method']}-{r['mode']}-s{round(r['S'] * 100)}-ga{g_attn}-gf{r['G_ffn']}-{r['stage']}"


UNIT = ("Eq. 6 group rate: mean over the 2N routed modules of the fraction of groups skipped, over the evaluation "
        "tokens (static: fraction removed); flop_weighted_sparsity = fraction of prunable compute skipped")


# --- model builders ---------------------------------------------------------------------------------
def stage1(a, r, base, src, blocks) -> Path:
    """Calibrate the routers of a WIDE / SkipGPT run (skipped when its checkpoint is complete)."""
    from wide.baselines.skipgpt import skipgpt_config
    from wide.train.loop import CalibrationArgs, calibrate

    out = Path(a.runs) / run_key({**r, "stage": "router"})
    if (out / "routers.safetensors").is_file() and (out / "done.json").is_file():
        return out
    cfg = WideConfig(attn_group_size=r["G_attn"], ffn_group_size=r["G_ffn"], router_rank=a.rank,
                     target_sparsity=r["S"], sparsity_mode=r["mode"])
    if r["method"] == "skipgpt":
        cfg = skipgpt_config(dims_of(base.config), cfg)
    torch.manual_seed(a.seed)
    wm = WideModel(base, cfg)
    targs = CalibrationArgs(steps=a.steps, batch_size=a.batch_size, lr=a.lr, warmup_steps=a.steps // 20,
                            save_every=max(1, a.steps), seed=a.seed)
    t0 = time.time()
    recs = calibrate(wm, blocks, targs, out, src.ref, progress=False,
                     on_step=lambda x: print(json.dumps(x), flush=True) if x["step"] % 50 == 0 else None)
    save_wide(wm, out, src.ref)
    atomic_write_text(out / "done.json", json.dumps({"wall_s": time.time() - t0, "final": recs[-1] if recs else None}))
    _unhook(wm)
    return out


def static_model(a, r, base, tok, src, blocks) -> Path:
    """Static pruning at S, saved as a sliced HF checkpoint (skipped when present)."""
    from wide.baselines.static import param_count, prune, save_pruned, slice_model

    out = Path(a.runs) / run_key({**r, "stage": "router"})
    if (out / "static_pruning.json").is_file() and (out / "config.json").is_file():
        return out
    p = prune(base, blocks[: a.static_blocks], r["S"], attn_group_size=r["G_attn"], ffn_group_size=r["G_ffn"],
              batch_size=a.batch_size)
    p.model, p.fingerprint = src.ref, fingerprint(base)
    small = slice_model(base, p)
    print(f"static S={r['S']}: attn {p.attn_sparsity:.3f} ffn {p.ffn_sparsity:.3f}; params {param_count(base):,} -> "
          f"{param_count(small):,}", flush=True)
    save_pruned(small, tok, p, out)
    del small
    return out


def lora_stage(a, r, stage1_dir: Path | None, model_spec: str | None, blocks) -> Path:
    """Stage-2 LoRA. WIDE / SkipGPT: `wide lora` on the stage-1 checkpoint. Dense / static: the same
    recovery (peft LoRA on the 7 projections, same settings) on a model whose masks are fixed to execute
    everything (routers unused, frozen), i.e. plain LoRA on the (pruned) model."""
    from wide.lora import LoraSettings
    from wide.train.loop import CalibrationArgs, recover

    out = Path(a.runs) / run_key(r)
    if (out / "adapter").is_dir() and (out / "done.json").is_file():
        return out
    targs = CalibrationArgs(steps=a.lora_steps, batch_size=a.batch_size, lr=a.lora_lr, warmup_steps=a.lora_steps // 20,
                            save_every=max(1, a.lora_steps), seed=a.seed)
    t0 = time.time()
    if stage1_dir is not None:
        wm, _ = load(stage1_dir, tokenizer=True)
        ref = json.loads((stage1_dir / "base_model.json").read_text())["model"]
        recover(wm, blocks, targs, out, ref, settings=LoraSettings(), stage1=str(stage1_dir), progress=False)
    else:
        base, _, src = load_base_model(model_spec)
        torch.manual_seed(a.seed)
        wm = WideModel(base, WideConfig(target_sparsity=0.0, alpha=0.0, method="skipgpt"))  # routers unused
        wm.fixed_masks = {"attn": True, "ffn": True}
        recover(wm, blocks, targs, out, src.ref, settings=LoraSettings(), freeze_router=True, progress=False)
    atomic_write_text(out / "done.json", json.dumps({"wall_s": time.time() - t0}))
    _unhook(wm)
    del wm
    return out


def _unhook(wm) -> None:
    for h in getattr(wm, "_handles", []):
        h.remove()
    wm._handles = []


# --- evaluation -----------------------------------------------------------------------------------
def evaluate_model(a, lm, wm, windows) -> dict:
    from wide.eval.lm_eval import evaluate

    t0 = time.time()
    res = evaluate(lm, "all", limit=a.limit, wikitext_path=a.wikitext, bootstrap_iters=a.bootstrap_iters)
    rec = {**res["summary"], "lm_eval_s": time.time() - t0}
    sp = res["sparsity"]
    if sp and sp.get("tokens"):
        rec.update({f"tasks_{k}": sp[k] for k in ("attn_sparsity", "ffn_sparsity", "realized_sparsity",
                                                   "flop_weighted_sparsity", "tokens")})
    model = wm if wm is not None else lm.model
    t0 = time.time()
    ppl = perplexity(model, windows, batch_size=a.ppl_batch_size, progress=False)
    rec.update({"ppl": ppl["ppl"], "ppl_tokens": ppl["tokens"], "ppl_s": time.time() - t0})
    if "realized_sparsity" in ppl:
        rec.update({k: ppl[k] for k in ("attn_sparsity", "ffn_sparsity", "flop_weighted_sparsity", "per_layer")},
                   realized=ppl["realized_sparsity"])
    return rec


SPEED_POINTS = ((1, 2048), (16, 2048))  # (batch, tokens): prefill prompt length = decode context


@torch.no_grad()
def engine_speed(model, vocab: int, wm=None, sample=None, runs: int = 100) -> dict:
    """TTFT and TPOT through the inference engine, CUDA graphs, bf16 (CUDA only; ``{}`` elsewhere).

    ``model`` (a dense or a sliced static HF model) runs as ``Engine(ops="dense")``: cuBLAS projections and the
    same fused norm / RoPE / attention kernels as the WIDE engine.  With ``wm`` (a bf16 :class:`WideModel` on
    CUDA) the WIDE engine with auto dispatch runs instead, its dispatch set from the activity the routers
    show on ``sample`` (int64 ``[1, T]``).  Per point of :data:`SPEED_POINTS`: the prefill of B random prompts
    of T tokens (ms, median of CUDA-graph replays) and one decode step of B rows at T tokens of context
    (ms, median of >= 50 replays)."""
    if not torch.cuda.is_available():
        return {}
    import copy

    from wide.bench.e2e import decode_fn, gpu_ms, prefill_fn
    from wide.inference.engine import Engine

    if wm is None:
        m = copy.deepcopy(model).to(device="cuda", dtype=torch.bfloat16).eval()
        eng = Engine(m, ops="dense", track_sparsity=False)
    else:
        m = None
        eng = Engine(wm, track_sparsity=False, kaxis="auto", naxis="auto", attn="auto")
        act = eng.measure_activity(sample.to("cuda"))
    g = torch.Generator(device="cuda").manual_seed(0)
    out = {}
    if wm is not None and act:  # executed fraction on the sample, per kind (mean over layers)
        for kind in ("attn", "ffn"):
            v = [f for (k, _), f in act.items() if k == kind]
            if v:
                out[f"{kind}_sparsity"] = 1.0 - sum(v) / len(v)
    for B, T in SPEED_POINTS:
        ids = torch.randint(0, vocab, (B, T), device="cuda", generator=g)
        out[f"engine_ttft_ms_b{B}_t{T}"] = gpu_ms(prefill_fn(eng, ids), runs)
        cache = eng.new_cache(B, T + 8)
        cache.k.normal_(0, 1)
        cache.v.normal_(0, 1)
        out[f"engine_tpot_ms_b{B}_ctx{T}"] = gpu_ms(decode_fn(eng, cache, T, ids[:, 0].clone()), runs)
        del cache
    del eng, m
    torch.cuda.empty_cache()
    return out


# --- records --------------------------------------------------------------------------------------
def load_records(path: Path) -> list[dict]:
    return json.loads(path.read_text()) if path.is_file() else []


def speed_key(ckpt) -> str:
    """Record key of a ``--speed-wide`` checkpoint."""
    return f"wide-speed-{Path(ckpt).name}"


def settings_of(a, r) -> dict:
    return {"key": run_key(r), "max_length": a.max_length,
            "steps": a.steps if r["method"] in ("wide", "skipgpt") else 0,
            "lora_steps": a.lora_steps if r["stage"] == "lora" else 0, "limit": a.limit,
            "batch_size": a.batch_size, "seq_len": a.seq_len}


def with_retention(records: list[dict]) -> list[dict]:
    """Fill ``retention`` = avg_acc / dense router-stage avg_acc (same ``limit``) in every record."""
    dense = {r.get("limit"): r["avg_acc"] for r in records
             if r["method"] == "dense" and r["stage"] == "router" and r.get("avg_acc")}
    for r in records:
        d = dense.get(r.get("limit"))
        r["retention"] = (r["avg_acc"] / d) if (d and r.get("avg_acc") is not None) else None
    return records


def write(records: list[dict], out: Path, tag: str) -> None:
    """``<out>/<tag>.json``: the records, with ``retention`` filled in."""
    atomic_write_text(out / f"{tag}.json", json.dumps(with_retention(records), indent=1) + "\n")


# --- main -----------------------------------------------------------------------------------------
def text_paths(a) -> dict[str, str | None]:
    """``{"calib": --calib, "wikitext": --wikitext}``, checked to exist (``--wikitext`` is None with
    ``--speed-only``, which evaluates nothing); called before any model loads.

    Raises:
        WideError: one message naming every missing path.
    """
    from wide.errors import WideError

    wanted = {"calib": a.calib, "wikitext": None if a.speed_only else a.wikitext}
    missing = [f"--{k} {v!r}" for k, v in wanted.items() if v is not None and not Path(v).expanduser().exists()]
    if missing:
        raise WideError(f"{' and '.join(missing)} not found: --calib takes the calibration text (.jsonl with "
                        f"'text', .txt, or a datasets folder), --wikitext WikiText-2's wiki.test.raw")
    return wanted


def main() -> None:
    from wide.cli.common import WideArgumentParser  # usage errors in one line

    p = WideArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--plan", choices=["table", "group", "sparsity", "uniform"], default="table")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--calib", required=True, help="calibration / LoRA text (.jsonl with 'text')")
    p.add_argument("--wikitext", required=True, help="wiki.test.raw")
    p.add_argument("--methods", nargs="+", default=["dense", "wide", "skipgpt", "static"],
                   choices=["dense", "wide", "skipgpt", "static"])
    p.add_argument("--sparsity", type=float, nargs="+", default=[0.5, 0.25])
    p.add_argument("--stages", nargs="+", default=["router"], choices=["router", "lora"])
    p.add_argument("--steps", type=int, default=300, help="stage-1 steps (WIDE / SkipGPT)")
    p.add_argument("--lora-steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--max-blocks", type=int, default=2000, help="calibration sequences packed")
    p.add_argument("--lr", type=float, default=5e-3)
    p.add_argument("--lora-lr", type=float, default=2e-4)
    p.add_argument("--rank", type=int, default=16, help="WIDE router rank (SkipGPT's is matched to it)")
    p.add_argument("--ffn-group-size", type=int, default=128)
    p.add_argument("--static-blocks", type=int, default=32, help="calibration sequences for static importance")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--limit", type=int, default=None, help="documents per task (default: all, as the paper)")
    p.add_argument("--eval-batch-size", type=int, default=64)
    p.add_argument("--max-length", type=int, default=4096, help="lm-eval context limit (the paper: 4096)")
    p.add_argument("--ppl-batch-size", type=int, default=4)
    p.add_argument("--ctx", type=int, default=2048)
    p.add_argument("--bootstrap-iters", type=int, default=1000)
    p.add_argument("--speed", action="store_true",
                   help="also time the dense / static models through the inference engine (CUDA only)")
    p.add_argument("--speed-only", action="store_true",
                   help="with --speed: time the dense / static models and skip their evaluation (no lm-eval, "
                        "no perplexity; the quality numbers are in the plan's own result file)")
    p.add_argument("--speed-wide", nargs="+", default=[], metavar="CKPT",
                   help="with --speed: also time these WIDE router checkpoints of --model through the engine "
                        "(auto dispatch, CUDA graphs), in the same process as the dense and static models")
    p.add_argument("--keep-routers", action="store_true", help="copy router checkpoints into <out>/checkpoints")
    p.add_argument("--max-runs", type=int, default=None, help="stop after this many new runs (budgeting)")
    p.add_argument("--time-budget", type=float, default=None,
                   help="seconds: start no new run after this much wall time (e.g. a machine lent for a fixed time)")
    p.add_argument("--resume-from", default=None,
                   help="record file of earlier calls (default: <out>/<tag>.json); its runs are skipped and kept")
    p.add_argument("--runs", default="runs/quality")
    p.add_argument("--out", default="benchmarks/quality")
    p.add_argument("--tag", default=None, help="result file stem (default: the plan name)")
    p.add_argument("--only-keys", default=None,
                   help="comma-separated run keys: do only these runs of the plan (run_parallel.py's jobs)")
    p.add_argument("--record-command", default=None, help="command line to record instead of this one")
    a = p.parse_args()
    bad = [s for s in a.sparsity if not 0.0 <= s < 1.0]
    if bad:
        p.error(f"--sparsity {' '.join(map(str, bad))}: target sparsity must be in [0, 1)")
    if a.speed_only:
        if not a.speed:
            p.error("--speed-only needs --speed")
        if set(a.methods) - {"dense", "static"}:
            p.error(f"--speed-only times the dense and sliced static models: --methods {' '.join(a.methods)} "
                    "must be among: dense static")
        if a.stages != ["router"]:
            p.error(f"--speed-only times the models before LoRA: --stages {' '.join(a.stages)} must be: router")
    if a.speed_wide:
        if not a.speed:
            p.error("--speed-wide needs --speed")
        missing = [c for c in a.speed_wide if not Path(c, "wide_config.json").is_file()]
        if missing:
            p.error(f"--speed-wide {' '.join(missing)}: not a WIDE checkpoint directory (no wide_config.json)")
    wanted = text_paths(a)  # before any other work: one error naming every missing text file
    tag = a.tag or a.plan
    out = Path(a.out)
    command = a.record_command or "python " + " ".join(shlex.quote(x) for x in sys.argv)
    from wide.bench._args import source_commit

    commit = source_commit()[0]
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    t_start = time.time()
    records = load_records(Path(a.resume_from) if a.resume_from else out / f"{tag}.json")
    done = {(r["key"], r.get("limit")) for r in records}
    runs = [r for r in plan_runs(a) if (run_key(r), a.limit) not in done]
    if a.only_keys is not None:
        wanted = set(a.only_keys.split(","))
        unknown = wanted - {run_key(r) for r in plan_runs(a)}
        if unknown:
            raise SystemExit(f"--only-keys: {sorted(unknown)} not in plan {a.plan!r}")
        runs = [r for r in runs if run_key(r) in wanted]
    wide_timed = [c for c in a.speed_wide if (speed_key(c), a.limit) not in done]
    print(f"{len(runs)} run(s) to do: {[run_key(r) for r in runs]}"
          + (f"; WIDE checkpoints to time: {wide_timed}" if wide_timed else ""), flush=True)
    if a.max_runs is not None:
        runs = runs[: a.max_runs]
    if not runs and not wide_timed:
        write(records, out, tag)
        return

    if not a.speed_only:
        from wide.eval.lm_eval import WideLM

    texts = {k: None if v is None else load_texts(v) for k, v in wanted.items()}  # read before the model loads
    base, tok, src = load_base_model(a.model)
    windows = None if a.speed_only else ppl_windows(texts["wikitext"], tok, a.ctx)
    blocks = pack(texts["calib"], tok, a.seq_len, max_blocks=a.max_blocks)
    print(f"WikiText-2 windows {None if windows is None else tuple(windows.shape)}, calibration blocks "
          f"{tuple(blocks.shape)}", flush=True)
    model_name = "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized)" if src.ref == "smollm2-135m" else src.ref
    for r in runs:
        if a.time_budget is not None and time.time() - t_start > a.time_budget:
            print(f"time budget {a.time_budget:.0f}s spent; stopping before {run_key(r)}", flush=True)
            break
        t_run = time.time()
        key = run_key(r)
        print(f"=== {key}", flush=True)
        rec = {"method": r["method"], "stage": r["stage"], "target": r["S"], "unit": UNIT, "realized": None,
               "ppl": None, "commit": commit, "sparsity_mode": r["mode"], "G_attn": r["G_attn"], "G_ffn": r["G_ffn"],
               "model": model_name, **settings_of(a, r)}
        wm = None
        extra_models = []
        if r["method"] in ("wide", "skipgpt"):
            s1 = stage1(a, r, base, src, blocks)
            ckpt = s1 if r["stage"] == "router" else lora_stage(a, r, s1, None, blocks)
            wm = load(ckpt, model=base if r["stage"] == "router" else None, merge_lora=True)
            rec.update({"G_attn": wm.config.attn_group_size, "G_ffn": wm.config.ffn_group_size,
                        "router_rank": wm.config.router_rank,
                        "router_params": router_param_count(wm.dims, wm.config), "checkpoint": str(ckpt)})
            lm = WideLM(pretrained=wm.base, wide=wm, tokenizer=tok, batch_size=a.eval_batch_size,
                        max_length=a.max_length)
            if r["stage"] == "lora":
                extra_models.append(wm)
            if a.keep_routers and r["stage"] == "router":  # one archive for all runs
                import tarfile

                out.mkdir(parents=True, exist_ok=True)
                with tarfile.open(out / f"{tag}_routers.tar", "a") as tar:
                    for name in ("routers.safetensors", "wide_config.json", "base_model.json", "train_log.jsonl"):
                        if (ckpt / name).is_file():
                            tar.add(ckpt / name, arcname=f"{key}/{name}")
        elif r["method"] == "static":
            from wide.baselines.static import StaticPruning, param_count

            sdir = static_model(a, r, base, tok, src, blocks)
            sp = StaticPruning.load(sdir)
            rec.update({"G_attn": sp.attn_group_size, "G_ffn": sp.ffn_group_size,
                        "realized": sp.sparsity, "attn_sparsity": sp.attn_sparsity,
                        "ffn_sparsity": sp.ffn_sparsity, "pruned_model": str(sdir)})
            if r["stage"] == "router":
                small, _, _ = load_base_model(str(sdir))
            else:
                ck = lora_stage(a, r, None, str(sdir), blocks)
                wm_l = load(ck, merge_lora=True)
                wm_l.fixed_masks = {"attn": True, "ffn": True}
                _unhook(wm_l)
                small = wm_l.base
            rec["params"] = param_count(small)
            lm = None if a.speed_only else WideLM(pretrained=small, tokenizer=tok, batch_size=a.eval_batch_size,
                                                  max_length=a.max_length)
            extra_models.append(small)
            if a.speed:
                rec.update(engine_speed(small, len(tok)))
        else:  # dense
            rec.update({"G_attn": None, "G_ffn": None})
            if a.speed_only:
                from wide.baselines.static import param_count

                lm = None
                rec["params"] = param_count(base)
            elif r["stage"] == "router":
                lm = WideLM(pretrained=base, tokenizer=tok, batch_size=a.eval_batch_size, max_length=a.max_length)
            else:
                ck = lora_stage(a, r, None, a.model, blocks)
                wm_l = load(ck, merge_lora=True)
                _unhook(wm_l)
                lm = WideLM(pretrained=wm_l.base, tokenizer=tok, batch_size=a.eval_batch_size, max_length=a.max_length)
                extra_models.append(wm_l)
            if a.speed and r["stage"] == "router":
                rec.update(engine_speed(base, len(tok)))
        ev = {} if a.speed_only else evaluate_model(a, lm, wm, windows)
        if r["method"] == "static":  # the realized sparsity of a static model is its removed fraction
            ev = {k: v for k, v in ev.items() if k not in ("attn_sparsity", "ffn_sparsity", "realized")}
        rec.update(ev)
        rec.update({"gpu": gpu, "date": dt.date.today().isoformat(), "command": command,
                    "wall_s": time.time() - t_run})
        print(json.dumps({k: v for k, v in rec.items() if k != "per_layer"}), flush=True)
        records.append(rec)
        write(records, out, tag)
        if wm is not None and r["stage"] == "router":
            _unhook(wm)
        del lm, wm, extra_models
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    for ck in wide_timed:  # --speed-wide: the engine's TTFT / TPOT of trained routers, same process
        if a.time_budget is not None and time.time() - t_start > a.time_budget:
            print(f"time budget {a.time_budget:.0f}s spent; stopping before {speed_key(ck)}", flush=True)
            break
        t_run = time.time()
        print(f"=== {speed_key(ck)}", flush=True)
        wm = load(ck, model=a.model, device=device, dtype=torch.bfloat16 if device.type == "cuda" else None)
        _unhook(wm)
        c = wm.config
        rec = {"method": "wide", "stage": "router", "target": c.target_sparsity, "unit": UNIT, "realized": None,
               "ppl": None, "commit": commit,
               "sparsity_mode": c.sparsity_mode, "G_attn": c.attn_group_size, "G_ffn": c.ffn_group_size,
               "model": model_name, "key": speed_key(ck), "limit": a.limit, "checkpoint": str(ck),
               "params": sum(t.numel() for t in wm.base.parameters()),
               **engine_speed(None, len(tok), wm=wm, sample=blocks[:1]),
               "gpu": gpu, "date": dt.date.today().isoformat(), "command": command, "wall_s": time.time() - t_run}
        print(json.dumps(rec), flush=True)
        records.append(rec)
        write(records, out, tag)
        del wm
        gc.collect()


if __name__ == "__main__":
    from wide.errors import WideError

    try:
        main()
    except WideError as e:  # bad input (a missing file, ...): one line, as the wide CLI prints it
        raise SystemExit(f"run_quality.py: error: {e}")
    except ModuleNotFoundError as e:
        if e.name not in ("lm_eval", "peft"):
            raise
        raise SystemExit(f"run_quality.py: error: {e.name} is not installed; zero-shot evaluation and LoRA need the "
                         "quality extra: pip install -e '.[quality]'")
