"""The WIDE inference engine: a Llama-family forward pass built from the routed kernels (paper §3.3, Appendix B).

Per layer the attention router reads the stream entering ``input_layernorm`` (Eq. 4-5); one reorder of its mask
(Eq. 7, Algorithm 1) serves the Q projection (``gemm_mn``, Algorithm 2) and the attention (Algorithm 4); O is
``o_proj`` in the shared token order of the mask (``token_order``) or ``gemm_k`` (Algorithm 3); K and V are dense
(Eq. 2).  The FFN router gates the fused SwiGLU and ``down_proj``.  Each
routed op runs as its kernel or as cuBLAS / SDPA with the skipped groups zeroed (the same function), chosen per layer
from the measured activity and :func:`wide.kernels.tuned_config`; on CUDA the routers run on a second stream beside
the work that reads no mask.  ``ops="dense"`` is the same structure unrouted (the benchmarks' baseline).
"""

from __future__ import annotations

import functools
import math
import operator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import record_function

from wide.errors import WideError
from wide.inference.cache import StaticKVCache
from wide.kernels import (
    Reordered,
    gemm_k,
    gemm_mn,
    gemv_mn,
    masked_swiglu_act,
    reorder,
    routed_attention,
    router_mask,
    sm90,
    swiglu,
    tuned_config,
    zero_skipped_heads_,
)
from wide.kernels._common import env_backend, use_triton
from wide.kernels.gemm_mn import uses_reorder
from wide.kernels.o_proj import o_proj as shared_order_gemm_k
from wide.kernels.rmsnorm import add_rmsnorm
from wide.kernels.rope import rope_cache
from wide.kernels.token_order import MAX_GROUPS, token_order
from wide.model import WideModel, check_architecture, check_token_ids, decoder_layers, dims_of, outside_vocab

OPS = ("routed", "dense")
MODES = ("kernel", "auto", "dense")
KAXIS_PATHS = ("dense", "shared", "gemm_k")


def kaxis_path(tuned: dict, op: str, M: int, p: float) -> str:
    """The path of the K-axis ``op`` ("o_proj" or "down_proj") of ``M`` rows executing the fraction ``p`` of its groups
    (``tuned``: the tuned config's ``"engine"`` section): in ``kaxis[op]`` at the row count nearest ``M`` in ``log2``
    (ties: the lower), the first ``[bound, path]`` with ``p <= bound``; "dense" past the last bound or without a table.
    Paths: "dense" (cuBLAS on the zero-filled input), "shared" (``o_proj``, shared token order), "gemm_k"."""
    table = tuned.get("kaxis", {}).get(op)
    if not table:
        return "dense"
    m = min((int(k) for k in table), key=lambda k: (abs(math.log2(k) - math.log2(max(M, 1))), k))
    return next((path for bound, path in table[str(m)] if p <= bound), "dense")


def naxis_dense_above(tuned: dict, op: str, G: int, M: int, router_beside: bool = False) -> float:
    """Executed fraction above which the N-axis ``op`` ("gemm_mn": Q, "swiglu": gate + up) of ``M`` rows and group
    size ``G`` runs as cuBLAS (``tuned``: the tuned config's ``"engine"`` section).  From 1024 rows the measured
    ``naxis_crossover``, linear in ``log2 M`` at the nearest G in ``log2``; 65-1023 rows a fixed rule; up to 64 rows Q
    dense, the SwiGLU routed, or with its router beside gate / up routed while ``(1 - p)^M > beside_skip_min``.  The
    nearest G is taken per row count (ties: the lower), so a table need not list every G at every M."""
    if M <= 64:
        if op != "swiglu":
            return 0.0
        return 1.0 - tuned["beside_skip_min"] ** (1.0 / M) if router_beside and M > 4 else 1.0
    if M < 1024:
        return 0.93 if op == "swiglu" else (0.92 if G >= 256 else 0.80)

    def nearest_g(by_g: dict) -> float:
        return by_g[min(by_g, key=lambda c: (abs(math.log2(int(c)) - math.log2(G)), int(c)))]

    return _log2_interp({int(m): nearest_g(by_g) for m, by_g in tuned["naxis_crossover"][op].items()}, M)


def attn_dense_above(tuned: dict, T: int) -> float:
    """Executed fraction of head groups above which prefill attention over a ``T``-token prompt runs as SDPA
    (``tuned``: the tuned config's ``"engine"`` section): its measured ``attn_crossover`` (``{T: p}``, from
    ``wide.bench.kernels.crossovers``) linear in ``log2 T``, held beyond its ends."""
    return _log2_interp({int(t): p for t, p in tuned["attn_crossover"].items()}, T)


def _log2_interp(points: dict[int, float], x: int) -> float:
    """``points`` ``{size: value}`` at ``x``: linear in ``log2 size`` between neighbours, held beyond the ends."""
    xs = sorted(points)
    if x <= xs[0] or x >= xs[-1]:
        return points[xs[0] if x <= xs[0] else xs[-1]]
    lo, hi = max(k for k in xs if k <= x), min(k for k in xs if k > x)
    w = (math.log2(x) - math.log2(lo)) / (math.log2(hi) - math.log2(lo))
    return (1 - w) * points[lo] + w * points[hi]


