import importlib

import pytest
import torch

from kernel_testutil import DEVICE, DTYPES, check_close, make_mask, poisoned, randn, seed_for
from wide.kernels import gemm_k, reorder
from wide.kernels.reference import gemm_k_ref

gemm_k_mod = importlib.import_module("wide.kernels.gemm_k")  # the module, not the op it exports


def _run(M, N, K, G, dtype, kind, path="auto", shared=False, p=0.5):
    gen = seed_for("gemm_k", M, N, K, G, dtype, kind, path, shared, p)
    a = randn((M, K), dtype, gen)
    w = randn((N, K), dtype, gen)
    route = make_mask(kind, (M, K // G), gen, p=p)
    out = poisoned((M, N), dtype)
    kw = {"reordered": reorder(route)} if shared else {}
    res = gemm_k(a, w, route, G, out=out, path=path, **kw)
    assert res is out
    check_close(out, gemm_k_ref(a.double(), w.double(), route, G))
    assert (out[~route.any(dim=1)] == 0).all()


@pytest.mark.parametrize("G", [16, 32, 64, 128, 256, 512])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("path", ["sparse", "dense"])
def test_every_group_size(G, dtype, path):
    _run(37, 40, max(G, 64), G, dtype, "random", path)


@pytest.mark.parametrize("p", [0.1, 0.9])
def test_auto_path_either_side_of_threshold(p, monkeypatch):
    monkeypatch.setattr(gemm_k_mod, "SPARSE_MIN_M", 0)
    _run(50, 48, 256, 64, torch.bfloat16, "random", "auto", p=p)


@pytest.mark.parametrize("G", [16, 32])
@pytest.mark.parametrize("kind", ["random", "none"])
def test_auto_small_groups_run_dense_without_reorder(G, kind, monkeypatch):
    # DENSE_ABOVE is 0 for G <= 32: the device would pick the dense kernel for any route with an active entry,
    # so the auto path runs it directly (no reorder, no fp32 workspace), all-False routes included
    monkeypatch.setattr(gemm_k_mod, "SPARSE_MIN_M", 0)
    assert gemm_k_mod.DENSE_ABOVE[G] == 0.0
    assert not gemm_k_mod.uses_reorder(4096, G) and gemm_k_mod.uses_reorder(4096, 128)
    assert gemm_k_mod.uses_reorder(4096) and not gemm_k_mod.uses_reorder(gemm_k_mod.SPARSE_MIN_M - 1, 128)

    def no_reorder(route):
        raise AssertionError("the auto path reordered a G <= 32 route")

    monkeypatch.setattr(importlib.import_module("wide.kernels.reorder"), "reorder", no_reorder)
    _run(40, 32, 128, G, torch.bfloat16, kind, "auto")


@pytest.mark.parametrize("M", [1, 2, 3, 4])
@pytest.mark.parametrize("G", [16, 128])
def test_decode_rows(M, G):
    _run(M, 72, 256, G, torch.bfloat16, "random")


@pytest.mark.parametrize("kind", ["all", "none", "one_row"])
@pytest.mark.parametrize("path", ["sparse", "dense", "auto"])
def test_mask_kinds(kind, path, monkeypatch):
    monkeypatch.setattr(gemm_k_mod, "SPARSE_MIN_M", 0)
    _run(33, 32, 128, 32, torch.float16, kind, path, shared=True)


def test_errors():
    a = torch.zeros(8, 64, dtype=torch.bfloat16, device=DEVICE)
    w = torch.zeros(16, 64, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match="does not divide"):
        gemm_k(a[:, :48], w[:, :48], torch.ones(8, 1, dtype=torch.bool, device=DEVICE), 32)
    with pytest.raises(ValueError, match="route"):
        gemm_k(a, w, torch.ones(8, 4, dtype=torch.bool, device=DEVICE), 32)
    with pytest.raises(ValueError, match="path"):
        gemm_k(a, w, torch.ones(8, 2, dtype=torch.bool, device=DEVICE), 32, path="fast")
    with pytest.raises(ValueError, match="reordered"):
        gemm_k(a, w, torch.ones(8, 2, dtype=torch.bool, device=DEVICE), 32, path="sparse",
               reordered=reorder(torch.ones(8, 4, dtype=torch.bool, device=DEVICE)))
    for rows in (8, 2):  # refused on every path (the CPU reference fallback and the few-row GEMV too)
        with pytest.raises(ValueError, match="reordered must be a Reordered"):
            gemm_k(a[:rows], w, torch.ones(rows, 2, dtype=torch.bool, device=DEVICE), 32, reordered=(1, 2))


@pytest.mark.parametrize("G,M,path", [(48, 37, "sparse"), (48, 37, "dense"), (192, 21, "auto"), (192, 3, "auto")])
def test_head_group_widths(G, M, path):
    # attention O projection: K-groups of the head-group width
    _run(M, 40, 2 * G, G, torch.bfloat16, "random", path)


@pytest.mark.parametrize("aligned", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dense_tma_tiles(aligned, dtype, monkeypatch):
    """The dense kernel's TMA candidate (A and weight tiles by tensor descriptor, the route applied in registers),
    forced; M = 37 and N = 40 leave partial tiles that the descriptor fills with zeros.  An A whose rows are not
    16-byte aligned (a column slice) runs the pointer-load variant of the same config."""
    orig = gemm_k_mod._dense_candidates
    monkeypatch.setattr(gemm_k_mod, "_dense_candidates", lambda G, M: [dict(orig(G, M)[0], TMA=True)])
    gen = seed_for("gemm_k_tma", aligned, dtype)
    M, N, K, G = 37, 40, 128, 32
    a = randn((M, K + (0 if aligned else 3)), dtype, gen)[:, (0 if aligned else 3):]
    w = randn((N, K), dtype, gen)
    route = make_mask("random", (M, K // G), gen)
    out = poisoned((M, N), dtype)
    gemm_k(a, w, route, G, out=out, path="dense")
    check_close(out, gemm_k_ref(a.double(), w.double(), route, G))
    assert (out[~route.any(dim=1)] == 0).all()
    assert gemm_k_mod.tma_aligned(a.contiguous(), w)
