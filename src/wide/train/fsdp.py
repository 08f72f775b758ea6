"""Multi-process calibration and LoRA recovery on FSDP2 (issue 6; the paper trains with FSDP2, §4.1).

One code path serves one process and many: :func:`wide.train.loop.train` asks :func:`current` for the
process group. Under ``torchrun`` (or ``wide calibrate --nproc N``, which starts ``torch.distributed.run``
itself) :func:`init` opens the group (NCCL on GPUs, gloo on CPU) with a timeout on every collective, and
:func:`shard` applies PyTorch's ``fully_shard`` (FSDP2) per decoder layer:

* all routers together form one FSDP unit in float32 (router master weights and router compute stay fp32),
  gathered once per step and kept unsharded from forward to backward (they are small);
* each decoder layer (frozen base weights, and the LoRA adapters in stage 2) is one unit with
  ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)`` on GPU, plain fp32 on CPU;
* the root (embeddings, final norm, LM head) is the last unit.

Data parallelism: in every micro-batch rank ``r`` of ``W`` reads rows ``r*B .. r*B+B-1`` of the global
micro-batch of ``B*W`` rows, so the global batch is micro-batch x accumulation x world size. Sharded
training state is written with ``torch.distributed.checkpoint`` (DCP) into a temporary folder that rank 0
renames into place once every rank has written; DCP reshards on load, so a state saved at one world size
resumes at any other (and at one process, without a process group).

Nothing here builds its own communication: only ``torch.distributed`` collectives, FSDP2 and DCP.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from wide.errors import WideError

DEFAULT_TIMEOUT_S = 600.0
ERROR_DIR_ENV = "WIDE_ERROR_DIR"  # set by launch(): each failing rank writes rank<r>.txt there


@dataclass(frozen=True)
class DistEnv:
    """Where this process stands: ``rank`` of ``world_size`` (``local_rank`` on its node) and its device.

    ``active`` is True when a process group is open (even with ``world_size == 1``).
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device | None = None
    active: bool = False

    @property
    def is_main(self) -> bool:
        """True on rank 0, the only rank that logs, shows progress and writes non-sharded files."""
        return self.rank == 0


def launched_by_torchrun() -> bool:
    """True in a worker started by ``torchrun`` / ``torch.distributed.run`` (its env vars are set)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"))


def current() -> DistEnv:
    """The :class:`DistEnv` of the open process group, or the single-process one when none is open."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return DistEnv()
    backend = dist.get_backend()
    local = int(os.environ.get("LOCAL_RANK", 0))
    dev = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    return DistEnv(dist.get_rank(), dist.get_world_size(), local, dev, True)


