"""The training loop of paper §3.2: router calibration (stage 1) and LoRA recovery (stage 2).

Loss = LM loss + sparsity loss (Eq. 6 / Eq. 22) over hard Gumbel-softmax masks (Eq. 5) whose temperature anneals
linearly; AdamW, warm-up then cosine decay, clipping, accumulation, bf16 autocast on a GPU, FSDP2 under torchrun.
Data order and noise are functions of (seed, sample, module), so a resumed run, at any world size with the same
global batch, has the losses of an uninterrupted one. The state is a ``torch.distributed.checkpoint`` folder.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import shutil
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

import wide.lora as L
import wide.train.fsdp as D
from wide.calibrate import check_reachable
from wide.checkpoint import BASE_NAME, CALIBRATION_NAME, ROUTERS_NAME, read_base_info, save_wide
from wide.config import CONFIG_NAME, SEED_MAX, replace_dir
from wide.errors import WideError, WideWarning, first_line
from wide.memory import check_train_memory
from wide.model import WideModel, fingerprint
from wide.routing import mix, module_weights, sample_keyed, sparsity_loss

STATE_NAME = "train_state.dcp"
META_NAME = "train_state.json"
LOG_NAME = "train_log.jsonl"
DEMO_RESULT_NAME = "demo_result.json"  #: ``wide demo``'s results, beside its checkpoint
#: every file and folder a run writes into its output folder; a new run there removes an earlier run's
#: (:func:`clear_run`), with the temporary ``.<name>.*`` copies of an interrupted write
RUN_FILES = (ROUTERS_NAME, CONFIG_NAME, BASE_NAME, CALIBRATION_NAME, LOG_NAME, DEMO_RESULT_NAME, L.ADAPTER_DIR,
             STATE_NAME)
LR_MAX = 1.0  #: above it one AdamW step moves the routers (initialized near 0.02) far beyond their scale


@dataclass
class CalibrationArgs:
    """A run's settings: ``batch_size`` sequences per micro-batch and process (global batch ``batch_size * grad_accum
    * world_size``), ``lr`` in ``(0, LR_MAX]``, ``seed`` in ``[0, SEED_MAX]``, a save every ``save_every`` steps;
    ``reshard_after_forward``: FSDP2 frees a layer's weights after its forward; ``memory_check``: see wide.memory."""

    steps: int = 500
    batch_size: int = 8
    grad_accum: int = 1
    lr: float = 1e-3
    warmup_steps: int = 0
    seed: int = 0
    save_every: int = 100
    grad_checkpoint: bool = False
    reshard_after_forward: bool = True
    memory_check: bool = True

    def validate(self) -> None:
        """Raises WideError naming the first value outside its range."""
        for name in ("steps", "batch_size", "grad_accum", "save_every"):  # worded as the CLI's at_least
            v = getattr(self, name)
            if type(v) is not int or v < 1:
                raise WideError(f"--{name.replace('_', '-')} {v!r} must be "
                                f"{'' if type(v) is int else 'an integer '}>= 1")
        if not 0 < self.lr <= LR_MAX:
            raise WideError(f"--lr {self.lr!r} must be > 0 and at most {LR_MAX:g} (stage 1 uses about 5e-3, "
                            f"stage 2 2e-4)")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or not 0 <= self.seed <= SEED_MAX:
            raise WideError(f"--seed {self.seed!r} must be an integer from 0 to {SEED_MAX} (2**32 - 1)")
        if self.warmup_steps < 0:
            raise WideError(f"--warmup-steps {self.warmup_steps!r} must be >= 0 (0 to --steps {self.steps!r})")
        if self.warmup_steps > self.steps:
            raise WideError(f"--warmup-steps {self.warmup_steps!r} must be <= --steps {self.steps!r} "
                            f"(0 to {self.steps})")


def lr_lambda(step: int, warmup: int, total: int) -> float:
    """Learning-rate factor: linear warm-up over ``warmup`` steps, then cosine decay to 0 at ``total``."""
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1.0 + math.cos(math.pi * min((step - warmup) / max(1, total - warmup), 1.0)))


