"""Import without Triton, CPU fallback without the interpreter, the autotuning cache and its launchable fallback."""

import json
import os
import subprocess
import sys
import types

import pytest
import torch

from wide.kernels import _common

_NO_TRITON = """
import sys
class _Block:
    def find_spec(self, name, path=None, target=None):
        if name == 'triton' or name.startswith('triton.'):
            raise ImportError('blocked for the test')
sys.meta_path.insert(0, _Block())
import torch, wide.kernels as K
from wide.kernels.reference import gemm_mn_ref
assert not K.HAS_TRITON
x = torch.randn(6, 32, dtype=torch.bfloat16); w = torch.randn(64, 32, dtype=torch.bfloat16)
r = torch.rand(6, 2) < 0.5
out = K.gemm_mn(x, w, r, 32)
assert torch.equal(out, gemm_mn_ref(x, w, r, 32))
print('ok')
"""


def _env(**kw):
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    env["CUDA_VISIBLE_DEVICES"] = ""
    env.update(kw)
    return env


def test_import_and_fallback_without_triton():
    res = subprocess.run([sys.executable, "-c", _NO_TRITON], env=_env(), capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr


def test_cpu_without_interpreter_falls_back_to_reference():
    code = ("import torch, wide.kernels as K\n"
            "from wide.kernels.reference import attention_ref\n"
            "q = torch.randn(1, 2, 5, 16); k = torch.randn(1, 1, 7, 16)\n"
            "r = torch.rand(1, 5, 2) < 0.5\n"
            "assert torch.allclose(K.routed_attention(q, k, k, r, True), attention_ref(q, k, k, r, True))\n"
            "print('ok')\n")
    res = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr


def test_cpu_reference_fallback_checks_reordered_as_the_kernels_do():
    """A malformed ``reordered`` is refused on the CPU fallback too (code that runs on the CPU runs on a GPU)."""
    code = ("import torch, wide.kernels as K\n"
            "x = torch.randn(8, 32); w = torch.randn(64, 32); r = torch.rand(8, 2) < 0.5\n"
            "for op in (lambda rr: K.gemm_mn(x, w, r, 32, reordered=rr),\n"
            "           lambda rr: K.swiglu(x, w, w, r, 32, reordered=rr),\n"
            "           lambda rr: K.gemm_k(torch.randn(8, 64), w.T.contiguous(), r, 32, reordered=rr)):\n"
            "    for bad in ('x', K.reorder(torch.ones(9, 2, dtype=torch.bool))):\n"
            "        try:\n"
            "            op(bad)\n"
            "        except ValueError as e:\n"
            "            assert 'reordered' in str(e), e\n"
            "        else:\n"
            "            raise SystemExit('accepted')\n"
            "print('ok')\n")
    res = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr + res.stdout


def test_a_gpu_tensor_without_triton_warns_once(monkeypatch):
    """Without Triton a CUDA tensor takes the reference path (no pruned work skipped): one RuntimeWarning says so;
    a CPU tensor (the documented reference fallback) does not warn. A stand-in for a CUDA tensor: no GPU here."""
    from types import SimpleNamespace

    monkeypatch.setattr(_common, "HAS_TRITON", False)
    monkeypatch.setattr(_common, "_WARNED_NO_TRITON", [])
    fake_cuda = SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0))
    with pytest.warns(RuntimeWarning, match=r"Triton is not installed, so the routed ops on cuda:0 run their PyTorch "
                                            r"references .*pip install -e '\.\[kernels\]'"):
        assert not _common.use_triton(fake_cuda)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not _common.use_triton(fake_cuda)  # once per process
        assert not _common.use_triton(torch.zeros(1))  # CPU: no warning


def test_interpreter_without_triton_warns_once(monkeypatch):
    """TRITON_INTERPRET=1 with no Triton installed (e.g. the core install of `make demo`): the CPU ops run the
    references, and one RuntimeWarning says the interpreter runs no kernel; without the variable, no warning."""
    import warnings

    monkeypatch.setattr(_common, "HAS_TRITON", False)
    monkeypatch.setattr(_common, "_WARNED_NO_TRITON", [])
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not _common.use_triton(torch.zeros(1))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.warns(RuntimeWarning, match=r"routed ops on cpu run their PyTorch references \(TRITON_INTERPRET=1 is "
                                            r"set, but no Triton kernel runs in the interpreter\)"):
        assert not _common.use_triton(torch.zeros(1))


def test_autotune_cache_roundtrip(tmp_path, monkeypatch):
    monkeypatch.setenv("WIDE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(_common, "_CACHE", None)
    assert _common.cache_dir() == str(tmp_path)
    _common._store_cache("op|gpu|key", {"BM": 64})
    data = json.loads((tmp_path / "kernel_autotune.json").read_text())
    assert data["op|gpu|key"] == {"BM": 64}
    monkeypatch.setattr(_common, "_CACHE", None)
    assert _common._load_cache()["op|gpu|key"] == {"BM": 64}
    # off the GPU the first candidate is used and nothing is tuned
    cfg = _common.pick_config("op", (1,), torch.device("cpu"), [{"a": 1}, {"a": 2}], lambda c: None)
    assert cfg == {"a": 1}


def test_autotune_retunes_when_the_candidates_change(tmp_path, monkeypatch):
    """The cached winner is reused for the same candidate list; a list that gains a config (a newer wide) re-tunes
    instead of returning the old winner forever.  The GPU timing is replaced by fixed times per config."""
    import triton.testing

    monkeypatch.setenv("WIDE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(_common, "_CACHE", None)
    monkeypatch.setattr(_common, "_device_tag", lambda d: "fake-gpu")
    monkeypatch.setattr(_common, "_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    ran = []
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kw: (fn(), {1: 2.0, 2: 1.0, 3: 0.5}[ran[-1]])[1])
    dev = types.SimpleNamespace(type="cuda")
    old = [{"a": 1}, {"a": 2}]
    assert _common.pick_config("op", (7,), dev, old, lambda c: ran.append(c["a"])) == {"a": 2}
    ran.clear()
    assert _common.pick_config("op", (7,), dev, old, lambda c: ran.append(c["a"])) == {"a": 2}
    assert ran == []  # cached: nothing timed
    monkeypatch.setattr(_common, "_CACHE", None)  # a second process reads the file
    assert _common.pick_config("op", (7,), dev, old, lambda c: ran.append(c["a"])) == {"a": 2} and ran == []
    assert _common.pick_config("op", (7,), dev, old + [{"a": 3}], lambda c: ran.append(c["a"])) == {"a": 3}


def test_first_launchable_skips_configs_that_run_out_of_resources():
    # an fp32 model can need more shared memory than a bf16-sized tile list allows (H200: 245,760 B asked,
    # 232,448 B there); the untuned choice is the first config that launches, other errors propagate
    from triton.runtime.errors import OutOfResources

    tried = []

    def run(cfg):
        tried.append(cfg["BM"])
        if cfg["BM"] > 64:
            raise OutOfResources(245760, 232448, "shared memory")

    cands = [{"BM": 128}, {"BM": 256}, {"BM": 64}, {"BM": 32}]
    assert _common.first_launchable(cands, run) == {"BM": 64}
    assert tried == [128, 256, 64]
    with pytest.raises(OutOfResources):
        _common.first_launchable(cands[:2], run)

    def bad(cfg):
        raise ValueError("a real bug, not a resource limit")

    with pytest.raises(ValueError, match="real bug"):
        _common.first_launchable(cands, bad)
