"""The K-axis routed GEMM of the O projection (any K-axis projection of at most 16 groups) in a shared token order
(paper Eq. 21, Algorithm 3 over one :func:`~wide.kernels.token_order` for all groups instead of one order per group):
``out[m] = sum over the groups g that row m executes of a[m, K_g] @ w[:, K_g].T``.

A program owns a ``(BM, BN)`` output tile of BM sorted rows.  Its K loop runs over the weight chunks of the groups in
its rows' union only (level-0 skipping per (row tile, group) block, Eq. 9), gathers the A rows through the
permutation (or reads them in place when the caller produced A in the sorted order), accumulates in registers and
stores each output element once, scattered to its token's row: no split-K partials, no atomics.  A row that skips a
group of its tile's union adds that group's A block, which is zero where the caller says so (``zeroed``) and is
masked to zero otherwise.

Backends: ``"triton"`` (every GPU, and the CPU interpreter) and ``"cute"`` (:mod:`wide.kernels.sm90` on sm_90a, for
sorted, zeroed A in bf16 / fp16, K and G multiples of 64, N of 256: the sorted rows by TMA, the union over the cluster's
tiles); ``"auto"`` takes CuTe where the GPU's config sets ``o_proj.cute`` (or ``WIDE_GEMM_BACKEND=cute``) and it runs.
:data:`LAST_BACKEND` records what ran.
"""

import torch

from wide.kernels import _common as common
from wide.kernels import reference, sm90
from wide.kernels.token_order import MAX_GROUPS, TILE, TokenOrder, check_order, token_order

