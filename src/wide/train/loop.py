"""Training loop for both stages of paper §3.2: router calibration (stage 1) and LoRA recovery (stage 2).

One loop, :func:`train`, trains whatever parameter set the caller marked ``requires_grad`` on a
:class:`~wide.model.WideModel`: the routers (stage 1, base frozen), the LoRA adapters with or without
the routers (stage 2, see :mod:`wide.lora`). :func:`calibrate` is stage 1.

Loss = LM loss + sparsity loss (Eq. 6, or Eq. 22 in uniform mode); hard Gumbel-softmax masks with a
straight-through gradient and a temperature annealed linearly from ``tau_start`` to ``tau_end``.
AdamW with linear warm-up then cosine decay, gradient clipping and accumulation, bf16 autocast on GPU,
optional activation checkpointing. Before the first step the micro-batch's memory is estimated and checked
against the memory available (:mod:`wide.memory`).

Randomness is a pure function of the settings, never of a carried RNG state: the Gumbel uniforms of
sample ``p`` of the data stream, layer ``i`` and module ``m`` come from a generator seeded with
``(seed, p, m, i)`` (so they do not depend on the world size nor on recomputation), and the global RNG
(LoRA dropout) is reseeded with ``(seed, step, rank)`` at every step.

Checkpoints. Single process: ``<output>/train_state.pt`` (trained parameters, optimizer, step, settings),
written atomically every ``save_every`` steps, read with ``torch.load(weights_only=True)``. Under torchrun:
``<output>/train_state.dcp/`` through ``torch.distributed.checkpoint``, written atomically. Either resumes
at any world size with the same global batch; ``resume=True`` continues with the losses an uninterrupted
run would have had.
"""

from __future__ import annotations

import contextlib
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

import wide.train.fsdp as D
from wide.checkpoint import save_wide
from wide.config import SEED_MAX, atomic_write
from wide.errors import WideError, WideWarning
from wide.memory import check_train_memory
from wide.model import WideModel, fingerprint, fingerprint_like
from wide.routing import sparsity_loss, uniform_noise

STATE_NAME = "train_state.pt"
DCP_NAME = "train_state.dcp"
LOG_NAME = "train_log.jsonl"
STAGES = ("router", "lora")
#: the largest --lr accepted: AdamW moves every parameter by about lr per step, so above 1 one step moves the
#: router weights (initialized near 0.02) far beyond their scale and training diverges
LR_MAX = 1.0


@dataclass
class CalibrationArgs:
    """One training run's settings (the method's own hyper-parameters live in WideConfig).

    Attributes:
        steps: optimizer steps.
        batch_size: sequences per micro-batch *per process*; the global batch is
            ``batch_size * grad_accum * world_size`` sequences.
        grad_accum: micro-batches per step.
        lr: peak learning rate in ``(0, LR_MAX]`` (stage 1 default 5e-3 in the CLI, stage 2 2e-4).
        warmup_steps: linear warm-up steps before cosine decay, ``0 <= warmup_steps <= steps``.
        weight_decay, max_grad_norm: AdamW decay and gradient-clipping norm.
        seed: seeds the data order, the Gumbel noise and dropout; an integer in ``[0, SEED_MAX]`` = ``[0, 2**32 - 1]``.
        save_every: checkpoint period in steps (and at the last step).
        log_every: kept for compatibility; every step is logged.
        grad_checkpoint: recompute each decoder layer in backward (activation checkpointing).
        reshard_after_forward: under FSDP2, free each decoder layer's gathered weights after its forward
            (default; least memory) or keep them for backward (False: one all-gather of the base per step
            instead of two, the whole base resident on every rank). No effect on one process.
        memory_check: before the first step, refuse a micro-batch whose estimated forward + backward memory
            (:func:`wide.memory.estimate_train_memory`) does not fit in the memory available
            (:func:`wide.memory.check_train_memory`). Not part of the resume key.
    """

    steps: int = 500
    batch_size: int = 8
    grad_accum: int = 1
    lr: float = 1e-3
    warmup_steps: int = 0
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    seed: int = 0
    save_every: int = 100
    log_every: int = 1
    grad_checkpoint: bool = False
    reshard_after_forward: bool = True
    memory_check: bool = True

    def validate(self) -> None:
        """Raises WideError naming the first bad value (non-positive counts, an ``lr`` outside ``(0, LR_MAX]``
        (NaN and inf included), a ``seed`` outside ``[0, SEED_MAX]``, a negative warm-up or one longer than
        ``steps``, a negative or non-finite ``weight_decay``)."""
        for name in ("steps", "batch_size", "grad_accum", "save_every", "log_every"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise WideError(f"--{name.replace('_', '-')} {v!r} must be a positive integer")
        if not 0 < self.lr <= LR_MAX:  # also rejects NaN and inf
            raise WideError(f"--lr {self.lr!r} must be > 0 and at most {LR_MAX:g} (stage 1 uses about 5e-3, "
                            f"stage 2 2e-4)")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or not 0 <= self.seed <= SEED_MAX:
            raise WideError(f"--seed {self.seed!r} must be an integer from 0 to {SEED_MAX} (2**32 - 1)")
        if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            raise WideError(f"weight_decay {self.weight_decay!r} must be a finite number >= 0")
        if self.warmup_steps < 0:
            raise WideError(f"--warmup-steps {self.warmup_steps!r} must be >= 0")
        if self.warmup_steps > self.steps:
            raise WideError(f"--warmup-steps {self.warmup_steps!r} must be <= --steps {self.steps!r} "
                            f"(0 to {self.steps})")
        if not self.max_grad_norm > 0:
            raise WideError(f"--max-grad-norm {self.max_grad_norm!r} must be > 0")


TrainArgs = CalibrationArgs


def lr_lambda(step: int, warmup: int, total: int) -> float:
    """Learning-rate factor: linear warm-up over ``warmup`` steps, then cosine decay to 0 at ``total``."""
    if step < warmup:
        return (step + 1) / warmup
    prog = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * min(prog, 1.0)))


