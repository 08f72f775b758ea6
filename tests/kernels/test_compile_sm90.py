"""The kernels compile for sm_90 (H100 / H200) on this GPU-less machine, at launch configurations the library uses
(``gemm_mn`` at its many-row TMA tiles, the Gluon kernel where Triton has Gluon).

The interpreter that runs the other kernel tests on the CPU does not catch what only the GPU compiler rejects (a
RoPE kernel that passed every CPU test once failed to compile on the H200); ``aot_sm90.py`` compiles them for the
real target in a subprocess without ``TRITON_INTERPRET``.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest


def test_kernels_compile_for_sm90():
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    src = str(Path(__file__).resolve().parents[2] / "src")
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, str(Path(__file__).with_name("aot_sm90.py"))], env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert r.stdout.count("ok ") == 36, r.stdout
