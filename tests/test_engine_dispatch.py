"""The engine's auto dispatch threshold :func:`naxis_dense_above`: the tuned crossover table interpolated linearly in
log2 rows at the nearest group size, and the fixed rules below 1024 rows, against values computed here by hand."""

import math

import pytest

from wide.inference.engine import naxis_dense_above

TUNED = {"beside_skip_min": 0.15, "attn_crossover": {"4096": 0.7, "16384": 0.9},
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


def test_a_table_without_every_g_at_every_m():
    """The nearest G is taken per row count: 512 at 1024 rows, 128 (the only one) at 4096."""
    tuned = {"naxis_crossover": {"gemm_mn": {"1024": {"128": 0.6, "512": 0.8}, "4096": {"128": 0.7}}}}
    assert naxis_dense_above(tuned, "gemm_mn", 512, 1024) == pytest.approx(0.8)
    assert naxis_dense_above(tuned, "gemm_mn", 512, 2048) == pytest.approx(0.75)
    tuned["naxis_crossover"]["gemm_mn"]["1024"] = {"128": 0.6}
    tuned["naxis_crossover"]["gemm_mn"]["4096"] = {"128": 0.7, "512": 0.9}
    assert naxis_dense_above(tuned, "gemm_mn", 512, 4096) == pytest.approx(0.9)


@pytest.mark.parametrize("M", [5, 8, 16, 32, 64])
def test_few_row_swiglu_with_the_router_beside(M):
    """5-64 rows with the router beside cuBLAS's gate / up: routed only while the groups no row executes, (1 - p)^M,
    are more than beside_skip_min; Q and the <= 4-row GEMVs keep their rule."""
    p = naxis_dense_above(TUNED, "swiglu", 128, M, router_beside=True)
    assert (1 - p) ** M == pytest.approx(0.15)
    assert naxis_dense_above(TUNED, "swiglu", 128, 4, router_beside=True) == 1.0
    assert naxis_dense_above(TUNED, "gemm_mn", 512, M, router_beside=True) == 0.0


def test_the_shipped_tables_load():
    for tuned in _every_shipped_engine_section():
        for op in ("gemm_mn", "swiglu"):
            for M in (1024, 3000, 16384, 1 << 20):
                assert 0.0 <= naxis_dense_above(tuned, op, 128, M) <= 1.0


@pytest.mark.parametrize("T,want", [
    (4096, 0.7), (16384, 0.9), (8192, 0.8), (1, 0.7), (1 << 20, 0.9),  # halfway in log2 T; held beyond the ends
    (5793, 0.7 + 0.2 * (math.log2(5793) - 12) / 2),
])
def test_attention_threshold(T, want):
    from wide.inference.engine import attn_dense_above

    assert attn_dense_above(TUNED, T) == pytest.approx(want)


def test_the_shipped_attention_tables_load():
    from wide.inference.engine import attn_dense_above

    for tuned in _every_shipped_engine_section():
        assert all(0.0 <= attn_dense_above(tuned, T) <= 1.0 for T in (1, 4096, 10000, 1 << 20))


KAXIS = {"kaxis": {"o_proj": {"64": [[1.0, "dense"]], "4096": [[0.3, "gemm_k"], [0.5, "shared"]],
                              "16384": [[0.6, "shared"], [1.0, "dense"]]}}}


@pytest.mark.parametrize("op,M,p,want", [
    ("o_proj", 4096, 0.2, "gemm_k"), ("o_proj", 4096, 0.3, "gemm_k"), ("o_proj", 4096, 0.45, "shared"),
    ("o_proj", 4096, 0.7, "dense"),  # past the last bound
    ("o_proj", 16384, 0.6, "shared"), ("o_proj", 1 << 20, 0.61, "dense"),
    ("o_proj", 8192, 0.25, "gemm_k"),  # halfway in log2: the lower row count
    ("o_proj", 9000, 0.55, "shared"), ("o_proj", 16, 0.1, "dense"), ("o_proj", 512, 0.1, "dense"),
    ("o_proj", 600, 0.1, "gemm_k"), ("down_proj", 4096, 0.1, "dense"),  # no table: dense
])
def test_kaxis_path(op, M, p, want):
    from wide.inference.engine import kaxis_path

    assert kaxis_path(KAXIS, op, M, p) == want


def _every_shipped_engine_section():
    """The ``engine`` section of every per-GPU config over ``default.json``, as :func:`tuned_config` merges them on
    that GPU (each GPU's tables checked on any machine)."""
    import os

    from wide.kernels._common import CONFIG_DIR, _tuned

    return [_tuned(name[:-5])["engine"] for name in sorted(os.listdir(CONFIG_DIR)) if name.endswith(".json")]


def test_the_shipped_kaxis_tables_name_known_paths():
    from wide.inference.engine import KAXIS_PATHS, kaxis_path

    for tuned in _every_shipped_engine_section():
        for op in ("o_proj", "down_proj"):
            for bounds in tuned.get("kaxis", {}).get(op, {}).values():
                assert all(0.0 <= b <= 1.0 and path in KAXIS_PATHS for b, path in bounds)
            assert all(kaxis_path(tuned, op, M, p) in KAXIS_PATHS for M in (5, 4096, 1 << 20) for p in (0.0, 1.0))


@pytest.mark.parametrize("mode,kind,M,p,n,want", [
    ("dense", "attn", 2, 0.1, 8, "dense"), ("kernel", "attn", 4, 0.1, 8, "gemm_k"),
    ("auto", "ffn", 4, 1.0, 112, "gemm_k"), ("kernel", "attn", 5, 1.0, 8, "shared"),
    ("kernel", "attn", 5, 0.1, 17, "gemm_k"), ("kernel", "ffn", 5, 0.1, 8, "gemm_k"),
    ("auto", "attn", 4096, None, 8, "dense"),  # unmeasured
    ("auto", "attn", 4096, 0.45, 8, "shared"), ("auto", "attn", 4096, 0.45, 17, "dense"),  # N_G > 16: no shared order
    ("auto", "attn", 4096, 0.2, 8, "gemm_k"), ("auto", "attn", 4096, 0.9, 8, "dense"),
])
def test_engine_kaxis_path(mode, kind, M, p, n, want):
    """Engine.kaxis_path: the mode, the GEMV up to 4 rows, the table of the measured activity, shared only for O-like
    ops of at most 16 groups."""
    from types import SimpleNamespace

    from wide.inference.engine import Engine

    e = SimpleNamespace(kaxis=mode, tuned=KAXIS, n_attn=n, n_ffn=n, expected_active={} if p is None else {(kind, 0): p})
    assert Engine.kaxis_path(e, kind, 0, M) == want
