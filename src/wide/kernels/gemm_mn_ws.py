"""GEMM-MN and the fused SwiGLU on Hopper with warp specialization (Gluon; paper Algorithm 2), a tuner candidate
of :func:`wide.kernels.swiglu`.  A producer partition issues the TMA copy of each weight tile and the cp.async
copies of the gathered token rows (an mbarrier per stage); the MMA warpgroups run ``wgmma`` from shared memory and
write through the scatter index.  Persistent grid by default (``PERSIST=False``: one program per tile).
"""

import torch

from wide.kernels._common import HAS_TRITON, num_sms, tma_aligned

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
        """``(m0, n0, group, active rows)`` of output tile ``tile`` in the grouped order."""
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
                  STAGES: gl.constexpr, SWIGLU: gl.constexpr, num_warps: gl.constexpr):
        acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                        instr_shape=[16, BN, 16])
        TN: gl.constexpr = BN // 8 if BN < 256 else 32
        # 16-byte stores after a layout change through shared memory
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
                           SWIGLU: gl.constexpr, num_warps: gl.constexpr):
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
                         stride_om, G, num_progs, BM, BN, BK, GROUP_M, STAGES, SWIGLU, num_warps)),
            (_producer, (x_ptr, idx_ptr, cnt_ptr, w_desc, w2_desc, a_bufs, b_bufs, b2_bufs, a_ready, b_ready, empty,
                         M, N, K, NG, stride_xm, G, num_progs, BM, BN, BK, GROUP_M, STAGES, PW, SWIGLU)),
        ], [PW], [PREGS])


def candidates(x: torch.Tensor, w: torch.Tensor, w2: torch.Tensor | None, G: int) -> list[dict]:
    """Configs of this kernel for the fused SwiGLU's tuner where it can run here (none otherwise)."""
    if w2 is None or not (HAS_GLUON and x.is_cuda and torch.cuda.get_device_capability(x.device)[0] == 9
                          and x.dtype in (torch.bfloat16, torch.float16) and x.shape[1] % 64 == 0 and G % 64 == 0
                          and tma_aligned(w, w2)):
        return []
    base = dict(default_config(G, True), WS=True)
    return [base, dict(base, PERSIST=False)]


def default_config(G: int, swiglu: bool = False) -> dict:
    """Tile config for group size G: 128 x 256 tiles where G allows (128 x 128 for the SwiGLU)."""
    bn = 256 if G % 256 == 0 and not swiglu else 128 if G % 128 == 0 else 64
    return dict(BM=128, BN=bn, BK=64, GROUP_M=16 if swiglu else 8, STAGES=3 if bn == 256 or swiglu else 4, PW=4,
                PREGS=40, num_warps=8, maxnreg=168)


def launch(x, w, w2, G: int, reordered, out, cfg: dict) -> torch.Tensor:
    """``out[m, n] = (x @ w.T)[m, n] if route[m, n // G] else 0`` (with ``w2``: ``silu(x @ w.T) * (x @ w2.T)``) on
    checked arguments: x ``[M, K]`` bf16 / fp16 on an sm_90 GPU, w (w2) ``[N, K]``, K and G multiples of 64,
    ``reordered`` of the route, contiguous ``out [M, N]``; ``cfg`` over :func:`default_config` (and ``PERSIST``)."""
    M, K = x.shape
    N = w.shape[0]
    cfg = {**default_config(G, w2 is not None), **cfg}
    x = x if x.stride(1) == 1 else x.contiguous()
    gdt = gl.bfloat16 if x.dtype == torch.bfloat16 else gl.float16
    b_layout = gl.NVMMASharedLayout.get_default_for([cfg["BN"], cfg["BK"]], gdt)
    w_desc = TensorDescriptor.from_tensor(w.contiguous(), [cfg["BN"], cfg["BK"]], b_layout)
    w2_desc = w_desc if w2 is None else TensorDescriptor.from_tensor(w2.contiguous(), [cfg["BN"], cfg["BK"]], b_layout)
    tiles = -(-M // cfg["BM"]) * (N // cfg["BN"])
    grid = (min(tiles, num_sms(x.device)) if cfg.get("PERSIST", True) else tiles,)
    _gemm_mn_ws_kernel[grid](x, out, reordered.index, reordered.counts, w_desc, w2_desc, M, N, K, N // G, x.stride(0),
                             out.stride(0), G, grid[0], BM=cfg["BM"], BN=cfg["BN"], BK=cfg["BK"],
                             GROUP_M=cfg["GROUP_M"], STAGES=cfg["STAGES"], PW=cfg["PW"], PREGS=cfg["PREGS"],
                             A_LAYOUT=gl.NVMMASharedLayout.get_default_for([cfg["BM"], cfg["BK"]], gdt),
                             SWIGLU=w2 is not None, num_warps=cfg["num_warps"], maxnreg=cfg["maxnreg"])
    return out

