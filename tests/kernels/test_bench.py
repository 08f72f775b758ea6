"""``wide bench kernels --report-only``: the table and plot rebuilt from a JSON of records without a GPU, and a file
that is not this benchmark's output refused in one line."""

import argparse
import importlib.util
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
    plot = importlib.util.find_spec("matplotlib") is not None
    files = "kernels_t.md, kernels_t.png" if plot else "kernels_t.md"
    assert capsys.readouterr().out.splitlines() == [
        f"rebuilt {files} in {tmp_path} from {tmp_path / 'kernels_t.json'}"
        + ("" if plot else " (no plot: matplotlib is not installed)")]
    md = (tmp_path / "kernels_t.md").read_text()
    assert md.count("| gemm_mn |") == 6 and "| attention_prefill | 16384 | 4 x 4096 |" in md
    pytest.importorskip("matplotlib")
    assert (tmp_path / "kernels_t.png").stat().st_size > 1000


@pytest.mark.parametrize("content,msg", [([{"op": "gemm_mn"}], "lacks the field"), ([1, 2], "JSON (records|object)")])
def test_report_only_refuses_other_files(tmp_path, content, msg):
    (tmp_path / "kernels_u.json").write_text(json.dumps(content))
    with pytest.raises(WideError, match=msg):
        bench.run(_args(tmp_path, "u"))


def _swept(op, wide_by_p, M=4096, G=128, T=None, run_date="2026-01-01T10:00:00+00:00"):
    """Records of one sweep with dense_ms 1 and the routed op's ms per executed fraction p = 1 - s."""
    return [dict(_rec(op, M, round(1.0 - p, 6), 1.0 / w, T), G=G, run_date=run_date) for p, w in wide_by_p.items()]


def test_crossovers_from_records():
    """The executed fraction where the routed op's time meets the baseline's, by hand: interpolated between the two
    fractions around it, extrapolated past the measured ones and clipped to [0, 1]; per shape the latest sweep."""
    later = "2026-01-02T09:00:00+00:00"
    recs = (_swept("attention_prefill", {0.3: 0.6, 0.5: 0.8, 1.0: 1.3}, T=4096)  # 0.5 + 0.5 * 0.2 / 0.5
            + _swept("attention_prefill", {0.5: 0.9}, T=16384)  # one fraction: no crossover
            + _swept("gemm_mn", {0.5: 0.5, 1.0: 0.9})  # wins at 1: 0.5 + 0.5 * 0.5 / 0.4 = 1.125, clipped
            + _swept("gemm_mn", {0.5: 1.2, 1.0: 2.0}, M=1024, G=512, run_date=later)  # 0.5 - 0.2 * 0.5 / 0.8
            + _swept("gemm_mn", {0.5: 0.5, 1.0: 1.5}, M=1024, G=512)  # an earlier sweep, listed after it
            + _swept("gemm_mn", {0.5: 0.5}, M=1024, G=512, run_date="2026-01-03T00:00:00+00:00")  # one point
            + _swept("swiglu", {0.5: 0.9, 1.0: 0.7}) + _swept("swiglu", {0.5: 1.3, 1.0: 1.1}, G=512)  # not rising
            + _swept("swiglu", {0.5: 0.5, 1.0: 2.0}, M=64)  # below 1024 rows the engine reads no table
            + [dict(_rec("o_proj", 4096, s, 1.5), G=0) for s in (0.0, 0.5)])  # K-axis paths: a table of its own
    got = bench.crossovers(recs)
    assert got == {"attention_prefill": {"4096": pytest.approx(0.7)},
                   "gemm_mn": {"1024": {"512": pytest.approx(0.375)}, "4096": {"128": 1.0}},
                   "swiglu": {"4096": {"128": 1.0, "512": 0.0}}}
    assert list(got["gemm_mn"]) == ["1024", "4096"]  # sizes in numeric order, as the tuned config lists them
    # two records at p = 0.5 (margins -0.3, -0.1: mean -0.2) and 0.2 at p = 1: 0.5 + 0.5 * 0.2 / 0.4
    twice = _swept("attention_prefill", {0.5: 0.7, 1.0: 1.2}, T=4096) + _swept("attention_prefill", {0.5: 0.9}, T=4096)
    assert bench.crossovers(twice) == {"attention_prefill": {"4096": pytest.approx(0.75)}}


