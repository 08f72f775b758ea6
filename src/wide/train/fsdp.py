"""Data-parallel training on FSDP2 (as the paper's, §4.1) and ``--nproc``'s launcher: under torchrun :func:`init`
opens the process group (NCCL on GPUs, gloo on the CPU) and :func:`apply_fsdp` shards the model; rank ``r`` of
``W`` reads rows ``r B .. r B + B - 1`` of each global micro-batch. One process runs the same code without a group.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import tempfile
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from wide.errors import WideError, first_line
from wide.hub import load_base_model
from wide.model import decoder_layers

ERROR_DIR_ENV = "WIDE_ERROR_DIR"  # set by launch(): a failing rank writes rank<r>.json there


@dataclass(frozen=True)
class DistEnv:
    """This process's ``rank`` of ``world_size`` and its device; ``active`` when a process group is open."""

    rank: int = 0
    world_size: int = 1
    device: torch.device | None = None
    active: bool = False

    @property
    def is_main(self) -> bool:  # rank 0 logs and writes the files that are not sharded
        return self.rank == 0


def launched_by_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"))


def current() -> DistEnv:
    """The :class:`DistEnv` of the open process group, or the single-process one."""
    if not (dist.is_available() and dist.is_initialized()):
        return DistEnv()
    nccl = dist.get_backend() == "nccl"
    return DistEnv(dist.get_rank(), dist.get_world_size(),
                   torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu"), True)


def init(device: str | None = None, timeout_s: float = 600.0) -> DistEnv:
    """Open the process group under torchrun (collectives time out after ``timeout_s``; on CUDA rank ``LOCAL_RANK``
    takes that GPU), else the single-process env. Raises WideError when CUDA is asked for and there are too few GPUs."""
    if not launched_by_torchrun():
        return DistEnv(device=torch.device(device) if device else None)
    if dist.is_initialized():
        return current()
    local, timeout = int(os.environ["LOCAL_RANK"]), datetime.timedelta(seconds=timeout_s)
    if (device is None and torch.cuda.is_available()) or str(device).startswith("cuda"):
        if not torch.cuda.is_available():
            raise WideError("--device cuda was asked for but no CUDA GPU is visible")
        if local >= torch.cuda.device_count():
            raise WideError(f"local rank {local} has no GPU: only {torch.cuda.device_count()} visible; "
                            f"use --nproc-per-node <= {torch.cuda.device_count()}")
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", timeout=timeout, device_id=torch.device("cuda", local))
    else:
        dist.init_process_group("gloo", timeout=timeout)
    return current()


def shutdown(synchronize: bool = False) -> None:
    """Close the process group if open; ``synchronize`` (on success only) waits for every rank first."""
    if dist.is_available() and dist.is_initialized():
        if synchronize and dist.get_world_size() > 1:
            dist.barrier()
        dist.destroy_process_group()


def apply_fsdp(wm: nn.Module, env: DistEnv, reshard_after_forward: bool = True) -> None:
    """Shard a :class:`wide.model.WideModel` with FSDP2 ``fully_shard`` in place, filled from rank 0's weights (the
    others may be on the ``meta`` device): all routers one float32 unit kept from forward to backward (two
    collectives a step), each decoder layer a unit (bf16 parameters, fp32 reduction on CUDA), the root the rest."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    persistent = set(wm.state_dict())
    transient = {n: b.detach().clone() for n, b in wm.named_buffers() if n not in persistent}  # rotary inv_freq
    full_sd = dict(wm.state_dict()) if env.is_main else {}
    mesh = init_device_mesh(env.device.type, (env.world_size,))
    fp32 = MixedPrecisionPolicy()
    layer_mp = MixedPrecisionPolicy(torch.bfloat16, torch.float32) if env.device.type == "cuda" else fp32
    routers = [*wm.attn_routers, *wm.ffn_routers]
    if routers:
        fully_shard(routers, mesh=mesh, mp_policy=fp32, reshard_after_forward=False)
    for layer in decoder_layers(wm.base):
        fully_shard(layer, mesh=mesh, mp_policy=layer_mp, reshard_after_forward=reshard_after_forward)
    fully_shard(wm, mesh=mesh, mp_policy=layer_mp, reshard_after_forward=reshard_after_forward)
    wm.to_empty(device=env.device)
    set_model_state_dict(wm, full_sd, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    bufs = dict(wm.named_buffers())
    for n, value in transient.items():
        if env.is_main:
            bufs[n].copy_(value)
        dist.broadcast(bufs[n], src=0)


def load_base(spec: str | None, env: DistEnv, device: str | None = None, check=None, config_check=None):
    """:func:`wide.hub.load_base_model` for this process: under a process group rank 0 loads the weights on the CPU
    (bf16 for GPUs) and the other ranks build the model on the ``meta`` device (:func:`apply_fsdp` fills them)."""
    if not env.active:
        return load_base_model(spec, device=device, check=check, config_check=config_check)
    return load_base_model(spec, device="cpu", dtype=torch.bfloat16 if env.device.type == "cuda" else torch.float32,
                           check=check, config_check=config_check, weights=env.is_main)


def is_sharded(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a possibly sharded tensor."""
    return t.to_local() if is_sharded(t) else t


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor behind a possibly sharded one (a collective: call on every rank)."""
    return t.full_tensor() if is_sharded(t) else t


def barrier(env: DistEnv) -> None:
    if env.active and env.world_size > 1:
        dist.barrier()


def all_mean(values: list[float], env: DistEnv) -> list[float]:
    """Each value averaged over the ranks (float64)."""
    if not env.active or env.world_size == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=env.device)
    dist.all_reduce(t)
    return (t / env.world_size).tolist()


def global_keep(keeps: list[torch.Tensor], env: DistEnv) -> list[torch.Tensor]:
    """Keep ratios of the global micro-batch ``k = mean_r k_r`` with the gradient of this rank's ``k_r``: FSDP's
    gradient averaging then gives the exact gradient of the non-linear sparsity loss (Eq. 6 / Eq. 22) of ``k``."""
    if not keeps or not env.active or env.world_size == 1:
        return keeps
    local = torch.stack(keeps)
    g = local.detach().clone()
    dist.all_reduce(g)
    return list((local + (g / env.world_size - local).detach()).unbind())


@torch.no_grad()
def clip_grad_norm_(params, max_norm: float, env: DistEnv) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` (2-norm), on the local shards of FSDP2 gradients: the per-parameter squared
    norms summed over the mesh in one all-reduce, then the same arithmetic without a DTensor dispatch per parameter.
    Returns the total norm before clipping, a plain 0-d tensor equal on every rank."""
    grads = [p.grad for p in params if p.grad is not None]
    sharded = [g for g in grads if is_sharded(g)]
    if not sharded:
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    shards, plain = [g.to_local() for g in sharded], [g for g in grads if not is_sharded(g)]
    dev = grads[0].device

    def norms(ts):
        groups = defaultdict(list)
        for t in ts:
            groups[(t.device, t.dtype)].append(t)
        return [n.to(dev) for grp in groups.values() for n in torch._foreach_norm(grp, 2.0)]

    sq = torch.stack(norms(shards)) ** 2
    dist.all_reduce(sq, group=sharded[0].device_mesh.get_group())
    per_param = torch.cat([sq ** 0.5, torch.stack(norms(plain))]) if plain else sq ** 0.5
    total = torch.linalg.vector_norm(per_param, 2.0)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for t in shards + plain:
        t.mul_(coef.to(t.device))
    return total


@torch.no_grad()
def optimizer_step(opt: torch.optim.Optimizer) -> None:
    """``opt.step()``; with FSDP2 parameters the same optimizer class steps on the local shards (parameters, their
    gradients and state, updated in place), which element-wise optimizers (AdamW) compute exactly as over DTensors
    without a dispatch per parameter and op. ``opt.state`` keeps DTensors, so DCP saves and loads it as before."""
    from torch.distributed.tensor import DTensor

    if not any(is_sharded(p) for g in opt.param_groups for p in g["params"]):
        opt.step()
        return
    shadow = type(opt)([torch.zeros(1)])
    shadow.defaults = dict(opt.defaults)
    pairs, groups = [], []
    for g in opt.param_groups:
        lps = []
        for p in (p for p in g["params"] if p.grad is not None):
            lp = local(p).detach()
            lp.grad = local(p.grad)
            if opt.state.get(p):
                shadow.state[lp] = {k: local(v) for k, v in opt.state[p].items()}
            lps.append(lp)
            pairs.append((p, lp))
        groups.append({**g, "params": lps})
    shadow.param_groups = groups
    shadow.step()
    for p, lp in pairs:
        lp.grad = None
        if not opt.state.get(p) and shadow.state.get(lp):  # state created by this first step
            opt.state[p] = {k: DTensor.from_local(v, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                                  stride=p.stride())
                            if is_sharded(p) and torch.is_tensor(v) and v.dim() > 0 and v.shape == lp.shape else v
                            for k, v in shadow.state[lp].items()}


def strip_nproc(argv: list[str]) -> list[str]:
    """``argv`` without ``--nproc N`` / ``--nproc=N``."""
    return [a for i, a in enumerate(argv) if a != "--nproc" and not a.startswith("--nproc=")
            and (i == 0 or argv[i - 1] != "--nproc")]


def launch(nproc: int, command: str, argv: list[str]) -> int:
    """Run ``python -m wide <argv>`` on ``nproc`` local processes through ``torch.distributed.run`` (standalone, its
    logging quiet); a failure ends with the lowest failing rank's one line. Returns 0, 2 (bad input) or 1."""
    if nproc < 1:
        raise WideError(f"--nproc {nproc} must be >= 1")
    with tempfile.TemporaryDirectory(prefix="wide-errors-") as errdir:
        env = {**os.environ, ERROR_DIR_ENV: errdir, "LOGLEVEL": os.environ.get("LOGLEVEL", "ERROR")}
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
        rc = subprocess.call([sys.executable, "-m", "wide.train.fsdp", "--standalone", f"--nproc-per-node={nproc}",
                              "-m", "wide", *argv], env=env)
        if rc == 0:
            return 0
        reports = sorted(Path(errdir).glob("rank*.json"), key=lambda p: int(p.stem[4:]))
        if not reports:
            print(f"wide {command}: error: torchrun exited with code {rc} (a worker died without a report)",
                  file=sys.stderr, flush=True)
            return 1
        rep = json.loads(reports[0].read_text())
        print(f"wide {command}: error (rank {rep['rank']}): {rep['message']}", file=sys.stderr, flush=True)
        return 2 if rep["bad_input"] else 1


def report_error(command: str, exc: BaseException, env: DistEnv | None = None) -> int:
    """A worker's failure as one line (into :func:`launch`'s error folder, else stderr); returns 2 for a
    :class:`WideError`, else 1."""
    env = env or current()
    bad = isinstance(exc, WideError)
    msg = first_line(exc) if bad else f"{type(exc).__name__}: {first_line(exc)}"
    rank = env.rank if env.active else int(os.environ.get("RANK", 0))
    errdir = os.environ.get(ERROR_DIR_ENV)
    if errdir and Path(errdir).is_dir():
        Path(errdir, f"rank{rank}.json").write_text(json.dumps({"rank": rank, "message": msg, "bad_input": bad}))
    else:
        print(f"wide {command}: error (rank {rank}): {msg}", file=sys.stderr, flush=True)
    return 2 if bad else 1


if __name__ == "__main__":  # launch()'s torchrun: worker errors come back as report files, not as its log
    import logging

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    try:
        run(parse_args(sys.argv[1:]))
    except ChildFailedError:
        sys.exit(1)
