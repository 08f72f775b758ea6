"""Gradient clipping and the optimizer step on FSDP2 shards.

:func:`wide.train.fsdp.clip_grad_norm_` and :func:`wide.train.fsdp.optimizer_step` work on each rank's local
shards (no per-parameter DTensor dispatch) and must give, bit for bit, what ``torch.nn.utils.clip_grad_norm_``
and ``AdamW.step`` give over the DTensors.

The 2-process checks run this file as a torchrun worker on gloo (CPU); single-process calls must be the
plain torch calls.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

HERE = Path(__file__).resolve().parent


def _env():
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", LOGLEVEL="ERROR")
    src = str(HERE.parent / "src")
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _model():
    """Odd shapes: uneven shards over 2 ranks, and a 1-row weight whose shard on rank 1 is empty."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 5), nn.Tanh(), nn.Linear(5, 3), nn.Tanh(), nn.Linear(3, 1))


def _backward(m, rank):
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(4, 7, generator=g)
    (m(x) ** 2).sum().mul(50.0).backward()


def _sharded(mesh):
    from torch.distributed.fsdp import fully_shard

    m = _model()
    fully_shard([m[0], m[2]], mesh=mesh, reshard_after_forward=False)  # a multi-module unit, as wide's routers
    fully_shard(m[4], mesh=mesh)
    fully_shard(m, mesh=mesh)
    return m


def _check_clip(mesh, rank):
    import wide.train.fsdp as D

    env = D.current()
    for max_norm in (0.05, 1e6):  # clipping active / inactive
        a, b = _sharded(mesh), _sharded(mesh)
        _backward(a, rank)
        _backward(b, rank)
        na = torch.nn.utils.clip_grad_norm_(list(a.parameters()), max_norm).full_tensor()
        nb = D.clip_grad_norm_(list(b.parameters()), max_norm, env)
        assert not D.is_sharded(nb)
        assert torch.equal(na, nb), (max_norm, na.item(), nb.item())
        if max_norm < 1:
            assert na.item() > max_norm  # really clipped
        for pa, pb in zip(a.parameters(), b.parameters()):
            torch.testing.assert_close(pa.grad.full_tensor(), pb.grad.full_tensor(), rtol=0, atol=0)


def _check_mixed_clip(mesh, rank):
    """DTensor gradients next to a replicated plain one: equal to clip_grad_norm_ over the full tensors."""
    from torch.distributed.tensor import Shard, distribute_tensor

    import wide.train.fsdp as D

    torch.manual_seed(1)
    fulls = [torch.randn(5, 3), torch.randn(1, 4), torch.randn(3)]
    plain = torch.randn(2, 2)
    ref = [nn.Parameter(t.clone()) for t in [*fulls, plain]]
    for p in ref:
        p.grad = p.detach() * 3.0
    nref = torch.nn.utils.clip_grad_norm_(ref, 0.5)
    ps = [nn.Parameter(distribute_tensor(t.clone(), mesh, [Shard(0)])) for t in fulls] + [nn.Parameter(plain.clone())]
    for p in ps:
        p.grad = p.detach() * 3.0
    n = D.clip_grad_norm_(ps, 0.5, D.current())
    torch.testing.assert_close(n, nref, rtol=1e-6, atol=0)
    for p, r in zip(ps, ref):
        torch.testing.assert_close(D.full(p.grad), r.grad, rtol=1e-6, atol=1e-7)


def _check_optimizer(mesh, rank):
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.tensor import DTensor

    import wide.train.fsdp as D

    for kw in ({}, {"foreach": True}, {"amsgrad": True}):
        a, b = _sharded(mesh), _sharded(mesh)
        oa = torch.optim.AdamW(a.parameters(), lr=0.05, weight_decay=0.1, **kw)
        ob = torch.optim.AdamW(b.parameters(), lr=0.05, weight_decay=0.1, **kw)
        for step in range(3):
            for m, o in ((a, oa), (b, ob)):
                o.zero_grad(set_to_none=True)
                for g in o.param_groups:
                    g["lr"] = 0.05 / (step + 1)
                _backward(m, rank)
            oa.step()
            D.optimizer_step(ob)
        for pa, pb in zip(a.parameters(), b.parameters()):
            assert torch.equal(pa.full_tensor(), pb.full_tensor())
            sa, sb = oa.state[pa], ob.state[pb]
            assert sa.keys() == sb.keys()
            for k in sa:
                assert type(sa[k]) is type(sb[k]), (k, type(sa[k]), type(sb[k]))
                if isinstance(sa[k], DTensor):
                    assert (sa[k].placements, sa[k].shape, sa[k].stride()) == (sb[k].placements, sb[k].shape,
                                                                                sb[k].stride())
                    assert sa[k].to_local().shape == sb[k].to_local().shape
                assert torch.equal(D.full(sa[k]), D.full(sb[k])), k
        _, osa = get_state_dict(a, oa)
        _, osb = get_state_dict(b, ob)
        assert set(osa["state"]) == set(osb["state"])


def _worker(what: str) -> int:
    from torch.distributed.device_mesh import init_device_mesh

    import wide.train.fsdp as D

    env = D.init("cpu", timeout_s=60)
    try:
        mesh = init_device_mesh("cpu", (env.world_size,))
        {"clip": _check_clip, "mixed": _check_mixed_clip, "optim": _check_optimizer}[what](mesh, env.rank)
    except BaseException:
        D.shutdown()
        raise
    D.shutdown(synchronize=True)
    return 0


@pytest.mark.parametrize("what", ["clip", "mixed", "optim"])
def test_two_processes_match_torch(what):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(Path(__file__).resolve()), what]
    p = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-4000:]


def test_single_process_is_plain_torch():
    import wide.train.fsdp as D

    a, b = _model(), _model()
    _backward(a, 0)
    _backward(b, 0)
    na = torch.nn.utils.clip_grad_norm_(list(a.parameters()), 0.05)
    nb = D.clip_grad_norm_(list(b.parameters()), 0.05, D.current())
    assert torch.equal(na, nb)
    oa, ob = torch.optim.AdamW(a.parameters(), lr=0.1), torch.optim.AdamW(b.parameters(), lr=0.1)
    oa.step()
    D.optimizer_step(ob)
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)
    assert not hasattr(ob, "_wide_local_opt")


if __name__ == "__main__":  # torchrun worker
    sys.path.insert(0, str(HERE.parent / "src"))
    raise SystemExit(_worker(sys.argv[1]))
