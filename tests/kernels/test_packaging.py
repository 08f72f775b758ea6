"""The package around the kernels: a leaf of ``wide``, import without Triton, the reference fallback, the one-time
warning, the per-GPU tuned settings (shipped as package data) and the autotuning cache."""

import ast
import json
import os
import subprocess
import sys
import types
import warnings
from pathlib import Path

import pytest
import torch

from wide.kernels import _common

KERNELS = Path(_common.__file__).parent


def _env():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def _python(code: str):
    res = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr + res.stdout


def test_kernels_import_nothing_else_from_wide():
    for path in KERNELS.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for name in names:
                assert not (name == "wide" or name.startswith("wide.")) or name.startswith("wide.kernels"), (path, name)


def test_import_and_fallback_without_triton():
    _python("import sys\n"
            "class Block:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name == 'triton' or name.startswith('triton.'):\n"
            "            raise ImportError('blocked for the test')\n"
            "sys.meta_path.insert(0, Block())\n"
            "import torch, wide.kernels as K\n"
            "from wide.kernels.reference import gemm_mn_ref\n"
            "assert not K.HAS_TRITON\n"
            "x = torch.randn(6, 32, dtype=torch.bfloat16); w = torch.randn(64, 32, dtype=torch.bfloat16)\n"
            "r = torch.rand(6, 2) < 0.5\n"
            "assert torch.equal(K.gemm_mn(x, w, r, 32), gemm_mn_ref(x, w, r, 32))\n"
            "print('ok')\n")


def test_cpu_without_interpreter_runs_the_references_and_checks_as_the_kernels_do():
    _python("import torch, wide.kernels as K\n"
            "from wide.kernels.reference import attention_ref\n"
            "q = torch.randn(1, 2, 5, 16); k = torch.randn(1, 1, 7, 16); r = torch.rand(1, 5, 2) < 0.5\n"
            "assert torch.allclose(K.routed_attention(q, k, k, r, True), attention_ref(q, k, k, r, True))\n"
            "x = torch.randn(8, 32); w = torch.randn(64, 32); r = torch.rand(8, 2) < 0.5\n"
            "for op in (lambda rr: K.gemm_mn(x, w, r, 32, reordered=rr),\n"
            "           lambda rr: K.swiglu(x, w, w, r, 32, reordered=rr),\n"
            "           lambda rr: K.gemm_k(torch.randn(8, 64), w.T.contiguous(), r, 32, reordered=rr)):\n"
            "    for bad in ('x', K.reorder(torch.ones(9, 2, dtype=torch.bool))):\n"
            "        try:\n"
            "            op(bad)\n"
            "        except K.KernelArgumentError as e:\n"
            "            assert 'reordered' in str(e), e\n"
            "        else:\n"
            "            raise SystemExit('accepted')\n"
            "print('ok')\n")


def test_missing_triton_warns_once(monkeypatch):
    """A CUDA tensor (a stand-in: no GPU here) or the interpreter without Triton: one RuntimeWarning per process;
    a CPU tensor without TRITON_INTERPRET (the documented fallback) none."""
    monkeypatch.setattr(_common, "HAS_TRITON", False)
    monkeypatch.setattr(_common, "_WARNED", [])
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not _common.use_triton(torch.zeros(1))
    fake_cuda = types.SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0))
    with pytest.warns(RuntimeWarning, match=r"Triton is not installed, so the routed ops on cuda:0 run their PyTorch "
                                            r"references .*pip install -e '\.\[kernels\]'"):
        assert not _common.use_triton(fake_cuda)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not _common.use_triton(fake_cuda)
    monkeypatch.setattr(_common, "_WARNED", [])
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.warns(RuntimeWarning, match=r"TRITON_INTERPRET=1 is set, but no Triton kernel runs"):
        assert not _common.use_triton(torch.zeros(1))


def test_tuned_config_per_gpu(tmp_path, monkeypatch):
    """configs/<GPU name>.json over default.json, section by section; the CPU and unknown GPUs get the defaults; the
    JSON files ship with the package."""
    assert _common.tuned_config("cpu") is _common.tuned_config(torch.device("cpu"))
    default = json.loads((KERNELS / "configs" / "default.json").read_text())
    assert _common.tuned_config("cpu") == default
    assert {"gemm_mn", "gemm_k", "router", "engine"} <= set(default)
    gpus = [p for p in (KERNELS / "configs").glob("*.json") if p.name != "default.json"]
    assert {"NVIDIA_H200.json", "NVIDIA_H100_80GB_HBM3.json"} <= {p.name for p in gpus}
    assert all(json.loads(p.read_text()).keys() <= default.keys() for p in gpus)
    for cfg in [default, *(json.loads(p.read_text()) for p in gpus)]:  # CuTe launch shapes: ops of the default's
        for op, launch in cfg.get("cute_launch", {}).items():
            assert op in default["cute_launch"], op
            assert launch["cluster_m"] in (1, 2) and launch["group_m"] >= 1, (op, launch)
    (tmp_path / "default.json").write_text(json.dumps({"gemm_k": {"masked_min_m": 512}, "router": {"max_rows": 32}}))
    (tmp_path / "Fake_GPU.json").write_text(json.dumps({"gemm_k": {"masked_min_m": 64}}))
    monkeypatch.setattr(_common, "CONFIG_DIR", str(tmp_path))
    _common._tuned.cache_clear()
    try:
        assert _common._tuned("Fake_GPU") == {"gemm_k": {"masked_min_m": 64}, "router": {"max_rows": 32}}
        assert _common._tuned("Other_GPU") == {"gemm_k": {"masked_min_m": 512}, "router": {"max_rows": 32}}
    finally:
        _common._tuned.cache_clear()
    pyproject = (KERNELS.parents[2] / "pyproject.toml").read_text()
    assert '"kernels/configs/*.json"' in pyproject


def test_autotune_cache_across_processes(tmp_path, monkeypatch):
    """The winner is timed once, written to $WIDE_CACHE_DIR/kernel_autotune.json and reused by a second process; a
    candidate list that changes is tuned afresh.  GPU timings replaced by fixed times per config."""
    import triton.testing

    monkeypatch.setenv("WIDE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(_common, "_CACHE", None)
    monkeypatch.setattr(_common, "device_name", lambda d: "fake-gpu")
    monkeypatch.setattr(_common, "_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    ran = []
    times = {1: 2.0, 2: 1.0, 3: 0.5}
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kw: (fn(), times[ran[-1]])[1])
    monkeypatch.setattr(triton.testing, "do_bench_cudagraph", lambda fn, **kw: (fn(), times[ran[-1]])[1])
    dev = types.SimpleNamespace(type="cuda")
    old = [{"a": 1}, {"a": 2}]
    for graph in (False, True):
        assert _common.pick_config(f"op{graph}", (7,), dev, old, lambda c: ran.append(c["a"]), graph) == {"a": 2}
    ran.clear()
    monkeypatch.setattr(_common, "_CACHE", None)  # a second process reads the file
    assert _common.pick_config("opFalse", (7,), dev, old, lambda c: ran.append(c["a"])) == {"a": 2} and ran == []
    assert _common.pick_config("opFalse", (7,), dev, old + [{"a": 3}], lambda c: ran.append(c["a"])) == {"a": 3}
    assert len(json.loads((tmp_path / "kernel_autotune.json").read_text())) == 3
    # off the GPU the first candidate, nothing timed
    assert _common.pick_config("op", (1,), torch.device("cpu"), [{"a": 1}, {"a": 2}], lambda c: 1 / 0) == {"a": 1}