def sliding_window(hf_config) -> int | None:
    """The sliding attention window a Hugging Face config really uses (Mistral whenever set, Qwen2 / Qwen3 with
    ``use_sliding_window``), or None.  The engine runs full attention, equal to it while a sequence fits."""
    win = getattr(hf_config, "sliding_window", None)
    on = getattr(hf_config, "use_sliding_window", getattr(hf_config, "model_type", None) == "mistral")
    return win if win and on else None


def tokens_str(n: int) -> str:
    return f"{n} token" if n == 1 else f"{n} tokens"


def batch_reorder_view(flat: Reordered, mask: torch.Tensor) -> Reordered:
    """The per-sequence reorder of ``mask [B, T, N_G]`` (equal to ``reorder(mask)``) gathered from ``flat``, the
    reorder of ``mask.view(B * T, N_G)``: the active rows of sequence ``b`` are a contiguous run of each column."""
    B, T, N = mask.shape
    cb = mask.sum(1, dtype=torch.int64)
    act_start = torch.cumsum(cb, 0) - cb
    inact = T - cb
    inact_start = flat.counts.to(torch.int64)[None] + torch.cumsum(inact, 0) - inact
    j = torch.arange(T, device=mask.device).view(1, T, 1)
    src = torch.where(j < cb[:, None, :], act_start[:, None, :] + j, inact_start[:, None, :] + j - cb[:, None, :])
    idx = torch.gather(flat.index.to(torch.int64), 0, src.view(B * T, N)).view(B, T, N)
    idx = idx - (torch.arange(B, device=mask.device) * T).view(B, 1, 1)
    return Reordered(idx.to(torch.int32), j < cb[:, None, :], cb.to(torch.int32))