def init(device: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> DistEnv:
    """Open the process group when running under torchrun; otherwise return the single-process env.

    Args:
        device: ``"cpu"``, ``"cuda"`` or None (CUDA when available). On CUDA each rank takes GPU
            ``LOCAL_RANK`` and the backend is NCCL; on CPU the backend is gloo.
        timeout_s: seconds any collective may wait before failing (so a dead rank cannot hang the job).

    Returns:
        the :class:`DistEnv` of this process.

    Raises:
        WideError: ``device`` is not cpu/cuda, CUDA is asked for but missing, or there are more local
            ranks than GPUs.
    """
    import torch.distributed as dist

    if device is not None and str(device).split(":")[0] not in ("cpu", "cuda"):
        raise WideError(f"--device {device!r} must be cpu or cuda")
    if not launched_by_torchrun():
        return DistEnv(device=torch.device(device) if device else None)
    if dist.is_initialized():
        return current()
    use_cuda = (device is None and torch.cuda.is_available()) or (device is not None and str(device).startswith("cuda"))
    local = int(os.environ["LOCAL_RANK"])
    if use_cuda:
        if not torch.cuda.is_available():
            raise WideError("--device cuda was asked for but no CUDA GPU is visible")
        if local >= torch.cuda.device_count():
            raise WideError(f"local rank {local} has no GPU: only {torch.cuda.device_count()} visible; "
                            f"use --nproc-per-node <= {torch.cuda.device_count()}")
        torch.cuda.set_device(local)
        dev = torch.device("cuda", local)
        dist.init_process_group("nccl", timeout=_dt.timedelta(seconds=timeout_s), device_id=dev)
    else:
        dev = torch.device("cpu")
        dist.init_process_group("gloo", timeout=_dt.timedelta(seconds=timeout_s))
    return DistEnv(dist.get_rank(), dist.get_world_size(), local, dev, True)


def shutdown(synchronize: bool = False) -> None:
    """Close the process group if one is open (idempotent).

    Args:
        synchronize: wait for every rank first (a barrier). Pass True on the success path: a gloo rank that
            tears its group down while a peer still has traffic in flight to it can abort the process
            (``terminate called without an active exception``, seen in CI). Leave False after an error,
            where a peer may never reach the barrier.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        if synchronize and dist.get_world_size() > 1:
            dist.barrier()
        dist.destroy_process_group()


def shard(wm: nn.Module, env: DistEnv, reshard_after_forward: bool = True) -> None:
    """Apply FSDP2 ``fully_shard`` to a :class:`wide.model.WideModel` in place, per decoder layer, with the
    weights of rank 0.

    Routers: all of them one float32 unit (no parameter cast), not resharded after forward: one all-gather
    and one reduce-scatter a step instead of three collectives per router (each with a fixed cost: on 2 CPU
    processes, 30 layers, this halved the step; issue 6). Decoder layers: one unit each, with
    ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)`` on CUDA (bf16 parameters and
    compute, fp32 gradient reduction) and fp32 on CPU. The root unit takes the rest. Parameters end on
    ``env.device``. Only rank 0 needs real weights (e.g. on the CPU); the other ranks may hold the same
    model on the ``meta`` device (:func:`load_base`): after sharding, every rank's shards are filled from
    rank 0's full state dict (``set_model_state_dict(..., broadcast_from_rank0=True)``) and the
    non-persistent buffers (rotary ``inv_freq``) are broadcast too. Call after LoRA injection and after
    enabling activation checkpointing.

    ``reshard_after_forward`` is FSDP2's option for the decoder layers. True (default): each layer's weights
    are freed after its forward and all-gathered again in backward (least memory: a rank holds 1/world of
    the base). False: the gathered bf16 weights stay from forward to backward, so a step all-gathers the
    base once instead of twice; every rank then holds the whole base during the step (as a single GPU
    does), which suits routers-only training of a model that fits on one GPU.

    Raises:
        WideError: no process group is open.
    """
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from wide.model import decoder_layers

    if not env.active:
        raise WideError("shard() needs an open process group (run under torchrun)")
    persistent = set(wm.state_dict().keys())
    transient = [n for n, _ in wm.named_buffers() if n not in persistent]
    full_sd = transient_values = None
    if env.is_main:  # references to rank 0's full tensors, taken before sharding replaces the parameters
        full_sd = dict(wm.state_dict())
        bufs = dict(wm.named_buffers())
        transient_values = {n: bufs[n].detach().clone() for n in transient}
    mesh = init_device_mesh(env.device.type, (env.world_size,))
    fp32 = MixedPrecisionPolicy()
    if env.device.type == "cuda":
        layer_mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    else:
        layer_mp = fp32
    # Router.forward returns a view of its output; nothing writes into it in place, so FSDP's warning (naming
    # every router of the one routers unit) is moot.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \((FSDPRouter(, )?)+\) returned a view tensor")
    routers = [*wm.attn_routers, *wm.ffn_routers]
    if routers:  # one unit for all routers: 2 collectives a step instead of 3 per router (issue 6)
        fully_shard(routers, mesh=mesh, mp_policy=fp32, reshard_after_forward=False)
    for layer in decoder_layers(wm.base):
        fully_shard(layer, mesh=mesh, mp_policy=layer_mp, reshard_after_forward=reshard_after_forward)
    fully_shard(wm, mesh=mesh, mp_policy=layer_mp, reshard_after_forward=reshard_after_forward)
    wm.to_empty(device=env.device)
    set_model_state_dict(wm, full_sd if env.is_main else {},
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    bufs = dict(wm.named_buffers())
    for n in transient:
        if env.is_main:
            bufs[n].copy_(transient_values[n])
        dist.broadcast(bufs[n], src=0)
    del full_sd, transient_values


def load_base(spec: str | None, env: DistEnv, device: str | None = None, check=None, config_check=None):
    """Load the frozen base model for this process: everything on rank 0, only the structure elsewhere.

    Single process: :func:`wide.model.load_base_model` on ``device``. Under a process group: rank 0
    loads the weights on the CPU (bf16 when training on GPUs) and every other rank builds the same model
    on the ``meta`` device (no memory), so no GPU ever holds the whole model; :func:`shard` then hands
    each rank its shard from rank 0. Every rank reads the config and the tokenizer and runs ``check``.

    Args:
        spec: ``--model`` (see :func:`wide.model.resolve_model`).
        env: this process's :class:`DistEnv`.
        device: single-process device (default CUDA when available).
        check: callable ``f(hf_config, tokenizer)`` run before weights are read (see ``load_base_model``).
        config_check: callable ``f(hf_config)`` run before the tokenizer loads (see ``load_base_model``).

    Returns:
        ``(model, tokenizer, source)`` with ``requires_grad=False`` and eval mode.

    Raises:
        WideError: as :func:`wide.model.load_base_model`.
    """
    from wide.model import check_architecture, load_base_model, quiet_bpe_cleanup, resolve_model

    if not env.active:
        return load_base_model(spec, device=device, check=check, config_check=config_check)
    dtype = torch.bfloat16 if env.device.type == "cuda" else torch.float32
    if env.is_main:
        return load_base_model(spec, device="cpu", dtype=dtype, check=check, config_check=config_check)
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    src = resolve_model(spec)
    try:
        hf_config = AutoConfig.from_pretrained(src.directory, **src.hf_kwargs())
    except (OSError, ValueError, KeyError) as e:
        raise WideError(f"cannot read model {src.ref!r}: {str(e).splitlines()[0]}") from None
    check_architecture(hf_config)
    if config_check is not None:
        config_check(hf_config)
    try:
        tok = quiet_bpe_cleanup(AutoTokenizer.from_pretrained(src.directory, **src.hf_kwargs()))
    except (OSError, ValueError, KeyError) as e:
        raise WideError(f"cannot read model {src.ref!r}: {str(e).splitlines()[0]}") from None
    if check is not None:
        check(hf_config, tok)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    model.eval()
    model.requires_grad_(False)
    return model, tok, src


def is_sharded(t: torch.Tensor) -> bool:
    """True for a DTensor (an FSDP2-sharded parameter or gradient)."""
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor behind a possibly sharded one (a collective for a DTensor: call on every rank)."""
    return t.full_tensor() if is_sharded(t) else t


