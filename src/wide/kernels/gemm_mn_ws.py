"""GEMM-MN on Hopper with warp specialization (Gluon): a producer warpgroup gathers the token rows, the MMA warps
only multiply.

Same op and tile schedule as :mod:`wide.kernels.gemm_mn` (paper §3.3, Eq. 9 level 0, Algorithm 2): output tile
``(pid_m, pid_n)`` covers rows ``pid_m * BM ...`` of the reordered row space of routing group ``g = pid_n * BN //
G``; a tile past the group's active count writes zeros and does no MMA.  What differs is who does the work.  In
the Triton kernel every warp computes the gathered row addresses, issues the cp.async copies of its share of the
token tile and waits for them before its ``wgmma``; here

- a producer partition of ``PW`` warps (few registers) issues, per K step, the bulk-tensor (TMA) copy of the
  weight tile and the cp.async copies of the ``BM`` gathered token rows, and signals an mbarrier per stage when
  they land (``cp.async.mbarrier.arrive.noinc``: every producer thread arrives once its own copies are done);
- the default partition (``num_warps`` warps, 2 warpgroups) waits for a stage, runs ``wgmma`` from shared
  memory, frees the stage once that ``wgmma`` retired, and writes the tile through the scatter index.

By default the grid is persistent (one program per SM, tiles taken in the grouped order), so the producer runs
ahead into the next tile while the MMA warps store the last one: the epilogue and the pipeline fill overlap the
main loop.  ``PERSIST=False`` runs one program per tile instead, which lets the hardware balance the skipped tiles
(a static round robin gives some SMs more executed tiles than others when there are few tiles per SM).  Hopper
has no TMA gather (that is sm_100's ``gather4``), so the token rows stay cp.async copies, but issued by warps that
do nothing else.  With ``w2`` the same kernel is the fused routed SwiGLU (two accumulators, 128-column tiles).

Measured on the H200 (``benchmarks/kernels/ws_probe_h200-s22*``, Llama-3.1-8B up shape, against the Triton kernel
in the same process): the fused SwiGLU with every group executed runs 5 % faster (0.985-0.998x of the cuBLAS pair
against 0.93-0.95x, M = 4096 / 16384), and 1-3 % slower at s = 0.5; the plain GEMM is never faster (equal at G =
128, 4-10 % slower at 128 x 256 tiles, where three stages fit against the Triton kernel's four).  So the tuner
offers it for the SwiGLU only (:func:`wide.kernels.gemm_mn._ws_candidates`).  ``DIRECT_STORE`` and ``BK = 32``
measured slower and are kept as switches of the probe.

Requires Triton's Gluon (Triton >= 3.5) and an sm_90 GPU; bf16 / fp16, ``K % BK == 0``, ``BN | G``.  The
reference is :func:`wide.kernels.reference.gemm_mn_ref` (:func:`~wide.kernels.reference.swiglu_ref` with ``w2``).
"""

from __future__ import annotations

import torch

from wide.kernels._common import HAS_TRITON, check_out, check_reordered, fail, num_sms, tma_aligned

HAS_GLUON = False
if HAS_TRITON:
    try:
        from triton.experimental import gluon
        from triton.experimental.gluon import language as gl
        from triton.experimental.gluon.language.nvidia.hopper import (
            async_copy,
            fence_async_shared,
            mbarrier,
            tma,
            warpgroup_mma,
            warpgroup_mma_wait,
        )
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

        HAS_GLUON = hasattr(gl, "warp_specialize")
    except ImportError:  # an older Triton: no Gluon
        HAS_GLUON = False