def stream_rows(blocks: torch.Tensor, positions, seed: int) -> torch.Tensor:
    """Rows of ``blocks`` (int64 ``[N, T]``) at ``positions`` of the endless stream of per-epoch seeded
    permutations of the ``N`` blocks: int64 ``[len(positions), T]``. Position ``p`` is block
    ``randperm(N, seed * 1_000_003 + p // N)[p % N]``; a pure function of ``p``, which makes resume exact
    and lets every rank read its own rows of a global micro-batch."""
    n = blocks.shape[0]
    cache: dict[int, torch.Tensor] = {}
    idx = []
    for pos in positions:
        epoch, j = divmod(pos, n)
        if epoch not in cache:
            cache[epoch] = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
        idx.append(int(cache[epoch][j]))
    return blocks[idx]


def micro_batch(blocks: torch.Tensor, k: int, batch_size: int, seed: int) -> torch.Tensor:
    """The ``k``-th micro-batch (``[batch_size, T]``) of the seeded block stream; a pure function of ``k``."""
    return stream_rows(blocks, range(k * batch_size, (k + 1) * batch_size), seed)


def _mix(*parts) -> int:
    """A 63-bit seed from a tuple of ints / strings (stable across processes and runs)."""
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:8], "little") & ((1 << 63) - 1)


class GumbelNoise:
    """Uniforms for :func:`wide.routing.gumbel_hard_mask` that depend only on (seed, sample, module, layer).

    Forward hooks on the routers set :attr:`key` to ``(kind, layer)`` just before the mask is drawn, and
    :attr:`positions` holds the stream positions of this process's rows; row ``b`` of the noise comes from
    a generator seeded with ``(seed, positions[b], kind, layer)``. So the union over ranks equals the
    single-process draw, and recomputation in backward redraws exactly the same noise.
    """

    def __init__(self, wm: WideModel, seed: int) -> None:
        self.seed = seed
        self.positions: list[int] = []
        self.key: tuple[str, int] | None = None
        self.handles = []
        for kind, mods in (("attn", wm.attn_routers), ("ffn", wm.ffn_routers)):
            for i, m in enumerate(mods):
                self.handles.append(m.register_forward_hook(self._setter(kind, i)))

    def _setter(self, kind: str, i: int):
        def hook(module, args, output):
            self.key = (kind, i)
        return hook

    def __call__(self, shape, device, dtype) -> torch.Tensor:
        if self.key is None or shape[0] != len(self.positions):
            raise RuntimeError(f"Gumbel noise for shape {tuple(shape)} without a router key / matching positions")
        kind, layer = self.key
        rows = []
        for p in self.positions:
            g = torch.Generator(device=device)
            g.manual_seed(_mix(self.seed, p, kind, layer))
            rows.append(torch.rand(tuple(shape[1:]), generator=g, device=device, dtype=dtype))
        return torch.stack(rows)

    def __enter__(self):
        _CURRENT_SAMPLES.append(self)
        return self

    def __exit__(self, *exc):
        _CURRENT_SAMPLES.pop()
        return False

    def remove(self) -> None:
        """Remove the router hooks."""
        for h in self.handles:
            h.remove()
        self.handles = []


_CURRENT_SAMPLES: list = []  # stack of the GumbelNoise objects of the micro-batches being run


def current_samples() -> GumbelNoise | None:
    """The :class:`GumbelNoise` of the micro-batch :func:`train` is running (its ``seed`` and this process's
    sample ``positions``), or None outside training. Keyed LoRA dropout (:mod:`wide.lora`) reads it."""
    return _CURRENT_SAMPLES[-1] if _CURRENT_SAMPLES else None


