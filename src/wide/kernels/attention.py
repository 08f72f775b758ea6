"""Routed flash attention for prefill (paper Eq. 2, Algorithm 4).

Every (b, head group) column of the route is reordered (Algorithm 1); a program owns BM sorted query rows of one
(b, query head): an inactive tile only writes zeros, an active one gathers its Q rows, streams K / V (online
softmax) and scatters the rows back.  The last active row of a tile is its largest query position, so causal
attention streams no later key.  ``Tq == 1`` runs :mod:`wide.kernels.decode_attn`.

On an sm_90 GPU the CuTe kernel ``sm90/attention_sm90.cu`` (producer / consumer warpgroups, K / V by TMA, wgmma) runs
the same computation for d = 128 where ``backend="cute"``, where ``WIDE_ATTN_BACKEND=cute`` is set, or where the GPU's
tuned config names it (``"attention": {"backend": "cute"}``, with ``cute_pingpong`` and ``cute_persistent`` choosing
its launch); ``WIDE_ATTN_BACKEND=triton`` keeps Triton.
:data:`LAST_BACKEND` names what the last prefill call ran.
"""

import torch

from wide.kernels import _common as common
from wide.kernels import reference, sm90
from wide.kernels.decode_attn import _decode_attention
from wide.kernels.reorder import reorder

