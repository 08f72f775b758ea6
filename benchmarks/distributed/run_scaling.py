"""Calibration throughput on 1 vs N GPUs: SmolLM2-135M and a Llama-3.1-8B-shaped model.

Runs `wide`'s own stage-1 training loop (:func:`wide.train.loop.calibrate`) — one process on one GPU, and
FSDP2 under ``torch.distributed.run`` on N GPUs — on random-weight models of the exact shapes (throughput
and memory do not depend on the weight values) with random token blocks, and records global tokens/s
(median over the measured steps, after warm-up) and the peak GPU memory of the busiest rank.

Writes ``<tag>.json`` into ``--out``: one record per run (``op`` calibrate / lora, ``model``, ``gpus``,
``seq_len``, ``micro_batch_per_gpu``, ``tokens_per_s``, ``speedup`` over the 1-GPU run, ``peak_mem_gb``,
``baseline``, ``gpu``, ``commit``, ``date``, ``command`` and more).

On a 2-GPU machine, from the repository root (plain python3 holding a CUDA PyTorch, transformers, peft,
safetensors; nothing to install):

    PYTHONUNBUFFERED=1 PYTHONPATH=src python3 benchmarks/distributed/run_scaling.py --gpus 1 2 --out $OUT
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SHAPES = {
    # HuggingFaceTB/SmolLM2-135M: 30 layers, d=576, 9 heads / 3 KV heads, FFN 1536, vocab 49152, tied embeddings.
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, head_dim=64, vocab_size=49152, tie_word_embeddings=True,
                         rope_theta=100000.0, max_position_embeddings=8192, rms_norm_eps=1e-5),
    # meta-llama/Llama-3.1-8B: 32 layers, d=4096, 32 heads / 8 KV heads, FFN 14336, vocab 128256.
    "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=128, vocab_size=128256, tie_word_embeddings=False,
                         rope_theta=500000.0, max_position_embeddings=131072, rms_norm_eps=1e-5),
    # a tiny shape to check this script on the CPU (--device cpu): not a measurement
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=128, tie_word_embeddings=False,
                 max_position_embeddings=256),
}
UNIT = "target Eq. 6 group rate of the routers (random weights and tokens: throughput does not depend on it)"
BASELINE = ("the record with gpus = 1 of the same command (one process, same micro-batch per GPU); "
            "speedup = global tokens/s over its tokens/s")
DEFAULT_RUNS = {  # model -> (seq_len, micro-batch per GPU)
    "smollm2-135m": (2048, 8),
    "llama-3.1-8b": (4096, 1),
    "tiny": (32, 2),
}


def build_model(name: str, device):
    """A random-weight bf16 ``LlamaForCausalLM`` of the named shape, created directly on ``device``."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(**SHAPES[name], attn_implementation="sdpa")
    cfg.architectures = ["LlamaForCausalLM"]
    with torch.device(device):
        m = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    m.eval().requires_grad_(False)
    return m