def sample_keyed_uniform(shape, device, dtype, key: tuple) -> torch.Tensor:
    """Uniforms ``[B, *shape[1:]]`` in ``[0, 1)`` whose row ``b`` depends only on (seed, sample position, ``key``).

    Uses :func:`current_samples` (``B`` must equal its number of positions).

    Raises:
        RuntimeError: outside a training micro-batch, or a batch size that does not match it.
    """
    cur = current_samples()
    if cur is None or shape[0] != len(cur.positions):
        raise RuntimeError(f"sample-keyed noise for shape {tuple(shape)} outside a matching training micro-batch")
    rows = []
    for p in cur.positions:
        g = torch.Generator(device=device)
        g.manual_seed(_mix(cur.seed, p, *key))
        rows.append(torch.rand(tuple(shape[1:]), generator=g, device=device, dtype=dtype))
    return torch.stack(rows)


def atomic_torch_save(obj, path: Path) -> None:
    """``torch.save`` through :func:`wide.config.atomic_write` (tensors, dicts, lists and numbers only)."""
    atomic_write(path, lambda tmp: torch.save(obj, tmp))


def load_train_state(path: Path, mmap: bool = False) -> dict:
    """Read a training state safely (``weights_only=True``); ``mmap=True`` maps the tensors instead of reading
    them (a cheap check of the file before a model loads).

    Raises:
        WideError: ``corrupt training state <path> (<short reason>); delete it or rerun without --resume``.
    """
    def corrupt(reason: str) -> WideError:
        return WideError(f"corrupt training state {path} ({reason}); delete it or rerun without --resume")

    try:
        st = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception:  # noqa: BLE001 - torch's messages for a damaged file are cryptic (an offset, an errno)
        raise corrupt("unreadable: truncated or not a torch file") from None
    if not isinstance(st, dict) or not {"step", "model", "optimizer", "meta"} <= set(st):
        raise corrupt("not a wide training state: old format or another file")
    return st


def _truncate_log(path: Path, step: int) -> None:
    """Drop log records written after the checkpoint we resume from (an interrupted run's tail).

    A line that is not a JSON record with an integer ``step`` (a truncated last line is what a killed run
    leaves) is dropped too, with a :class:`~wide.errors.WideWarning` (one line from the CLI).
    """
    if not path.is_file():
        return
    keep, bad = [], []
    for i, ln in enumerate(path.read_text(errors="replace").splitlines(), 1):
        if not ln.strip():
            continue
        try:
            rec = json.loads(ln)
            rec_step = rec["step"] if isinstance(rec, dict) else None
        except (json.JSONDecodeError, KeyError):
            rec_step = None
        if not isinstance(rec_step, int) or isinstance(rec_step, bool):
            bad.append(i)
        elif rec_step <= step:
            keep.append(ln)
    if bad:
        warnings.warn(f"{path}: skipped {len(bad)} unreadable line(s) (line {', '.join(map(str, bad[:3]))}"
                      f"{', ...' if len(bad) > 3 else ''}; a killed run leaves a truncated last line)",
                      WideWarning, stacklevel=2)
    path.write_text("".join(ln + "\n" for ln in keep))


def _remove_train_state(output: Path) -> None:
    """Remove the training state and log a run of this library left in ``output``: ``train_state.pt``, the
    ``train_state.dcp`` folder of a multi-process run (and the ``.old`` / ``.tmp`` copies a crash leaves), and
    ``train_log.jsonl``. A DCP folder is removed only if it holds DCP's ``.metadata`` or our
    ``train_state.json``; nothing else in ``output`` is touched."""
    for f in (output / STATE_NAME, output / LOG_NAME):
        if f.is_file():
            f.unlink()
    for d in (output / DCP_NAME, output / f".{DCP_NAME}.old", output / f".{DCP_NAME}.tmp"):
        if d.is_dir() and ((d / ".metadata").exists() or (d / "train_state.json").exists()
                           or d.name.endswith(".tmp")):
            shutil.rmtree(d)


def _check_finite_step(step: int, total: int, values: dict[str, float], bad_params: float, output: Path,
                       saved_step: int, lr: float) -> None:
    """Stop a diverged run: any non-finite logged loss / gradient norm, or non-finite trained parameters after
    the optimizer step (``bad_params`` > 0).

    Raises:
        WideError: ``training diverged at step <k> of <n>: lm_loss nan, ...``, saying which state is kept (the
            last good one is never overwritten: this runs before the step's save) and what to lower.
    """
    if all(math.isfinite(v) for v in values.values()) and not bad_params:
        return
    shown = ", ".join(f"{k} {v:.4g}" for k, v in values.items())
    if bad_params:
        shown += ", non-finite trained parameters after the optimizer step"
    kept = (f"the last good state (step {saved_step}) is kept in {str(output)!r}" if saved_step
            else "nothing was saved")
    raise WideError(f"training diverged at step {step} of {total}: {shown}; {kept}; lower --lr (now {lr:g}) "
                    f"or --alpha, or raise --tau-end")