if common.HAS_TRITON:
    import triton
    import triton.language as tl

    from wide.kernels._common import mma

    @triton.jit
    def _or(a, b):
        return a | b

    @triton.jit
    def _shared_order_kernel(a_ptr, w_ptr, out_ptr, perm_ptr, key_ptr, union_ptr, M, N, NG, stride_am, stride_wn,
                             stride_om, a_desc, w_desc, G: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                             BK: tl.constexpr, GROUP_M: tl.constexpr, NGP: tl.constexpr, UT: tl.constexpr,
                             A_SORTED: tl.constexpr, MASK_A: tl.constexpr, EVEN_N: tl.constexpr,
                             TMA_A: tl.constexpr, TMA_W: tl.constexpr):
        # grouped raster: GROUP_M row tiles share a weight column panel in L2
        pid = tl.program_id(0)
        num_m = tl.cdiv(M, BM)
        in_group = GROUP_M * tl.cdiv(N, BN)
        first_m = (pid // in_group) * GROUP_M
        size_m = tl.minimum(num_m - first_m, GROUP_M)
        m0 = (first_m + (pid % in_group) % size_m) * BM
        n0 = ((pid % in_group) // size_m) * BN
        offs_j = m0 + tl.arange(0, BM)
        valid = offs_j < M
        rows = tl.load(perm_ptr + offs_j, mask=valid, other=0).to(tl.int64)
        # the union of the tile's rows: the OR of its UT-row tile unions (one when BM < UT)
        if BM > UT:
            offs_u = m0 // UT + tl.arange(0, BM // UT)
            u = tl.reduce(tl.load(union_ptr + offs_u, mask=offs_u < tl.cdiv(M, UT), other=0), 0, _or)
        else:
            u = tl.load(union_ptr + m0 // UT)
        offs_g = tl.arange(0, NGP)
        act = ((u >> offs_g) & 1) * (offs_g < NG).to(tl.int32)
        rank = tl.where(act != 0, tl.cumsum(act, axis=0), 0)  # 1-based rank of each executed group
        CPG: tl.constexpr = G // BK
        total = tl.sum(act, axis=0) * CPG
        offs_k = tl.arange(0, BK)
        offs_n = n0 + tl.arange(0, BN)
        nmask = offs_n < N
        a_rows = offs_j.to(tl.int64) if A_SORTED else rows
        a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :]
        w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
        if MASK_A:
            keys = tl.load(key_ptr + offs_j, mask=valid, other=0)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for t in range(0, total):
            q = t // CPG
            g = tl.sum(tl.where(rank == q + 1, offs_g, 0), axis=0)  # the q-th executed group
            k0 = g * G + (t - q * CPG) * BK
            if TMA_A:
                at = a_desc.load([m0, k0])
            else:
                at = tl.load(a_ptrs + k0, mask=valid[:, None], other=0.0)
            if MASK_A:
                at = tl.where(((keys >> g) & 1)[:, None] != 0, at, tl.zeros_like(at))
            if TMA_W:
                wt = w_desc.load([n0, k0])
            elif EVEN_N:
                wt = tl.load(w_ptrs + k0)
            else:
                wt = tl.load(w_ptrs + k0, mask=nmask[:, None], other=0.0)
            acc = mma(at, tl.trans(wt), acc)
        o_ptrs = out_ptr + rows[:, None] * stride_om + offs_n[None, :]
        tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & nmask[None, :])


BACKENDS = common.BACKEND_CHOICES
LAST_BACKEND: dict[str, str] = {}  # "o_proj" -> what ran last: "cute", "triton" or "reference"


def cute_unsupported(a, w, G: int, out, zeroed: bool, a_sorted: bool) -> str:
    """Why the CuTe kernel cannot take these checked arguments ("" when it can); builds it on first use."""
    if not (zeroed and a_sorted):
        return "a not sorted and zeroed (it takes a_sorted=True, zeroed=True)"
    if a.dtype not in (torch.bfloat16, torch.float16):
        return f"dtype {str(a.dtype).replace('torch.', '')} (it takes bfloat16 and float16)"
    if a.shape[1] % 64 or G % 64 or w.shape[0] % 256:
        return f"K={a.shape[1]}, G={G}, N={w.shape[0]} (it takes K and G multiples of 64, N a multiple of 256)"
    if a.numel() and not common.tma_aligned(a, w, out):
        return "tensors not 16-byte aligned with unit column stride"
    if not sm90.available(a.device):
        return "no sm_90 GPU, or the CuTe kernels did not build (see the warning)"
    return ""


def candidates(G: int, M: int) -> list[dict]:
    """Tile configs ``(BM, BN, BK, GROUP_M, warps, stages, TMA)`` of the shared-order kernel, BK dividing G."""
    bk = min(64, common.pow2_part(G))
    if common.interpret_mode():
        return [dict(BM=32, BN=16, BK=min(bk, 32), GROUP_M=2)]
    base = [(128, 128, 8, 8, 4, True), (128, 256, 8, 8, 3, True), (64, 256, 8, 8, 4, True), (64, 256, 8, 4, 4, True),
            (128, 128, 8, 8, 3, True), (64, 128, 8, 4, 4, True), (128, 128, 8, 8, 4, False), (64, 128, 8, 4, 4, False)]
    if M <= 512:
        base = [c for c in base if c[0] == 64] + [c for c in base if c[0] != 64]
    tma_ok = hasattr(tl, "tensor_descriptor")
    out = []
    for bm, bn, gm, w, st, tma in base:
        c = dict(BM=bm, BN=bn, BK=bk, GROUP_M=gm, num_warps=w, num_stages=st, **({"TMA": True} if tma and tma_ok
                                                                                  else {}))
        if c not in out:
            out.append(c)
    return out


def launch(a, w, order: TokenOrder, G: int, out, cfg: dict, zeroed: bool, a_sorted: bool) -> torch.Tensor:
    """One launch of the shared-order kernel with tile config ``cfg`` on checked, contiguous arguments."""
    M, K = a.shape
    N = w.shape[0]
    bm, bn, bk = cfg["BM"], cfg["BN"], cfg["BK"]
    tma_w = cfg.get("TMA", False) and N >= bn and common.tma_aligned(w)
    tma_a = tma_w and a_sorted and M >= bm and common.tma_aligned(a)
    a_desc = w_desc = w
    if tma_w:
        from triton.tools.tensor_descriptor import TensorDescriptor

        w_desc = TensorDescriptor.from_tensor(w, [bn, bk])
        if tma_a:
            a_desc = TensorDescriptor.from_tensor(a, [bm, bk])
    grid = (triton.cdiv(M, bm) * triton.cdiv(N, bn),)
    _shared_order_kernel[grid](a, w, out, order.perm, order.keys, order.union, M, N, K // G, a.stride(0), w.stride(0),
                               out.stride(0), a_desc, w_desc, G=G, BM=bm, BN=bn, BK=bk, GROUP_M=cfg["GROUP_M"],
                               NGP=max(2, common.next_pow2(K // G)), UT=TILE, A_SORTED=a_sorted, MASK_A=not zeroed,
                               EVEN_N=N % bn == 0, TMA_A=tma_a, TMA_W=tma_w, **common.launch_opts(cfg))
    return out


def _o_proj(a, w, route, G, order, zeroed, a_sorted, out, backend="auto") -> torch.Tensor:
    M, K = a.shape
    N = w.shape[0]
    out = torch.empty((M, N), dtype=a.dtype, device=a.device) if out is None else out
    env = common.env_backend("WIDE_GEMM_BACKEND")
    if backend == "cute" or (backend == "auto" and env != "triton" and a.is_cuda and
                             (env == "cute" or common.tuned_config(a.device)["o_proj"]["cute"])):
        why = cute_unsupported(a, w, G, out, zeroed, a_sorted) if a.is_cuda else f"a is on {a.device}, not an sm_90 GPU"
        if not why and M == 0:
            LAST_BACKEND["o_proj"] = "cute"
            return out

        def cute_launch():
            return sm90.o_proj(a, w, order.perm, order.union, out, G)

        if not why and backend == "cute":
            cute_launch()
            LAST_BACKEND["o_proj"] = "cute"
            return out
        if not why and common.auto_cute("o_proj", cute_launch) is not None:
            LAST_BACKEND["o_proj"] = "cute"
            return out
        if backend == "cute":
            common.fail(f"backend='cute' cannot run this o_proj: {why}")
    LAST_BACKEND["o_proj"] = "triton" if common.use_triton(a) else "reference"
    if not common.use_triton(a):
        return out.copy_(reference.o_proj_ref(a, w, route, G, order.perm if a_sorted else None))
    if M == 0 or N == 0:
        return out
    if order is None:
        order = token_order(route)
    a = a if a.stride(1) == 1 else a.contiguous()
    w = w if w.stride(1) == 1 else w.contiguous()

    def run(cfg):
        launch(a, w, order, G, out, cfg, zeroed, a_sorted)

    key = (common.m_bucket(M), N, K, G, str(a.dtype), zeroed, a_sorted)
    run(common.pick_config("o_proj_shared", key, a.device, candidates(G, M), run, graph=True))
    return out


def o_proj(a: torch.Tensor, w: torch.Tensor, route: torch.Tensor, G: int, *, order: TokenOrder | None = None,
           zeroed: bool = False, a_sorted: bool = False, out: torch.Tensor | None = None,
           backend: str = "auto") -> torch.Tensor:
    """K-axis routed GEMM in the shared token order (Eq. 21): ``out[m] = sum over g with route[m, g] of
    a[m, K_g] @ w[:, K_g].T``, each output tile summing only the groups some row of its sorted rows executes.

    a ``[M, K]`` bf16/fp16/fp32 (``a_sorted``: row j holds token ``order.perm[j]``), w ``[N, K]``, route bool
    ``[M, K // G]`` with ``1 <= K // G <= 16``, G a multiple of 16 dividing K, ``order`` the
    :func:`~wide.kernels.token_order` of route (computed here when None), out optional contiguous ``[M, N]`` in token
    order.  ``zeroed``: the caller guarantees ``a`` is zero in every (row, group) block the route skips, so the kernel
    does not mask it.  ``backend``: ``"auto"``, ``"triton"`` or ``"cute"`` (see the module).  Triton configs are timed
    on the first call of each shape.  Raises KernelArgumentError: bad arguments, more than 16 groups, ``a_sorted``
    without ``order``, or ``backend="cute"`` where the CuTe kernel cannot run.
    """
    M, N, K = common.check_gemm(a, w, route, G, "K", xname="a")
    if K // G > MAX_GROUPS:
        common.fail(f"o_proj: N_G = K / G = {K // G} groups; the shared token order takes at most {MAX_GROUPS} "
                    "(use gemm_k)")
    common.check_out(out, (M, N), a.dtype, a.device, a=a, w=w, route=route)
    common.check_flag("zeroed", zeroed)
    if common.check_flag("a_sorted", a_sorted) and order is None:
        common.fail("o_proj(a_sorted=True) needs the order a was sorted by: pass order=token_order(route)")
    if backend not in BACKENDS:
        common.fail(f"backend={backend!r} is not allowed; allowed: {', '.join(map(repr, BACKENDS))}")
    if order is not None:
        order = check_order(order, M, route.device)
    return _o_proj(a, w, route, G, order, zeroed, a_sorted, out, backend)
