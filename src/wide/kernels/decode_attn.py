"""Split-KV routed decode attention (``Tq == 1``) with GQA packing (paper Algorithm 4, Appendix B: no reorder).

A pack (the query heads of one KV head) no routed head group spans reads no K / V; its programs become more KV
splits of the active packs, numbered on the device.  A second kernel merges the splits by log-sum-exp.
"""

import torch

from wide.kernels import _common as common
from wide.kernels import reference

if common.HAS_TRITON:
    import triton
    import triton.language as tl

    from wide.kernels._common import left_pad_at, mma, nth_active

    @triton.jit
    def _pack_flags(route_ptr, PACKS, Hk, NG, REP, HPG, PP: tl.constexpr, GPP: tl.constexpr):
        """int32 ``[PP]``: 1 where KV pack ``p = b * Hk + hk`` is active (some head group it spans is routed)."""
        offs_p = tl.arange(0, PP)
        pm = offs_p < PACKS
        b = offs_p // Hk
        h0 = (offs_p % Hk) * REP
        g0 = h0 // HPG
        g1 = (h0 + REP - 1) // HPG
        act = tl.zeros((PP,), dtype=tl.int32)
        for j in tl.static_range(GPP):  # the head groups a pack spans
            on = pm & (g0 + j <= g1)
            act = tl.maximum(act, (tl.load(route_ptr + b * NG + g0 + j, mask=on, other=0) != 0).to(tl.int32))
        return act

    @triton.jit
    def _split_count(n_act, PACKS, SPLITS, SMAX, WAVE):
        """``S``, the KV splits of each of the ``n_act`` active packs: their ``A * SPLITS`` programs rounded up to
        whole waves of WAVE programs, ``S = ceil(A * SPLITS / WAVE) * WAVE // A``, within ``[1, min(SMAX, PACKS *
        SPLITS // A)]`` (the grid).  WAVE = 1 keeps ``S = SPLITS``, and so does ``n_act == PACKS`` (every pack
        active: ``S >= SPLITS`` before the clamp to ``PACKS * SPLITS // PACKS``)."""
        A = tl.maximum(n_act, 1)
        S = tl.cdiv(A * SPLITS, WAVE) * WAVE // A
        return tl.maximum(tl.minimum(tl.minimum(S, SMAX), (PACKS * SPLITS) // A), 1)

    @triton.jit
    def _split_len(Tk, S, BN: tl.constexpr):
        """Keys per split of ``S`` splits of ``Tk`` keys, whole BN tiles."""
        return tl.cdiv(tl.cdiv(Tk, S), BN) * BN

    @triton.jit
    def _pack_q(q_ptr, route_ptr, pk, Hk, NG, REP, HPG, sqb, sqh, D: tl.constexpr, RP: tl.constexpr):
        """The query rows ``[RP, D]`` of KV pack ``pk`` (heads past REP: 0) and whether each head is routed."""
        offs_r = tl.arange(0, RP)
        hmask = offs_r < REP
        b = pk // Hk
        h = (pk % Hk) * REP + offs_r
        act = tl.load(route_ptr + b * NG + h // HPG, mask=hmask, other=0) != 0
        q = tl.load(q_ptr + b.to(tl.int64) * sqb + h[:, None].to(tl.int64) * sqh + tl.arange(0, D)[None, :],
                    mask=hmask[:, None], other=0.0)
        return q, act

    @triton.jit
    def _decode_attn_split_kernel(q_ptr, k_ptr, v_ptr, route_ptr, lp_ptr, mpart_ptr, lpart_ptr, opart_ptr, ns_ptr,
                                  Hq, Hk, Tk, NG, REP, HPG, PACKS, SPLITS, SMAX, WAVE, scale,
                                  sqb, sqh, skb, skh, skt, svb, svh, svt,
                                  D: tl.constexpr, RP: tl.constexpr, BN: tl.constexpr, HAS_LP: tl.constexpr,
                                  PP: tl.constexpr, GPP: tl.constexpr):
        # 1-D grid of PACKS * SPLITS programs: program p runs KV split p % S of the (p // S)-th active pack (S from
        # _split_count; programs past A * S exit), partials to slot sp of (b, h) in [B, Hq, SMAX]; program 0 stores S
        # for the merge kernel.  The query of the dense numbering (pack p // SPLITS) is loaded before the pack flags
        # arrive and kept when every pack is active (no lookup then)
        pid = tl.program_id(0)
        pk = pid // SPLITS
        q, act = _pack_q(q_ptr, route_ptr, pk, Hk, NG, REP, HPG, sqb, sqh, D, RP)
        act_p = _pack_flags(route_ptr, PACKS, Hk, NG, REP, HPG, PP, GPP)
        n_act = tl.sum(act_p, axis=0)
        S = _split_count(n_act, PACKS, SPLITS, SMAX, WAVE)
        if pid == 0:
            tl.store(ns_ptr, S)
        qi = pid // S
        sp = pid - qi * S
        if n_act != PACKS:
            pk = nth_active(act_p, qi, tl.arange(0, PP))
            q, act = _pack_q(q_ptr, route_ptr, pk, Hk, NG, REP, HPG, sqb, sqh, D, RP)
        split_len = _split_len(Tk, S, BN)
        run = qi < n_act
        b = pk // Hk
        hk = pk % Hk
        start = sp * split_len
        if run & (start < Tk):  # skip KV reads of an inactive head group pack
            offs_r = tl.arange(0, RP)
            hmask = offs_r < REP
            h = hk * REP + offs_r
            offs_d = tl.arange(0, D)
            q = tl.where(act[:, None], q, tl.zeros_like(q))  # inactive heads of an active pack: 0 (written as 0)
            lo = 0
            if HAS_LP:
                lo = left_pad_at(lp_ptr, b, Tk)
            end = tl.minimum(start + split_len, Tk)
            jstart = tl.maximum(start, (lo // BN) * BN)
            m_i = tl.full((RP,), -1.0e30, dtype=tl.float32)
            l_i = tl.zeros((RP,), dtype=tl.float32)
            acc = tl.zeros((RP, D), dtype=tl.float32)
            qk_scale = scale * 1.4426950408889634
            kbase = k_ptr + b.to(tl.int64) * skb + hk.to(tl.int64) * skh
            vbase = v_ptr + b.to(tl.int64) * svb + hk.to(tl.int64) * svh
            for j in range(jstart, end, BN):
                offs_j = j + tl.arange(0, BN)
                jm = (offs_j < end) & (offs_j >= lo)
                kt = tl.load(kbase + offs_j[None, :].to(tl.int64) * skt + offs_d[:, None], mask=jm[None, :],
                             other=0.0)  # [D, BN]
                s = mma(q, kt, None) * qk_scale
                s = tl.where(jm[None, :], s, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, axis=1))
                alpha = tl.exp2(m_i - m_new)
                p = tl.exp2(s - m_new[:, None])
                l_i = l_i * alpha + tl.sum(p, axis=1)
                vt = tl.load(vbase + offs_j[:, None].to(tl.int64) * svt + offs_d[None, :], mask=jm[:, None], other=0.0)
                acc = acc * alpha[:, None] + mma(p.to(vt.dtype), vt, None)
                m_i = m_new
            pidx = (b * Hq + h) * SMAX + sp
            tl.store(mpart_ptr + pidx, m_i, mask=hmask)
            tl.store(lpart_ptr + pidx, l_i, mask=hmask)
            tl.store(opart_ptr + pidx[:, None].to(tl.int64) * D + offs_d[None, :], acc, mask=hmask[:, None])

    @triton.jit
    def _decode_attn_combine_kernel(route_ptr, mpart_ptr, lpart_ptr, opart_ptr, out_ptr, ns_ptr, Hq, Tk, NG, HPG, SMAX,
                                    sob, soh, D: tl.constexpr, SP: tl.constexpr, BN: tl.constexpr):
        # merges the splits of (b, h) by log-sum-exp; S, the split kernel's split count, read from ns_ptr
        pid = tl.program_id(0)
        b = pid // Hq
        h = pid % Hq
        act = tl.load(route_ptr + b * NG + h // HPG) != 0
        S = tl.load(ns_ptr)
        offs_d = tl.arange(0, D)
        o_ptrs = out_ptr + b.to(tl.int64) * sob + h.to(tl.int64) * soh + offs_d
        if act:
            split_len = _split_len(Tk, S, BN)
            offs_s = tl.arange(0, SP)
            smask = offs_s < tl.cdiv(Tk, split_len)  # splits that start before Tk (the others wrote nothing)
            base = (b * Hq + h) * SMAX
            m = tl.load(mpart_ptr + base + offs_s, mask=smask, other=-1.0e30)
            z = tl.load(lpart_ptr + base + offs_s, mask=smask, other=0.0)
            o = tl.load(opart_ptr + (base + offs_s)[:, None].to(tl.int64) * D + offs_d[None, :],
                        mask=smask[:, None], other=0.0)
            mmax = tl.max(m, axis=0)
            wgt = tl.exp2(m - mmax)
            den = tl.sum(z * wgt, axis=0)
            num = tl.sum(o * wgt[:, None], axis=0)
            res = tl.where(den > 0, num / tl.where(den > 0, den, 1.0), 0.0)
            tl.store(o_ptrs, res.to(out_ptr.dtype.element_ty))
        else:
            tl.store(o_ptrs, tl.zeros((D,), dtype=out_ptr.dtype.element_ty))


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, route: torch.Tensor, *,
                     left_pad: torch.Tensor | None = None, scale: float | None = None,
                     out: torch.Tensor | None = None, splits: int | None = None, max_splits: int | None = None,
                     wave: int | None = None) -> torch.Tensor:
    """Split-KV routed decode attention (Eq. 2; Algorithm 4, decode): for ``route[b, 0, g]`` the softmax attention of
    ``q[b, h, 0]`` over the keys ``j >= left_pad[b]`` of KV head ``h // (Hq / Hk)``, else 0 (g the head's group).

    q ``[B, Hq, 1, d]``, k / v ``[B, Hk, Tk, d]`` (any strides but the last), route ``[B, 1, N_G]``; left_pad, scale
    and out as :func:`~wide.kernels.routed_attention`.  ``splits`` KV splits per pack when all are active, at most
    ``max_splits`` per active pack, ``wave`` programs per wave: the A active packs get ``ceil(A * splits / wave) * wave
    // A`` splits (``wave=1`` keeps ``splits``); defaults fill the GPU.  Raises KernelArgumentError: Tq != 1, splits /
    max_splits / wave not an int >= 1, or as :func:`~wide.kernels.routed_attention`.
    """
    B, Hq, Tq, D, Hk, Tk, NG = common.check_attention(q, k, v, route, left_pad)
    common.check_out(out, tuple(q.shape), q.dtype, q.device, q=q, k=k, v=v, route=route, left_pad=left_pad)
    if Tq != 1:
        common.fail(f"decode_attention needs Tq == 1, got Tq={Tq}")
    for name, val in (("splits", splits), ("max_splits", max_splits), ("wave", wave)):
        if val is not None and (isinstance(val, bool) or not isinstance(val, int) or val < 1):
            common.fail(f"decode_attention: {name}={val!r} must be an int >= 1 (or None for the default)")
    return _decode_attention(q, k, v, route, left_pad, common.softmax_scale(scale, D), out, splits, max_splits, wave)


def _decode_attention(q, k, v, route, left_pad, scale: float, out, splits=None, max_splits=None, wave=None):
    """:func:`decode_attention` on checked arguments (any ``out`` layout with a contiguous last dimension)."""
    B, Hq, _, D = q.shape
    Hk, Tk = k.shape[1], k.shape[2]
    NG = route.shape[-1]
    if out is None:
        out = torch.empty_like(q)
    if not common.use_triton(q):
        return out.copy_(reference.attention_ref(q, k, v, route, False, left_pad, scale))
    if B * Hq == 0:
        return out
    if left_pad is not None:
        left_pad = left_pad.contiguous()  # the kernel reads left_pad[b] at offset b
    rep = Hq // Hk
    hpg = Hq // NG
    route = route.contiguous()
    if splits is None:  # enough programs to fill the GPU
        splits = 2 if common.interpret_mode() else max(1, min(triton.cdiv(Tk, 128),
                                                               triton.cdiv(8 * common.num_sms(q.device), B * Hk)))
    bn = 16 if common.interpret_mode() else 64
    split_len = triton.cdiv(triton.cdiv(Tk, splits), bn) * bn
    splits = triton.cdiv(Tk, split_len)  # the dense split count: no split starts past Tk
    if max_splits is None:
        max_splits = min(triton.cdiv(Tk, 2 * bn), 4 * splits)
    smax = max(splits, min(int(max_splits), triton.cdiv(Tk, bn)))
    mpart = torch.empty((B, Hq, smax), dtype=torch.float32, device=q.device)
    lpart = torch.empty_like(mpart)
    opart = torch.empty((B, Hq, smax, D), dtype=torch.float32, device=q.device)
    rp = max(16, common.next_pow2(rep))
    packs = B * Hk
    pp = max(2, common.next_pow2(packs))
    gpp = max((hk * rep + rep - 1) // hpg - (hk * rep) // hpg + 1 for hk in range(Hk))
    ns = torch.empty(1, dtype=torch.int32, device=q.device)  # S, from the split kernel to the merge kernel
    lp = left_pad if left_pad is not None else mpart  # dummy pointer when unused
    opts = {} if common.interpret_mode() else {"num_warps": 4, "num_stages": 3}
    consts = dict(D=D, RP=rp, HAS_LP=left_pad is not None, PP=pp, GPP=gpp, BN=bn)

    def args(w):  # the split kernel's runtime arguments with WAVE = w
        return (q, k, v, route, lp, mpart, lpart, opart, ns, Hq, Hk, Tk, NG, rep, hpg, packs, splits, smax, w, scale,
                q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1),
                v.stride(2))

    if wave is None:  # compiled (not launched) with a WAVE of the same specialization as any real one
        wave = 2 if common.interpret_mode() else common.resident_programs(
            _decode_attn_split_kernel, ("decode_attn", q.dtype, D, rp, bn, left_pad is not None), q.device, args(3),
            consts, opts)
    _decode_attn_split_kernel[(packs * splits,)](*args(wave), **consts, **opts)
    _decode_attn_combine_kernel[(B * Hq,)](route, mpart, lpart, opart, out, ns, Hq, Tk, NG, hpg, smax, out.stride(0),
                                           out.stride(1), D=D, SP=max(2, common.next_pow2(smax)), BN=bn,
                                           **common.warps(1))
    return out
