"""Run several quality plans of ``run_quality.py`` at once, as many small jobs spread over the GPUs.

SmolLM2-135M leaves an H200 mostly idle: one calibration uses about a tenth of it, and an lm-eval pass is
bound by Python on one CPU core. This launcher therefore

1. builds the union of the runs of ``--plans`` (a run shared by two plans, such as dense or WIDE at S = 0.5,
   G = 128, is done once),
2. makes one job per run (one ``run_quality.py --only-keys KEY`` process) and starts up to ``--workers`` of
   them at a time, each on the GPU with the fewest running jobs; a LoRA job starts once its stage-1 job has
   written the stage-1 checkpoint, and evaluation of the stage-1 model runs alongside the LoRA training,
3. starts no job after ``--time-budget`` seconds and kills what still runs at ``--hard-limit``; finished runs
   are kept and a later call skips them (``--resume-dir``),
4. merges the records into ``<plan>.json`` per plan (with the shared runs, and retention against the dense run
   of the same ``--limit``), and packs them with the job logs into ``<out>/quality.tgz`` plus the stage-1 router
   checkpoints of the ``--keep-routers-plans`` into ``<out>/routers.tar``.

GPU example (the task data and WikiText-2 as in the README's evaluation section):

    python benchmarks/quality/run_parallel.py --plans table uniform sparsity group --workers 12 \
        --time-budget 420 --hard-limit 560 --resume-dir benchmarks/quality --out $OUT -- \
        --model SmolLM2-135M-Instruct.Q4_1.gguf --calib data/calibration/wiki_owt.jsonl \
        --wikitext data/wikitext-2-raw/wiki.test.raw --steps 300 --lora-steps 200 --limit 1000 \
        --bootstrap-iters 0 --runs /tmp/runs

CPU check of the launcher itself (tiny steps / limits; not a measurement): ``--workers 2`` and small
``--steps`` / ``--lora-steps`` / ``--limit``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from types import SimpleNamespace

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from run_quality import load_records, plan_runs, run_key, write  # noqa: E402

# per-plan arguments of run_quality.py (the plans' own axes); the common ones come after "--"
PLAN_ARGS = {
    "table": ["--methods", "dense", "wide", "skipgpt", "static", "--sparsity", "0.5", "0.25",
              "--stages", "router", "lora"],
    "uniform": ["--stages", "router", "lora"],
    "sparsity": ["--methods", "wide", "skipgpt", "static", "--stages", "router"],
    "group": ["--stages", "router"],
}


def _common(argv: list[str]) -> SimpleNamespace:
    """The few common run_quality.py arguments this launcher needs to know (plan_runs, settings)."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--ffn-group-size", type=int, default=128)
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--runs", default="runs/quality")
    a, _ = p.parse_known_args(argv)
    return a


