"""Stage-1 calibration (paper §3.2): only the routers train, the base model stays frozen.

Loss = LM loss + sparsity loss (Eq. 6, or Eq. 22 in uniform mode); hard Gumbel-softmax masks with a
straight-through gradient and a temperature annealed linearly from ``tau_start`` to ``tau_end``.
AdamW with linear warm-up then cosine decay, gradient clipping and accumulation, bf16 autocast on GPU.

Training state (routers, optimizer, scheduler, RNG states, step) is written atomically every
``save_every`` steps to ``<output>/train_state.pt`` and read back with ``torch.load(weights_only=True)``;
``resume=True`` continues with exactly the losses an uninterrupted run would have had.
"""

from __future__ import annotations

import json
import math
import os
import random
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .checkpoint import save_wide
from .errors import WideError
from .modeling import WideModel
from .routing import sparsity_loss

STATE_NAME = "train_state.pt"
LOG_NAME = "train_log.jsonl"


@dataclass
class CalibrationArgs:
    """One calibration run's settings (the method's own hyper-parameters live in WideConfig)."""

    steps: int = 500
    batch_size: int = 8
    grad_accum: int = 1
    lr: float = 5e-3
    warmup_steps: int = 0
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    seed: int = 0
    save_every: int = 100
    log_every: int = 1

    def validate(self) -> None:
        for name in ("steps", "batch_size", "grad_accum", "save_every", "log_every"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise WideError(f"--{name.replace('_', '-')} {v!r} must be a positive integer")
        if not self.lr > 0:
            raise WideError(f"--lr {self.lr!r} must be > 0")
        if self.warmup_steps < 0:
            raise WideError(f"--warmup-steps {self.warmup_steps!r} must be >= 0")


def lr_lambda(step: int, warmup: int, total: int) -> float:
    """Linear warm-up over ``warmup`` steps, then cosine decay to 0 at ``total``."""
    if step < warmup:
        return (step + 1) / warmup
    prog = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * min(prog, 1.0)))


def micro_batch(blocks: torch.Tensor, k: int, batch_size: int, seed: int) -> torch.Tensor:
    """The ``k``-th micro-batch of an endless stream of per-epoch seeded permutations of ``blocks``.

    A pure function of ``k``: that is what makes resume exact.
    """
    n = blocks.shape[0]
    idx = []
    start = k * batch_size
    for pos in range(start, start + batch_size):
        epoch, j = divmod(pos, n)
        g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        idx.append(int(torch.randperm(n, generator=g)[j]))
    return blocks[idx]


def _rng_state() -> dict:
    st = {"torch": torch.get_rng_state(), "python": list(random.getstate()[1]), "python_pos": random.getstate()[2]}
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def _set_rng_state(st: dict) -> None:
    torch.set_rng_state(st["torch"])
    random.setstate((3, tuple(st["python"]), st["python_pos"]))
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["cuda"])


def atomic_torch_save(obj, path: Path) -> None:
    """``torch.save`` to a temporary file, then rename (tensors, dicts, lists and numbers only)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    try:
        torch.save(obj, tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def load_train_state(path: Path) -> dict:
    """Read a training state safely (``weights_only=True``). Raises WideError if corrupt."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any failure to parse is a corrupt file to the user
        raise WideError(f"corrupt training state {path}: {str(e).splitlines()[0]}") from None


def _truncate_log(path: Path, step: int) -> None:
    """Drop log records written after the checkpoint we resume from (an interrupted run's tail)."""
    if path.is_file():
        keep = [ln for ln in path.read_text().splitlines() if ln.strip() and json.loads(ln)["step"] <= step]
        path.write_text("".join(ln + "\n" for ln in keep))


