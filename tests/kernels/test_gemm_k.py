import importlib

import pytest
import torch
from kernel_testutil import DEVICE, DTYPES, check_close, make_mask, poisoned, randn, seed_for

from wide.kernels import gemm_k, gemm_mn, reorder
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
    # the on-device choice between the sparse path and the dense kernel (G > MASKED_AUTO_MAX_G on the GPU)
    monkeypatch.setattr(gemm_k_mod, "SPARSE_MIN_M", 0)
    monkeypatch.setattr(gemm_k_mod, "MASKED_AUTO_MAX_G", 0)
    _run(50, 48, 256, 64, torch.bfloat16, "random", "auto", p=p)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["random", "all", "none", "one_row"])
def test_masked_path(dtype, kind):
    _run(37, 40, 192, 64, dtype, kind, "masked")


def test_masked_path_drops_inactive_values_and_runs_auto(monkeypatch):
    """The masked path selects (not multiplies): inf / NaN in inactive groups never reach the result, as in the
    kernels; from SPARSE_MIN_M rows auto takes it for G <= MASKED_AUTO_MAX_G without a reorder."""
    gen = seed_for("gemm_k_masked_nan")
    M, N, K, G = 20, 24, 128, 32
    a = randn((M, K), torch.bfloat16, gen)
    w = randn((N, K), torch.bfloat16, gen)
    route = make_mask("random", (M, K // G), gen)
    a.view(M, K // G, G)[~route] = float("nan")
    a[~route.repeat_interleave(G, dim=1) & (torch.arange(K, device=DEVICE) % 7 == 0)] = float("inf")
    ref = gemm_k_ref(a.double(), w.double(), route, G)
    assert torch.isfinite(ref).all()
    monkeypatch.setattr(gemm_k_mod, "SPARSE_MIN_M", 0)

    def no_reorder(route):
        raise AssertionError("the masked auto path reordered")

    monkeypatch.setattr(importlib.import_module("wide.kernels.reorder"), "reorder", no_reorder)
    for path in ("masked", "auto"):
        out = poisoned((M, N), torch.bfloat16)
        gemm_k(a, w, route, G, out=out, path=path)
        check_close(out, ref)
    assert not gemm_k_mod.uses_reorder(4096, gemm_k_mod.MASKED_AUTO_MAX_G)
    assert gemm_k_mod.uses_reorder(4096, 2 * gemm_k_mod.MASKED_AUTO_MAX_G)


@pytest.mark.parametrize("G", [16, 64, 192, 512])
@pytest.mark.parametrize("dtype", DTYPES + [torch.float32])
def test_mask_select(G, dtype):
    """The masked path's select, against a select built from repeat_interleave: exact, inactive inf / NaN dropped,
    a row-strided input (a column slice of a wider tensor), rows not a multiple of the block."""
    gen = seed_for("mask_select", G, dtype)
    M, K = 11, 3 * G
    wide_a = randn((M, K + 48), dtype, gen)
    a = wide_a[:, 16:16 + K]
    route = make_mask("random", (M, K // G), gen)
    a[~route.repeat_interleave(G, dim=1)] = float("nan")
    ref = torch.where(route.repeat_interleave(G, dim=1), a, torch.zeros((), dtype=dtype, device=DEVICE))
    out = poisoned((M, K), dtype)
    assert gemm_k_mod.mask_select(a, route, G, out) is out
    assert torch.equal(out, ref)


@pytest.mark.parametrize("G", [16, 64, 192, 512])
@pytest.mark.parametrize("dtype", DTYPES + [torch.float32])
def test_mask_select_in_place(G, dtype):
    """mask_select with out=a: the inactive groups become exactly 0 (NaN there too), every executed element keeps
    its bits, and the columns of a wider tensor outside the view are not touched (a row-strided a)."""
    gen = seed_for("mask_select_in_place", G, dtype)
    M, K = 11, 3 * G
    wide_a = randn((M, K + 48), dtype, gen)
    a = wide_a[:, 16:16 + K]
    route = make_mask("random", (M, K // G), gen)
    keep = route.repeat_interleave(G, dim=1)
    a[~keep] = float("nan")
    before = wide_a.clone()
    ref = torch.where(keep, a, torch.zeros((), dtype=dtype, device=DEVICE))
    assert gemm_k_mod.mask_select(a, route, G, a) is a
    assert torch.equal(a, ref)
    assert torch.equal(wide_a[:, :16], before[:, :16]) and torch.equal(wide_a[:, 16 + K:], before[:, 16 + K:])
    # the PyTorch fallback (no Triton for this tensor), and out given as another view of the same elements
    wide_a.copy_(before)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gemm_k_mod, "use_triton", lambda t: False)
        same = wide_a[:, 16:16 + K]
        assert gemm_k_mod.mask_select(a, route, G, same) is same
    assert torch.equal(a, ref)
    assert torch.equal(wide_a[:, :16], before[:, :16]) and torch.equal(wide_a[:, 16 + K:], before[:, 16 + K:])


@pytest.mark.parametrize("path", ["masked", "auto"])
@pytest.mark.parametrize("M", [37, 600])
def test_overwrite_a(path, M, monkeypatch):
    """gemm_k(overwrite_a=True): the masked path zeroes a's inactive groups in place and gives the reference; the
    executed groups of a keep their bits.  M = 600 reaches the in-place branch of the many-row auto path (from
    SPARSE_MIN_M rows), M = 37 the few-row auto path with the masked candidate forced."""
    gen = seed_for("gemm_k_overwrite_a", path, M)
    N, K, G = 40, 192, 64
    a = randn((M, K), torch.bfloat16, gen)
    w = randn((N, K), torch.bfloat16, gen)
    route = make_mask("random", (M, K // G), gen)
    keep = route.repeat_interleave(G, dim=1)
    a[~keep] = float("nan")
    a0 = a.clone()
    ref = gemm_k_ref(a.double(), w.double(), route, G)
    if M < gemm_k_mod.SPARSE_MIN_M and path == "auto":
        monkeypatch.setattr(gemm_k_mod, "pick_config", lambda op, key, dev, cands, *a, **k: dict(KIND="masked", ROWS=0))
    out = poisoned((M, N), torch.bfloat16)
    assert gemm_k(a, w, route, G, out=out, path=path, overwrite_a=True) is out
    check_close(out, ref)
    assert torch.equal(a[keep], a0[keep]) and (a[~keep] == 0).all()
    # without the flag a is never written
    a1 = a0.clone()
    gemm_k(a1, w, route, G, out=out, path=path)
    assert torch.equal(a1[keep], a0[keep]) and a1[~keep].isnan().all()


def test_masked_dense_overwrite_a():
    gen = seed_for("masked_dense_overwrite_a")
    M, N, K, G = 21, 24, 128, 32
    a = randn((M, K), torch.float16, gen)
    w = randn((N, K), torch.float16, gen)
    route = make_mask("random", (M, K // G), gen)
    ref = gemm_k_ref(a.double(), w.double(), route, G)
    out = poisoned((M, N), torch.float16)
    assert gemm_k_mod.masked_dense(a, w, route, G, out, rows=7, overwrite_a=True) is out
    check_close(out, ref)
    assert (a[~route.repeat_interleave(G, dim=1)] == 0).all()


@pytest.mark.parametrize("rows", [1, 7, 16, 0])
def test_masked_path_row_chunks(rows):
    """The masked path in row chunks (the zeroed copy is [rows, K]; 0 = all rows) gives the reference."""
    gen = seed_for("gemm_k_masked_rows", rows)
    M, N, K, G = 37, 40, 192, 64
    a = randn((M, K), torch.bfloat16, gen)
    w = randn((N, K), torch.bfloat16, gen)
    route = make_mask("random", (M, K // G), gen)
    out = poisoned((M, N), torch.bfloat16)
    assert gemm_k_mod.masked_dense(a, w, route, G, out, rows) is out
    check_close(out, gemm_k_ref(a.double(), w.double(), route, G))


def test_masked_chunk_candidates():
    # all rows first (the untuned choice), then the chunks of MASKED_CHUNKS below the row bucket
    assert gemm_k_mod.masked_cands(600) == [dict(ROWS=0)]
    assert gemm_k_mod.masked_cands(1500) == [dict(ROWS=0), dict(ROWS=1024)]
    assert gemm_k_mod.masked_cands(16384) == [dict(ROWS=0)] + [dict(ROWS=r) for r in gemm_k_mod.MASKED_CHUNKS]


@pytest.mark.parametrize("G", [16, 32])
@pytest.mark.parametrize("kind", ["random", "none"])
def test_auto_small_groups_run_without_reorder(G, kind, monkeypatch):
    # G <= MASKED_AUTO_MAX_G: from SPARSE_MIN_M rows the auto path runs the masked cuBLAS path (no reorder, no fp32
    # workspace), all-False routes included
    monkeypatch.setattr(gemm_k_mod, "SPARSE_MIN_M", 0)
    assert G <= gemm_k_mod.MASKED_AUTO_MAX_G
    assert not gemm_k_mod.uses_reorder(4096, G) and not gemm_k_mod.uses_reorder(4096, 512)
    assert gemm_k_mod.uses_reorder(4096, 2 * gemm_k_mod.MASKED_AUTO_MAX_G)
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
    with pytest.raises(ValueError, match="path='fast'; allowed: .*'masked'"):
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
    from triton.tools.tensor_descriptor import TensorDescriptor

    orig = gemm_k_mod._dense_candidates
    monkeypatch.setattr(gemm_k_mod, "_dense_candidates", lambda G, M: [dict(orig(G, M)[0], TMA=True)])
    made = []  # descriptors built: the TMA variant ran iff the operands are aligned
    real = TensorDescriptor.from_tensor
    monkeypatch.setattr(TensorDescriptor, "from_tensor", staticmethod(lambda t, b: made.append(b) or real(t, b)))
    gen = seed_for("gemm_k_tma", aligned, dtype)
    M, N, K, G = 37, 40, 128, 32
    a = randn((M, K + (0 if aligned else 3)), dtype, gen)[:, (0 if aligned else 3):]
    w = randn((N, K), dtype, gen)
    route = make_mask("random", (M, K // G), gen)
    out = poisoned((M, N), dtype)
    gemm_k(a, w, route, G, out=out, path="dense")
    check_close(out, gemm_k_ref(a.double(), w.double(), route, G))
    assert (out[~route.any(dim=1)] == 0).all()
    assert len(made) == (2 if aligned else 0)


def test_tma_aligned_rules():
    from wide.kernels._common import tma_aligned

    t = torch.zeros(8, 64, dtype=torch.bfloat16)
    assert tma_aligned(t) and tma_aligned(t[2:], t.T.contiguous())
    assert not tma_aligned(t[:, 3:])  # base and row stride off 16 bytes
    assert not tma_aligned(torch.zeros(8, 12, dtype=torch.bfloat16))  # 24-byte rows
    assert not tma_aligned(t[:, ::2])  # strided columns
    assert not tma_aligned(torch.zeros(1, 64).expand(8, 64))  # broadcast rows (stride 0)
    assert not tma_aligned(torch.zeros(0, 64))  # empty: no descriptor can be built


@pytest.mark.parametrize("op", ["gemm_k", "gemm_mn"])
def test_empty_output_with_tma_configs(op, monkeypatch):
    # N = 0 with a TMA config forced: pointer-load variant (a descriptor of an empty tensor cannot be built)
    gemm_mn_mod = importlib.import_module("wide.kernels.gemm_mn")
    if op == "gemm_k":
        orig = gemm_k_mod._dense_candidates
        monkeypatch.setattr(gemm_k_mod, "_dense_candidates", lambda G, M: [dict(orig(G, M)[0], TMA=True)])
        a = torch.randn(8, 64, device=DEVICE).bfloat16()
        res = gemm_k(a, torch.zeros(0, 64, dtype=torch.bfloat16, device=DEVICE),
                     torch.ones(8, 2, dtype=torch.bool, device=DEVICE), 32, path="dense")
        assert res.shape == (8, 0)
    else:
        orig = gemm_mn_mod._candidates
        monkeypatch.setattr(gemm_mn_mod, "_candidates", lambda G, M, sw: [dict(orig(G, M, sw)[0], TMA=True)])
        monkeypatch.setattr(gemm_mn_mod, "DIRECT_MAX_M", 0)
        x = torch.randn(200, 64, device=DEVICE).bfloat16()
        res = gemm_mn(x, torch.zeros(0, 64, dtype=torch.bfloat16, device=DEVICE),
                      torch.ones(200, 0, dtype=torch.bool, device=DEVICE), 32)
        assert res.shape == (200, 0)


def test_mask_select_and_masked_dense_refuse_bad_input():
    # the two public helpers validate like the ops (a bad `out` used to be written past its end by the kernel)
    a = torch.zeros(6, 128, dtype=torch.bfloat16, device=DEVICE)
    r = torch.ones(6, 4, dtype=torch.bool, device=DEVICE)
    w = torch.zeros(40, 128, dtype=torch.bfloat16, device=DEVICE)
    sel = gemm_k_mod.mask_select
    with pytest.raises(ValueError, match="out"):
        sel(a, r, 32, torch.empty(8, 64, dtype=torch.bfloat16, device=DEVICE))
    with pytest.raises(ValueError, match="does not divide"):
        sel(a, torch.ones(6, 2, dtype=torch.bool, device=DEVICE), 48, torch.empty_like(a))
    with pytest.raises(ValueError, match="route"):
        sel(a, torch.ones(6, 2, dtype=torch.bool, device=DEVICE), 32, torch.empty_like(a))
    with pytest.raises(ValueError, match="out"):
        gemm_k_mod.masked_dense(a, w, r, 32, torch.empty(6, 43, dtype=torch.bfloat16, device=DEVICE))
    with pytest.raises(ValueError, match="dtype"):
        gemm_k_mod.masked_dense(a, w.half(), r, 32, torch.empty(6, 40, dtype=torch.bfloat16, device=DEVICE))
    with pytest.raises(ValueError, match="rows=-5"):
        gemm_k_mod.masked_dense(a, w, r, 32, torch.empty(6, 40, dtype=torch.bfloat16, device=DEVICE), -5)
    # in place: out must be a itself, not a view that partly overlaps it; a transposed a cannot be zeroed in place
    with pytest.raises(ValueError, match="overlaps a"):
        buf = torch.zeros(7, 128, dtype=torch.bfloat16, device=DEVICE)
        sel(buf[:6], r, 32, buf[1:])
    with pytest.raises(ValueError, match="unit column stride"):
        at0 = torch.zeros(128, 6, dtype=torch.bfloat16, device=DEVICE).t()
        sel(at0, r, 32, at0)
    # in place on rows that share memory (an expanded view) is refused, or, in gemm_k, copied first; an a that requires
    # grad or shares memory with w is refused before anything is written
    ex = torch.ones(1, 128, dtype=torch.bfloat16, device=DEVICE).expand(6, 128)
    with pytest.raises(ValueError, match="rows do not share memory"):
        sel(ex, r.logical_not(), 32, ex)
    with pytest.raises(ValueError, match="rows do not share memory"):
        gemm_k_mod.masked_dense(ex, w, r, 32, torch.empty(6, 40, dtype=torch.bfloat16, device=DEVICE), overwrite_a=True)
    route_half = torch.tensor([[True, False, True, False]] * 6, device=DEVICE)
    out = poisoned((6, 40), torch.bfloat16)
    gen = seed_for("gemm_k_expanded_overwrite")
    w_r = randn((40, 128), torch.bfloat16, gen)
    ex_r = randn((1, 128), torch.bfloat16, gen).expand(6, 128)
    gemm_k(ex_r, w_r, route_half, 32, out=out, path="masked", overwrite_a=True)
    check_close(out, gemm_k_ref(ex_r.double(), w_r.double(), route_half, 32))
    assert (ex_r != 0).all(), "the expanded a itself must not be written"
    ag = torch.ones(6, 128, dtype=torch.float32, device=DEVICE, requires_grad=True)
    for call in (lambda: gemm_k(ag, w.float(), r, 32, path="masked", overwrite_a=True),
                 lambda: gemm_k_mod.masked_dense(ag, w.float(), r, 32, torch.empty(6, 40, device=DEVICE),
                                                 overwrite_a=True)):
        with pytest.raises(ValueError, match="requires grad"):
            call()
    both = torch.ones(46, 128, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match="a overlaps w in memory, and a is written in place"):
        gemm_k(both[:6], both[4:44], r, 32, path="masked", overwrite_a=True)
    assert (both == 1).all()
    with pytest.raises(ValueError, match="overwrite_a=1"):
        gemm_k_mod.masked_dense(a, w, r, 32, torch.empty(6, 40, dtype=torch.bfloat16, device=DEVICE), overwrite_a=1)
    with pytest.raises(ValueError, match="overwrite_a='yes'"):
        gemm_k(a, w, r, 32, overwrite_a="yes")
    # a transposed `a` and a non-contiguous route are made contiguous, not misread
    gen = seed_for("mask_select_strides")
    at = randn((128, 6), torch.bfloat16, gen).t()
    rt = make_mask("random", (4, 6), gen).t()
    out = poisoned((6, 128), torch.bfloat16)
    sel(at, rt, 32, out)
    assert torch.equal(out, torch.where(rt.repeat_interleave(32, dim=1), at, torch.zeros((), dtype=at.dtype,
                                                                                           device=DEVICE)))