def plan_namespace(plan: str, common: SimpleNamespace) -> SimpleNamespace:
    """The argparse namespace ``plan_runs`` expects for ``plan`` with its PLAN_ARGS."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--methods", nargs="+", default=["dense", "wide", "skipgpt", "static"])
    p.add_argument("--sparsity", type=float, nargs="+", default=[0.5, 0.25])
    p.add_argument("--stages", nargs="+", default=["router"])
    a = p.parse_args(PLAN_ARGS[plan])
    return SimpleNamespace(plan=plan, methods=a.methods, sparsity=a.sparsity, stages=a.stages,
                           ffn_group_size=common.ffn_group_size)


def build_jobs(plans: list[str], common: SimpleNamespace, done: set[str]) -> list[dict]:
    """One job per distinct run key over ``plans``, in plan order; ``needs`` is the stage-1 checkpoint a LoRA
    job waits for (a directory under ``--runs``) or None."""
    jobs, seen = [], set()
    for plan in plans:
        for r in plan_runs(plan_namespace(plan, common)):
            key = run_key(r)
            if key in seen or key in done:
                continue
            seen.add(key)
            needs = None
            if r["stage"] == "lora" and r["method"] != "dense":
                needs = run_key({**r, "stage": "router"})
            jobs.append({"key": key, "plan": plan, "needs": needs, "method": r["method"], "stage": r["stage"]})
    # a LoRA job whose stage-1 run is not a job of its own (done in an earlier call) trains stage 1 itself
    keys = {j["key"] for j in jobs}
    for j in jobs:
        if j["needs"] is not None and j["needs"] not in keys:
            j["needs"] = None
    return jobs


# peak GPU memory per job kind on an H200 (GB; SmolLM2-135M, batch 8 x 2048; seen with torch.cuda memory and
# the OOM reports of the first run): stage-1 training 26, LoRA training up to 49, evaluation alone ~12
MEM_GB = {"lora": 50.0, "train": 28.0, "eval": 12.0}


def job_mem_gb(job: dict) -> float:
    if job["stage"] == "lora":
        return MEM_GB["lora"]
    return MEM_GB["train"] if job["method"] in ("wide", "skipgpt") else MEM_GB["eval"]


def stage1_ready(runs: Path, key: str, method: str) -> bool:
    d = runs / key
    if method == "static":
        return (d / "static_pruning.json").is_file() and (d / "config.json").is_file()
    return (d / "routers.safetensors").is_file() and (d / "done.json").is_file()


def gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:  # noqa: BLE001 - no torch / no CUDA: CPU jobs
        return 0


def main() -> None:
    argv = sys.argv[1:]
    common_argv = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    from wide.cli.common import WideArgumentParser  # usage errors in one line

    p = WideArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--plans", nargs="+", choices=list(PLAN_ARGS), default=["table", "uniform", "sparsity", "group"])
    p.add_argument("--workers", type=int, default=8, help="jobs running at once (all GPUs together)")
    p.add_argument("--gpus", type=int, default=None, help="GPUs to use (default: all visible)")
    p.add_argument("--gpu-mem-gb", type=float, default=120,
                   help="per GPU: sum of the running jobs' memory guesses (MEM_GB) allowed at once")
    p.add_argument("--time-budget", type=float, default=420, help="seconds: start no job after this")
    p.add_argument("--hard-limit", type=float, default=560, help="seconds: kill running jobs, then merge")
    p.add_argument("--resume-dir", default=None,
                   help="folder with <plan>.json of earlier calls (their runs are skipped)")
    p.add_argument("--keep-routers-plans", nargs="*", default=["table", "uniform"])
    p.add_argument("--work", default="/tmp/wide-quality", help="job records and logs")
    p.add_argument("--out", required=True)
    a = p.parse_args(own)
    t0 = time.time()
    common = _common(common_argv)
    work, out, runs = Path(a.work), Path(a.out), Path(common.runs)
    (work / "parts").mkdir(parents=True, exist_ok=True)
    (work / "logs").mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    command = "python " + " ".join(shlex.quote(x) for x in [sys.argv[0], *argv])

    earlier: dict[str, list[dict]] = {}
    done: set[str] = set()
    for plan in a.plans:
        f = Path(a.resume_dir) / f"{plan}.json" if a.resume_dir else None
        earlier[plan] = load_records(f) if f else []
        done |= {r["key"] for r in earlier[plan] if r.get("limit") == common.limit}
    jobs = build_jobs(a.plans, common, done)
    n_gpu = a.gpus if a.gpus is not None else gpu_count()
    print(f"{len(jobs)} job(s), {a.workers} at a time on {n_gpu} GPU(s); {len(done)} run(s) already recorded",
          flush=True)

    env0 = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false",
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2"),
            "PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")}
    pending, running, finished = list(jobs), {}, []
    failed_keys: set[str] = set()
    while pending or running:
        now = time.time() - t0
        for key, (proc, job, t_start, gpu, log) in list(running.items()):
            if proc.poll() is not None:
                log.close()
                del running[key]
                ok = proc.returncode == 0
                if not ok:
                    failed_keys.add(key)
                finished.append({**job, "rc": proc.returncode, "wall_s": round(time.time() - t_start, 1), "gpu": gpu})
                print(f"[{now:6.0f}s] done {key} rc={proc.returncode} in {time.time() - t_start:.0f}s", flush=True)
        if now > a.hard_limit:
            for key, (proc, job, t_start, gpu, log) in running.items():
                proc.kill()
                proc.wait()
                log.close()
                finished.append({**job, "rc": "killed", "wall_s": round(time.time() - t_start, 1), "gpu": gpu})
                print(f"[{now:6.0f}s] killed {key} at the hard limit", flush=True)
            running.clear()
            break
        if now > a.time_budget:
            for job in pending:
                finished.append({**job, "rc": "not started"})
            if pending:
                print(f"[{now:6.0f}s] time budget spent: {len(pending)} job(s) not started", flush=True)
            pending = []
        # drop jobs whose stage-1 job failed; start ready jobs in plan order
        for job in list(pending):
            if job["needs"] in failed_keys:
                pending.remove(job)
                failed_keys.add(job["key"])
                finished.append({**job, "rc": "stage 1 failed"})
        for job in list(pending):
            if len(running) >= a.workers:
                break
            if job["needs"] is not None and not stage1_ready(runs, job["needs"], job["method"]):
                continue
            mem = job_mem_gb(job)
            load = [sum(1 for r in running.values() if r[3] == g) for g in range(max(1, n_gpu))]
            used = [sum(job_mem_gb(r[1]) for r in running.values() if r[3] == g) for g in range(max(1, n_gpu))]
            free = [g for g in range(len(load)) if used[g] + mem <= a.gpu_mem_gb]
            if not free:
                continue
            gpu = min(free, key=lambda g: (load[g], used[g]))
            env = dict(env0)
            if n_gpu:
                env["CUDA_VISIBLE_DEVICES"] = str(gpu)
            tag = job["key"]
            cmd = [sys.executable, str(HERE / "run_quality.py"), "--plan", job["plan"], *PLAN_ARGS[job["plan"]],
                   *common_argv, "--only-keys", job["key"], "--tag", tag, "--out", str(work / "parts"),
                   "--resume-from", str(work / "parts" / f"{tag}.json"), "--record-command", command]
            if job["plan"] in a.keep_routers_plans:
                cmd.append("--keep-routers")
            log = open(work / "logs" / f"{tag}.log", "w")
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
            running[job["key"]] = (proc, job, time.time(), gpu, log)
            pending.remove(job)
            print(f"[{now:6.0f}s] start {job['key']} (plan {job['plan']}) on GPU {gpu}", flush=True)
        time.sleep(1.0)

    # merge: every plan gets its own runs from any job (shared runs included) plus its earlier records
    new = [r for f in sorted((work / "parts").glob("*.json")) for r in load_records(f)]
    new += [r for plan in a.plans for r in earlier[plan]]  # a run shared by two plans may sit in either file
    summary = {"command": command, "wall_s": round(time.time() - t0, 1), "jobs": finished}
    for plan in a.plans:
        keys = {run_key(r) for r in plan_runs(plan_namespace(plan, common))}
        recs = list(earlier[plan])
        have = {(r["key"], r.get("limit")) for r in recs}
        for r in new:
            if r["key"] in keys and (r["key"], r.get("limit")) not in have:
                recs.append(r)
                have.add((r["key"], r.get("limit")))
        if recs:
            write(recs, work, plan)
            summary[plan] = f"{len(recs)} of {len(keys)} runs"
    (work / "jobs.json").write_text(json.dumps(summary, indent=1) + "\n")
    with tarfile.open(out / "quality.tgz", "w:gz") as tar:
        for plan in a.plans:
            if (work / f"{plan}.json").is_file():
                tar.add(work / f"{plan}.json", arcname=f"{plan}.json")
        tar.add(work / "jobs.json", arcname="jobs.json")
        tar.add(work / "logs", arcname="logs")
    routers = sorted((work / "parts").glob("*_routers.tar"))
    if routers:
        with tarfile.open(out / "routers.tar", "w") as dst:
            for f in routers:
                with tarfile.open(f) as src:
                    for m in src.getmembers():
                        dst.addfile(m, src.extractfile(m) if m.isfile() else None)
    print(json.dumps({k: v for k, v in summary.items() if k != "jobs"}), flush=True)


if __name__ == "__main__":
    main()