def has_train_state(output: str | os.PathLike) -> bool:
    """True if ``output`` holds a single-process or a sharded training state."""
    output = Path(output)
    return (output / STATE_NAME).is_file() or D.sharded_meta(output / DCP_NAME) is not None


@contextlib.contextmanager
def _writing(path: Path, saved_step: int):
    """Turn a failed write of the checkpoint or training state (``OSError``, e.g. ``ENOSPC``; torch's zip
    writer's ``RuntimeError``; safetensors' error) into one :class:`WideError` line naming ``path``. Every file
    is written through :func:`wide.config.atomic_write`, so no partial file is left and the previous state stays.

    Raises:
        WideError: ``could not write the checkpoint to <path> (<reason>; is the disk full?) ...``.
    """
    from safetensors import SafetensorError

    try:
        yield
    except (OSError, RuntimeError, SafetensorError) as e:
        reason = (e.strerror if isinstance(e, OSError) and e.strerror else str(e).strip().splitlines()[0]
                  if str(e).strip() else type(e).__name__)[:200]
        kept = f"the training state of step {saved_step} is kept" if saved_step else "nothing was saved yet"
        raise WideError(f"could not write the checkpoint to {path} ({reason}; is the disk full?); {kept}") from None


def _check_base_identity(output: Path, wm: WideModel, fp: str | None, env: D.DistEnv) -> None:
    """Before a resume loads any state: the base model given now must be the one the saved run in ``output``
    trained on (``base_model.json``: its ``dims`` and weight ``fingerprint``). Rank 0 compares the
    fingerprint (only it holds the real weights); every rank learns the verdict.

    Raises:
        WideError: ``--resume: the run in <output> was trained on base model <saved ref> (fingerprint ...,
            dims ...), not on the model given now (fingerprint ..., dims ...); pass --model <saved ref> ...``.
    """
    from wide.checkpoint import BASE_NAME, read_base_info

    msg = None
    if (output / BASE_NAME).is_file():
        info = read_base_info(output)
        dims = wm.dims.__dict__
        saved_fp = str(info["fingerprint"])
        now_fp = fingerprint_like(wm.base, saved_fp, current=fp) if fp is not None else None
        if (info.get("dims") and info["dims"] != dims) or (now_fp is not None and now_fp != saved_fp):
            saved_dims = f", dims {info['dims']}" if info.get("dims") else ""
            msg = (f"--resume: the run in {str(output)!r} was trained on base model {info['model']!r} (fingerprint "
                   f"{saved_fp}{saved_dims}), not on the model given now (fingerprint {now_fp or '?'}, dims "
                   f"{dims}); pass --model {info['model']!r} to continue it, or use another -o")
    if D.all_mean([float(msg is not None)], env)[0] > 0:
        raise WideError(msg or f"--resume: the base model differs from the one the run in {str(output)!r} "
                               f"was trained on (see rank 0)")


def _key_diff(saved, now, prefix: str = "") -> str:
    """The settings that differ between two resume keys, e.g. ``train.steps: saved 2, now 4``."""
    if not (isinstance(saved, dict) and isinstance(now, dict)):
        return f"{prefix or 'settings'}: saved {saved!r}, now {now!r}"
    parts = []
    for k in sorted(set(saved) | set(now), key=str):
        a, b = saved.get(k, "(absent)"), now.get(k, "(absent)")
        if a != b:
            parts.append(_key_diff(a, b, f"{prefix}{k}.") if isinstance(a, dict) and isinstance(b, dict)
                         else f"{prefix}{k}: saved {a!r}, now {b!r}")
    return "; ".join(parts)


# resume-key entries added later: a state saved without one still resumes (the entry is not compared)
_OPTIONAL_KEYS = ("data",)


def data_fingerprint(blocks: torch.Tensor) -> str:
    """sha256 (first 16 hex digits) of the packed token blocks: their dtype, shape and bytes."""
    t = blocks.detach().to("cpu").contiguous()
    h = hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode())
    h.update(t.view(-1).view(torch.uint8).numpy() if t.numel() else b"")
    return h.hexdigest()[:16]


def _resume_key(wm: WideModel, args: CalibrationArgs, stage: str, extra_key: dict | None, world: int,
                blocks: torch.Tensor | None = None) -> dict:
    """The settings a resumed run must share with the saved one (the global batch, not its split, and the
    training data: its sequence length and a fingerprint of the packed tokens)."""
    train = {k: v for k, v in asdict(args).items()
             if k not in ("batch_size", "grad_accum", "save_every", "log_every", "grad_checkpoint",
                          "reshard_after_forward", "memory_check")}
    train["global_batch"] = args.batch_size * args.grad_accum * world
    key = {"stage": stage, "config": wm.config.to_dict(), "train": train, **(extra_key or {})}
    if blocks is not None:
        key["data"] = {"seq_len": int(blocks.shape[1]), "tokens_sha256": data_fingerprint(blocks)}
    return key


