"""benchmarks/e2e/decode_probe.py runs its CPU smoke path (TRITON_INTERPRET=1, tiny shapes) and writes its report."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(np.lib.NumpyVersion(np.__version__) >= "2.4.0",
                    reason=f"Triton 3.6's interpreter breaks on numpy >= 2.4 (numpy {np.__version__}; the project pins "
                    "numpy<2.3)")
def test_decode_probe_smoke(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks/e2e/decode_probe.py"), "--smoke", "--out",
                        str(tmp_path), "--budget", "4"], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads((tmp_path / "decode_probe.json").read_text())
    assert doc["meta"]["smoke"] is True
    assert doc["parts"]["router B=1"].startswith("ok")
    assert any(v.startswith("skipped: time budget") for v in doc["parts"].values())  # fail-soft budget
    for row in doc["rows"]:
        chk = row.get("check", "")
        if chk.startswith("rel err"):
            assert float(chk.split()[-1]) < 1e-2, row
        if chk.startswith("decisions equal"):
            assert float(chk.split()[-1]) == 1.0, row
    assert "| op | B | s |" in (tmp_path / "decode_probe.md").read_text()