if common.HAS_TRITON:
    import triton
    import triton.language as tl

    from wide.kernels._common import left_pad_at, mma

    try:
        from triton.tools.tensor_descriptor import TensorDescriptor
        HAS_DESC = True
    except ImportError:  # a Triton without host-side tensor descriptors streams K / V through pointers
        HAS_DESC = False

    @triton.jit
    def _attn_inner(acc, l_i, m_i, q, kbase, vbase, kd, vd, b, hk, skt, svt, start, end, qpos, lo, Tk, qk_scale,
                    offs_d, D: tl.constexpr, BN: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
                    DESC: tl.constexpr):
        for j in range(start, end, BN):
            offs_n = j + tl.arange(0, BN)
            kmask = (offs_n < Tk) & (offs_n >= lo)
            if DESC:  # TMA: rows past Tk read as zeros
                kt = kd.load([b, hk, j, 0]).reshape(BN, D).T
            elif MASKED:
                kt = tl.load(kbase + offs_n[None, :].to(tl.int64) * skt + offs_d[:, None], mask=kmask[None, :],
                             other=0.0)
            else:
                kt = tl.load(kbase + offs_n[None, :].to(tl.int64) * skt + offs_d[:, None])
            s = mma(q, kt, None) * qk_scale
            if MASKED:
                vis = kmask[None, :]
                if CAUSAL:
                    vis = vis & (offs_n[None, :] <= qpos[:, None])
                s = tl.where(vis, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            if DESC:
                vt = vd.load([b, hk, j, 0]).reshape(BN, D)
            elif MASKED:
                vt = tl.load(vbase + offs_n[:, None].to(tl.int64) * svt + offs_d[None, :], mask=kmask[:, None],
                             other=0.0)
            else:
                vt = tl.load(vbase + offs_n[:, None].to(tl.int64) * svt + offs_d[None, :])
            acc = acc * alpha[:, None] + mma(p.to(vt.dtype), vt, None)
            m_i = m_new
        return acc, l_i, m_i

    @triton.jit
    def _attn_fwd_kernel(q_ptr, k_ptr, v_ptr, kd, vd, out_ptr, idx_ptr, cnt_ptr, lp_ptr,
                         Hq, Tq, Tk, NG, REP, HPG, scale,
                         sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, sob, soh, sot,
                         D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, CAUSAL: tl.constexpr,
                         HAS_LP: tl.constexpr, DESC: tl.constexpr):
        num_m = tl.cdiv(Tq, BM)
        pid_m = tl.program_id(0)
        if CAUSAL:
            pid_m = num_m - 1 - pid_m  # heavy (late) tiles first
        bh = tl.program_id(1)
        b = bh // Hq
        h = bh % Hq
        g = h // HPG
        hk = h // REP
        cnt = tl.load(cnt_ptr + b * NG + g)
        m0 = pid_m * BM
        offs_j = m0 + tl.arange(0, BM)
        valid = offs_j < Tq
        col_ptr = idx_ptr + (b * Tq).to(tl.int64) * NG + g
        rows = tl.load(col_ptr + offs_j.to(tl.int64) * NG, mask=valid, other=0)
        offs_d = tl.arange(0, D)
        o_ptrs = (out_ptr + b.to(tl.int64) * sob + h.to(tl.int64) * soh + rows[:, None].to(tl.int64) * sot
                  + offs_d[None, :])
        if m0 >= cnt:
            tl.store(o_ptrs, tl.zeros((BM, D), dtype=out_ptr.dtype.element_ty), mask=valid[:, None])
        else:
            active = offs_j < cnt
            q = tl.load(q_ptr + b.to(tl.int64) * sqb + h.to(tl.int64) * sqh + rows[:, None].to(tl.int64) * sqt
                        + offs_d[None, :], mask=active[:, None], other=0.0)
            delta = Tk - Tq
            lo = 0
            if HAS_LP:
                lo = left_pad_at(lp_ptr, b, Tk)
            qpos = rows + delta
            if CAUSAL:
                last_row = tl.load(col_ptr + (tl.minimum(m0 + BM, cnt) - 1).to(tl.int64) * NG)
                first_row = tl.load(col_ptr + m0.to(tl.int64) * NG)
                hi = tl.minimum(Tk, delta + last_row + 1)
                full_hi = ((delta + first_row + 1) // BN) * BN
            else:
                hi = Tk
                full_hi = (Tk // BN) * BN
            lo_t = (lo // BN) * BN
            full_lo = tl.cdiv(lo, BN) * BN
            mid_end = tl.maximum(full_lo, tl.minimum(full_hi, hi))
            m_i = tl.full((BM,), -1.0e30, dtype=tl.float32)
            l_i = tl.zeros((BM,), dtype=tl.float32)
            acc = tl.zeros((BM, D), dtype=tl.float32)
            qk_scale = scale * 1.4426950408889634
            kbase = k_ptr + b.to(tl.int64) * skb + hk.to(tl.int64) * skh
            vbase = v_ptr + b.to(tl.int64) * svb + hk.to(tl.int64) * svh
            # part A: boundary tile of the left padding (masked)
            acc, l_i, m_i = _attn_inner(acc, l_i, m_i, q, kbase, vbase, kd, vd, b, hk, skt, svt, lo_t,
                                        tl.minimum(full_lo, hi), qpos, lo, Tk, qk_scale, offs_d, D, BN, True, CAUSAL,
                                        DESC)
            # part B: fully visible tiles, no element-wise mask
            acc, l_i, m_i = _attn_inner(acc, l_i, m_i, q, kbase, vbase, kd, vd, b, hk, skt, svt, full_lo, mid_end,
                                        qpos, lo, Tk, qk_scale, offs_d, D, BN, False, CAUSAL, DESC)
            # part C: causal diagonal band / ragged end (masked)
            acc, l_i, m_i = _attn_inner(acc, l_i, m_i, q, kbase, vbase, kd, vd, b, hk, skt, svt, mid_end, hi,
                                        qpos, lo, Tk, qk_scale, offs_d, D, BN, True, CAUSAL, DESC)
            keep = active & (l_i > 0)
            res = acc / tl.where(keep, l_i, 1.0)[:, None]
            res = tl.where(keep[:, None], res, 0.0).to(out_ptr.dtype.element_ty)
            tl.store(o_ptrs, res, mask=valid[:, None])


BACKENDS = common.BACKEND_CHOICES
LAST_BACKEND: dict[str, str] = {}  # "attention_prefill" -> what ran last: "cute", "triton" or "reference"


def cute_unsupported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor | None,
                     scale: float | None = None) -> str:
    """Why the CuTe kernel cannot run these checked arguments ("" when it can)."""
    if q.dtype not in (torch.bfloat16, torch.float16) or q.shape[-1] != 128:
        return f"dtype {common._dt(q.dtype)}, d={q.shape[-1]}: it takes bfloat16 / float16 with d = 128"
    if scale is not None and not scale > 0:
        return f"scale={scale}: it takes a positive softmax scale"
    if not (q.is_cuda and torch.cuda.get_device_capability(q.device) == (9, 0)):
        return f"no sm_90 GPU ({q.device})"
    ts = (q, k, v) if out is None else (q, k, v, out)
    if not all(t.stride(-1) == 1 and t.data_ptr() % 16 == 0
               and all(st % 8 == 0 and (st > 0 or n == 1) for st, n in zip(t.stride()[:-1], t.shape[:-1]))
               for t in ts):
        return ("q, k, v and out need unit stride on d, 16-byte aligned data and positive strides that are multiples "
                "of 8")
    if not sm90.available(q.device):
        return "the CuTe kernels did not build here (see the warning)"
    return ""


def _wants_cute(backend: str, env: str, q: torch.Tensor) -> bool:
    """Whether a prefill call asks for the CuTe kernel: ``backend``, then ``env`` (``WIDE_ATTN_BACKEND``), then the
    GPU's tuned config."""
    if backend == "cute":
        return True
    if backend == "triton" or env == "triton" or not q.is_cuda:
        return False
    return env == "cute" or common.tuned_config(q.device)["attention"].get("backend", "triton") == "cute"


def routed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, route: torch.Tensor,
                     causal: bool = False, *, left_pad: torch.Tensor | None = None, scale: float | None = None,
                     reordered: common.Reordered | None = None, out: torch.Tensor | None = None,
                     backend: str = "auto") -> torch.Tensor:
    """Routed FlashAttention (Eq. 2, Algorithm 4) in SDPA's layout: q ``[B, Hq, Tq, d]`` (d a power of 2 in [16, 256]),
    k / v ``[B, Hk, Tk, d]`` of q's dtype with ``Hq % Hk == 0`` and ``Tk >= Tq`` (query i at key position
    ``i + Tk - Tq``), route bool ``[B, Tq, N_G]`` (group g: query heads ``[g*Hq/N_G, (g+1)*Hq/N_G)``), optional int
    ``left_pad [B]`` (keys ``j < left_pad[b]`` masked), scale (default ``1/sqrt(d)``), reordered (a
    :func:`~wide.kernels.reorder` of route) and contiguous out.  Returns ``[B, Hq, Tq, d]`` (without out: a view of a
    contiguous ``[B, Tq, Hq, d]``, as SDPA's flash backend); 0 for an inactive (token, group) or a row with no visible
    key.  backend (prefill, ``Tq > 1``): ``"auto"`` (see the module), ``"triton"`` or ``"cute"`` (the sm_90a kernel).
    Raises KernelArgumentError: bad shapes, dtypes, devices, left_pad, reordered, out, scale, causal or backend, or
    ``backend="cute"`` where that kernel cannot run.
    """
    B, Hq, Tq, D, Hk, Tk, NG = common.check_attention(q, k, v, route, left_pad)
    common.check_flag("causal", causal)
    if backend not in BACKENDS:
        common.fail(f"backend={backend!r} is not allowed; allowed: {', '.join(map(repr, BACKENDS))}")
    env = common.env_backend("WIDE_ATTN_BACKEND")
    common.check_out(out, (B, Hq, Tq, D), q.dtype, q.device, q=q, k=k, v=v, route=route, left_pad=left_pad)
    if reordered is not None:
        reordered = common.check_reordered(reordered, (B, Tq, NG), route.device)
    scale = common.softmax_scale(scale, D)
    cute = _wants_cute(backend, env, q)
    why = ("Tq = 1 is decode attention" if Tq == 1 else cute_unsupported(q, k, v, out, scale)) if cute else ""
    if backend == "cute" and why:
        common.fail(f"backend='cute' cannot run this attention: {why}")
    if not common.use_triton(q):
        LAST_BACKEND["attention_prefill"] = "reference"
        res = reference.attention_ref(q, k, v, route, causal, left_pad, scale)
        return out.copy_(res) if out is not None else res
    if out is None:  # [B, Tq, Hq, d] in memory, like SDPA's flash output: the O projection reads a free view
        out = torch.empty((B, Tq, Hq, D), dtype=q.dtype, device=q.device).transpose(1, 2)
    if B * Tq == 0:
        return out
    if Tq == 1:
        return _decode_attention(q, k, v, route, left_pad, scale, out)
    if reordered is None:
        reordered = reorder(route)
    if cute and not why:
        lp32 = None if left_pad is None else left_pad.clamp(0, Tk).to(torch.int32).contiguous()
        tuned = common.tuned_config(q.device)["attention"]
        grid = torch.cuda.get_device_properties(q.device).multi_processor_count if tuned.get("cute_persistent") else 0
        sm90.module(q.device).attention(q, k, v, reordered.index.contiguous(), reordered.counts.contiguous(), lp32,
                                        out, bool(causal), float(scale), bool(tuned.get("cute_pingpong", True)), grid)
        LAST_BACKEND["attention_prefill"] = "cute"
        return out
    LAST_BACKEND["attention_prefill"] = "triton"
    if left_pad is not None:
        left_pad = left_pad.contiguous()  # the kernel reads left_pad[b] at offset b
    cfg = _config(D, q.device)
    lp = left_pad if left_pad is not None else reordered.counts
    kd = vd = k
    desc = cfg["desc"] and all(t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and
                               all(st * t.element_size() % 16 == 0 for st in t.stride()[:-1]) for t in (k, v))
    if desc:
        kd, vd = (TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, cfg["BN"], D]) for t in (k, v))
    grid = (triton.cdiv(Tq, cfg["BM"]), B * Hq)
    _attn_fwd_kernel[grid](q, k, v, kd, vd, out, reordered.index, reordered.counts, lp,
                           Hq, Tq, Tk, NG, Hq // Hk, Hq // NG, scale,
                           q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                           v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
                           D=D, BM=cfg["BM"], BN=cfg["BN"], CAUSAL=bool(causal), HAS_LP=left_pad is not None,
                           DESC=desc, **cfg["opts"])
    return out


def _config(D: int, device: torch.device) -> dict:
    """Tile sizes, launch options and whether K / V stream through TMA descriptors (``configs/<GPU>.json``'s
    ``attention`` section over the defaults; the interpreter takes 16 x 16 tiles)."""
    if common.interpret_mode():
        return {"BM": 16, "BN": 16, "desc": HAS_DESC, "opts": {}}
    tuned = common.tuned_config(device)["attention"]
    bm, bn = (tuned["BM"], tuned["BN"]) if D <= 128 else (64, 32)
    opts = {"num_warps": 8 if D >= 128 else 4, "num_stages": tuned["num_stages"]}
    desc = HAS_DESC and tuned["tma"] and torch.cuda.get_device_capability(device)[0] >= 9 and D <= 128
    return {"BM": bm, "BN": bn, "desc": desc, "opts": opts}