def enable_grad_checkpoint(wm: WideModel) -> None:
    """Turn on Hugging Face's activation checkpointing of every decoder layer (non-reentrant).

    ``torch.utils.checkpoint`` restores the RNG state on recompute, and the routers' Gumbel noise is keyed
    per sample and layer (:class:`GumbelNoise`), so the recomputed masks equal the forward ones. HF only
    checkpoints in train mode, so :func:`train` puts the base model in train mode when this is on.

    Raises:
        WideError: the base model does not support gradient checkpointing.
    """
    base = wm.base
    if not getattr(base, "supports_gradient_checkpointing", False):
        raise WideError(f"--grad-checkpoint: {type(base).__name__} does not support gradient checkpointing")
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def _state_options(full: bool = False):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(ignore_frozen_params=True, strict=False, full_state_dict=full)


def _trained_state(wm: WideModel, opt) -> tuple[dict, dict]:
    """``get_state_dict`` of the trained parameters only. With tied input / output embeddings (SmolLM2), torch
    reports the frozen tied weight under its second name (``base.lm_head.weight``) despite
    ``ignore_frozen_params``, which would put a 49152 x 576 frozen matrix into every training state."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    names = {n for n, p in wm.named_parameters() if p.requires_grad}
    msd, osd = get_state_dict(wm, opt, options=_state_options())
    return {k: v for k, v in msd.items() if k in names}, osd


def _newest_state(output: Path, mmap: bool = False) -> tuple[dict | None, dict | None]:
    """The newer of the two training states in ``output``: ``(train_state.pt's dict, None)`` or ``(None, the
    train_state.json of train_state.dcp)``; ``(None, None)`` when there is neither. ``mmap`` as in
    :func:`load_train_state`.

    Raises:
        WideError: a corrupt state (:func:`load_train_state`, :func:`wide.train.fsdp.sharded_meta`).
    """
    pt = output / STATE_NAME
    meta = D.sharded_meta(output / DCP_NAME)
    st = load_train_state(pt, mmap=mmap) if pt.is_file() else None
    if st is not None and (meta is None or int(st["step"]) >= int(meta.get("step", -1))):
        return st, None
    return None, meta


def saved_options(output: str | os.PathLike) -> dict | None:
    """The ``options`` that :func:`train` stored with the newest training state in ``output`` (the command line's
    options of the run, see ``wide.cli``), or None: no state, or one saved before options were stored.

    Raises:
        WideError: a corrupt state (as :func:`load_train_state`).
    """
    st, meta = _newest_state(Path(output), mmap=True)
    options = (st or meta or {}).get("options")
    return options if isinstance(options, dict) else None


def _load_state(wm: WideModel, opt, output: Path, key: dict, env: D.DistEnv) -> tuple[int, Path]:
    """Load the newest training state in ``output`` (``.pt`` or DCP) into ``wm`` / ``opt``; return its step
    and its path. Entries of ``key`` in ``_OPTIONAL_KEYS`` that the saved state lacks are not compared."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    pt = output / STATE_NAME
    st, meta = _newest_state(output)
    if st is None and meta is None:
        raise WideError(f"--resume: no {STATE_NAME} or {DCP_NAME} in {str(output)!r}")
    use_pt = st is not None
    saved_key = st["meta"] if use_pt else meta.get("key")
    src = pt if use_pt else Path(meta["_path"])
    if isinstance(saved_key, dict):  # states from before an optional entry existed
        key = {k: v for k, v in key.items() if k in saved_key or k not in _OPTIONAL_KEYS}
    if saved_key != key:
        diff = _key_diff(saved_key, key)
        # the saved text is a likely cause only when the tokens differ at the same sequence length
        source = ((st.get("data_source") if use_pt else meta.get("data_source"))
                  if "data.tokens_sha256:" in diff and "data.seq_len:" not in diff else None)
        hint = f" (the saved run used {source}; pass the same to resume it)" if isinstance(source, str) else ""
        kept = isinstance((st if use_pt else meta).get("options"), dict)
        fix = "drop the options that differ and the saved run's own are reused" if kept else "give the saved values"
        raise WideError(f"--resume: {src} was written with other settings: {diff}{hint} (to continue it, {fix}; "
                        f"or start over with --overwrite)")
    names = {n for n, p in wm.named_parameters() if p.requires_grad}
    if use_pt:
        msd, osd, step = st["model"], st["optimizer"], int(st["step"])
        # states written before _trained_state also hold frozen tied aliases (base.lm_head.weight): drop
        # every frozen parameter name, but keep unknown names so that a mismatch is still reported
        frozen = {n for n, p in wm.named_parameters(remove_duplicate=False) if not p.requires_grad}
        msd = {k: v for k, v in msd.items() if k not in frozen}
        if set(msd) != names:
            extra, missing = sorted(set(msd) - names), sorted(names - set(msd))
            raise WideError(f"--resume: {src} does not match this run's trained parameters (saved only: "
                            f"{extra[:3]}{'...' if len(extra) > 3 else ''}; missing: "
                            f"{missing[:3]}{'...' if len(missing) > 3 else ''})")
        set_state_dict(wm, opt, model_state_dict=msd, optim_state_dict=osd, options=_state_options(full=True))
        return step, src
    msd, osd = _trained_state(wm, opt)
    if set(msd) != names:
        raise WideError(f"--resume: this run trains parameters that {src} does not hold")
    state = {"model": msd, "optim": osd}
    D.load_sharded(state, src, env)
    set_state_dict(wm, opt, model_state_dict=state["model"], optim_state_dict=state["optim"], options=_state_options())
    return int(meta["step"]), src


