"""The engine's auto dispatch thresholds (``naxis="auto"``): the crossover table is the committed H200 kernel grid's,
re-derived here from the JSON, and the lookup interpolates it as documented."""

import json
from collections import defaultdict
from pathlib import Path

import pytest

from wide.inference.engine import BESIDE_SKIP_MIN, NAXIS_CROSSOVER, naxis_dense_above

GRID = Path(__file__).resolve().parents[1] / "benchmarks" / "kernels" / "kernels_h200-full.json"


def _crossover(speedups: dict) -> float:
    """1 - the Bernoulli skip ratio s at which the routed kernel's speedup over cuBLAS reaches 1 (linear in s
    between measured points); 1.0 if it already wins at s = 0, 0.0 if it never does."""
    ss = sorted(speedups)
    if speedups[ss[0]] >= 1:
        return 1.0
    for a, b in zip(ss, ss[1:]):
        if speedups[b] >= 1:
            return 1 - (a + (b - a) * (1 - speedups[a]) / (speedups[b] - speedups[a]))
    return 0.0


def test_crossover_table_is_the_kernel_grid():
    rows = json.loads(GRID.read_text())
    sp = defaultdict(dict)
    for r in rows:
        if r["op"] in NAXIS_CROSSOVER:
            sp[(r["op"], r["M"], r["G"])][r["sparsity"]] = r["speedup"]
    for op, by_m in NAXIS_CROSSOVER.items():
        for M, by_g in by_m.items():
            for G, p in by_g.items():
                assert p == pytest.approx(_crossover(sp[(op, M, G)]), abs=1e-3), (op, M, G)


def test_lookup_interpolates_in_log_rows():
    t = NAXIS_CROSSOVER["swiglu"]
    assert naxis_dense_above("swiglu", 128, 1024) == pytest.approx(t[1024][128])
    assert naxis_dense_above("swiglu", 128, 2048) == pytest.approx((t[1024][128] + t[4096][128]) / 2)
    assert naxis_dense_above("swiglu", 64, 8192) == pytest.approx((t[4096][64] + t[16384][64]) / 2)
    assert naxis_dense_above("gemm_mn", 512, 1 << 20) == pytest.approx(NAXIS_CROSSOVER["gemm_mn"][16384][512])
    # a G between measured ones takes the nearest in log2: 16 -> 32; 96 -> 128 (log2 96 = 6.58)
    assert naxis_dense_above("swiglu", 16, 4096) == pytest.approx(t[4096][32])
    assert naxis_dense_above("swiglu", 96, 4096) == pytest.approx(t[4096][128])


def test_small_row_rules_unchanged():
    assert naxis_dense_above("swiglu", 128, 16) == 1.0 and naxis_dense_above("gemm_mn", 512, 64) == 0.0
    assert naxis_dense_above("swiglu", 128, 512) == 0.93
    assert naxis_dense_above("gemm_mn", 512, 512) == 0.92 and naxis_dense_above("gemm_mn", 128, 1000) == 0.80
    with pytest.raises(ValueError, match="op must be"):
        naxis_dense_above("gemm_k", 128, 4096)


def test_few_row_swiglu_with_the_router_beside():
    """5-64 rows with the router beside cuBLAS: routed only while (1 - p)^M > BESIDE_SKIP_MIN of the groups are
    expected unexecuted by every row; at <= 4 rows (the GEMVs) and without the overlap the rule is unchanged."""
    for M in (5, 8, 16, 32, 64):
        p = naxis_dense_above("swiglu", 128, M, router_beside=True)
        assert (1 - p) ** M == pytest.approx(BESIDE_SKIP_MIN)
    assert naxis_dense_above("swiglu", 128, 5, router_beside=True) == pytest.approx(1 - 0.15 ** 0.2)
    assert naxis_dense_above("swiglu", 128, 4, router_beside=True) == 1.0
    assert naxis_dense_above("gemm_mn", 512, 16, router_beside=True) == 0.0
    assert naxis_dense_above("swiglu", 128, 512, router_beside=True) == 0.93