def test_report_lists_the_crossovers(tmp_path):
    recs = _swept("attention_prefill", {0.5: 0.8, 1.0: 1.3}, T=4096)
    bench.write_report(recs, str(tmp_path), "c")
    md = (tmp_path / "kernels_c.md").read_text()
    assert "## Crossovers" in md and '{"attention_prefill": {"4096": 0.7}}' in md


@pytest.mark.parametrize("field,value", [("wide_ms", None), ("sparsity", "0.5"), ("sparsity", 1.0), ("G", None),
                                         ("T", "drop")])
def test_report_only_writes_nothing_from_a_bad_record(tmp_path, field, value):
    recs = _swept("attention_prefill", {0.5: 0.8, 1.0: 1.3}, T=4096) + _swept("gemm_mn", {0.5: 0.5, 1.0: 0.9})
    if value == "drop":
        del recs[0][field]
    else:
        recs[0 if field != "G" else 2][field] = value
    (tmp_path / "kernels_v.json").write_text(json.dumps(recs))
    with pytest.raises(WideError, match="lacks the field|wrong type or out of range"):
        bench.run(_args(tmp_path, "v"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kernels_v.json"]


def test_report_only_refuses_no_records(tmp_path):
    (tmp_path / "kernels_e.json").write_text("[]")
    with pytest.raises(WideError, match="holds no records"):
        bench.run(_args(tmp_path, "e"))


def test_records_name_the_backend_variables_in_their_command(monkeypatch):
    from wide.bench._args import command_line

    args = argparse.Namespace(argv=["bench", "kernels", "--ops", "attention_prefill"])
    monkeypatch.delenv("WIDE_GEMM_BACKEND", raising=False)
    monkeypatch.setenv("WIDE_ATTN_BACKEND", "cute")
    assert command_line("kernels", args) == "WIDE_ATTN_BACKEND=cute wide bench kernels --ops attention_prefill"
    monkeypatch.delenv("WIDE_ATTN_BACKEND")
    assert command_line("e2e", argparse.Namespace(argv=["bench", "e2e"])) == "wide bench e2e"


@pytest.mark.parametrize("name,tag", [("NVIDIA H200", "h200"), ("NVIDIA H100 80GB HBM3", "h100"),
                                      ("NVIDIA A100-SXM4-80GB", "a100"),
                                      ("NVIDIA GeForce RTX 4090", "nvidia_geforce_rtx_4090")])
def test_result_files_are_named_after_the_gpu(name, tag, monkeypatch):
    import torch

    from wide.bench._args import gpu_tag

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: name)
    assert gpu_tag() == tag


def test_an_archived_tree_names_its_commit(tmp_path):
    """`git archive` fills in wide/COMMIT (export-subst), so records written from a tree carried as an archive to
    another machine name its commit and date, as a checkout's do."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=root)
    if git.returncode != 0:
        pytest.skip("not a git checkout")
    date = subprocess.run(["git", "show", "-s", "--format=%cs", "HEAD"], capture_output=True, text=True,
                          cwd=root).stdout.strip()
    archive = subprocess.run(["git", "archive", "HEAD", "src/wide"], capture_output=True, cwd=root, check=True)
    subprocess.run(["tar", "-x", "-C", str(tmp_path)], input=archive.stdout, check=True)
    got = subprocess.run([sys.executable, "-c", "from wide.bench._args import source_commit; print(*source_commit())"],
                         capture_output=True, text=True, cwd=tmp_path, env={"PATH": "/nonexistent",
                                                                             "PYTHONPATH": str(tmp_path / "src")})
    assert got.returncode == 0, got.stderr
    assert got.stdout.split() == [git.stdout.strip(), date]
    from wide.bench._args import source_commit

    assert source_commit() == (git.stdout.strip(), date)  # a checkout: from git
