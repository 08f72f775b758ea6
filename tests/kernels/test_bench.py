"""``wide bench kernels --report-only``: the table and plot rebuilt from a JSON of records without a GPU, and a file
that is not this benchmark's output refused in one line."""

import argparse
import json

import pytest

from wide.bench import kernels as bench
from wide.errors import WideError


def _rec(op, M, s, speedup, T=None):
    r = dict(op=op, M=M, N=4096, K=4096, G=128, sparsity=s, dense_ms=1.0, wide_ms=1.0 / speedup, speedup=speedup,
             ideal=1.0 / (1.0 - s), baseline="cuBLAS x @ w.T (torch.matmul)", gpu="test", commit="abc1234",
             date="2026-01-01", command="wide bench kernels")
    return r if T is None else dict(r, B=16384 // T, T=T)


def _args(tmp_path, tag):
    return bench.add_arguments(argparse.ArgumentParser()).parse_args(
        ["--report-only", "--out-dir", str(tmp_path), "--tag", tag])


def test_report_only(tmp_path, capsys):
    recs = [_rec("gemm_mn", M, s, 1.0 + s) for M in (1, 64, 4096) for s in (0.0, 0.5)]
    recs.append(_rec("attention_prefill", 16384, 0.5, 1.9, T=4096))
    (tmp_path / "kernels_t.json").write_text(json.dumps(recs))
    assert bench.run(_args(tmp_path, "t")) == 0
    assert capsys.readouterr().out.splitlines() == [
        f"rebuilt the table and plot of 't' in {tmp_path} from {tmp_path / 'kernels_t.json'}"]
    md = (tmp_path / "kernels_t.md").read_text()
    assert md.count("| gemm_mn |") == 6 and "| attention_prefill | 16384 | 4 x 4096 |" in md
    pytest.importorskip("matplotlib")
    assert (tmp_path / "kernels_t.png").stat().st_size > 1000


@pytest.mark.parametrize("content,msg", [([{"op": "gemm_mn"}], "lacks the field"), ([1, 2], "JSON (records|object)")])
def test_report_only_refuses_other_files(tmp_path, content, msg):
    (tmp_path / "kernels_u.json").write_text(json.dumps(content))
    with pytest.raises(WideError, match=msg):
        bench.run(_args(tmp_path, "u"))