if HAS_GLUON:

    @gluon.jit
    def _tile_of(tile, M, N, G, cnt_ptr, BM: gl.constexpr, BN: gl.constexpr, GROUP_M: gl.constexpr):
        """First row ``m0`` (reordered row space) and column ``n0`` of output tile number ``tile`` in the grouped
        order (as gemm_mn.grouped_tile), its routing group ``g`` and that group's active row count."""
        num_pid_m = gl.cdiv(M, BM)
        num_pid_n = N // BN
        in_group = GROUP_M * num_pid_n
        first_m = (tile // in_group) * GROUP_M
        size_m = gl.minimum(num_pid_m - first_m, GROUP_M)
        m0 = (first_m + (tile % in_group) % size_m) * BM
        n0 = ((tile % in_group) // size_m) * BN
        g = n0 // G
        return m0, n0, g, gl.load(cnt_ptr + g)

    @gluon.jit
    def _producer(x_ptr, idx_ptr, cnt_ptr, w_desc, w2_desc, a_bufs, b_bufs, b2_bufs, a_ready, b_ready, empty,
                  M, N, K, NG, stride_xm, G, num_progs,
                  BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, GROUP_M: gl.constexpr,
                  STAGES: gl.constexpr, PW: gl.constexpr, SWIGLU: gl.constexpr):
        # 8 contiguous elements (16 bytes) per thread: one cp.async each, BK / 8 threads per row
        TK: gl.constexpr = BK // 8
        ld: gl.constexpr = gl.BlockedLayout([1, 8], [32 // TK, TK], [PW, 1], [1, 0])
        offs_k = gl.arange(0, BK, layout=gl.SliceLayout(0, ld))
        num_tiles = gl.cdiv(M, BM) * (N // BN)
        k_iters = K // BK
        it = 0
        for tile in range(gl.program_id(0), num_tiles, num_progs):
            m0, n0, g, cnt = _tile_of(tile, M, N, G, cnt_ptr, BM, BN, GROUP_M)
            if m0 < cnt:
                offs_j = m0 + gl.arange(0, BM, layout=gl.SliceLayout(1, ld))
                rows = gl.load(idx_ptr + offs_j.to(gl.int64) * NG + g, mask=offs_j < M, other=0).to(gl.int64)
                a_ptrs = x_ptr + rows[:, None] * stride_xm + offs_k[None, :]
                for kt in range(k_iters):
                    s = it % STAGES
                    mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
                    if SWIGLU:
                        mbarrier.expect(b_ready.index(s), 2 * w_desc.block_type.nbytes)
                        tma.async_copy_global_to_shared(w2_desc, [n0, kt * BK], b_ready.index(s), b2_bufs.index(s))
                    else:
                        mbarrier.expect(b_ready.index(s), w_desc.block_type.nbytes)
                    tma.async_copy_global_to_shared(w_desc, [n0, kt * BK], b_ready.index(s), b_bufs.index(s))
                    async_copy.async_copy_global_to_shared(a_bufs.index(s), a_ptrs + kt * BK)
                    async_copy.mbarrier_arrive(a_ready.index(s), increment_count=False)
                    it += 1

    @gluon.jit
    def _consumer(out_ptr, idx_ptr, cnt_ptr, a_bufs, b_bufs, b2_bufs, a_ready, b_ready, empty,
                  M, N, K, NG, stride_om, G, num_progs,
                  BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, GROUP_M: gl.constexpr,
                  STAGES: gl.constexpr, SWIGLU: gl.constexpr, DIRECT_STORE: gl.constexpr, num_warps: gl.constexpr):
        acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                        instr_shape=[16, BN, 16])
        TN: gl.constexpr = BN // 8 if BN < 256 else 32
        if DIRECT_STORE:  # store from the accumulator layout: no shared-memory scratch for a layout change
            st: gl.constexpr = acc_l
        else:  # 16-byte stores after a layout change through shared memory
            st: gl.constexpr = gl.BlockedLayout([1, 8], [32 // TN, TN], [num_warps, 1], [1, 0])
        offs_n0 = gl.arange(0, BN, layout=gl.SliceLayout(0, st))
        num_tiles = gl.cdiv(M, BM) * (N // BN)
        k_iters = K // BK
        it = 0
        for tile in range(gl.program_id(0), num_tiles, num_progs):
            m0, n0, g, cnt = _tile_of(tile, M, N, G, cnt_ptr, BM, BN, GROUP_M)
            acc = gl.zeros((BM, BN), dtype=gl.float32, layout=acc_l)
            acc2 = gl.zeros((BM, BN), dtype=gl.float32, layout=acc_l)  # SwiGLU's up projection (unused otherwise)
            if m0 < cnt:
                for kt in range(k_iters):
                    s = it % STAGES
                    ph = (it // STAGES) & 1
                    mbarrier.wait(b_ready.index(s), ph)
                    mbarrier.wait(a_ready.index(s), ph)
                    fence_async_shared()  # cp.async wrote through the generic proxy, wgmma reads the async one
                    acc = warpgroup_mma(a_bufs.index(s), b_bufs.index(s).permute((1, 0)), acc, is_async=True)
                    if SWIGLU:
                        acc2 = warpgroup_mma(a_bufs.index(s), b2_bufs.index(s).permute((1, 0)), acc2, is_async=True)
                        acc, acc2 = warpgroup_mma_wait(num_outstanding=2, deps=(acc, acc2))
                    else:
                        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
                    # the previous step's wgmma has retired: its stage may be refilled
                    mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), pred=kt > 0)
                    it += 1
                if SWIGLU:
                    acc, acc2 = warpgroup_mma_wait(num_outstanding=0, deps=(acc, acc2))
                else:
                    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES))
            offs_j = m0 + gl.arange(0, BM, layout=gl.SliceLayout(1, st))
            valid = offs_j < M
            rows = gl.load(idx_ptr + offs_j.to(gl.int64) * NG + g, mask=valid, other=0).to(gl.int64)
            DT: gl.constexpr = out_ptr.dtype.element_ty
            if SWIGLU:  # silu(gate) * up with the model MLP's rounding points (as _common.swiglu_act)
                gate = acc.to(DT).to(gl.float32)
                act = (gate / (1.0 + gl.exp(-gate))).to(DT).to(gl.float32)
                acc = act * acc2.to(DT).to(gl.float32)
            res = gl.convert_layout(acc.to(DT), st)
            res = gl.where((offs_j < cnt)[:, None], res, gl.zeros_like(res))
            gl.store(out_ptr + rows[:, None] * stride_om + (n0 + offs_n0)[None, :], res, mask=valid[:, None])

    @gluon.jit
    def _gemm_mn_ws_kernel(x_ptr, out_ptr, idx_ptr, cnt_ptr, w_desc, w2_desc, M, N, K, NG, stride_xm, stride_om, G,
                           num_progs, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, GROUP_M: gl.constexpr,
                           STAGES: gl.constexpr, PW: gl.constexpr, PREGS: gl.constexpr, A_LAYOUT: gl.constexpr,
                           SWIGLU: gl.constexpr, DIRECT_STORE: gl.constexpr, num_warps: gl.constexpr):
        a_bufs = gl.allocate_shared_memory(x_ptr.dtype.element_ty, [STAGES, BM, BK], A_LAYOUT)
        b_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BN, BK], w_desc.layout)
        if SWIGLU:
            b2_bufs = gl.allocate_shared_memory(w2_desc.dtype, [STAGES, BN, BK], w2_desc.layout)
        else:
            b2_bufs = b_bufs
        a_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        b_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(a_ready.index(i), count=PW * 32)  # one cp.async arrival per producer thread
            mbarrier.init(b_ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=1)
        gl.warp_specialize([
            (_consumer, (out_ptr, idx_ptr, cnt_ptr, a_bufs, b_bufs, b2_bufs, a_ready, b_ready, empty, M, N, K, NG,
                         stride_om, G, num_progs, BM, BN, BK, GROUP_M, STAGES, SWIGLU, DIRECT_STORE, num_warps)),
            (_producer, (x_ptr, idx_ptr, cnt_ptr, w_desc, w2_desc, a_bufs, b_bufs, b2_bufs, a_ready, b_ready, empty,
                         M, N, K, NG, stride_xm, G, num_progs, BM, BN, BK, GROUP_M, STAGES, PW, SWIGLU)),
        ], [PW], [PREGS])


def ws_supported(x: torch.Tensor, w: torch.Tensor, w2: torch.Tensor | None, G: int) -> bool:
    """Whether :func:`gemm_mn_ws` can run ``x [M, K] @ w [N, K]^T`` (and ``w2``) at group size ``G`` here: Gluon,
    an sm_90 CUDA device, bf16 / fp16, ``K % 64 == 0``, ``G % 64 == 0`` and weights a TMA descriptor can read."""
    return (HAS_GLUON and x.is_cuda and torch.cuda.get_device_capability(x.device)[0] == 9
            and x.dtype in (torch.bfloat16, torch.float16) and w.dtype == x.dtype and x.shape[1] % 64 == 0
            and G % 64 == 0 and tma_aligned(w, *(() if w2 is None else (w2,))))


def default_ws_config(G: int, swiglu: bool = False) -> dict:
    """The tile config of :func:`gemm_mn_ws` for group size ``G``: 128 x 256 tiles where the group allows it (128 x
    128 for the fused SwiGLU, whose two fp32 accumulators would not fit the registers at 256 columns)."""
    bn = 256 if G % 256 == 0 and not swiglu else 128 if G % 128 == 0 else 64
    stages = 3 if bn == 256 or swiglu else 4
    return dict(BM=128, BN=bn, BK=64, GROUP_M=16 if swiglu else 8, STAGES=stages, PW=4, PREGS=40, num_warps=8,
                maxnreg=168)


def gemm_mn_ws(x: torch.Tensor, w: torch.Tensor, route: torch.Tensor, G: int, *, w2: torch.Tensor | None = None,
               reordered=None, out: torch.Tensor | None = None, config: dict | None = None) -> torch.Tensor:
    """N-axis routed GEMM (Algorithm 2) by the warp-specialized Hopper kernel:
    ``out[m, n] = (x @ w.T)[m, n] if route[m, n // G] else 0``; with ``w2`` the fused routed SwiGLU
    ``silu(x @ w.T) * (x @ w2.T)`` on the same entries (``w`` the gate, ``w2`` the up projection).

    Args:
        x: ``[M, K]`` bf16 / fp16 activations on an sm_90 GPU, ``K`` a multiple of 64.
        w: ``[N, K]`` weight of x's dtype, 16-byte aligned rows.
        w2: optional ``[N, K]`` up-projection weight (fused SwiGLU), like ``w``.
        route: bool ``[M, N // G]``, True = execute.
        G: group size along N, a multiple of 64 dividing N.
        reordered: optional :func:`wide.kernels.reorder` result of ``route``; computed when None.
        out: optional contiguous ``[M, N]`` output of x's dtype.
        config: tile config (keys of :func:`default_ws_config`, and ``PERSIST``: one program per SM taking the
            tiles in turn, the default, or with False one program per tile; ``DIRECT_STORE``: write the output
            from the accumulator layout, freeing the layout change's shared memory for a pipeline stage); the
            default when None.

    Returns:
        ``[M, N]`` in x's dtype, fp32 accumulation.

    Raises:
        ValueError: shapes, dtypes, devices or G outside the above (checked first, on any device).
        RuntimeError: no Gluon in this Triton, or not a CUDA sm_90 device.
    """
    from wide.kernels.gemm_mn import _validate  # the checks every gemm_mn / SwiGLU path runs

    M, N, K = _validate(x, w, route, G)
    if w2 is not None:
        if isinstance(w2, torch.Tensor) and w2.shape != w.shape:
            fail(f"w2 shape {tuple(w2.shape)} must equal w shape {tuple(w.shape)}")
        _validate(x, w2, route, G, "w2")
    check_out(out, (M, N), x.dtype, x.device, x=x, w=w, w2=w2, route=route)
    if x.dtype not in (torch.bfloat16, torch.float16):
        fail(f"gemm_mn_ws takes bf16 / fp16 x and w; got {x.dtype}")
    if K % 64:
        fail(f"gemm_mn_ws needs K a multiple of 64; got K={K}")
    if G % 64:
        fail(f"gemm_mn_ws needs G a multiple of 64 dividing N={N}; got G={G}")
    NG = N // G
    if not HAS_GLUON:
        raise RuntimeError("gemm_mn_ws needs Triton's Gluon (triton >= 3.5)")
    if not x.is_cuda or torch.cuda.get_device_capability(x.device)[0] != 9:
        raise RuntimeError(f"gemm_mn_ws needs an sm_90 (Hopper) GPU; x is on {x.device}")
    cfg = {**default_ws_config(G, w2 is not None), **(config or {})}
    if G % cfg["BN"] or K % cfg["BK"]:
        fail(f"config BN={cfg['BN']} must divide G={G} and BK={cfg['BK']} divide K={K}")
    if reordered is None:
        from wide.kernels.reorder import reorder
        reordered = reorder(route.contiguous())
    reordered = check_reordered(reordered, (M, NG), route.device)
    x = x if x.stride(1) == 1 else x.contiguous()
    w = w.contiguous()
    if out is None:
        out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    gdt = gl.bfloat16 if x.dtype == torch.bfloat16 else gl.float16
    a_layout = gl.NVMMASharedLayout.get_default_for([cfg["BM"], cfg["BK"]], gdt)
    b_layout = gl.NVMMASharedLayout.get_default_for([cfg["BN"], cfg["BK"]], gdt)
    w_desc = TensorDescriptor.from_tensor(w, [cfg["BN"], cfg["BK"]], b_layout)
    w2_desc = TensorDescriptor.from_tensor(w2.contiguous(), [cfg["BN"], cfg["BK"]], b_layout) if w2 is not None \
        else w_desc
    tiles = -(-M // cfg["BM"]) * (N // cfg["BN"])
    # persistent (one program per SM, tiles in turn) or one program per tile (the hardware balances the skipped
    # tiles; the same loop, run once)
    grid = (min(tiles, num_sms(x.device)) if cfg.get("PERSIST", True) else tiles,)
    _gemm_mn_ws_kernel[grid](x, out, reordered.index, reordered.counts, w_desc, w2_desc, M, N, K, NG, x.stride(0),
                             out.stride(0), G, grid[0], BM=cfg["BM"], BN=cfg["BN"], BK=cfg["BK"],
                             GROUP_M=cfg["GROUP_M"], STAGES=cfg["STAGES"], PW=cfg["PW"], PREGS=cfg["PREGS"],
                             A_LAYOUT=a_layout, SWIGLU=w2 is not None, DIRECT_STORE=cfg.get("DIRECT_STORE", False),
                             num_warps=cfg["num_warps"],
                             maxnreg=cfg["maxnreg"])
    return out