def worker(a) -> int:
    """One process (or one torchrun rank): build, calibrate ``warmup + steps`` steps, report (rank 0)."""
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))
    from wide.config import WideConfig
    from wide.model import WideModel
    from wide.train import fsdp as D
    from wide.train.loop import CalibrationArgs, calibrate, recover

    cuda = a.device == "cuda"
    t_start = time.time()
    env = D.init(a.device)
    device = env.device if env.active else torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    # like the CLI under torchrun: rank 0 holds the weights (here created on its GPU: random init on the CPU is
    # slow for 8B), the other ranks only the structure on the meta device; sharding hands out rank 0's weights
    base = build_model(a.model, device if env.is_main else torch.device("meta"))
    torch.manual_seed(0)
    wm = WideModel(base, WideConfig(target_sparsity=0.5, ffn_group_size=128))
    n_params = sum(p.numel() for p in base.parameters())
    if cuda:
        torch.cuda.synchronize()
    t_build = time.time() - t_start
    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, base.config.vocab_size, (64, a.seq_len), generator=g)
    args = CalibrationArgs(steps=a.warmup + a.steps, batch_size=a.micro_batch, grad_accum=1, lr=1e-3,
                           warmup_steps=0, save_every=10**9, grad_checkpoint=a.grad_checkpoint,
                           reshard_after_forward=not a.keep_gathered)
    recs = []

    def on_step(r):
        recs.append(r)
        if cuda and r["step"] == 1:  # peak of steady-state training (weights shards, activations, optimizer)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()

    out = Path(a.run_dir) / "run"  # the same folder for every rank (made by the launching process)
    if a.stage == "router":
        calibrate(wm, blocks, args, out, a.model, progress=False, on_step=on_step)
    else:  # stage 2: peft LoRA (r=16, alpha=32, dropout 0.1) on all 7 projections, routers trained
        recover(wm, blocks, args, out, a.model, progress=False, on_step=on_step)
    D.barrier(env)
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0
    reserved = torch.cuda.max_memory_reserved() / 2**30 if cuda else 0.0
    peaks = _all_max([peak, reserved], env) if env.active else [peak, reserved]
    if env.is_main:
        tps = [r["tokens_per_s"] for r in recs[a.warmup:]]
        res = {
            "op": "calibrate" if a.stage == "router" else "lora",
            "model": f"{a.model} shape, random bf16 weights ({n_params / 1e9:.2f}B params)",
            "gpus": env.world_size,
            "stage": a.stage,
            "mode": "fsdp2" if env.active else "single-process",
            "tokens_per_s": statistics.median(tps),
            "tokens_per_s_steps": tps,
            "peak_mem_gb": peaks[0],
            "peak_reserved_gb": peaks[1],
            "seq_len": a.seq_len,
            "micro_batch_per_gpu": a.micro_batch,
            "global_batch": a.micro_batch * env.world_size,
            "sparsity": 0.5,
            "unit": UNIT,
            "grad_checkpoint": a.grad_checkpoint,
            "reshard_after_forward": (not a.keep_gathered) if env.active else None,
            "warmup_steps": a.warmup,
            "measured_steps": a.steps,
            "lm_loss_last": recs[-1]["lm_loss"],
            "build_s": t_build,
            "gpu": torch.cuda.get_device_name(device) if cuda else "cpu (script check, not a measurement)",
            "torch": torch.__version__,
        }
        Path(a.result).write_text(json.dumps(res))
    return 0