def stream_rows(blocks: torch.Tensor, positions, seed: int) -> torch.Tensor:
    """Rows of ``blocks`` (int64 ``[N, T]``) at ``positions`` of the endless stream of seeded per-epoch permutations:
    position ``p`` is block ``randperm(N, seed * 1_000_003 + p // N)[p % N]``."""
    n, perms = blocks.shape[0], {}
    for epoch in {p // n for p in positions}:
        perms[epoch] = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
    return blocks[[int(perms[p // n][p % n]) for p in positions]]


def read_meta(output: str | os.PathLike) -> dict | None:
    """The ``train_state.json`` of the state in ``output`` (or of the copy a crash left aside), or None."""
    output = Path(output)
    for d in (output / STATE_NAME, output / f".{STATE_NAME}.old"):
        if (d / META_NAME).is_file() and (d / ".metadata").is_file():
            try:
                return {**json.loads((d / META_NAME).read_text()), "_path": str(d)}
            except (ValueError, UnicodeDecodeError) as e:
                raise WideError(f"corrupt training state {d / META_NAME}: {e}") from None
    return None


def has_train_state(output: str | os.PathLike) -> bool:
    return read_meta(output) is not None


def clear_run(output: str | os.PathLike) -> list[str]:
    """Remove the files of an earlier run (:data:`RUN_FILES` and their ``.<name>.*`` temporaries) from ``output``,
    leaving any other file; returns the names removed, sorted."""
    output, removed = Path(output), []
    if not output.is_dir():
        return removed
    for p in sorted(output.iterdir()):
        if p.name in RUN_FILES or any(p.name.startswith(f".{n}.") for n in RUN_FILES):
            try:
                if p.is_dir() and not p.is_symlink():
                    shutil.rmtree(p)
                else:
                    p.unlink()
            except OSError as e:
                raise WideError(f"could not remove {p}, a file of the earlier run in {str(output)!r} "
                                f"({e.strerror or e})") from None
            removed.append(p.name)
    return removed


def saved_options(output: str | os.PathLike) -> dict | None:
    """The command-line options stored with the training state in ``output``, or None."""
    options = (read_meta(output) or {}).get("options")
    return options if isinstance(options, dict) else None


_OPTIONS = StateDictOptions(ignore_frozen_params=True, strict=False)


def _trained_state(wm: WideModel, opt) -> dict:
    """The trained parameters' and the optimizer's state (a frozen tied embedding is listed under its second name)."""
    names = {n for n, p in wm.named_parameters() if p.requires_grad}
    msd, osd = get_state_dict(wm, opt, options=_OPTIONS)
    return {"model": {k: v for k, v in msd.items() if k in names}, "optim": osd}


def _dcp(op: str, state: dict, path, env: D.DistEnv) -> None:
    with warnings.catch_warnings():  # one process has no process group, on purpose
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        getattr(dcp, op)(state, checkpoint_id=str(path), no_dist=not (env.active and env.world_size > 1))


def _cause(e: CheckpointException) -> BaseException:
    """The exception behind DCP's CheckpointException (``failures``: rank -> ``(exception, traceback)``): a
    KeyboardInterrupt or SystemExit of any rank (Ctrl-C; SIGTERM, which the CLI turns into KeyboardInterrupt),
    else the lowest rank's."""
    causes = [f[0] if isinstance(f, tuple) else f for _, f in sorted(e.failures.items())]
    causes = [c for c in causes if isinstance(c, BaseException)] or [e]
    return next((c for c in causes if isinstance(c, (KeyboardInterrupt, SystemExit))), causes[0])


def _save_state(wm: WideModel, opt, output: Path, meta: dict, env: D.DistEnv) -> None:
    """Write the state with DCP into ``.train_state.dcp.tmp``, then swap it into place (every rank)."""
    tmp = output / f".{STATE_NAME}.tmp"
    if env.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
    D.barrier(env)
    try:
        _dcp("save", _trained_state(wm, opt), tmp, env)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, CheckpointException):
            cause = _cause(e)  # an interrupt stays one (the CLI's "interrupted" and --resume hint)
            raise (cause if isinstance(cause, (KeyboardInterrupt, SystemExit, OSError))
                   else RuntimeError(first_line(cause))) from None
        raise
    if env.is_main:
        (tmp / META_NAME).write_text(json.dumps(meta, indent=2) + "\n")
        replace_dir(tmp, output / STATE_NAME)
    D.barrier(env)


def _load_state(wm: WideModel, opt, meta: dict, env: D.DistEnv) -> None:
    state = _trained_state(wm, opt)
    try:
        _dcp("load", state, meta["_path"], env)
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - any failure to read is a corrupt state
        cause = _cause(e) if isinstance(e, CheckpointException) else e
        if isinstance(cause, (KeyboardInterrupt, SystemExit)):
            raise cause from None
        raise WideError(f"corrupt training state {meta['_path']}: {first_line(cause)}") from None
    set_state_dict(wm, opt, model_state_dict=state["model"], optim_state_dict=state["optim"], options=_OPTIONS)


def _truncate_log(path: Path, step: int) -> None:
    """Drop the log records after ``step`` (an interrupted run's tail); an unreadable line (a killed run's last) is
    dropped with a one-line :class:`WideWarning`."""
    if not path.is_file():
        return
    keep, bad = [], []
    for i, ln in enumerate(path.read_text(errors="replace").splitlines(), 1):
        try:
            if json.loads(ln)["step"] + 0 <= step:  # + 0: a step that is not a number is a bad line
                keep.append(ln)
        except (ValueError, KeyError, TypeError):
            bad += [i] if ln.strip() else []
    if bad:
        warnings.warn(f"{path}: skipped {len(bad)} unreadable line(s) (line {', '.join(map(str, bad[:3]))}"
                      f"{', ...' if len(bad) > 3 else ''}; a killed run leaves a truncated last line)",
                      WideWarning, stacklevel=2)
    path.write_text("".join(ln + "\n" for ln in keep))


@contextlib.contextmanager
def _writing(path: Path, saved_step: int):
    """A failed write (a full disk: ``OSError``, DCP's or safetensors' error) as one WideError naming ``path``."""
    from safetensors import SafetensorError

    try:
        yield
    except (OSError, RuntimeError, SafetensorError) as e:
        reason = (e.strerror if isinstance(e, OSError) and e.strerror else first_line(e))[:200]
        kept = f"the training state of step {saved_step} is kept" if saved_step else "nothing was saved yet"
        raise WideError(f"could not write the checkpoint to {path} ({reason}; is the disk full?); {kept}") from None


def _key_diff(saved, now, prefix: str = "") -> str:
    """The settings that differ between two resume keys, e.g. ``train.steps: saved 2, now 4``."""
    if not (isinstance(saved, dict) and isinstance(now, dict)):
        return f"{prefix or 'settings'}: saved {saved!r}, now {now!r}"
    a, b = ({k: d.get(k, "(absent)") for k in sorted(set(saved) | set(now), key=str)} for d in (saved, now))
    return "; ".join(_key_diff(a[k], b[k], f"{prefix}{k}.") if isinstance(a[k], dict) and isinstance(b[k], dict)
                     else f"{prefix}{k}: saved {a[k]!r}, now {b[k]!r}" for k in a if a[k] != b[k])


def _resume_key(wm: WideModel, args: CalibrationArgs, stage: str, extra_key: dict | None, world: int,
                blocks: torch.Tensor) -> dict:
    """What a resumed run must share with the saved one: the settings, the global batch (not its split), the data."""
    skip = ("batch_size", "grad_accum", "save_every", "grad_checkpoint", "reshard_after_forward", "memory_check")
    train = {k: v for k, v in asdict(args).items() if k not in skip}
    train["global_batch"] = args.batch_size * args.grad_accum * world
    t = blocks.detach().to("cpu").contiguous()
    digest = hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode() + t.view(-1).view(torch.uint8).numpy().tobytes())
    config = {k: v for k, v in wm.config.to_dict().items()  # the fields a run of an earlier version had not
              if (k, v) not in (("sparsity_unit", "groups"), ("max_module_sparsity", 1.0), ("seq_len", t.shape[1]))}
    return {"stage": stage, "config": config, "train": train, **(extra_key or {}),
            "data": {"seq_len": int(t.shape[1]), "tokens_sha256": digest.hexdigest()[:16]}}


def _check_resume(output: Path, wm: WideModel, fp: str | None, key: dict, env: D.DistEnv) -> dict:
    """The saved state's meta, after checking that the base model (on rank 0, before any state loads) and the
    settings are the saved run's. Raises WideError naming what differs."""
    msg = None
    if (output / BASE_NAME).is_file():
        info = read_base_info(output)
        if info["dims"] != wm.dims.__dict__ or (fp is not None and fp != info["fingerprint"]):
            msg = (f"--resume: the run in {str(output)!r} was trained on base model {info['model']!r} (fingerprint "
                   f"{info['fingerprint']}, dims {info['dims']}), not on the model given now (fingerprint "
                   f"{fp or '?'}, dims {wm.dims.__dict__}); pass --model {info['model']!r} to continue it, or use "
                   f"another -o")
    if D.all_mean([float(msg is not None)], env)[0] > 0:
        raise WideError(msg or f"--resume: the base model differs from the one the run in {str(output)!r} was "
                               f"trained on (see rank 0)")
    meta = read_meta(output)
    step = meta.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise WideError(f"corrupt training state {meta['_path']}/{META_NAME}: \"step\" is {step!r}; it must be an "
                        f"integer >= 0 (the optimizer steps done)")
    if meta.get("key") != key:
        diff = _key_diff(meta.get("key"), key)
        source = meta.get("data_source") if "data.tokens_sha256:" in diff and "data.seq_len:" not in diff else None
        hint = f" (the saved run used {source}; pass the same to resume it)" if isinstance(source, str) else ""
        fix = ("drop the options that differ and the saved run's own are reused"
               if isinstance(meta.get("options"), dict) else "give the saved values")
        raise WideError(f"--resume: {meta['_path']} was written with other settings: {diff}{hint} (to continue it, "
                        f"{fix}; or start over with --overwrite)")
    return meta


def train(wm: WideModel, blocks: torch.Tensor, args: CalibrationArgs, output: str | os.PathLike, model_ref: str, *,
          stage: str = "router", resume: bool = False, progress: bool = True, on_step=None,
          extra_key: dict | None = None, extra_info: dict | None = None, data_source: str | None = None,
          options: dict | None = None, on_clear=None) -> list[dict]:
    """Train the parameters of ``wm`` with ``requires_grad`` (paper §3.2, Eq. 6 / Eq. 22) on int64 ``blocks``
    ``[N, seq_len]``, in one process or under torchrun, into ``output`` (checkpoint, ``train_state.dcp``,
    ``train_log.jsonl``). ``resume`` continues the saved run (same settings, base model, data and ``extra_key``);
    ``extra_info`` goes into ``base_model.json``, ``data_source`` and ``options`` into the state for ``--resume``.
    A run that is not resumed starts by removing an earlier run's files from ``output`` (:func:`clear_run`, once
    every check has passed), so that a folder never mixes two runs; ``on_clear(names)`` is then called (rank 0)
    with the names removed, if any.
    A config without ``seq_len`` gets the blocks' (the context of the flops unit). Returns one record a step
    (``step``, ``lm_loss``, ``sparsity_loss``, ``attn_sparsity``, ``ffn_sparsity``, ``groups_sparsity`` (Eq. 6),
    ``flops_sparsity`` (the routed compute skipped), ``tau``, ``lr``, ``grad_norm``, ``tokens_per_s``,
    ``world_size``; the sparsities of the step's Gumbel masks). Raises WideError for bad settings, a bad state
    to resume, a failed write, a batch that does not fit, or a diverged step (the last saved state is kept)."""
    from tqdm.auto import tqdm

    from wide.eval.perplexity import bar_intervals

    args.validate()
    wm.config.check_training()
    check_reachable(wm.config.target_sparsity, wm.config.max_module_sparsity, wm.config.sparsity_unit)
    if wm.config.seq_len is None:
        wm.config = dataclasses.replace(wm.config, seq_len=int(blocks.shape[1]))
    env, output = D.current(), Path(output)
    if resume and not has_train_state(output):
        raise WideError(f"--resume: no {STATE_NAME} in {str(output)!r}")
    fp = fingerprint(wm.base) if env.is_main else None  # before sharding: only rank 0 holds the weights
    if args.grad_checkpoint:  # every supported architecture supports it
        wm.base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if env.active:
        D.apply_fsdp(wm, env, reshard_after_forward=args.reshard_after_forward)
    device = env.device if env.active else next(wm.base.parameters()).device
    if args.memory_check:
        check_train_memory(wm, args.batch_size, blocks.shape[1], grad_checkpoint=args.grad_checkpoint,
                           grad_accum=args.grad_accum, device=device,
                           procs=int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if env.active else 1)
    params = [p for p in wm.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0, betas=(0.9, 0.999))
    key = _resume_key(wm, args, stage, extra_key, env.world_size, blocks)
    start = 0
    if resume:
        meta = _check_resume(output, wm, fp, key, env)
        _load_state(wm, opt, meta, env)
        start = int(meta["step"])
        if progress and env.is_main:
            print(f"the run in {output} is already complete: step {start} of {args.steps} done (state in "
                  f"{meta['_path']}); nothing to train" if start >= args.steps else
                  f"resuming from step {start} of {args.steps} (state in {meta['_path']})", flush=True)
        if start >= args.steps:
            return []
    log_path, created = output / LOG_NAME, False
    if env.is_main:
        created = not output.exists()
        output.mkdir(parents=True, exist_ok=True)
        if resume:
            _truncate_log(log_path, start)
        else:  # an earlier run's files must not be resumed, nor mixed with this run's
            removed = clear_run(output)
            if removed and progress:
                print(f"removed the earlier run's files from {output}: {', '.join(removed)}", flush=True)
            if removed and on_clear is not None:
                on_clear(removed)
    D.barrier(env)
    saved_step, cfg, records = start, wm.config, []
    wm.stochastic = True
    wm.train()
    if not (any(p.requires_grad for p in wm.base.parameters()) or args.grad_checkpoint):
        wm.base.eval()  # stage 1: no dropout in the frozen base (HF checkpointing needs train mode)
    W, R, B, T = env.world_size, env.rank, args.batch_size, blocks.shape[1]
    kinds = [k for k, on in (("attn", cfg.route_attn), ("ffn", cfg.route_ffn)) if on]
    weights = None if cfg.sparsity_unit == "groups" else module_weights(wm.dims, cfg)
    flops_w = torch.tensor(module_weights(wm.dims, cfg, "flops"), dtype=torch.float64, device=device)
    flops_w = (flops_w / flops_w.sum()).float()
    bar = tqdm(total=args.steps, initial=start, disable=not (progress and env.is_main), desc=f"train {stage}",
               dynamic_ncols=True, **bar_intervals())
    try:
        for step in range(start, args.steps):
            t0 = time.perf_counter()
            wm.tau, lr = cfg.tau_at(step, args.steps), args.lr * lr_lambda(step, args.warmup_steps, args.steps)
            for g in opt.param_groups:
                g["lr"] = lr
            torch.manual_seed(mix(args.seed, step, R))
            opt.zero_grad(set_to_none=True)
            parts = []
            for a in range(args.grad_accum):
                first = (step * args.grad_accum + a) * B * W + R * B
                positions = list(range(first, first + B))
                ids = stream_rows(blocks, positions, args.seed).to(device)
                with sample_keyed(args.seed, positions):  # backward too: recomputed layers redraw the same noise
                    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                        out = wm(ids, labels=ids, use_cache=False)
                    na = len(wm.record.attn_keep)
                    keeps = D.global_keep([*wm.record.attn_keep, *wm.record.ffn_keep], env)
                    sp = sparsity_loss(keeps[:na], keeps[na:], cfg.target_sparsity, cfg.alpha, cfg.sparsity_mode,
                                       weights=weights, max_module=cfg.max_module_sparsity)
                    ((out.loss.float() + sp) / args.grad_accum).backward()
                skip = 1.0 - torch.stack(keeps).detach().float()
                parts.append(torch.stack([out.loss.detach().float(), sp.detach(), skip.mean(), (flops_w * skip).sum(),
                                          *(1.0 - torch.stack(k).detach().mean() for k in (keeps[:na], keeps[na:])
                                            if k)]))
            gnorm = D.clip_grad_norm_(params, 1.0, env)
            D.optimizer_step(opt)
            bad = sum((~torch.isfinite(D.local(p).detach())).sum() for p in params)
            lm, spl, groups, flops, *sparsity, gn, bad = torch.cat([torch.stack(parts).double().mean(0), torch.stack(
                [gnorm.to(device, torch.float64), bad.to(device, torch.float64)])]).tolist()  # one host sync
            lm, bad = D.all_mean([lm, bad], env)
            if bad or not all(map(math.isfinite, (lm, spl, gn))):
                kept = (f"the last good state (step {saved_step}) is kept in {str(output)!r}" if saved_step
                        else "nothing was saved")
                raise WideError(f"training diverged at step {step + 1} of {args.steps}: lm_loss {lm:.4g}, "
                                f"sparsity_loss {spl:.4g}, grad_norm {gn:.4g}"
                                f"{', non-finite trained parameters after the optimizer step' if bad else ''}; "
                                f"{kept}; lower --lr (now {args.lr:g}) or --alpha, or raise --tau-end")
            sparsity = dict(zip(kinds, sparsity))
            r = {"step": step + 1, "lm_loss": lm, "sparsity_loss": spl, "attn_sparsity": sparsity.get("attn", 0.0),
                 "ffn_sparsity": sparsity.get("ffn", 0.0), "groups_sparsity": groups, "flops_sparsity": flops,
                 "tau": wm.tau, "lr": lr, "grad_norm": gn,
                 "tokens_per_s": B * args.grad_accum * W * T / (time.perf_counter() - t0), "world_size": W}
            records.append(r)
            if env.is_main:
                with log_path.open("a") as f:
                    f.write(json.dumps(r) + "\n")
                bar.set_postfix(lm=f"{lm:.3f}", attn=f"{r['attn_sparsity']:.2f}", ffn=f"{r['ffn_sparsity']:.2f}",
                                tau=f"{wm.tau:.2f}", tok_s=f"{r['tokens_per_s']:.0f}", refresh=False)
                bar.update(1)  # draws, postfix included, at most every mininterval
            if on_step is not None:
                on_step(r)
            if (step + 1) % args.save_every == 0 or step + 1 == args.steps:
                meta = {"step": step + 1, "key": key, "world_size": W, "data_source": data_source, "options": options}
                _save(wm, opt, output, model_ref, {"stage": stage, "step": step + 1, "steps": args.steps,
                                                   **(extra_info or {})}, fp, env, saved_step, meta)
                saved_step = step + 1
    except BaseException:
        if saved_step == 0 and env.is_main:  # nothing to resume from: no log of unsaved steps, no new empty folder
            log_path.unlink(missing_ok=True)
            if created and output.is_dir() and not any(output.iterdir()):
                output.rmdir()
        raise
    finally:
        bar.close()
        wm.stochastic = False
        wm.eval()
    return records


def _save(wm: WideModel, opt, output: Path, model_ref: str, extra: dict, fp: str | None, env: D.DistEnv,
          saved_step: int, meta: dict) -> None:
    """Write the adapter (stage 2), the WIDE checkpoint, then the training state; shards are gathered on every rank."""
    routers = {f"{kind}.{k}": D.full(v).detach().to("cpu", torch.float32).contiguous()
               for kind, mods in (("attn", wm.attn_routers), ("ffn", wm.ffn_routers))
               for k, v in mods.state_dict().items()}
    lora = ({f"base_model.model.{n}": D.full(p.detach()).cpu().contiguous() for n, p in L.lora_named_parameters(wm)}
            if extra["stage"] == "lora" else None)
    if env.is_main:
        with _writing(output, saved_step):
            if lora is not None:
                L.save_adapter(wm, output / L.ADAPTER_DIR, lora)
            save_wide(wm, output, model_ref, extra=extra, routers=routers, base_fingerprint=fp)
    with _writing(output / STATE_NAME, saved_step):
        _save_state(wm, opt, output, meta, env)


def calibrate(wm: WideModel, blocks: torch.Tensor, args: CalibrationArgs, output: str | os.PathLike,
              model_ref: str, **kw) -> list[dict]:
    """Stage 1 (paper §3.2): train the routers, base frozen. Arguments as :func:`train`."""
    wm.base.requires_grad_(False)
    for p in wm.router_parameters():
        p.requires_grad_(True)
    return train(wm, blocks, args, output, model_ref, stage="router", **kw)


def recover(wm: WideModel, blocks: torch.Tensor, args: CalibrationArgs, output: str | os.PathLike, model_ref: str, *,
            settings: L.LoraSettings | None = None, freeze_router: bool = False, stage1: str | None = None,
            extra_info: dict | None = None, **kw) -> list[dict]:
    """Stage 2 (paper §3.2): LoRA on all seven projections (``lora_A`` drawn after ``torch.manual_seed(seed)``, the
    same on every rank), the routers trained unless ``freeze_router``; arguments as :func:`train`, ``stage1`` the
    stage-1 directory recorded in ``base_model.json`` with ``extra_info``."""
    settings = settings or L.LoraSettings()
    settings.validate()
    if L.peft_model(wm) is None:
        torch.manual_seed(args.seed)
        L.attach_lora(wm, settings)
    L.use_keyed_dropout(wm)
    for n, p in wm.base.named_parameters():
        p.requires_grad_(".lora_A." in n or ".lora_B." in n)
    for p in wm.router_parameters():
        p.requires_grad_(not freeze_router)
    key = {"lora": settings.to_dict(), "freeze_router": bool(freeze_router)}
    info = {"adapter": L.ADAPTER_DIR, **key, **({"stage1": str(stage1)} if stage1 is not None else {}),
            **(extra_info or {})}
    return train(wm, blocks, args, output, model_ref, stage="lora", extra_key=key, extra_info=info, **kw)