def _save_state(wm: WideModel, opt, output: Path, step: int, key: dict, env: D.DistEnv,
                data_source: str | None = None, saved_step: int = 0, options: dict | None = None) -> None:
    """Write the training state (``train_state.pt``, or DCP under a process group) atomically; ``data_source``
    (how the training text was given, for messages only) and ``options`` (see :func:`train`) are stored beside
    the resume key, not compared.

    Raises:
        WideError: the write failed (a full disk: see :func:`_writing`); the previous state stays.
    """
    msd, osd = _trained_state(wm, opt)
    extra = {"data_source": data_source} if data_source else {}
    if options is not None:
        extra["options"] = options
    if env.active:
        with _writing(output / DCP_NAME, saved_step):
            D.save_sharded({"model": msd, "optim": osd}, output / DCP_NAME,
                           {"step": step, "key": key, "world_size": env.world_size, **extra}, env)
    else:
        with _writing(output / STATE_NAME, saved_step):
            atomic_torch_save({"step": step, "model": {k: v.detach().cpu() for k, v in msd.items()},
                               "optimizer": osd, "meta": key, **extra}, output / STATE_NAME)


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a possibly sharded (FSDP2 DTensor) tensor; the tensor itself otherwise."""
    return t.to_local() if D.is_sharded(t) else t


def full_router_state(wm: WideModel) -> dict[str, torch.Tensor]:
    """Router weights as a flat float32 CPU dict (keys as :meth:`WideModel.router_state_dict`), gathering
    FSDP shards; under a process group every rank must call it."""
    out = {}
    for kind, mods in (("attn", wm.attn_routers), ("ffn", wm.ffn_routers)):
        for k, v in mods.state_dict().items():
            out[f"{kind}.{k}"] = D.full(v).detach().to("cpu", torch.float32).contiguous()
    return out


def train(wm: WideModel, blocks: torch.Tensor, args: CalibrationArgs, output: str | os.PathLike, model_ref: str, *,
          stage: str = "router", resume: bool = False, progress: bool = True, on_step=None,
          extra_key: dict | None = None, extra_info: dict | None = None, save_extra=None,
          data_source: str | None = None, options: dict | None = None) -> list[dict]:
    """Train the parameters of ``wm`` that have ``requires_grad=True`` (paper §3.2, Eq. 6 / Eq. 22).

    Works single-process and under torchrun (see :mod:`wide.train.fsdp`): with an open process group the
    model is sharded with FSDP2 here, each rank reads its slice of every global micro-batch, the keep
    ratios entering the sparsity loss are those of the global micro-batch, and the state is saved with DCP.

    Args:
        wm: routed model on its device; every parameter to train must have ``requires_grad=True``
            (stage 1: the routers; stage 2: LoRA adapters and, unless frozen, the routers).
        blocks: int64 ``[N, seq_len]`` packed token blocks (the same on every rank).
        args: run settings; ``args.batch_size`` is per process.
        output: folder for the WIDE checkpoint, the training state and ``train_log.jsonl``.
        model_ref: the base model's ``--model`` value, stored in the checkpoint.
        stage: ``"router"`` or ``"lora"`` (recorded in the state and the checkpoint).
        resume: continue from the newest training state in ``output`` (any world size, same global batch;
            the settings, the sequence length and the packed tokens must be those of the saved run).
        progress: show a tqdm bar and, with ``resume``, the step it resumes from (rank 0 only).
        on_step: optional callback ``f(record)`` after every step, on every rank.
        extra_key: JSON-able settings a resumed run must match (e.g. the LoRA config).
        extra_info: JSON-able facts stored in ``base_model.json`` under ``"extra"``.
        save_extra: optional callable ``f(output, env)`` run on every rank at every save (e.g. the adapter).
        data_source: how the training text was given (e.g. ``--text '/data/calib.txt'``), kept in the
            training state so that a ``resume`` on other data names it.
        options: JSON-able ``{option: value}`` of the command line that started the run, kept in the training
            state (not compared) so that a ``wide ... --resume`` can reuse them (:func:`saved_options`).

    Returns:
        the per-step log records of this call: ``step``, ``lm_loss`` (nats/token, mean over ranks),
        ``sparsity_loss``, ``attn_sparsity``/``ffn_sparsity`` (fractions skipped, global batch), ``tau``,
        ``lr`` (used in this step), ``grad_norm``, ``tokens_per_s`` (global), ``world_size``. Empty when
        ``resume`` finds the run already complete (then nothing is written).

    A run without ``resume`` first removes an earlier run's training state and log from ``output``
    (``train_state.pt``, ``train_state.dcp/``, ``train_log.jsonl``; nothing else). If this call created
    ``output`` and fails before its first save, it removes ``output`` again.

    Raises:
        WideError: bad settings (a tau outside :meth:`wide.config.WideConfig.check_training`'s range
            included), nothing to train, an unknown stage, ``resume`` with a missing, corrupt or mismatched
            state, ``resume`` with another base model than the saved run's (its ``base_model.json``
            fingerprint or dims; checked before any state loads), a failed write of the checkpoint or
            training state (a full disk; the previous state stays), (with ``args.memory_check``) a micro-batch whose estimated memory does not fit
            (:func:`wide.memory.check_train_memory`; checked before the first step), or a diverged step: a
            non-finite LM / sparsity loss or gradient norm, or non-finite trained parameters after the
            optimizer step (checked every step before it is logged or saved, so the last saved state stays
            the last good one).
    """
    from tqdm.auto import tqdm

    args.validate()
    wm.config.check_training()
    if stage not in STAGES:
        raise WideError(f"stage {stage!r} is not one of {', '.join(STAGES)}")
    env = D.current()
    output = Path(output)
    if resume and not has_train_state(output):
        raise WideError(f"--resume: no {STATE_NAME} in {str(output)!r}")
    cfg = wm.config
    if not any(p.requires_grad for p in wm.parameters()):
        raise WideError("nothing to train: no parameter of the model requires a gradient")
    fp = fingerprint(wm.base) if env.is_main else None  # before sharding; only rank 0 holds real weights
    if args.grad_checkpoint:
        enable_grad_checkpoint(wm)
    if env.active:
        D.shard(wm, env, reshard_after_forward=args.reshard_after_forward)
        device = env.device
    else:
        device = next(wm.base.parameters()).device
    if args.memory_check:  # before any step: a batch too large ends here with one line, not in the OOM killer
        procs = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if env.active else 1
        check_train_memory(wm, args.batch_size, blocks.shape[1], grad_checkpoint=args.grad_checkpoint,
                           grad_accum=args.grad_accum, device=device, procs=procs)
    params = [p for p in wm.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay, betas=(0.9, 0.999))
    key = _resume_key(wm, args, stage, extra_key, env.world_size, blocks)
    start = 0
    if resume:
        _check_base_identity(output, wm, fp, env)  # before any state loads (another shape: a size mismatch)
        start, src = _load_state(wm, opt, output, key, env)
        if start >= args.steps:  # a finished run: nothing to train, nothing rewritten
            if progress and env.is_main:
                print(f"the run in {output} is already complete: step {start} of {args.steps} done (state in "
                      f"{src}); nothing to train", flush=True)
            return []
        if progress and env.is_main:
            print(f"resuming from step {start} of {args.steps} (state in {src})", flush=True)
    log_path = output / LOG_NAME
    created = False  # this call made the output folder (removed again if it fails before its first save)
    if env.is_main:
        created = not output.exists()
        output.mkdir(parents=True, exist_ok=True)
        if resume:
            _truncate_log(log_path, start)
        else:  # a new run: an earlier run's state (e.g. a DCP state of a --nproc run) must not be resumed
            _remove_train_state(output)
    D.barrier(env)
    saved_step = start

    use_amp = device.type == "cuda"
    trains_base_side = any(p.requires_grad for p in wm.base.parameters())  # LoRA (dropout active)
    wm.stochastic = True
    wm.train()
    if not (trains_base_side or args.grad_checkpoint):
        wm.base.eval()  # frozen base, stage 1: no dropout; HF checkpointing needs train mode
    noise = GumbelNoise(wm, args.seed)
    records: list[dict] = []
    seq_len = blocks.shape[1]
    W, R, B = env.world_size, env.rank, args.batch_size
    bar = tqdm(total=args.steps, initial=start, disable=not (progress and env.is_main), desc=f"train {stage}",
               dynamic_ncols=True)
    try:
        for step in range(start, args.steps):
            t0 = time.perf_counter()
            wm.tau = cfg.tau_at(step, args.steps)
            lr = args.lr * lr_lambda(step, args.warmup_steps, args.steps)
            for g in opt.param_groups:
                g["lr"] = lr
            torch.manual_seed(_mix(args.seed, step, R))  # dropout: a pure function of (seed, step, rank)
            opt.zero_grad(set_to_none=True)
            parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]] = []
            for a in range(args.grad_accum):
                first = (step * args.grad_accum + a) * B * W + R * B
                noise.positions = list(range(first, first + B))
                ids = stream_rows(blocks, noise.positions, args.seed).to(device)
                with uniform_noise(noise), noise:
                    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_amp):
                        out = wm(ids, labels=ids, use_cache=False)
                    rec = wm.record
                    na = len(rec.attn_keep)
                    keeps = D.global_keep([*rec.attn_keep, *rec.ffn_keep], env)  # one all-reduce for all layers
                    ak, fk = keeps[:na], keeps[na:]
                    sp = sparsity_loss(ak, fk, cfg.target_sparsity, cfg.alpha, cfg.sparsity_mode)
                    loss = (out.loss.float() + sp) / args.grad_accum
                    parts.append((out.loss.detach(), sp.detach(), torch.stack(ak).detach().mean() if ak else None,
                                  torch.stack(fk).detach().mean() if fk else None))
                    loss.backward()  # inside uniform_noise: checkpointed layers redraw the same noise
            gnorm = D.clip_grad_norm_(params, args.max_grad_norm, env)
            D.optimizer_step(opt)
            # every logged scalar of the step in one device-to-host copy (no sync per micro-batch)
            nonfinite = torch.stack([(~torch.isfinite(_local(p.detach()))).sum() for p in params]).sum()
            flat = [t for part in parts for t in part if t is not None] + [gnorm, nonfinite]
            vals = iter(torch.stack([torch.as_tensor(t).to(device, torch.float64) for t in flat]).tolist())
            lm_tot = sp_tot = 0.0
            attn_sp, ffn_sp = [], []
            for _, _, am, fm in parts:  # same float64 arithmetic, in the same order, as per-item .item() calls
                lm_tot += next(vals) / args.grad_accum
                sp_tot += next(vals) / args.grad_accum
                if am is not None:
                    attn_sp.append(1.0 - next(vals))
                if fm is not None:
                    ffn_sp.append(1.0 - next(vals))
            gnorm = next(vals)
            bad = next(vals)
            lm_tot, bad = D.all_mean([lm_tot, bad], env)
            _check_finite_step(step + 1, args.steps, {"lm_loss": lm_tot, "sparsity_loss": sp_tot, "grad_norm": gnorm},
                               bad, output, saved_step, args.lr)
            dt = time.perf_counter() - t0
            r = {
                "step": step + 1,
                "lm_loss": lm_tot,
                "sparsity_loss": sp_tot,
                "attn_sparsity": sum(attn_sp) / len(attn_sp) if attn_sp else 0.0,
                "ffn_sparsity": sum(ffn_sp) / len(ffn_sp) if ffn_sp else 0.0,
                "tau": wm.tau,
                "lr": lr,
                "grad_norm": gnorm,
                "tokens_per_s": B * args.grad_accum * W * seq_len / dt,
                "world_size": W,
            }
            records.append(r)
            if env.is_main:
                with log_path.open("a") as f:
                    f.write(json.dumps(r) + "\n")
                bar.update(1)
                bar.set_postfix(lm=f"{r['lm_loss']:.3f}", attn=f"{r['attn_sparsity']:.2f}",
                                ffn=f"{r['ffn_sparsity']:.2f}", tau=f"{r['tau']:.2f}", tok_s=f"{r['tokens_per_s']:.0f}")
            if on_step is not None:
                on_step(r)
            if (step + 1) % args.save_every == 0 or step + 1 == args.steps:
                routers = full_router_state(wm)
                if env.is_main:
                    with _writing(output, saved_step):
                        save_wide(wm, output, model_ref,
                                  extra={"stage": stage, "step": step + 1, "steps": args.steps, **(extra_info or {})},
                                  routers=routers, base_fingerprint=fp)
                if save_extra is not None:
                    with _writing(output, saved_step):
                        save_extra(output, env)
                _save_state(wm, opt, output, step + 1, key, env, data_source, saved_step, options)
                saved_step = step + 1
    except BaseException:
        if created and saved_step == 0:  # leave no folder behind that holds nothing to resume from
            if log_path.is_file():
                log_path.unlink()
            if output.is_dir() and not any(output.iterdir()):
                output.rmdir()
        raise
    finally:
        bar.close()
        noise.remove()
        wm.stochastic = False
        wm.eval()
    return records


def calibrate(wm: WideModel, blocks: torch.Tensor, args: CalibrationArgs, output: str | os.PathLike,
              model_ref: str, resume: bool = False, progress: bool = True, on_step=None,
              data_source: str | None = None, options: dict | None = None) -> list[dict]:
    """Stage-1 router calibration (paper §3.2): train only the routers, base frozen.

    Marks the routers trainable and every base parameter frozen, then runs :func:`train`. Arguments,
    returns and errors as in :func:`train`; ``blocks`` is int64 ``[N, seq_len]``.
    """
    wm.base.requires_grad_(False)
    for p in wm.router_parameters():
        p.requires_grad_(True)
    return train(wm, blocks, args, output, model_ref, stage="router", resume=resume, progress=progress,
                 on_step=on_step, data_source=data_source, options=options)