def _all_max(values, env):
    import torch
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64, device=env.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def main() -> int:
    from wide.bench._args import doc_summary, int_at_least
    from wide.cli.common import WideArgumentParser

    p = WideArgumentParser(description=doc_summary(__doc__))
    p.add_argument("--models", nargs="+", default=["smollm2-135m", "llama-3.1-8b"], choices=list(SHAPES))
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu only checks this script")
    p.add_argument("--gpus", type=int_at_least(1), nargs="+", default=[1, 2])
    p.add_argument("--steps", type=int_at_least(1), default=8, help="measured steps")
    p.add_argument("--warmup", type=int_at_least(0), default=3)
    p.add_argument("--grad-checkpoint", choices=["off", "on", "both"], default="off",
                   help="activation checkpointing for the Llama-3.1-8B shape (SmolLM2 always off)")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent))
    p.add_argument("--tag", default="scaling")
    p.add_argument("--reshard-after-forward", choices=["on", "off", "both"], default="on",
                   help="FSDP2 runs (N > 1): free each layer's gathered weights after forward (on, default) or "
                        "keep them for backward (off: one all-gather a step; wide calibrate "
                        "--no-reshard-after-forward)")
    p.add_argument("--micro-batch-8b", type=int_at_least(1), nargs="+", default=None,
                   help="micro-batches per GPU for the Llama-3.1-8B shape (default 1; the paper trains "
                        "16 x 4096 on 4 GPUs = 4 per GPU)")
    p.add_argument("--stages", nargs="+", choices=["router", "lora"], default=["router"],
                   help="router = stage-1 calibration (the scaling measurement); lora = stage-2 LoRA recovery")
    # worker mode (internal)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--seq-len", type=int, help=argparse.SUPPRESS)
    p.add_argument("--micro-batch", type=int, help=argparse.SUPPRESS)
    p.add_argument("--worker-grad-checkpoint", dest="grad_checkpoint_w", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--worker-keep-gathered", dest="keep_gathered", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--run-dir", help=argparse.SUPPRESS)
    p.add_argument("--stage", default="router", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        a.grad_checkpoint = a.grad_checkpoint_w
        return worker(a)

    command = "PYTHONPATH=src python3 " + " ".join(shlex.quote(x) for x in sys.argv)
    date = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    from wide.bench._args import source_commit

    commit = source_commit()[0]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    records = []
    me = str(Path(__file__).resolve())
    runs = []
    for stage in a.stages:
        for model in a.models:
            ckpts = {"off": [False], "on": [True], "both": [False, True]}[a.grad_checkpoint]
            ckpts = [False] if model == "smollm2-135m" else ckpts
            mbs = [DEFAULT_RUNS[model][1]]
            if model == "llama-3.1-8b" and a.micro_batch_8b:
                mbs = a.micro_batch_8b
            rafs = {"on": [True], "off": [False], "both": [True, False]}[a.reshard_after_forward]
            runs += [(stage, model, ck, mb, n, raf) for ck in ckpts for mb in mbs for n in a.gpus
                     for raf in (rafs if n > 1 else [True])]
    for stage, model, ck, mb, n, raf in runs:
        seq_len = DEFAULT_RUNS[model][0]
        run_dir = tempfile.mkdtemp(prefix="run_scaling_")
        result = os.path.join(run_dir, "result.json")
        wargs = [me, "--worker", "--device", a.device, "--model", model, "--seq-len", str(seq_len),
                 "--micro-batch", str(mb), "--steps", str(a.steps), "--warmup", str(a.warmup), "--result", result,
                 "--run-dir", run_dir, "--stage", stage]
        if ck:
            wargs.append("--worker-grad-checkpoint")
        if not raf:
            wargs.append("--worker-keep-gathered")
        if n == 1:
            cmd = [sys.executable, *wargs]
        else:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}", *wargs]
        print(f"== {stage}: {model} seq {seq_len} micro-batch {mb}/GPU, {n} GPU(s), grad checkpoint {ck}"
              + ("" if n == 1 else f", reshard after forward {raf}"), flush=True)
        t0 = time.time()
        proc = subprocess.run(cmd)
        ok = proc.returncode == 0 and os.path.isfile(result)
        rec = json.loads(Path(result).read_text()) if ok else None
        shutil.rmtree(run_dir, ignore_errors=True)
        if not ok:
            print(f"   FAILED (exit {proc.returncode})", flush=True)
            records.append({"op": "calibrate" if stage == "router" else "lora", "model": model, "gpus": n,
                            "stage": stage, "grad_checkpoint": ck,
                            "error": f"exit {proc.returncode}", "date": date, "command": command,
                            "seq_len": seq_len, "micro_batch_per_gpu": mb,
                            "reshard_after_forward": raf if n > 1 else None})
            continue
        rec.update(baseline=BASELINE, commit=commit, date=date, command=command, wall_s=time.time() - t0)
        one = [r for r in records if r.get("gpus") == 1 and r.get("seq_len") == seq_len and r.get("stage") == stage
               and r.get("grad_checkpoint") == ck and r.get("micro_batch_per_gpu") == mb
               and r["model"] == rec["model"] and "tokens_per_s" in r]
        if one and n > 1:
            rec["speedup"] = rec["tokens_per_s"] / one[0]["tokens_per_s"]
        print(f"   {rec['tokens_per_s']:.0f} tokens/s, peak {rec['peak_mem_gb']:.1f} GB/GPU"
              + (f", x{rec['speedup']:.2f} vs 1 GPU" if "speedup" in rec else ""), flush=True)
        records.append(rec)
        (out / f"{a.tag}.json").write_text(json.dumps(records, indent=2) + "\n")
    return 0 if all("error" not in r for r in records) else 1


if __name__ == "__main__":
    raise SystemExit(main())
