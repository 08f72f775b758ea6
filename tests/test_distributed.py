"""Multi-process training on FSDP2 with gloo on the CPU: a 2-process run matches a 1-process run
with the same global batch and seed; sharded (DCP) states resume across world sizes; errors on one rank end
the job without a hang.

The 2-process runs go through torchrun: either `wide ... --nproc 2` (the CLI path) or this file run as a
torchrun worker script (``python -m torch.distributed.run ... tests/test_distributed.py SPEC``), which
calls the same :func:`wide.train.loop.calibrate` with an interruption hook.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from wide_testutil import tiny_model  # noqa: E402

REL = 1e-5


def _env():
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", LOGLEVEL="ERROR")
    src = str(HERE.parent / "src")
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _torchrun(spec: dict, nproc: int = 2, timeout: float = 120):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(Path(__file__).resolve()), json.dumps(spec)]
    return subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=timeout)


def _blocks():
    return torch.randint(0, 128, (12, 16), generator=torch.Generator().manual_seed(3))


def _wide_model():
    from wide.config import WideConfig
    from wide.model import WideModel

    base = tiny_model()  # seeds the global RNG: routers initialize identically everywhere
    return WideModel(base, WideConfig(ffn_group_size=32, target_sparsity=0.5))


def _args(batch_size, steps=5, grad_accum=2):
    from wide.train.loop import CalibrationArgs

    return CalibrationArgs(steps=steps, batch_size=batch_size, grad_accum=grad_accum, lr=2e-2, warmup_steps=1,
                           save_every=2)


class _Stop(Exception):
    pass


def _calibrate(out, batch_size, stop_after=None, resume=False):
    """Stage-1 calibration of the tiny model in this process (under torchrun: this rank's share)."""
    from wide.train.loop import calibrate

    def cb(r):
        if stop_after is not None and r["step"] == stop_after:
            raise _Stop

    try:
        calibrate(_wide_model(), _blocks(), _args(batch_size), out, "tiny", resume=resume, progress=False, on_step=cb)
    except _Stop:
        pass


def _worker(spec: dict) -> int:
    import wide.train.fsdp as D

    env = D.init("cpu", timeout_s=60)
    ok = False
    try:
        if spec["mode"] == "fail":  # rank 1 fails on bad input while rank 0 waits in a collective
            if env.rank == 1:
                raise __import__("wide.errors", fromlist=["WideError"]).WideError("boom on rank 1")
            D.barrier(env)
        else:
            _calibrate(spec["out"], spec["batch_size"], spec.get("stop_after"), spec.get("resume", False))
        ok = True
        return 0
    except Exception as e:  # noqa: BLE001 - same handling as the CLI's workers
        return D.report_error("test", e, env)
    finally:
        D.shutdown(synchronize=ok)  # as the CLI: a barrier before teardown on success only


def _log(path):
    return [json.loads(ln) for ln in Path(path, "train_log.jsonl").read_text().splitlines()]


def _assert_same_losses(a, b):
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for x, y in zip(a, b):
        for k in ("lm_loss", "sparsity_loss", "attn_sparsity", "ffn_sparsity"):
            assert x[k] == pytest.approx(y[k], rel=REL, abs=1e-7), (x["step"], k, x[k], y[k])


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Uninterrupted 1-process run: global batch 4 per micro-batch x 2 accumulation."""
    out = tmp_path_factory.mktemp("ref")
    _calibrate(out, batch_size=4)
    return out


def test_resume_two_processes_to_one(tmp_path, reference):
    p = _torchrun({"mode": "calib", "out": str(tmp_path), "batch_size": 2, "stop_after": 3})
    assert p.returncode == 0, p.stderr[-3000:]
    assert (tmp_path / "train_state.dcp" / ".metadata").is_file()
    assert json.loads((tmp_path / "train_state.dcp" / "train_state.json").read_text())["step"] == 2
    first = _log(tmp_path)
    assert [r["world_size"] for r in first] == [2, 2, 2]
    _assert_same_losses(first, _log(reference)[:3])  # 2 processes match 1 process step by step
    from wide.errors import WideError

    # global batch 2 x 2 = 4, saved with 2 x 2 x 2 = 8: the message names the one setting that differs
    with pytest.raises(WideError, match=r"other settings: train\.global_batch: saved 8, now 4 "
                                        r"\(to continue it, give the saved values"):
        _calibrate(tmp_path, batch_size=2, resume=True)
    bad = tmp_path.parent / (tmp_path.name + "-corrupt")
    shutil.copytree(tmp_path, bad)
    shard = next((bad / "train_state.dcp").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:20])
    with pytest.raises(WideError, match="corrupt training state"):
        _calibrate(bad, batch_size=4, resume=True)
    _calibrate(tmp_path, batch_size=4, resume=True)  # same global batch on one process
    _assert_same_losses(_log(tmp_path), _log(reference))
    assert [r["world_size"] for r in _log(tmp_path)] == [2, 2, 1, 1, 1]


def test_resume_one_process_to_two(tmp_path, reference):
    _calibrate(tmp_path, batch_size=4, stop_after=3)
    assert json.loads((tmp_path / "train_state.dcp" / "train_state.json").read_text())["world_size"] == 1
    p = _torchrun({"mode": "calib", "out": str(tmp_path), "batch_size": 2, "resume": True})
    assert p.returncode == 0, p.stderr[-3000:]
    log = _log(tmp_path)
    _assert_same_losses(log, _log(reference))
    assert [r["world_size"] for r in log] == [1, 1, 2, 2, 2]
    from safetensors.torch import load_file

    a, b = load_file(str(reference / "routers.safetensors")), load_file(str(tmp_path / "routers.safetensors"))
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5)


def test_error_on_one_rank_ends_the_job(tmp_path):
    errdir = tmp_path / "errs"
    errdir.mkdir()
    t0 = time.time()
    env = _env()
    env["WIDE_ERROR_DIR"] = str(errdir)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(Path(__file__).resolve()), json.dumps({"mode": "fail"})]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode != 0
    assert time.time() - t0 < 60
    rep = json.loads((errdir / "rank1.json").read_text())
    assert rep == {"rank": 1, "message": "boom on rank 1", "bad_input": True}


# --- through the CLI: `wide calibrate --nproc 2` and `wide lora --nproc 2 --grad-checkpoint` ----------------
def _cli(args, nproc=None):
    """``wide ARGS --nproc N`` in a subprocess (which starts torchrun), or ``wide ARGS`` in this process."""
    if nproc is None:
        from wide.cli import main

        rc = main([str(a) for a in args])
        return subprocess.CompletedProcess(args, rc, "", "")
    cmd = [sys.executable, "-m", "wide", *map(str, args), "--nproc", str(nproc)]
    return subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=180)


def test_cli_two_processes_match_one(tmp_path, model_dir, text_file):
    import wide

    common = ["--model", model_dir, "--text", text_file, "--seq-len", "32", "--device", "cpu", "--steps", "3",
              "--grad-accum", "2", "--save-every", "2", "--lr", "2e-2"]
    cal = ["calibrate", *common, "--ffn-group-size", "32"]
    one = _cli([*cal, "-o", tmp_path / "c1", "--batch-size", "2"])
    assert one.returncode == 0, one.stderr[-3000:]
    # FSDP2 keeps the gathered layer weights for backward here (one all-gather a step): same losses
    two = _cli([*cal, "-o", tmp_path / "c2", "--batch-size", "1", "--no-reshard-after-forward"], nproc=2)
    assert two.returncode == 0, two.stderr[-3000:]
    assert "global batch 4" in two.stdout and two.stdout.count("saved WIDE checkpoint") == 1  # rank 0 only
    _assert_same_losses(_log(tmp_path / "c1"), _log(tmp_path / "c2"))
    a, b = wide.load(tmp_path / "c1", device="cpu"), wide.load(tmp_path / "c2", device="cpu")
    x = torch.randint(0, 128, (2, 10))
    with torch.no_grad():
        torch.testing.assert_close(a(x).logits, b(x).logits, rtol=1e-4, atol=1e-4)

    lo = ["lora", *common, "--wide", tmp_path / "c1"]  # default LoRA dropout 0.1: keyed per sample, so equal too
    one = _cli([*lo, "-o", tmp_path / "l1", "--batch-size", "2"])
    assert one.returncode == 0, one.stderr[-3000:]
    two = _cli([*lo, "-o", tmp_path / "l2", "--batch-size", "1", "--grad-checkpoint"], nproc=2)
    assert two.returncode == 0, two.stderr[-3000:]
    _assert_same_losses(_log(tmp_path / "l1"), _log(tmp_path / "l2"))
    assert (tmp_path / "l2" / "train_state.dcp" / ".metadata").is_file()
    a = wide.load(tmp_path / "l1", device="cpu")
    b = wide.load(tmp_path / "l2", device="cpu", merge_lora=True)
    with torch.no_grad():
        torch.testing.assert_close(a(x).logits, b(x).logits, rtol=1e-4, atol=1e-4)


def test_cli_nproc_bad_input_is_one_line(tmp_path, model_dir, text_file):
    p = _cli(["lora", "--model", model_dir, "--text", text_file, "--wide", tmp_path / "missing", "-o",
              tmp_path / "o", "--device", "cpu"], nproc=2)
    assert p.returncode == 2
    assert p.stderr.strip().splitlines() == [p.stderr.strip()] and "stage-1 checkpoint" in p.stderr
    assert not (tmp_path / "o").exists()


if __name__ == "__main__":  # torchrun worker
    raise SystemExit(_worker(json.loads(sys.argv[1])))
