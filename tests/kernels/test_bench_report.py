"""The benchmark's report step (table and plot) runs without a GPU from a JSON of records."""

import argparse
import json

from wide.bench import kernels as bench


def _rec(op, M, s, speedup, T=None):
    r = dict(op=op, M=M, N=4096, K=4096, G=128, sparsity=s, dense_ms=1.0, wide_ms=1.0 / speedup,
             speedup=speedup, ideal=1.0 / (1.0 - s), fraction_of_ideal=speedup * (1.0 - s),
             gpu="test", date="2026-01-01", command="test")
    if T is not None:
        r["T"] = T
    return r


def test_report_only(tmp_path):
    recs = [_rec("gemm_mn", M, s, 1.0 + s) for M in (1, 64, 4096) for s in (0.0, 0.5)]
    recs += [_rec("attention_prefill", 16384, 0.5, 1.9, T=4096)]
    (tmp_path / "kernels_t.json").write_text(json.dumps(recs))
    args = bench.add_arguments(argparse.ArgumentParser()).parse_args(
        ["--report-only", "--out-dir", str(tmp_path), "--tag", "t"])
    assert bench.run(args) == 0
    md = (tmp_path / "kernels_t.md").read_text()
    assert md.count("| gemm_mn |") == 6 and "attention_prefill" in md
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert (tmp_path / "kernels_t.png").stat().st_size > 1000
