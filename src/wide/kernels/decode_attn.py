"""Split-KV routed decode attention (``Tq == 1``) with GQA packing (Algorithm 4, decode variant; paper Appendix B:
"For decoding (Tq = 1), mask reordering is bypassed and routing is checked directly at the block level").

A KV-head pack (the ``Hq / Hk`` query heads sharing one KV head) that no routed head group spans reads no K / V; the
programs of skipped packs become more KV splits of the active ones (numbered on the device: no host sync, CUDA-graph
capturable), and a second kernel merges the splits by log-sum-exp.
"""

from __future__ import annotations

import torch

from wide.kernels import reference
from wide.kernels._common import (
    HAS_TRITON,
    check_out,
    fail,
    interpret_mode,
    next_pow2,
    num_sms,
    resident_programs,
    softmax_scale,
    use_triton,
)

if HAS_TRITON:
    import triton
    import triton.language as tl

    from wide.kernels._common import left_pad_at, mm  # noqa: F401

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
    def _nth_active(act, n, PP: tl.constexpr):
        """Index of the ``n``-th (0-based) nonzero of int32 ``act [PP]`` (0 when there are fewer than n + 1)."""
        rank = tl.where(act != 0, tl.cumsum(act, axis=0), 0)  # 1-based rank among the active packs
        return tl.sum(tl.where(rank == n + 1, tl.arange(0, PP), 0), axis=0)

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
                                  PP: tl.constexpr, GPP: tl.constexpr, SPECULATE: tl.constexpr):
        # 1-D grid of PACKS * SPLITS programs.  The active packs are numbered on the device (no host sync);
        # program p runs KV split sp = p % S of the q-th active pack (q = p // S; S from _split_count), so the
        # programs of skipped packs can become more splits of the active ones; programs past A * S exit.
        # Partials go to slot sp of (b, h) in [B, Hq, SMAX]; program 0 stores S in ns_ptr for the merge kernel.
        # SPECULATE: the query (and head routes) of the dense numbering (p // SPLITS, split p % SPLITS; what the
        # numbering gives when every pack is active) are loaded before the pack flags arrive and kept when every
        # pack is active, which also skips the cumsum; otherwise the qi-th active pack is looked up and loaded.
        pid = tl.program_id(0)
        if SPECULATE:
            pk_d = pid // SPLITS
            q_d, act_d = _pack_q(q_ptr, route_ptr, pk_d, Hk, NG, REP, HPG, sqb, sqh, D, RP)
        act_p = _pack_flags(route_ptr, PACKS, Hk, NG, REP, HPG, PP, GPP)
        n_act = tl.sum(act_p, axis=0)
        S = _split_count(n_act, PACKS, SPLITS, SMAX, WAVE)
        if pid == 0:
            tl.store(ns_ptr, S)
        qi = pid // S
        sp = pid - qi * S
        if SPECULATE:
            if n_act == PACKS:  # S == SPLITS: the dense numbering
                pk = pk_d
                q = q_d
                act = act_d
            else:
                pk = _nth_active(act_p, qi, PP)
                q, act = _pack_q(q_ptr, route_ptr, pk, Hk, NG, REP, HPG, sqb, sqh, D, RP)
        else:
            pk = _nth_active(act_p, qi, PP)
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
                s = mm(q, kt) * qk_scale
                s = tl.where(jm[None, :], s, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, axis=1))
                alpha = tl.exp2(m_i - m_new)
                p = tl.exp2(s - m_new[:, None])
                l_i = l_i * alpha + tl.sum(p, axis=1)
                vt = tl.load(vbase + offs_j[:, None].to(tl.int64) * svt + offs_d[None, :], mask=jm[:, None],
                             other=0.0)
                acc = acc * alpha[:, None] + mm(p.to(vt.dtype), vt)
                m_i = m_new
            pidx = (b * Hq + h) * SMAX + sp
            tl.store(mpart_ptr + pidx, m_i, mask=hmask)
            tl.store(lpart_ptr + pidx, l_i, mask=hmask)
            tl.store(opart_ptr + pidx[:, None].to(tl.int64) * D + offs_d[None, :], acc, mask=hmask[:, None])

    @triton.jit
    def _decode_attn_combine_kernel(route_ptr, mpart_ptr, lpart_ptr, opart_ptr, out_ptr, ns_ptr, Hq, Hk, Tk, NG, REP,
                                    HPG, PACKS, SPLITS, SMAX, WAVE, sob, soh, D: tl.constexpr, SP: tl.constexpr,
                                    PP: tl.constexpr, GPP: tl.constexpr, BN: tl.constexpr, SPECULATE: tl.constexpr):
        # merges the splits of (b, h) by log-sum-exp; the split count S is the split kernel's (SPECULATE: read from
        # ns_ptr, a load issued beside the route's; else recomputed from the pack flags as the split kernel did)
        pid = tl.program_id(0)
        b = pid // Hq
        h = pid % Hq
        act = tl.load(route_ptr + b * NG + h // HPG) != 0
        if SPECULATE:
            S = tl.load(ns_ptr)
        offs_d = tl.arange(0, D)
        o_ptrs = out_ptr + b.to(tl.int64) * sob + h.to(tl.int64) * soh + offs_d
        if act:
            if not SPECULATE:
                S = _split_count(tl.sum(_pack_flags(route_ptr, PACKS, Hk, NG, REP, HPG, PP, GPP), axis=0), PACKS,
                                 SPLITS, SMAX, WAVE)
            split_len = _split_len(Tk, S, BN)
            offs_s = tl.arange(0, SP)
            smask = offs_s < tl.cdiv(Tk, split_len)  # splits that start before Tk (the others wrote nothing)
            base = (b * Hq + h) * SMAX
            m = tl.load(mpart_ptr + base + offs_s, mask=smask, other=-1.0e30)
            l = tl.load(lpart_ptr + base + offs_s, mask=smask, other=0.0)
            o = tl.load(opart_ptr + (base + offs_s)[:, None].to(tl.int64) * D + offs_d[None, :],
                        mask=smask[:, None], other=0.0)
            mmax = tl.max(m, axis=0)
            wgt = tl.exp2(m - mmax)
            den = tl.sum(l * wgt, axis=0)
            num = tl.sum(o * wgt[:, None], axis=0)
            res = tl.where(den > 0, num / tl.where(den > 0, den, 1.0), 0.0)
            tl.store(o_ptrs, res.to(out_ptr.dtype.element_ty))
        else:
            tl.store(o_ptrs, tl.zeros((D,), dtype=out_ptr.dtype.element_ty))


# Speculative dense numbering in the decode attention kernels (see _decode_attn_split_kernel); False runs the
# session-13 numbering (pack flags, then cumsum, then the query), kept for the A/B in decode_attn_waves.py.
SPECULATE = True


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, route: torch.Tensor, *,
                     left_pad: torch.Tensor | None = None, scale: float | None = None,
                     out: torch.Tensor | None = None, splits: int | None = None, max_splits: int | None = None,
                     wave: int | None = None) -> torch.Tensor:
    """Split-KV routed decode attention (``Tq == 1``) with GQA packing (Eq. 2; Algorithm 4, decode variant).

    For each batch row b and query head h of head group ``g = h // (Hq / N_G)``::

        out[b, h, 0] = softmax(scale * q[b, h, 0] @ k[b, h // (Hq / Hk), j].T) @ v[b, h // (Hq / Hk), j]
                       over the visible keys j in [left_pad[b], Tk)        if route[b, 0, g]
        out[b, h, 0] = 0                                                   otherwise

    i.e. the attention output of Eq. 2 gated per head group, ``Attn(Q, K, V) ⊙_G M_attn`` (K and V are never
    skipped).  The query is the newest token, at key position ``Tk - 1``, so it sees every key: no causal mask.

    Args:
        q: ``[B, Hq, 1, d]`` bf16/fp16/fp32, last dim contiguous; d a power of two in [16, 256].
        k, v: ``[B, Hk, Tk, d]`` KV cache in q's dtype (SDPA layout, last dim contiguous; any other strides,
            e.g. one layer's view of :class:`wide.inference.StaticKVCache`), ``Hq % Hk == 0`` (GQA: query
            head h reads KV head ``h // (Hq / Hk)``), ``Tk >= 1``.
        route: bool ``[B, 1, N_G]``, True = execute; head group g = query heads ``[g*Hq/N_G, (g+1)*Hq/N_G)``
            (``N_G`` divides Hq, so ``G = Hq * d / N_G`` is a multiple of d; the paper's GQA choice is
            ``N_G = Hk``).
        left_pad: optional int32/int64 ``[B]``: keys ``j < left_pad[b]`` are masked (padding, or the empty
            slots of the engine's reversed-slot cache; a negative value masks nothing, one ``>= Tk`` every key;
            any strides).
        scale: softmax scale (default ``1/sqrt(d)``).
        out: optional contiguous ``[B, Hq, 1, d]`` output in q's dtype on q's device.
        splits: number of KV splits per head pack in the dense case, an int ``>= 1`` (default: enough programs
            to fill the GPU, 2 under the interpreter); rounded so that every split covers a whole number of key
            tiles.  The grid is ``B * Hk * splits`` programs whatever the route.
        max_splits: the most splits an active pack may get (default: ``4 * splits``, at most one split per two
            key tiles); at least ``splits``.
        wave: programs per wave (an int ``>= 1``; default: the programs of the split kernel that the GPU holds
            at once, SMs x per-SM occupancy of the compiled kernel, :func:`wide.kernels._common.resident_programs`;
            2 under the interpreter): the ``A * splits`` programs of the A active packs are rounded up to whole
            waves, ``S = ceil(A * splits / wave) * wave // A`` splits per active pack (within ``[1, max_splits]``
            and the grid), so the last wave is not nearly empty.  ``wave=1`` keeps ``splits`` per pack (the
            layout before session 13); ``wave = B * Hk * splits`` hands every program of the grid to the active
            packs.  On the H200 (``benchmarks/kernels/decode_attn_waves_h200-s13*.md``) the occupancy wave was
            the best rule on average at s > 0, and 5-7 % faster (geometric mean) than a fixed split count at
            B = 8-16 and s = 0.5-0.75.

    Returns:
        ``out`` (or a new tensor shaped and typed like q), fp32-accumulated: 0 for an inactive (row, head group)
        and for a row with no visible key (``left_pad[b] >= Tk``).

    The ``Hq / Hk`` query heads sharing a KV head are packed into one program per KV split (GQA packing:
    the K/V tile is read once for all of them); the level-0 predicate (Eq. 9, block = that head pack) is
    "some head of the pack is active" -- no reorder, routing is checked at the block level (Appendix B: "For
    decoding (Tq = 1), mask reordering is bypassed ..."), and a pack with no active head reads no K/V at all.
    Inactive heads of an admitted pack load no Q (level 1).  Each program runs the online softmax of
    FlashAttention (running max m, sum z, fp32 accumulator) over the key tiles of its split from
    ``max(split start, left_pad[b])``; a second kernel merges the splits by log-sum-exp
    (``out = sum_s exp(m_s - M) O_s / sum_s exp(m_s - M) z_s``) and writes 0 for inactive heads and for rows
    without a visible key.  The split kernel numbers the active packs on the device (a cumsum over the ``B * Hk``
    pack flags) and gives each of the A active packs S splits (``wave`` above): a fixed split count leaves
    ``(1 - s)`` of the dense grid's programs, whose last wave on the SMs can be nearly empty; it hands S to the
    merge kernel through a one-element device buffer.  Each program loads the query of the dense numbering
    before the pack flags arrive and keeps it when every pack is active (no cumsum, one dependent load fewer).
    Grid sizes come from shapes only: no host sync, CUDA-graph capturable.  CPU without ``TRITON_INTERPRET=1`` (or without
    Triton) falls back to :func:`wide.kernels.reference.attention_ref`.

    Raises:
        ValueError: (:class:`~wide.kernels.KernelArgumentError`, a :class:`wide.errors.WideError`) Tq != 1, or
            bad shapes/dtypes/devices as :func:`wide.kernels.routed_attention`: q/k/v not 4-D, k or v not in
            q's dtype or shaped differently from each other or not ``[B, Hk, Tk, d]``, Hq not a multiple of
            Hk, d not a power of two in [16, 256], a last dim that is not contiguous, route not bool
            ``[B, 1, N_G]`` with N_G dividing Hq, left_pad not int32/int64 ``[B]``, tensors on different
            devices, or ``out`` of the wrong shape, dtype or device, not contiguous, or overlapping an input
            in memory; ``splits``,
            ``max_splits`` or ``wave`` not None and not an int >= 1, or a ``scale`` that is not a finite number.
    """
    from wide.kernels.attention import _validate as _validate_attention

    _validate_attention(q, k, v, route, left_pad)
    check_out(out, tuple(q.shape), q.dtype, q.device, q=q, k=k, v=v, route=route, left_pad=left_pad)
    B, Hq, Tq, D = q.shape
    Hk, Tk = k.shape[1], k.shape[2]
    NG = route.shape[-1]
    if Tq != 1:
        fail(f"decode_attention needs Tq == 1, got Tq={Tq}")
    for name, val in (("splits", splits), ("max_splits", max_splits), ("wave", wave)):
        if val is not None and (isinstance(val, bool) or not isinstance(val, int) or val < 1):
            fail(f"decode_attention: {name}={val!r} must be an int >= 1 (or None for the default)")
    scale = softmax_scale(scale, D)
    if out is None:
        out = torch.empty_like(q)
    if not use_triton(q):
        return out.copy_(reference.attention_ref(q, k, v, route, False, left_pad, scale))
    if B * Hq == 0:
        return out
    if left_pad is not None:
        left_pad = left_pad.contiguous()  # the kernel reads left_pad[b] at offset b
    rep = Hq // Hk
    hpg = Hq // NG
    route = route.contiguous()
    if splits is None:
        if interpret_mode():
            splits = 2
        else:
            sms = num_sms(q.device)
            splits = max(1, min(triton.cdiv(Tk, 128), triton.cdiv(8 * sms, B * Hk)))
    bn = 16 if interpret_mode() else 64
    split_len = triton.cdiv(triton.cdiv(Tk, splits), bn) * bn
    splits = triton.cdiv(Tk, split_len)  # the dense split count: no split starts past Tk
    if max_splits is None:
        max_splits = min(triton.cdiv(Tk, 2 * bn), 4 * splits)
    smax = max(splits, min(int(max_splits), triton.cdiv(Tk, bn)))
    mpart = torch.empty((B, Hq, smax), dtype=torch.float32, device=q.device)
    lpart = torch.empty_like(mpart)
    opart = torch.empty((B, Hq, smax, D), dtype=torch.float32, device=q.device)
    rp = max(16, next_pow2(rep))
    packs = B * Hk
    pp = max(2, next_pow2(packs))
    gpp = max((hk * rep + rep - 1) // hpg - (hk * rep) // hpg + 1 for hk in range(Hk))
    ns = torch.empty(1, dtype=torch.int32, device=q.device)  # S, from the split kernel to the merge kernel
    lp = left_pad if left_pad is not None else mpart  # dummy pointer when unused
    opts = {} if interpret_mode() else {"num_warps": 4, "num_stages": 3}
    geo = dict(PP=pp, GPP=gpp, BN=bn, SPECULATE=bool(SPECULATE))
    consts = dict(D=D, RP=rp, HAS_LP=left_pad is not None, **geo)

    def args(w):  # the split kernel's runtime arguments with WAVE = w
        return (q, k, v, route, lp, mpart, lpart, opart, ns, Hq, Hk, Tk, NG, rep, hpg, packs, splits, smax, w, scale,
                q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1),
                v.stride(2))

    if wave is None:  # compiled (not launched) with a WAVE of the same specialization as any real one
        wave = 2 if interpret_mode() else resident_programs(
            _decode_attn_split_kernel, ("decode_attn", q.dtype, D, rp, bn, left_pad is not None, bool(SPECULATE)),
            q.device,
            args(3), consts, opts)
    _decode_attn_split_kernel[(packs * splits,)](*args(wave), **consts, **opts)
    _decode_attn_combine_kernel[(B * Hq,)](route, mpart, lpart, opart, out, ns, Hq, Hk, Tk, NG, rep, hpg, packs,
                                           splits, smax, wave, out.stride(0), out.stride(1), D=D,
                                           SP=max(2, next_pow2(smax)), **geo,
                                           **({} if interpret_mode() else {"num_warps": 1}))
    return out