def _op(fn):
    """Run ``fn`` inside a profiler range named after it (the per-op trace of ``wide bench e2e``)."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        with record_function(fn.__name__):
            return fn(*args, **kwargs)
    return run


def _norm(module: nn.Module, h: torch.Tensor, add: torch.Tensor | None):
    """``(h + add, module(h + add))`` for an RMSNorm module, through the fused kernel."""
    return add_rmsnorm(h, add, module.weight, getattr(module, "variance_epsilon", getattr(module, "eps", 1e-6)))


def _sdpa(q, k, v, pad, causal: bool, scale: float):
    """SDPA over keys ``j >= pad[b]`` (causal at prefill; a padding query sees itself); None pad: no padding."""
    gqa = q.shape[1] != k.shape[1]
    if pad is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=gqa)
    T, S = q.shape[2], k.shape[2]
    j = torch.arange(S, device=q.device)
    allowed = j.view(1, 1, 1, S) >= pad.view(-1, 1, 1, 1)
    if causal:
        allowed = (allowed | torch.eye(T, S, dtype=torch.bool, device=q.device)) & (j.view(1, S) <= j[:T].view(T, 1))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale, enable_gqa=gqa)


@dataclass
class Pass:
    """What the layers of one forward share: ``valid`` (bool ``[B, T]``: tokens counted in the statistics, or None),
    ``pad`` (int64 ``[B]``: keys below it are masked, or None), ``slots`` (int64 ``[B, T]``: where K / V go)."""

    engine: Engine
    phase: str
    cache: StaticKVCache
    valid: torch.Tensor | None
    pad: torch.Tensor | None
    slots: torch.Tensor
    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None


class Layer(nn.Module):
    """Decoder layer ``i`` over the Hugging Face layer's weights (no copies) and its routers (None: unrouted)."""

    def __init__(self, layer: nn.Module, i: int, attn_router: nn.Module | None, ffn_router: nn.Module | None) -> None:
        super().__init__()
        at, mlp = layer.self_attn, layer.mlp
        self.i = i
        self.wq, self.wk, self.wv, self.wo = at.q_proj.weight, at.k_proj.weight, at.v_proj.weight, at.o_proj.weight
        self.bq, self.bk, self.bv, self.bo = at.q_proj.bias, at.k_proj.bias, at.v_proj.bias, at.o_proj.bias
        self.wg, self.wu, self.wd = mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight
        self.ln1, self.ln2 = layer.input_layernorm, layer.post_attention_layernorm
        self.q_norm, self.k_norm = getattr(at, "q_norm", None), getattr(at, "k_norm", None)  # Qwen3
        self.scaling = float(getattr(at, "scaling", at.head_dim ** -0.5))
        self.attn_router, self.ffn_router = attn_router, ffn_router
        qkv = ((self.bq, self.wq), (self.bk, self.wk), (self.bv, self.wv))
        self.bqkv = None if all(b is None for b, _ in qkv) else torch.cat(
            [b.detach() if b is not None else w.new_zeros(w.shape[0]) for b, w in qkv])

    def forward(self, h: torch.Tensor, add: torch.Tensor | None, f: Pass):
        """Residual ``h [B, T, D]`` and the previous sublayer's output ``add`` (None in layer 0) ->
        ``(h + add + attention output, FFN output)``; the next norm adds the FFN output."""
        h, o = self.attention(h, add, f)
        return self.feed_forward(h, o, f)

    def attention(self, h, add, f: Pass):
        e, i = f.engine, self.i
        B, T, _ = h.shape
        M, decode = B * T, f.phase == "decode"
        one = decode and e.qkv_one_launch(M, i)
        q_dense = not one and (e.ops == "dense" or e.naxis_dense("attn", i, M))
        sdpa = not e.fast or (f.phase == "prefill" and (e.ops == "dense" or e.attn_dense(i, T)))
        beside = e.streams and self.attn_router is not None
        path = "dense" if e.ops == "dense" else e.kaxis_path("attn", i, M)  # O's
        if decode:  # the router reads h + add beside the norm, K / V and a cuBLAS Q
            def main():
                h2, x = _norm(self.ln1, h, add)
                return (h2, x) + ((None,) * 3 if one else self.qkv_proj(x, q_dense))
            m, (h, x, q, k, v) = e.beside(lambda: self.route("attn", h, f, add), main, beside)
            flat, per = self.reorder("attn", m, not q_dense, False)
            order = self.token_order("attn", m, path)
        else:  # the router, its reorder and O's token order beside K / V and a cuBLAS Q
            h, x = _norm(self.ln1, h, add)

            def side():
                r = self.route_reorder("attn", h, f, not q_dense, not sdpa)
                return (*r, self.token_order("attn", r[0], path))

            (m, flat, per, order), (q, k, v) = e.beside(side, lambda: self.qkv_proj(x, q_dense), beside)
        if one:
            q, k, v = self.qkv_gemv(x, m, e)
        elif q is None:
            q = self.q_proj(x, m, flat, e.g_attn, False)
        d = e.dims
        q, k, v = q.view(B, T, -1, d.head_dim), k.view(B, T, -1, d.head_dim), v.view(B, T, -1, d.head_dim)
        if self.q_norm is not None:
            q, k = _norm(self.q_norm, q, None)[1], _norm(self.k_norm, k, None)[1]
        q, k = self.rope_kv_cache(q, k, v, f)
        a = self.attend(q.transpose(1, 2), k.transpose(1, 2) if k is not None else None, v.transpose(1, 2), m, per, f,
                        sdpa)
        return h, self.o_proj(a, m, e, "dense" if m is None else path, order).view(B, T, -1)

    def feed_forward(self, h, o, f: Pass):
        e, i = f.engine, self.i
        B, T, D = h.shape
        M = B * T
        n_dense = e.ops == "dense" or e.naxis_dense("ffn", i, M)
        path = "dense" if e.ops == "dense" else e.kaxis_path("ffn", i, M)
        k_dense = path == "dense"
        beside = e.streams and self.ffn_router is not None
        g = u = flat = None
        # a dense gate / up as the fused SwiGLU that zeroes the skipped groups in its epilogue: the router runs first
        route_in_kernel = (e.ops == "routed" and f.phase == "prefill" and n_dense and e.fused_swiglu(M)
                           and e.fused_swiglu_route and self.ffn_router is not None)
        if f.phase == "decode" and not (n_dense and k_dense):  # the router reads h + o beside the norm
            m, (h, x) = e.beside(lambda: self.route("ffn", h, f, o), lambda: _norm(self.ln2, h, o), beside)
            flat, _ = self.reorder("ffn", m, not n_dense, False)
        else:
            h, x = _norm(self.ln2, h, o)
            if n_dense and k_dense and not route_in_kernel:  # the router beside gate / up, which need no mask
                m, (g, u) = e.beside(lambda: self.route("ffn", h, f),
                                     lambda: self.gate_up_dense(x.view(M, D), e.fused_swiglu(M)), beside)
            else:
                m, flat, _ = self.route_reorder("ffn", h, f, not n_dense, False)
        route = m.view(M, -1) if m is not None else None
        act = self.gate_up(x.view(M, D), route, flat, g, u, n_dense, e.g_ffn, e.fused_swiglu(M), route_in_kernel)
        order = self.token_order("ffn", m, path)
        return h, self.down_proj(act, route, "dense" if route is None else path, order, e.g_ffn).view(B, T, D)

    # --- the ops (each a profiler range) ---------------------------------------------------------------------
    def route(self, kind: str, h, f: Pass, add=None):
        """Bool mask ``[B, T, N_G]`` (Eq. 4-5) of the router reading ``h + add``; all True without a router; None
        for ``ops="dense"``.  Counts the executed groups of valid tokens and records the mask when asked."""
        e = f.engine
        if e.ops == "dense":
            return None
        with record_function(f"{kind}_router"):
            r = self.attn_router if kind == "attn" else self.ffn_router
            n = e.n_attn if kind == "attn" else e.n_ffn
            if r is None:
                m = e.all_true((*h.shape[:-1], n))
            else:
                m = router_mask(h, r.w1.weight, r.w1.bias, r.w2.weight, r.w2.bias, add=add)
            if e.track_sparsity:
                w = f.valid.to(torch.float64) if f.valid is not None else h.new_ones(h.shape[:-1], dtype=torch.float64)
                j = 0 if kind == "attn" else 2
                e.stats[j] += (m.sum(-1).to(torch.float64) * w).sum()
                e.stats[j + 1] += w.sum() * n
            if e.record_masks:
                e.masks[(kind, self.i)] = m
            return m

    def reorder(self, kind: str, m, mn_kernel: bool, attention: bool):
        """``(flat, per-sequence)`` reorders of ``m`` that the ops running as kernels read (else None)."""
        if m is None or not use_triton(m):
            return None, None
        with record_function(f"{kind}_reorder"):
            B, T, N = m.shape
            flat = reorder(m.view(B * T, N)) if mn_kernel and uses_reorder(B * T, m.device) else None
            if not attention or T == 1:
                return flat, None
            if flat is None:
                return None, reorder(m)
            if B == 1:
                return flat, Reordered(flat.index.view(1, T, N), flat.mask.view(1, T, N), flat.counts.view(1, N))
            return flat, batch_reorder_view(flat, m)

    def token_order(self, kind: str, m, path: str):
        """The shared token order of ``m`` when its K-axis projection runs in it (``path`` "shared"), else None;
        computed once per layer and routing decision, readable by every op of that decision."""
        if path != "shared" or m is None:
            return None
        with record_function(f"{kind}_token_order"):
            return token_order(m)

    def route_reorder(self, kind: str, h, f: Pass, mn_kernel: bool, attention: bool):
        m = self.route(kind, h, f)
        return (m, *self.reorder(kind, m, mn_kernel, attention))

    def qkv_proj(self, x, q_dense: bool):
        """The projections that read no mask: K, V, and Q where it runs as cuBLAS."""
        return (self.q_proj(x, None, None, 0, True) if q_dense else None, *self.kv_proj(x))

    @_op
    def kv_proj(self, x):
        return F.linear(x, self.wk, self.bk), F.linear(x, self.wv, self.bv)

    @_op
    def qkv_gemv(self, x, m, e: Engine):
        """Decode of <= 4 rows: ``[Q routed | K | V]`` as one GEMV launch (K and V its always-executed tail)."""
        B, T, D = x.shape
        g = e.qkv_group
        route = m if m is not None else e.all_true((B, T, e.dims.attn_width // g))
        out = gemv_mn(x.view(B * T, D), self.wq, route.view(B * T, -1), g, tail=(self.wk, self.wv))
        if self.bqkv is not None:
            out = out + self.bqkv
        nq, nkv = self.wq.shape[0], self.wk.shape[0]
        return out[:, :nq], out[:, nq:nq + nkv], out[:, nq + nkv:]

    @_op
    def q_proj(self, x, m, flat, G: int, dense: bool):
        x2 = x.view(-1, x.shape[-1])
        if dense:  # cuBLAS: the routed attention ignores the skipped head groups' Q
            return F.linear(x2, self.wq, self.bq)
        q = gemm_mn(x2, self.wq, m.view(x2.shape[0], -1), G, reordered=flat)
        return q + self.bq if self.bq is not None else q

    @_op
    def rope_kv_cache(self, q, k, v, f: Pass):
        """RoPE of Q and K and the cache write: ``(q [B, T, Hq, d], k [B, T, Hk, d] at prefill, else None)``."""
        c = f.cache
        return rope_cache(q, k, v, f.cos, f.sin, c.k[self.i], c.v[self.i], f.slots, want_k=f.phase == "prefill")

    @_op
    def attend(self, q, k, v, m, per, f: Pass, sdpa: bool):
        """Routed attention ``[B, Hq, T, d]`` over the prompt block (prefill, causal) or the cache (decode)."""
        B = q.shape[0]
        if f.phase == "decode":
            k, v = f.cache.k[self.i, :B], f.cache.v[self.i, :B]
        if sdpa:
            a = _sdpa(q, k, v, f.pad, f.phase == "prefill", self.scaling)
            return zero_skipped_heads_(a, m) if m is not None else a
        route = m if m is not None else f.engine.all_true((B, q.shape[2], f.engine.n_attn))
        return routed_attention(q, k, v, route, f.phase == "prefill", left_pad=f.pad, scale=self.scaling,
                                reordered=per)

    @_op
    def o_proj(self, a, m, e: Engine, path: str, order):
        """O of ``path`` (:func:`kaxis_path`) over the attention output ``a [B, Hq, T, d]``, whose skipped head groups
        are exact zeros, as ``[B * T, Hq * d]``.  In the shared order the copy to token rows writes them in the sorted
        order (one gather instead of the transposing copy), so the kernel reads A tiles contiguously."""
        B, _, T, _ = a.shape
        if path == "shared":
            idx, at = order.perm.long(), a.transpose(1, 2)
            a_sorted = (at[0].index_select(0, idx) if B == 1 else at[idx // T, idx % T]).reshape(B * T, -1)
            o = shared_order_gemm_k(a_sorted, self.wo, m.view(B * T, -1), e.g_attn, order=order, zeroed=True,
                                    a_sorted=True)
            return o + self.bo if self.bo is not None else o
        a = a.transpose(1, 2).reshape(B * T, -1)
        if path == "dense":
            return F.linear(a, self.wo, self.bo)
        o = gemm_k(a, self.wo, m.view(B * T, -1), e.g_attn)
        return o + self.bo if self.bo is not None else o

    @_op
    def gate_up_dense(self, x, fused: bool):
        """:meth:`dense_gate_up` in its own profiler range (beside the router)."""
        return self.dense_gate_up(x, fused)

    def dense_gate_up(self, x, fused: bool):
        """Dense gate / up of ``x [M, D]``: ``(gate, up)`` by cuBLAS, or with ``fused`` ``(silu(gate) * up, None)`` by
        the fused CuTe SwiGLU."""
        if fused:
            return sm90.dense_swiglu(x, self.wg, self.wu), None
        return F.linear(x, self.wg), F.linear(x, self.wu)

    @_op
    def gate_up(self, x, route, flat, g, u, n_dense: bool, G: int, fused: bool, route_in_kernel: bool = False):
        """``silu(gate(x)) * up(x)`` with the skipped groups zero (``g``, ``u``: :meth:`dense_gate_up`'s output, if
        already computed; ``fused``: the dense path as the fused SwiGLU; ``route_in_kernel``: that kernel zeroes the
        skipped groups itself, with no masking pass after it)."""
        if not n_dense:
            return swiglu(x, self.wg, self.wu, route, G, reordered=flat)
        if route_in_kernel and route is not None:
            return sm90.dense_swiglu(x, self.wg, self.wu, route=route)
        if g is None:  # inside this op's range, not a second one (the trace sums the ranges)
            g, u = self.dense_gate_up(x, fused)
        if u is None:  # the fused SwiGLU's activation: only the skipped groups to zero
            return g if route is None else g.view(g.shape[0], -1, G).mul_(route.unsqueeze(-1)).view(g.shape)
        return F.silu(g) * u if route is None else masked_swiglu_act(g, u, route, G)

    @_op
    def down_proj(self, act, route, path: str, order, G: int):
        """Down of ``path`` (:func:`kaxis_path`); the skipped groups of ``act`` are exact zeros."""
        if path == "dense":
            return F.linear(act, self.wd)
        if path == "shared":
            return shared_order_gemm_k(act, self.wd, route, G, order=order, zeroed=True)
        return gemm_k(act, self.wd, route, G)


class Engine(nn.Module):
    """The routed (or dense) forward pass of a Llama-family model over a static KV cache.

    ``model``: a :class:`wide.WideModel` (argmax routing) or a Hugging Face ``*ForCausalLM`` (every group executes).
    ``ops``: "routed", or "dense" (cuBLAS, SDPA prefill; routers ignored).  ``track_sparsity``: count the executed
    groups of valid tokens (:meth:`realized_sparsity`).  ``kaxis`` (O, down), ``naxis`` (Q, gate + up) and ``attn``
    (prefill attention): "kernel", "dense" (cuBLAS / SDPA, the skipped groups zeroed) or "auto": per layer from its
    activity (:meth:`measure_activity`) and the tuned tables (O / down: :func:`kaxis_path`; unmeasured, dense above 4
    rows).  O runs as a kernel in the shared token order (``o_proj``) where N_G <= 16, else as ``gemm_k``.

    Raises:
        WideError: another kind of model, an unsupported architecture or activation, a wrapped (unmerged LoRA)
            projection, FFN biases, or an option outside the values above.
    """

    def __init__(self, model: nn.Module, ops: str = "routed", track_sparsity: bool = True, kaxis: str = "auto",
                 naxis: str = "auto", attn: str = "auto") -> None:
        super().__init__()
        for name, value, allowed in (("ops", ops, OPS), ("kaxis", kaxis, MODES), ("naxis", naxis, MODES),
                                     ("attn", attn, MODES)):
            if value not in allowed:
                raise WideError(f"{name}={value!r} is not one of {', '.join(allowed)}")
        if not isinstance(model, nn.Module) or not hasattr(model, "config"):
            raise WideError(f"Engine needs a WideModel (wide.load) or a Hugging Face causal LM; got "
                            f"{type(model).__name__}")
        wide = model if isinstance(model, WideModel) else None
        base = wide.base if wide is not None else model
        cfg = base.config
        check_architecture(cfg)
        if getattr(cfg, "hidden_act", "silu") not in ("silu", "swish"):
            raise WideError(f"activation {cfg.hidden_act!r} is not supported by the inference engine (SiLU only)")
        hf_layers = decoder_layers(base)
        for layer in hf_layers:
            for name in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
                mod = getattr(layer.self_attn if name[0] in "qkvo" else layer.mlp, name)
                if hasattr(mod, "base_layer") or not isinstance(getattr(mod, "weight", None), torch.Tensor):
                    raise WideError(f"{name} is wrapped (e.g. an unmerged LoRA adapter); load the checkpoint with "
                                    "merge_lora=True to run the inference engine")
                if name[0] in "gud" and mod.bias is not None:
                    raise WideError("FFN projections with biases are not supported by the inference engine")
        self.ops, self.track_sparsity, self.kaxis, self.naxis, self.attn = ops, track_sparsity, kaxis, naxis, attn
        self.base, self.dims, self.window = base, dims_of(cfg), sliding_window(cfg)
        inner = base
        while not hasattr(inner, "layers"):
            inner = inner.model
        self.embed, self.norm, self.rotary = inner.embed_tokens, inner.norm, inner.rotary_emb
        self.lm_head = base.get_output_embeddings()
        p = next(base.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.tuned = tuned_config(self.device)["engine"]
        d, L = self.dims, self.dims.num_layers
        self.g_attn, self.g_ffn = ((wide.config.attn_group_size, wide.config.ffn_group_size) if wide is not None else
                                   (d.gqa_group_size, 128 if d.intermediate_size % 128 == 0 else d.intermediate_size))
        attn_r, ffn_r = ((list(wide.attn_routers) or [None] * L, list(wide.ffn_routers) or [None] * L)
                         if wide is not None else ([None] * L, [None] * L))
        self.layers = nn.ModuleList(Layer(hf_layers[i], i, attn_r[i], ffn_r[i]) for i in range(L))
        self.n_attn, self.n_ffn = d.attn_width // self.g_attn, d.intermediate_size // self.g_ffn
        kv = d.num_kv_heads * d.head_dim
        gcd = math.gcd(d.attn_width, kv)  # the dense engine's GEMV groups need only divide both widths
        self.qkv_group = self.g_attn if kv % self.g_attn == 0 else (gcd if ops == "dense" and gcd % 16 == 0 else None)
        self.fast = use_triton(p)
        self.streams = self.fast and self.device.type == "cuda" and ops == "routed"
        # dense gate / up from this many rows as the fused CuTe SwiGLU (sm_90), where it beats two cuBLAS GEMMs and
        # the activation pass: the dense engine's baseline and the routed engine's dense path (None: never)
        rows = self.tuned.get("fused_swiglu_min_rows")
        self.fused_swiglu_min_rows = rows if (  # WIDE_GEMM_BACKEND=triton: no CuTe kernel at all
            rows is not None and self.fast and self.dtype in (torch.bfloat16, torch.float16)
            and env_backend("WIDE_GEMM_BACKEND") != "triton"
            and d.hidden_size % 64 == 0 and d.intermediate_size % 128 == 0 and sm90.available(self.device)) else None
        # the fused SwiGLU applies the route in its epilogue, in place of a masking pass over its output (where the
        # config says so and G is a multiple of its 128-column tiles)
        self.fused_swiglu_route = bool(self.tuned["fused_swiglu_route"]) and self.g_ffn % 128 == 0
        self.expected_active = {(kind, i): 1.0 for kind, r in (("attn", attn_r[0]), ("ffn", ffn_r[0])) if r is None
                                for i in range(L)}  # an unrouted kind executes every group
        self.record_masks, self.masks, self._ones, self._side = False, {}, {}, None
        self.stats = torch.zeros(4, dtype=torch.float64, device=self.device)  # attn executed / total, ffn the same

    # --- dispatch ------------------------------------------------------------------------------------------------
    def kaxis_path(self, kind: str, i: int, M: int) -> str:
        """Path of layer ``i``'s O (``kind`` "attn") or down ("ffn") projection of ``M`` rows: "dense" (cuBLAS on the
        zero-filled input), "shared" (``o_proj`` in the shared token order, N_G <= 16) or "gemm_k".  "kernel": the
        GEMV up to 4 rows, above it O shared, down ``gemm_k``; "auto": the GEMV up to 4 rows, above it
        :func:`kaxis_path` of the measured activity (dense when unmeasured)."""
        shared_ok = (self.n_attn if kind == "attn" else self.n_ffn) <= MAX_GROUPS
        if self.kaxis == "dense":
            return "dense"
        if M <= 4:
            return "gemm_k"
        if self.kaxis == "kernel":
            return "shared" if kind == "attn" and shared_ok else "gemm_k"
        p = self.expected_active.get((kind, i))
        path = "dense" if p is None else kaxis_path(self.tuned, "o_proj" if kind == "attn" else "down_proj", M, p)
        return "dense" if path == "shared" and not shared_ok else path

    def naxis_dense(self, kind: str, i: int, M: int) -> bool:
        """Whether layer ``i``'s Q (``kind`` "attn") or gate + up ("ffn") of ``M`` rows run as cuBLAS."""
        if self.naxis != "auto":
            return self.naxis == "dense"
        p = self.expected_active.get((kind, i))
        if M <= 4 or p is None:  # the decode GEMVs match cuBLAS with every group executed
            return False
        beside = kind == "ffn" and self.streams and self.layers[i].ffn_router is not None
        return p > naxis_dense_above(self.tuned, "gemm_mn" if kind == "attn" else "swiglu",
                                     self.g_attn if kind == "attn" else self.g_ffn, M, beside)

    def fused_swiglu(self, M: int) -> bool:
        """Whether a dense gate / up of ``M`` rows runs as the fused CuTe SwiGLU (:meth:`Layer.gate_up_dense`)."""
        return self.fused_swiglu_min_rows is not None and M >= self.fused_swiglu_min_rows

    def attn_dense(self, i: int, T: int) -> bool:
        """Whether layer ``i``'s prefill attention over ``T`` tokens runs as SDPA, its skipped head groups zeroed."""
        p = self.expected_active.get(("attn", i))
        return self.attn == "dense" or (self.attn == "auto" and p is not None and p > attn_dense_above(self.tuned, T))

    def qkv_one_launch(self, M: int, i: int = 0) -> bool:
        """Whether a decode step of ``M`` rows runs Q, K and V as one GEMV launch (``gemv_mn`` with K and V as its
        tail): up to 4 rows on the Triton path, where Q would run its kernel (always in the dense engine)."""
        return (M <= 4 and self.fast and self.qkv_group is not None
                and (self.ops == "dense" or not self.naxis_dense("attn", i, M)))

    def beside(self, side, main, on: bool):
        """``(side(), main())``; with ``on``, ``side`` runs on a second CUDA stream forked from the current one,
        which waits for both (memory of the second stream is reused only after a later fork, so after every use)."""
        if not on:
            return side(), main()
        if self._side is None:
            self._side = torch.cuda.Stream(self.device)
        cur = torch.cuda.current_stream(self.device)
        self._side.wait_stream(cur)
        with torch.cuda.stream(self._side):
            res = side()
        out = main()
        cur.wait_stream(self._side)
        return res, out

    def all_true(self, shape: tuple) -> torch.Tensor:
        """A cached all-execute mask (no fill kernel per layer and step)."""
        if shape not in self._ones:
            self._ones[shape] = torch.ones(shape, dtype=torch.bool, device=self.device)
        return self._ones[shape]

    # --- cache, statistics, activity -----------------------------------------------------------------------------
    def new_cache(self, batch: int, max_len: int) -> StaticKVCache:
        """A zeroed :class:`StaticKVCache` of ``batch`` rows and ``max_len`` tokens per row for this model.  Raises
        WideError for a size that is not an int >= 1, or beyond the model's context, its sliding window or the
        device's available memory."""
        for name, v in (("batch", batch), ("max_len", max_len)):
            if isinstance(v, bool) or not hasattr(v, "__index__"):
                raise WideError(f"new_cache: {name}={v!r} must be an int >= 1")
            if v < 1:
                raise WideError(f"new_cache: {name}={v} must be >= 1")
        batch, max_len = operator.index(batch), operator.index(max_len)
        ctx = getattr(self.base.config, "max_position_embeddings", None)
        if ctx is not None and max_len > ctx:
            raise WideError(f"a KV cache of {max_len} tokens exceeds the model's context of {ctx} tokens "
                            "(max_position_embeddings)")
        if self.window is not None and max_len > self.window:
            raise WideError(f"a KV cache of {max_len} tokens exceeds the model's sliding attention window "
                            f"({self.window}); sliding-window attention is not supported by the inference engine")
        d = self.dims
        nbytes = 2 * d.num_layers * batch * d.num_kv_heads * max_len * d.head_dim * self.dtype.itemsize
        from wide.memory import available_memory

        avail = available_memory(self.device)
        if avail is not None and nbytes > avail[0]:  # a CPU would overcommit, then kill the process while zeroing
            raise WideError(f"a KV cache of {batch} x {max_len} tokens needs {nbytes / 2**30:.2f} GiB on "
                            f"{self.device}, more than the {avail[0] / 2**30:.2f} GiB available ({avail[1]}): lower "
                            "the batch or max_len (--max-cache-len)")
        return StaticKVCache(d.num_layers, batch, d.num_kv_heads, d.head_dim, max_len, self.dtype, self.device)

    def reset_stats(self) -> None:
        self.stats.zero_()

    def realized_sparsity(self) -> dict:
        """``{"attn", "ffn", "overall"}`` skipped-group fractions of valid tokens since :meth:`reset_stats` (overall:
        the mean over the routed kinds, Eq. 6); a host sync."""
        s = self.stats.tolist()
        out = {k: 1.0 - s[j] / s[j + 1] for k, j in (("attn", 0), ("ffn", 2)) if s[j + 1] > 0}
        if out:
            out["overall"] = sum(out.values()) / len(out)
        return out

    @torch.no_grad()
    def measure_activity(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> dict:
        """Each routed sublayer's executed fraction over the real tokens of a sample prefill, ``{(kind, layer): p}``,
        kept in :attr:`expected_active` for the ``"auto"`` dispatch (one host sync; not counted in
        :meth:`realized_sparsity`).  Raises WideError as :meth:`prefill`."""
        if self.ops == "dense":
            return {}
        self._check_ids(input_ids)
        prev = self.record_masks, self.track_sparsity
        self.record_masks, self.track_sparsity = True, False
        try:
            self.prefill(input_ids, attention_mask, self.new_cache(*input_ids.shape))
            masks = self.masks
        finally:
            (self.record_masks, self.track_sparsity), self.masks = prev, {}
        w = (attention_mask if attention_mask is not None else torch.ones_like(input_ids)).to(torch.float64)
        keys = [(kind, i) for kind, i in masks if getattr(self.layers[i], kind + "_router") is not None]
        fr = [(masks[k].to(torch.float64).mean(-1) * w).sum() / w.sum() for k in keys]
        measured = dict(zip(keys, torch.stack(fr).tolist())) if keys else {}
        self.expected_active.update(measured)
        return measured

    # --- forward passes ------------------------------------------------------------------------------------------
    def _forward(self, ids: torch.Tensor, pos: torch.Tensor, f: Pass, all_logits: bool) -> torch.Tensor:
        self.masks = {}
        h = self.embed(ids)
        f.cos, f.sin = self.rotary(h, pos)
        add = None
        for layer in self.layers:
            h, add = layer(h, add, f)
        if not all_logits:
            h, add = h[:, -1].contiguous(), add[:, -1].contiguous()
        return self.lm_head(_norm(self.norm, h, add)[1])

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, cache: StaticKVCache,
                all_logits: bool = False) -> torch.Tensor:
        """Prefill ``input_ids`` int64 ``[B, T]``, left-padded by ``attention_mask`` (rows ``[0]*pad + [1]*n``, n >= 1,
        or None), into rows ``0..B-1`` of ``cache``; logits ``[B, V]`` of the last position (``[B, T, V]`` with
        ``all_logits``).  Positions count real tokens only: a padded row gives its prompt's logits alone.  Raises
        WideError for ids that are not an integer ``[B, T]`` tensor of the vocabulary, a mask that is not left-padded
        0/1, another device, a cache too small or made for another model."""
        self._check_ids(input_ids)
        self._check_cache(cache, "prefill")
        B, T = input_ids.shape
        if cache.batch < B:
            raise WideError(f"batch of {B} prompts does not fit a KV cache of {cache.batch} rows")
        if T > cache.max_len:
            raise WideError(f"prompt of {tokens_str(T)} is longer than the KV cache ({tokens_str(cache.max_len)})")
        m = attention_mask
        if m is not None and (m.shape != input_ids.shape or m.device != input_ids.device):
            raise WideError(f"attention_mask {tuple(m.shape)} on {m.device} must match input_ids "
                            f"{tuple(input_ids.shape)} on {input_ids.device}")
        if not (input_ids.is_cuda and torch.cuda.is_current_stream_capturing()):  # one host sync
            vocab = self.embed.num_embeddings
            bad = [((input_ids < 0) | (input_ids >= vocab)).any()]
            if m is not None:
                bad += [~((m == 0) | (m == 1)).all(), (m[:, 1:] < m[:, :-1]).any(), (m[:, -1] != 1).any()]
            bad = torch.stack(bad).tolist()
            if bad[0]:
                raise outside_vocab(input_ids, vocab)
            if any(bad[1:]):
                raise WideError("attention_mask must be left-padded, each row [0]*pad + [1]*n with n >= 1 real "
                                "tokens (0/1 values); set tokenizer.padding_side = 'left'")
        n = m.sum(1) if m is not None else torch.full((B,), T, dtype=torch.int64, device=self.device)
        pad = T - n
        pos = (torch.arange(T, device=self.device).view(1, T) - pad.view(B, 1)).clamp_min(0)
        cache.lengths.zero_()
        cache.lengths[:B] = n
        f = Pass(self, "prefill", cache, m.bool() if m is not None else None, pad if m is not None else None,
                 cache.prefill_slots(pad, T))
        return self._forward(input_ids, pos, f, all_logits)

    @torch.no_grad()
    def decode(self, tokens: torch.Tensor, cache: StaticKVCache, valid: torch.Tensor | None = None) -> torch.Tensor:
        """One decode step: ``tokens[b]`` (int64 ``[cache.batch]``) joins row ``b`` at position ``cache.lengths[b]`` and
        the lengths grow by 1; logits ``[B, V]``.  ``valid`` (bool ``[B]``) weights the statistics.  No host sync.

        Raises:
            WideError: tokens that are not int64 ``[cache.batch]``, a bad ``valid``, another device, a cache of another
                model; on the CPU also ids outside the vocabulary and a full row (on a GPU the caller sizes the cache).
        """
        if not isinstance(tokens, torch.Tensor) or tokens.dim() != 1 or tokens.dtype != torch.int64:
            got = f"{tokens.dtype} {list(tokens.shape)}" if isinstance(tokens, torch.Tensor) else type(tokens).__name__
            raise WideError(f"decode: tokens must be an int64 tensor [B] (one token id per cache row), got {got}")
        self._check_cache(cache, "decode")
        B = tokens.shape[0]
        if B != cache.batch:
            raise WideError(f"decode: {tokens_str(B)} for a KV cache of {cache.batch} rows; pass one token per cache "
                            f"row (batch {cache.batch})")
        if tokens.device != self.device:
            raise WideError(f"decode: tokens are on {tokens.device}, the engine's model is on {self.device}")
        if valid is not None and (not isinstance(valid, torch.Tensor) or valid.dtype != torch.bool
                                  or tuple(valid.shape) != (B,) or valid.device != self.device):
            got = (f"{valid.dtype} {list(valid.shape)} on {valid.device}" if isinstance(valid, torch.Tensor)
                   else type(valid).__name__)
            raise WideError(f"decode: valid must be a bool tensor [{B}] on {self.device} or None, got {got}")
        if self.device.type == "cpu":  # value checks read the device: free on the CPU only
            vocab, lo, hi = self.embed.num_embeddings, int(tokens.min()), int(tokens.max())
            if lo < 0 or hi >= vocab:
                raise WideError(f"decode: tokens hold ids from {lo} to {hi}; the model's vocabulary is 0..{vocab - 1}")
            full = (cache.lengths >= cache.max_len).nonzero().view(-1).tolist()
            if full:
                raise WideError(f"decode: the KV cache is full (row {full[0]} holds "
                                f"{tokens_str(int(cache.lengths[full[0]]))} of {cache.max_len}); no slot is left for "
                                "the new token: make a larger cache (new_cache max_len >= prompt + new tokens)")
        slot = cache.max_len - 1 - cache.lengths
        f = Pass(self, "decode", cache, valid.view(B, 1) if valid is not None else None, slot, slot.view(B, 1))
        logits = self._forward(tokens.view(B, 1), cache.lengths.view(B, 1), f, False)
        cache.lengths += 1
        return logits

    def _check_ids(self, input_ids) -> None:
        check_token_ids(input_ids)
        if input_ids.device != self.device:
            raise WideError(f"input_ids are on {input_ids.device}, the engine's model is on {self.device}")

    def _check_cache(self, cache, where: str) -> None:
        if not isinstance(cache, StaticKVCache):
            raise WideError(f"{where}: cache must be a StaticKVCache (Engine.new_cache), got {type(cache).__name__}")
        d = self.dims
        want, got = (d.num_layers, d.num_kv_heads, d.head_dim), (cache.k.shape[0], cache.k.shape[2], cache.k.shape[4])
        if got != want or cache.device != self.device or cache.k.dtype != self.dtype:
            raise WideError(f"{where}: the KV cache (layers, KV heads, head_dim) = {got}, {cache.k.dtype} on "
                            f"{cache.device} does not fit this model: {want}, {self.dtype} on {self.device}; "
                            "make it with this engine's new_cache")
