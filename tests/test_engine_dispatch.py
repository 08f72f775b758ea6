"""The engine's auto dispatch threshold :func:`naxis_dense_above`: the tuned crossover table interpolated linearly in
log2 rows at the nearest group size, and the fixed rules below 1024 rows, against values computed here by hand."""

import math

import pytest

from wide.inference.engine import naxis_dense_above

TUNED = {"beside_skip_min": 0.15, "attn_dense_above": 0.69,
         "naxis_crossover": {"swiglu": {"1024": {"32": 0.4, "128": 0.8}, "4096": {"32": 0.5, "128": 0.9}},
                             "gemm_mn": {"1024": {"128": 0.6, "512": 0.7}, "4096": {"128": 0.65, "512": 0.85}}}}


@pytest.mark.parametrize("op,G,M,want", [
    ("swiglu", 128, 1024, 0.8), ("swiglu", 128, 4096, 0.9), ("swiglu", 128, 1 << 20, 0.9),  # held beyond the table
    ("swiglu", 128, 2048, 0.85), ("swiglu", 32, 2048, 0.45),  # halfway in log2 M
    ("swiglu", 32, 1448, 0.4 + 0.1 * (math.log2(1448) - 10) / 2),
    ("swiglu", 16, 4096, 0.5), ("swiglu", 64, 4096, 0.5), ("swiglu", 96, 4096, 0.9),  # nearest G in log2 (ties: lower)
    ("gemm_mn", 256, 4096, 0.65), ("gemm_mn", 1024, 2048, 0.775),
    ("swiglu", 128, 512, 0.93), ("gemm_mn", 512, 512, 0.92), ("gemm_mn", 128, 1000, 0.80),  # 65-1023 rows
    ("swiglu", 128, 16, 1.0), ("swiglu", 128, 64, 1.0), ("gemm_mn", 512, 64, 0.0), ("gemm_mn", 512, 16, 0.0),
])
def test_threshold(op, G, M, want):
    assert naxis_dense_above(TUNED, op, G, M) == pytest.approx(want)


@pytest.mark.parametrize("M", [5, 8, 16, 32, 64])
def test_few_row_swiglu_with_the_router_beside(M):
    """5-64 rows with the router beside cuBLAS's gate / up: routed only while the groups no row executes, (1 - p)^M,
    are more than beside_skip_min; Q and the <= 4-row GEMVs keep their rule."""
    p = naxis_dense_above(TUNED, "swiglu", 128, M, router_beside=True)
    assert (1 - p) ** M == pytest.approx(0.15)
    assert naxis_dense_above(TUNED, "swiglu", 128, 4, router_beside=True) == 1.0
    assert naxis_dense_above(TUNED, "gemm_mn", 512, M, router_beside=True) == 0.0


def test_the_shipped_tables_load():
    from wide.kernels import tuned_config

    for device in ("cpu", None):
        tuned = tuned_config(device)["engine"]
        for op in ("gemm_mn", "swiglu"):
            for M in (1024, 3000, 16384, 1 << 20):
                assert 0.0 <= naxis_dense_above(tuned, op, 128, M) <= 1.0