def all_mean(values: list[float], env: DistEnv) -> list[float]:
    """Mean of each float over all ranks (float64 all-reduce); the input itself when single-process."""
    import torch.distributed as dist

    if not env.active or env.world_size == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=env.device)
    dist.all_reduce(t)
    return (t / env.world_size).tolist()


def global_keep(keeps: list[torch.Tensor], env: DistEnv) -> list[torch.Tensor]:
    """Per-layer keep ratios of the global micro-batch, differentiable through this rank's share.

    Each rank holds keep ratios ``k_r`` (scalars, mean over its ``B`` sequences of equal length). The
    global ratio is ``k = mean_r k_r``. The returned value equals ``k`` while its gradient is that of
    ``k_r``; FSDP's gradient averaging over ranks then gives exactly ``d/dθ f(k)`` for the sparsity loss
    ``f`` (Eq. 6 / Eq. 22), which is not linear in ``k`` and so cannot be averaged per rank.

    Args:
        keeps: list of scalar float32 tensors (one per routed layer), possibly empty.

    Returns:
        a list of the same length.
    """
    import torch.distributed as dist

    if not keeps or not env.active or env.world_size == 1:
        return keeps
    local = torch.stack(keeps)
    g = local.detach().clone()
    dist.all_reduce(g)
    g = g / env.world_size
    return list((local + (g - local).detach()).unbind())