def calibrate(wm: WideModel, blocks: torch.Tensor, args: CalibrationArgs, output: str | os.PathLike,
              model_ref: str, resume: bool = False, progress: bool = True, on_step=None) -> list[dict]:
    """Run stage-1 router calibration.

    Args:
        wm: routed model (base frozen); its routers are trained in place.
        blocks: int64 ``[N, seq_len]`` packed token blocks.
        args: run settings.
        output: folder for the WIDE checkpoint, ``train_state.pt`` and ``train_log.jsonl``.
        model_ref: the base model's ``--model`` value, stored in the checkpoint.
        resume: continue from ``<output>/train_state.pt``.
        progress: show a tqdm bar.
        on_step: optional callback ``f(record)`` after every step.

    Returns:
        the per-step log records of this call (step, lm_loss, sparsity_loss, attn/ffn sparsity, tau,
        lr, tokens_per_s).

    Raises:
        WideError: bad settings, or ``resume`` with a missing, corrupt or mismatched state.
    """
    from tqdm.auto import tqdm

    args.validate()
    output = Path(output)
    device = next(wm.base.parameters()).device
    cfg = wm.config
    params = wm.router_parameters()
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay, betas=(0.9, 0.999))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_lambda(s, args.warmup_steps, args.steps))
    start = 0
    state_path = output / STATE_NAME
    if resume:
        if not state_path.is_file():
            raise WideError(f"--resume: no {STATE_NAME} in {str(output)!r}")
        st = load_train_state(state_path)
        if st.get("config") != cfg.to_dict() or st.get("args") != asdict(args):
            raise WideError(f"--resume: {state_path} was written with other settings "
                            f"(config {st.get('config')}, args {st.get('args')})")
        wm.load_router_state_dict(st["routers"])
        opt.load_state_dict(st["optimizer"])
        sched.load_state_dict(st["scheduler"])
        _set_rng_state(st["rng"])
        start = int(st["step"])
        _truncate_log(output / LOG_NAME, start)
    else:
        torch.manual_seed(args.seed)
        random.seed(args.seed)

    use_amp = device.type == "cuda"
    wm.stochastic = True
    wm.train()
    wm.base.eval()  # frozen; no dropout
    log_path = output / LOG_NAME
    records: list[dict] = []
    seq_len = blocks.shape[1]
    bar = tqdm(total=args.steps, initial=start, disable=not progress, desc="calibrate", dynamic_ncols=True)
    try:
        for step in range(start, args.steps):
            t0 = time.perf_counter()
            wm.tau = cfg.tau_at(step, args.steps)
            opt.zero_grad(set_to_none=True)
            lm_tot = sp_tot = 0.0
            attn_sp, ffn_sp = [], []
            for a in range(args.grad_accum):
                ids = micro_batch(blocks, step * args.grad_accum + a, args.batch_size, args.seed).to(device)
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_amp):
                    out = wm(ids, labels=ids)
                rec = wm.record
                sp = sparsity_loss(rec.attn_keep, rec.ffn_keep, cfg.target_sparsity, cfg.alpha, cfg.sparsity_mode)
                loss = (out.loss.float() + sp) / args.grad_accum
                loss.backward()
                lm_tot += out.loss.item() / args.grad_accum
                sp_tot += sp.item() / args.grad_accum
                if rec.attn_keep:
                    attn_sp.append(1.0 - torch.stack(rec.attn_keep).mean().item())
                if rec.ffn_keep:
                    ffn_sp.append(1.0 - torch.stack(rec.ffn_keep).mean().item())
            gnorm = torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm)
            opt.step()
            sched.step()
            dt = time.perf_counter() - t0
            r = {
                "step": step + 1,
                "lm_loss": lm_tot,
                "sparsity_loss": sp_tot,
                "attn_sparsity": sum(attn_sp) / len(attn_sp) if attn_sp else 0.0,
                "ffn_sparsity": sum(ffn_sp) / len(ffn_sp) if ffn_sp else 0.0,
                "tau": wm.tau,
                "lr": sched.get_last_lr()[0],
                "grad_norm": float(gnorm),
                "tokens_per_s": args.batch_size * args.grad_accum * seq_len / dt,
            }
            records.append(r)
            output.mkdir(parents=True, exist_ok=True)
            with log_path.open("a") as f:
                f.write(json.dumps(r) + "\n")
            bar.update(1)
            bar.set_postfix(lm=f"{r['lm_loss']:.3f}", attn=f"{r['attn_sparsity']:.2f}", ffn=f"{r['ffn_sparsity']:.2f}",
                            tau=f"{r['tau']:.2f}", tok_s=f"{r['tokens_per_s']:.0f}")
            if on_step is not None:
                on_step(r)
            if (step + 1) % args.save_every == 0 or step + 1 == args.steps:
                save_wide(wm, output, model_ref)
                atomic_torch_save({
                    "step": step + 1,
                    "routers": wm.router_state_dict(),
                    "optimizer": opt.state_dict(),
                    "scheduler": sched.state_dict(),
                    "rng": _rng_state(),
                    "config": cfg.to_dict(),
                    "args": asdict(args),
                }, state_path)
    finally:
        bar.close()
        wm.stochastic = False
        wm.eval()
    return records