def _sharded_1d(tensors: list[torch.Tensor]):
    """The common 1-D device mesh of DTensors all sharded along it (FSDP2's ``Shard(0)``), else None."""
    from torch.distributed.tensor import Shard

    mesh = tensors[0].device_mesh
    for t in tensors:
        if t.device_mesh != mesh or mesh.ndim != 1 or not all(isinstance(pl, Shard) for pl in t.placements):
            return None
    return mesh


def _by_device_dtype(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    groups: dict = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    return list(groups.values())


@torch.no_grad()
def clip_grad_norm_(params, max_norm: float, env: DistEnv) -> torch.Tensor:
    """:func:`torch.nn.utils.clip_grad_norm_` (2-norm) for parameters that may be FSDP2-sharded.

    Without sharded gradients this *is* ``torch.nn.utils.clip_grad_norm_``. With them, it works on this
    rank's local shards: ``torch._foreach_norm`` over the shards, their squares summed over the mesh by one
    ``all_reduce`` (one value per parameter), the norm of the resulting per-parameter norms, then
    ``torch._foreach_mul_`` of the shards by ``min(1, max_norm / (norm + 1e-6))``: the arithmetic of
    clip_grad_norm_ over DTensors (whose norm partials reduce the same way), without one DTensor dispatch
    per parameter and op (issue 6).

    Returns:
        the total gradient norm before clipping, a plain 0-d tensor (the same on every rank).
    """
    import torch.distributed as dist

    grads = [p.grad for p in params if p.grad is not None]
    sharded = [g for g in grads if is_sharded(g)]
    mesh = _sharded_1d(sharded) if sharded else None
    if mesh is None:
        total = torch.nn.utils.clip_grad_norm_(params, max_norm)
        return full(total) if is_sharded(total) else total
    local = [g.to_local() for g in sharded]
    plain = [g for g in grads if not is_sharded(g)]  # replicated: counted once, not summed over ranks

    def norms(ts):
        return [n.to(grads[0].device) for grp in _by_device_dtype(ts) for n in torch._foreach_norm(grp, 2.0)]

    # per-parameter norms of the whole gradients (sqrt of the summed squares of the shards' norms, as a
    # DTensor norm partial reduces), then the norm of those norms, as clip_grad_norm_ does
    sq = torch.stack(norms(local)) ** 2
    dist.all_reduce(sq, group=mesh.get_group())
    per_param = torch.cat([sq ** 0.5, torch.stack(norms(plain))]) if plain else sq ** 0.5
    total = torch.linalg.vector_norm(per_param, 2.0)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for grp in _by_device_dtype(local + plain):
        torch._foreach_mul_(grp, coef.to(grp[0].device))
    return total


@torch.no_grad()
def optimizer_step(opt: torch.optim.Optimizer) -> None:
    """``opt.step()``, run on the local shards when parameters are FSDP2-sharded.

    Without sharded parameters this is ``opt.step()``. With them, the same optimizer class performs the
    step on plain tensors: each parameter's local shard, its gradient's local shard and the local shards
    of its state (``exp_avg`` ... of ``opt.state``, updated in place), with ``opt``'s current
    hyper-parameters. Element-wise optimizers (AdamW) compute exactly what they compute over DTensors,
    with the foreach kernels a plain-tensor run would choose, but without one DTensor dispatch per
    parameter and op. ``opt.state`` keeps DTensors (state created in the first step is wrapped into
    DTensors with the parameter's layout), so ``get_state_dict`` / DCP save and load it as before.
    """
    from collections import defaultdict

    from torch.distributed.tensor import DTensor

    if not any(is_sharded(p) for g in opt.param_groups for p in g["params"]):
        opt.step()
        return
    shadow = getattr(opt, "_wide_local_opt", None)
    if shadow is None:
        shadow = type(opt)([torch.zeros(1)])
        shadow.defaults = dict(opt.defaults)
        opt._wide_local_opt = shadow
    pairs, groups = [], []
    shadow.state = defaultdict(dict)
    for g in opt.param_groups:
        lps = []
        for p in g["params"]:
            if p.grad is None:
                continue
            lp = (p.to_local() if is_sharded(p) else p).detach()  # aliases the shard's storage
            lp.grad = p.grad.to_local() if is_sharded(p.grad) else p.grad
            st = opt.state.get(p)
            if st:
                shadow.state[lp] = {k: (v.to_local() if is_sharded(v) else v) for k, v in st.items()}
            lps.append(lp)
            pairs.append((p, lp))
        groups.append({**g, "params": lps})
    shadow.param_groups = groups
    try:
        shadow.step()
    finally:
        for p, lp in pairs:
            lp.grad = None
            if not opt.state.get(p) and shadow.state.get(lp):  # state created by this first step
                opt.state[p] = {
                    k: DTensor.from_local(v, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                          stride=p.stride())
                    if is_sharded(p) and torch.is_tensor(v) and v.dim() > 0 and v.shape == lp.shape else v
                    for k, v in shadow.state[lp].items()}
        shadow.state = defaultdict(dict)
        shadow.param_groups = []


def barrier(env: DistEnv) -> None:
    """Wait for every rank (no-op single-process)."""
    import torch.distributed as dist

    if env.active and env.world_size > 1:
        dist.barrier()


def broadcast_object(obj, env: DistEnv):
    """Rank 0's ``obj`` on every rank (a small JSON-able value)."""
    import torch.distributed as dist

    if not env.active or env.world_size == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


# --- launching ------------------------------------------------------------------------------------
_TORCHRUN_LOG = re.compile(r"^(?:[WIE]\d{4} \d\d:\d\d:\d\d|\*{5,}|Setting OMP_NUM_THREADS)")


def strip_nproc(argv: list[str]) -> list[str]:
    """``argv`` without ``--nproc N`` / ``--nproc=N``."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a == "--nproc":
            skip = True
            continue
        if a.startswith("--nproc="):
            continue
        out.append(a)
    return out


def launch(nproc: int, command: str, argv: list[str]) -> int:
    """Run ``python -m wide <argv>`` on ``nproc`` local processes through ``torch.distributed.run``.

    Standalone rendezvous on this node (a free port is chosen). Worker output streams through; torchrun's
    own log lines and its failure report are dropped, and if a rank fails the job ends with that rank's
    one-line message (the lowest failing rank's).

    Args:
        nproc: processes (GPUs) on this node, ``>= 1``.
        command: the subcommand name, for messages.
        argv: the full ``wide`` argument list without ``--nproc``.

    Returns:
        0 on success, 2 if a rank failed on bad input (:class:`WideError`), else 1.

    Raises:
        WideError: ``nproc < 1``, or more processes than GPUs when CUDA is used.
    """
    if nproc < 1:
        raise WideError(f"--nproc {nproc} must be >= 1")
    with tempfile.TemporaryDirectory(prefix="wide-errors-") as errdir:
        env = dict(os.environ)
        env[ERROR_DIR_ENV] = errdir
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
        env.setdefault("LOGLEVEL", "ERROR")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "-m", "wide", *argv]
        proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE)
        _forward_stderr(proc)
        rc = proc.wait()
        if rc == 0:
            return 0
        reports = sorted(Path(errdir).glob("rank*.json"), key=lambda p: int(p.stem[4:]))
        if reports:
            rep = json.loads(reports[0].read_text())
            print(f"wide {command}: error (rank {rep['rank']}): {rep['message']}", file=sys.stderr, flush=True)
            return 2 if rep.get("bad_input") else 1
        print(f"wide {command}: error: torchrun exited with code {rc} (a worker died without a report)",
              file=sys.stderr, flush=True)
        return 1


def _forward_stderr(proc: subprocess.Popen) -> None:
    """Copy the child's stderr to ours (keeping ``\\r`` progress updates), minus torchrun's own lines."""
    buf = b""
    dropping = False
    out = sys.stderr.buffer if hasattr(sys.stderr, "buffer") else None
    while True:
        chunk = proc.stderr.read1(4096) if hasattr(proc.stderr, "read1") else proc.stderr.read(4096)
        if not chunk:
            break
        buf += chunk
        parts = re.split(rb"(?<=[\r\n])", buf)
        buf = parts.pop() if parts and not parts[-1].endswith((b"\r", b"\n")) else b""
        for seg in parts:
            text = seg.decode("utf-8", "replace")
            if text.startswith("Traceback (most recent call last)"):
                dropping = True  # torchrun's ChildFailedError report; workers never print tracebacks
            if dropping or _TORCHRUN_LOG.match(text):
                continue
            if out is not None:
                out.write(seg)
                out.flush()
            else:
                sys.stderr.write(text)
    if buf and not dropping and out is not None:
        out.write(buf)
        out.flush()


def report_error(command: str, exc: BaseException, env: DistEnv | None = None) -> int:
    """Handle an exception in a worker: one line (to the launcher's error folder or stderr), exit code.

    Returns 2 for a :class:`WideError` (bad input), 1 otherwise.
    """
    env = env or current()
    bad = isinstance(exc, WideError)
    msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if not bad:
        msg = f"{type(exc).__name__}: {msg}"
    errdir = os.environ.get(ERROR_DIR_ENV)
    rank = env.rank if env.active else int(os.environ.get("RANK", 0))
    if errdir and Path(errdir).is_dir():
        Path(errdir, f"rank{rank}.json").write_text(json.dumps({"rank": rank, "message": msg, "bad_input": bad}))
    else:
        print(f"wide {command}: error (rank {rank}): {msg}", file=sys.stderr, flush=True)
    return 2 if bad else 1


# --- sharded training state (DCP) -------------------------------------------------------------------
def save_sharded(state: dict, directory: str | os.PathLike, meta: dict, env: DistEnv) -> None:
    """Write a DCP checkpoint of ``state`` atomically to ``directory`` (all ranks call this).

    Every rank writes its shards into ``.<name>.tmp``; after DCP's own completion step, rank 0 adds
    ``meta`` as ``train_state.json``, moves any previous checkpoint aside, renames the temporary folder
    into place and deletes the old one. A crash leaves either the previous or the new checkpoint whole.
    The folder must be on a file system every rank sees (one node, or a shared one across nodes).

    Args:
        state: ``{"model": ..., "optim": ...}`` from ``get_state_dict`` (DTensors or plain tensors).
        directory: final folder, e.g. ``<output>/train_state.dcp``.
        meta: JSON-able facts (step, settings) stored next to the shards.

    Raises:
        RuntimeError: a rank failed to write its shards (the previous checkpoint stays in place).
    """
    import torch.distributed.checkpoint as dcp

    directory = Path(directory)
    tmp = directory.parent / f".{directory.name}.tmp"
    old = directory.parent / f".{directory.name}.old"
    if env.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier(env)
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

    try:
        dcp.save(state, checkpoint_id=str(tmp), no_dist=not (env.active and env.world_size > 1))
    except CheckpointException as e:
        first = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
        raise RuntimeError(f"writing the training state to {tmp} failed: {first}") from None
    if env.is_main:
        (tmp / "train_state.json").write_text(json.dumps(meta, indent=2) + "\n")
        shutil.rmtree(old, ignore_errors=True)
        if directory.exists():
            os.replace(directory, old)
        os.replace(tmp, directory)
        shutil.rmtree(old, ignore_errors=True)
    barrier(env)


def sharded_meta(directory: str | os.PathLike) -> dict | None:
    """The ``train_state.json`` of a DCP checkpoint folder (or of its ``.old`` copy left by a crash), or None.

    Raises:
        WideError: the JSON is unreadable.
    """
    directory = Path(directory)
    for d in (directory, directory.parent / f".{directory.name}.old"):
        f = d / "train_state.json"
        if f.is_file() and (d / ".metadata").is_file():
            try:
                meta = json.loads(f.read_text())
                meta["_path"] = str(d)
                return meta
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise WideError(f"corrupt training state {f}: {e}") from None
    return None


def load_sharded(state: dict, directory: str | os.PathLike, env: DistEnv) -> None:
    """Fill ``state`` (a ``get_state_dict`` template) in place from a DCP folder, at any world size.

    Raises:
        WideError: the folder is missing or unreadable.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

    try:
        dcp.load(state, checkpoint_id=str(directory), no_dist=not (env.active and env.world_size > 1))
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - any failure to read is a corrupt checkpoint
        first = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
        raise WideError(f"corrupt training state {directory}: {first}") from None
