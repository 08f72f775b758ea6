"""The WIDE inference engine: a Llama-family forward pass built from the routed kernels (paper §3.3, App. B).

Per decoder layer (prefill of a left-padded batch, or one decode step over a :class:`StaticKVCache`):

* **attention routing**: the router reads the residual stream entering ``input_layernorm`` (Eq. 4), argmax
  gives the bool mask ``[B, T, N_G]`` (Eq. 5); one reorder (Eq. 7, Algorithm 1) of it is shared by the Q
  projection (``gemm_mn``, Algorithm 2), the routed attention (Algorithm 4) and the O projection
  (``gemm_k``, Algorithm 3).  K and V are dense (Eq. 2).
* RoPE comes from the Hugging Face model's own rotary module (same cos/sin values, same rotation).
* **FFN routing**: the router reads the residual stream entering ``post_attention_layernorm``; one reorder
  is shared by the fused SwiGLU (``swiglu`` = gate + up through ``gemm_mn``) and ``down_proj`` (``gemm_k``).
* RMSNorm modules, embeddings, the final norm and ``lm_head`` are the model's own.

Decode steps need no reorder (M = batch <= 128: the GEMMs read the route directly, GEMV for M <= 4) and
no host synchronisation; :mod:`wide.inference.graphs` captures them in CUDA graphs.  With M <= 4 the Q, K and
V projections are one GEMV launch (:meth:`Engine.qkv_one_launch`), and on CUDA each router runs on a second
stream beside the RMSNorm before it (:meth:`Engine.overlaps_router`); at prefill the attention router and its
reorder run beside the K / V projections (:meth:`Engine.overlaps_prefill_router`).  Where a routed projection
runs as cuBLAS (``naxis`` dense: the mask is then only needed after it), the router also runs beside it: the
attention router beside Q (:meth:`Engine.overlaps_q_router`), the FFN router beside gate / up
(:meth:`Engine.overlaps_gate_up_router`).

``ops="dense"`` runs the same structure with cuBLAS linears and SDPA (the dense baseline of the
benchmarks); routers are then ignored.  On CPU without ``TRITON_INTERPRET=1`` every kernel falls back to
its PyTorch reference (:mod:`wide.kernels.reference`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from wide.errors import WideError
from wide.inference.cache import StaticKVCache
from wide.kernels import Reordered, gemm_k, gemm_mn, gemv_mn, reorder, routed_attention, swiglu
from wide.kernels._common import use_triton
from wide.kernels.fused import add_rmsnorm, masked_swiglu_act, rope_cache, router_mask, zero_skipped_heads_
from wide.model import check_architecture, check_token_ids, decoder_layers, dims_of, outside_vocab

OPS = ("routed", "dense")
KAXIS = ("kernel", "auto", "dense")
NAXIS = ("kernel", "auto", "dense")
ATTN = ("kernel", "auto", "dense")

# Attention executed fraction above which attn="auto" runs the prefill attention as SDPA (flash) and zeroes the
# skipped head groups.  From the H200 trace of one Llama-3.1-8B layer at 16k tokens
# (benchmarks/e2e/e2e_h200-quick4_trace.json): the routed kernel took 1.72 ms at 30 % of the head groups executed,
# SDPA 3.96 ms at all of them, so about 5.7 ms at full activity: it wins below ~0.69.  (At 4k tokens per sequence
# the kernel probe measured it 1.21x faster than SDPA at full activity, so this is conservative there.)
ATTN_DENSE_ABOVE = 0.69


# Executed fraction p* at which the routed tile kernel's time equals cuBLAS's, per op, rows M and group size G:
# on the H200 kernel grid (benchmarks/kernels/kernels_h200-full.json, Bernoulli(1 - s) masks, reorder share
# included), the speedup over cuBLAS interpolated linearly between the measured s = 0, 0.25, 0.5, 0.75 to where
# it reaches 1; p* = 1 - that s.  tests/test_engine_dispatch.py re-derives this table from the JSON.
NAXIS_CROSSOVER = {
    "gemm_mn": {1024: {32: 0.252, 64: 0.421, 128: 0.648, 256: 0.787, 512: 0.788},
                4096: {32: 0.323, 64: 0.473, 128: 0.679, 256: 0.826, 512: 0.89},
                16384: {32: 0.307, 64: 0.493, 128: 0.76, 256: 0.883, 512: 0.887}},
    "swiglu": {1024: {32: 0.487, 64: 0.713, 128: 0.84, 256: 0.843, 512: 0.839},
               4096: {32: 0.55, 64: 0.801, 128: 0.9, 256: 0.92, 512: 0.903},
               16384: {32: 0.554, 64: 0.769, 128: 0.859, 256: 0.862, 512: 0.884}},
}


# Few-row decode (5-64 rows) with the FFN router able to run beside cuBLAS's gate / up GEMMs: the fused SwiGLU
# runs routed only while more than this fraction of the weight's groups is expected to be skipped, (1 - p)^M.
BESIDE_SKIP_MIN = 0.15


def naxis_dense_above(op: str, G: int, M: int = 1 << 20, router_beside: bool = False) -> float:
    """Executed fraction above which ``naxis="auto"`` runs an N-axis op of ``M > 4`` rows as dense cuBLAS GEMMs.

    From 1024 rows (prefill): :data:`NAXIS_CROSSOVER`, the measured crossover of the routed kernel against
    cuBLAS, interpolated linearly in ``log2 M`` between 1024, 4096 and 16384 rows (held constant beyond), at
    the nearest measured G in ``log2``.  E.g. the fused SwiGLU at G = 128 wins below 84-90 % of groups executed,
    at G = 64 below 71-80 %, at G = 32 below about half.

    65-1023 rows, the rule from the tile probe (benchmarks/kernels/tile_probe.json, M = 16384, s = 0, best
    config): the routed kernel at full activity reaches 0.82 of cuBLAS's speed for ``gemm_mn`` at G = 128, 0.95
    at G = 512, and 1.00 / 0.95 for the fused SwiGLU, so it runs below 0.80 / 0.92 / 0.93 of groups executed.
    (The grid has only M = 256 there, where the kernels lose to cuBLAS at almost every s, and the end-to-end
    prefill at 512 tokens gains from routing at s = 0.5: not enough to set a rule for these sizes.)

    Few rows (5-64, decode at batch 16), from the H200 decode traces at batch 16 (Llama-3.1-8B shapes,
    benchmarks/e2e/e2e_h200-quick8_trace.json, e2e_h200-decode8_trace.json): the Q projection (N = K = 4096,
    G = 512) through ``gemm_mn`` took 22.0 us at p = 0.30 against cuBLAS's 9.9 us at p = 1 (its N / BN tiles
    are too few programs to stream the weight), so it always runs dense there.  The fused SwiGLU took 61.4-62.1
    us at p = 0.70 against 64.6-65.8 us for cuBLAS + the masked activation, and 1.11-1.15x cuBLAS's speed at
    p = 1 in the kernel sweep (M = 16 and 64, G >= 64; 0.86-0.92x at G = 32;
    benchmarks/kernels/kernels_h200-sweep7.md): with 16 rows some row
    executes nearly every group, so its time hardly depends on p, and it runs routed unless ``router_beside``.
    With ``router_beside`` (the engine can run the FFN router on a second stream beside cuBLAS's gate / up,
    :meth:`Engine.overlaps_gate_up_router`) the router leaves the critical path: the router of 16-32 rows took
    13-16 µs on the H200 (``benchmarks/e2e/e2e_h200-grid1-kv_trace.json``) against the fused kernel's 3-4 µs
    lead over cuBLAS + the activation.  The SwiGLU then runs routed only while the expected fraction of groups
    no row executes, ``(1 - p)^M``, is above :data:`BESIDE_SKIP_MIN` (15 %): ``p* = 1 - 0.15^(1/M)``, e.g.
    0.32 at 5 rows, 0.11 at 16.

    Args:
        op: ``"gemm_mn"`` (the Q projection) or ``"swiglu"`` (gate + up).
        G: the op's group size (channels), >= 1.
        M: rows of the op.
        router_beside: whether the op's router can run beside cuBLAS's GEMMs (changes the 5-64 row SwiGLU rule).

    Returns:
        The threshold p* in [0, 1]: the op runs as cuBLAS when the layer's expected executed fraction is above.

    Raises:
        ValueError: an unknown ``op``.
    """
    if op not in NAXIS_CROSSOVER:
        raise ValueError(f"naxis_dense_above: op must be 'gemm_mn' or 'swiglu', got {op!r}")
    if M <= 64:
        if op != "swiglu":
            return 0.0
        return 1.0 - BESIDE_SKIP_MIN ** (1.0 / M) if router_beside and M > 4 else 1.0
    if M < 1024:
        if op == "swiglu":
            return 0.93
        return 0.92 if G >= 256 else 0.80
    table = NAXIS_CROSSOVER[op]
    g = min(table[1024], key=lambda c: (abs(math.log2(c) - math.log2(max(G, 1))), c))
    ms = sorted(table)
    if M >= ms[-1]:
        return table[ms[-1]][g]
    lo = max(m for m in ms if m <= M)
    hi = min(m for m in ms if m > M)
    w = (math.log2(M) - math.log2(lo)) / (math.log2(hi) - math.log2(lo))
    return (1 - w) * table[lo][g] + w * table[hi][g]


def sliding_window(hf_config) -> int | None:
    """The sliding attention window (tokens) a Hugging Face config really uses, or None for full attention.

    Mistral uses ``sliding_window`` whenever it is set; Qwen2 / Qwen3 only with ``use_sliding_window``.  The
    engine runs full attention, which equals sliding-window attention while a sequence fits the window, so a
    KV cache longer than this is refused (:meth:`Engine.new_cache`; ``wide generate`` checks it from the config
    before loading the weights).
    """
    win = getattr(hf_config, "sliding_window", None)
    on = getattr(hf_config, "use_sliding_window", getattr(hf_config, "model_type", None) == "mistral")
    return win if win and on else None


def _gemm_mn_uses_reorder(M: int) -> bool:
    from wide.kernels.gemm_mn import uses_reorder

    return uses_reorder(M)


def _gemm_k_uses_reorder(M: int, G: int) -> bool:
    from wide.kernels.gemm_k import uses_reorder

    return uses_reorder(M, G)


def batch_reorder_view(flat: Reordered, mask: torch.Tensor) -> Reordered:
    """Per-sequence reorder ``[B, T, N_G]`` derived from the reorder of the flattened mask ``[B*T, N_G]``.

    The flattened reorder (shared by the GEMMs) lists the active rows of each column in increasing order,
    so the active rows of sequence ``b`` are a contiguous run of it (and likewise the inactive ones); the
    per-sequence index the attention kernel needs is a gather from it.  Equal to ``reorder(mask)``
    (Algorithm 1 per (b, g) column) without a second pass over the mask.

    Args:
        flat: :func:`wide.kernels.reorder` of ``mask.view(B*T, N_G)``.
        mask: bool ``[B, T, N_G]``.

    Returns:
        :class:`~wide.kernels.Reordered` with index int32 ``[B, T, N_G]`` (rows within the sequence), sorted
        mask bool ``[B, T, N_G]`` and counts int32 ``[B, N_G]``.
    """
    B, T, N = mask.shape
    cb = mask.sum(1, dtype=torch.int64)  # [B, N]
    act_start = torch.cumsum(cb, 0) - cb
    inact = T - cb
    inact_start = flat.counts.to(torch.int64)[None] + torch.cumsum(inact, 0) - inact
    j = torch.arange(T, device=mask.device).view(1, T, 1)
    src = torch.where(j < cb[:, None, :], act_start[:, None, :] + j, inact_start[:, None, :] + j - cb[:, None, :])
    idx = torch.gather(flat.index.to(torch.int64), 0, src.view(B * T, N)).view(B, T, N)
    idx = idx - (torch.arange(B, device=mask.device) * T).view(B, 1, 1)
    return Reordered(idx.to(torch.int32), j < cb[:, None, :], cb.to(torch.int32))


class _Layer:
    """Weights and modules of one decoder layer, read from the Hugging Face module (no copies)."""

    def __init__(self, layer: nn.Module) -> None:
        at, mlp = layer.self_attn, layer.mlp
        for name, mod in (("q_proj", at.q_proj), ("k_proj", at.k_proj), ("v_proj", at.v_proj),
                          ("o_proj", at.o_proj), ("gate_proj", mlp.gate_proj), ("up_proj", mlp.up_proj),
                          ("down_proj", mlp.down_proj)):
            if hasattr(mod, "base_layer") or not isinstance(getattr(mod, "weight", None), torch.Tensor):
                raise WideError(f"{name} is wrapped (e.g. an unmerged LoRA adapter); load the checkpoint with "
                                f"merge_lora=True to run the inference engine")
        self.wq, self.wk, self.wv, self.wo = at.q_proj.weight, at.k_proj.weight, at.v_proj.weight, at.o_proj.weight
        self.bq, self.bk, self.bv = at.q_proj.bias, at.k_proj.bias, at.v_proj.bias
        self.bo = at.o_proj.bias
        bs = (self.bq, self.bk, self.bv)
        # bias of the one-launch [Q | K | V] decode projection (Qwen2 has q/k/v biases); None without biases
        self.bqkv = (None if all(b is None for b in bs) else torch.cat(
            [b.detach() if b is not None else torch.zeros(w.shape[0], dtype=w.dtype, device=w.device)
             for b, w in zip(bs, (self.wq, self.wk, self.wv))]))
        self.wg, self.wu, self.wd = mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight
        if any(b is not None for b in (mlp.gate_proj.bias, mlp.up_proj.bias, mlp.down_proj.bias)):
            raise WideError("FFN projections with biases are not supported by the inference engine")
        self.ln1, self.ln2 = layer.input_layernorm, layer.post_attention_layernorm
        self.q_norm = getattr(at, "q_norm", None)  # Qwen3
        self.k_norm = getattr(at, "k_norm", None)
        self.scaling = float(getattr(at, "scaling", at.head_dim ** -0.5))


class Engine:
    """Routed (or dense) forward pass of a Llama-family model from the project's kernels.

    Args:
        model: a :class:`wide.WideModel` (its routers are used; argmax routing) or a plain Hugging Face
            ``*ForCausalLM`` of a supported architecture (no routers: every group executes, s = 0, still
            through the routed kernels when ``ops="routed"``).
        ops: ``"routed"`` (the WIDE kernels) or ``"dense"`` (cuBLAS linears, SDPA prefill attention; the
            dense baseline; routers ignored; decode of <= 4 rows runs Q/K/V as one GEMV, see below).
        track_sparsity: accumulate executed / total groups over valid tokens on the device (a few tiny
            kernels per layer; off in the benchmarks).
        fused: on the Triton path, run RMSNorm (+ residual add), RoPE + KV-cache write and few-row routers as
            the fused kernels of :mod:`wide.kernels.fused` (default) instead of the model's PyTorch modules.
        kaxis: how the K-axis projections (O, down) run: ``"kernel"`` (``gemm_k``, Algorithm 3),
            ``"dense"`` (cuBLAS on the zero-filled input: the routed producer already wrote exact zeros for the
            skipped groups, so the function is the same), or ``"auto"`` (default: cuBLAS where the measured
            ``gemm_k`` is slower, see :meth:`kaxis_dense`).
        naxis: how the N-axis ops (Q projection, gate + up) run: ``"kernel"`` (``gemm_mn`` / fused ``swiglu``,
            Algorithm 2), ``"dense"`` (cuBLAS GEMMs; the routed attention ignores the Q rows of
            skipped head groups and :func:`~wide.kernels.fused.masked_swiglu_act` zeroes the skipped FFN
            groups, so the function is the same), or ``"auto"`` (default): cuBLAS for more than 4 rows (prefill,
            decode at batch > 4) in the layers whose executed fraction, measured by :meth:`measure_activity`, is
            above what the routed kernel needs to beat cuBLAS (:func:`naxis_dense_above`); the kernels
            otherwise (and before any measurement).  A host-side choice per layer, so no step syncs the host.
        attn: how the prefill attention runs: ``"kernel"`` (routed attention, Algorithm 4), ``"dense"``
            (SDPA's flash attention for every head, then the skipped head groups' outputs set to 0: the same
            function), or ``"auto"`` (default): SDPA in the layers whose measured attention activity is above
            ``ATTN_DENSE_ABOVE``.  Decode always runs the project's split-KV decode attention.
        overlap: on CUDA, run each decode router on a second stream concurrently with the RMSNorm before it
            (:meth:`overlaps_router`), and the prefill attention router and its reorder concurrently with the
            K / V projections (:meth:`overlaps_prefill_router`); default True.

    At decode with up to 4 rows (batch <= 4) both engines run Q, K and V as one GEMV launch
    (:meth:`qkv_one_launch`): the project's ``gemv_mn`` with K and V as an always-executed tail, every group
    executed in the dense engine.

    Attributes:
        dims: :class:`wide.ModelDims`; ``n_attn``, ``n_ffn``: groups per layer; ``g_attn``, ``g_ffn``: group
            sizes (channels); ``record_masks``: when True, :attr:`masks` gets ``{(kind, layer): bool [B, T, N_G]}``
            of the last call (prefill masks include padding rows).

    Raises:
        WideError: ``model`` neither a WideModel nor a Hugging Face model, unsupported architecture, activation
            other than SiLU, a wrapped (unmerged LoRA) projection, an unknown ``ops`` / ``kaxis`` / ``naxis`` /
            ``attn``, or an ``overlap`` that is not a bool.
    """

    def __init__(self, model: nn.Module, ops: str = "routed", track_sparsity: bool = True, fused: bool = True,
                 kaxis: str = "auto", naxis: str = "auto", attn: str = "auto", overlap: bool = True) -> None:
        if ops not in OPS:
            raise WideError(f"ops={ops!r} is not one of {', '.join(OPS)}")
        if kaxis not in KAXIS:
            raise WideError(f"kaxis={kaxis!r} is not one of {', '.join(KAXIS)}")
        if naxis not in NAXIS:
            raise WideError(f"naxis={naxis!r} is not one of {', '.join(NAXIS)}")
        if attn not in ATTN:
            raise WideError(f"attn={attn!r} is not one of {', '.join(ATTN)}")
        if not isinstance(overlap, bool):
            raise WideError(f"overlap={overlap!r} must be True or False")
        self.fused, self.kaxis, self.naxis, self.attn = fused, kaxis, naxis, attn
        self.overlap = overlap
        self.expected_active: dict = {}  # {(kind, layer): executed fraction}, see measure_activity
        from wide.model import WideModel

        if not isinstance(model, WideModel) and not (isinstance(model, nn.Module) and hasattr(model, "config")):
            raise WideError(f"Engine needs a WideModel (wide.load) or a Hugging Face causal LM; got "
                            f"{type(model).__name__}")
        self.wide = model if isinstance(model, WideModel) else None
        base = self.wide.base if self.wide is not None else model
        check_architecture(base.config)
        cfg = base.config
        act = getattr(cfg, "hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise WideError(f"activation {act!r} is not supported by the inference engine (SwiGLU with SiLU only)")
        # sliding-window attention equals full attention while a sequence fits the window (checked per cache)
        self.window = sliding_window(cfg)
        self.base, self.ops, self.track_sparsity = base, ops, track_sparsity
        self.dims = dims_of(cfg)
        inner = base
        while not hasattr(inner, "layers"):
            inner = inner.model
        self.embed, self.norm, self.rotary = inner.embed_tokens, inner.norm, inner.rotary_emb
        self.lm_head = base.get_output_embeddings()
        self.layers = [_Layer(l) for l in decoder_layers(base)]
        p = next(base.parameters())
        self.device, self.dtype = p.device, p.dtype
        d = self.dims
        if self.wide is not None:
            wc = self.wide.config
            self.g_attn, self.g_ffn = wc.attn_group_size, wc.ffn_group_size
            self.attn_routers = list(self.wide.attn_routers) if wc.route_attn else None
            self.ffn_routers = list(self.wide.ffn_routers) if wc.route_ffn else None
        else:
            self.g_attn, self.g_ffn = d.num_heads // d.num_kv_heads * d.head_dim, min(128, d.intermediate_size)
            if d.intermediate_size % self.g_ffn:
                self.g_ffn = d.intermediate_size
            self.attn_routers = self.ffn_routers = None
        self.n_attn, self.n_ffn = d.attn_width // self.g_attn, d.intermediate_size // self.g_ffn
        for kind, routers in (("attn", self.attn_routers), ("ffn", self.ffn_routers)):
            if routers is None:  # not routed: every group executes, known without measuring
                self.expected_active.update({(kind, i): 1.0 for i in range(d.num_layers)})
        self.record_masks = False
        self.masks: dict = {}
        self.stats = torch.zeros(4, dtype=torch.float64, device=self.device)  # attn exec/total, ffn exec/total

    # --- helpers ---------------------------------------------------------------------------------
    @property
    def uses_kernels(self) -> bool:
        """Whether the Triton kernels run (CUDA, or CPU under ``TRITON_INTERPRET=1``); else the references."""
        from wide.kernels._common import HAS_TRITON, interpret_mode

        return HAS_TRITON and (self.device.type == "cuda" or (self.device.type == "cpu" and interpret_mode()))

    def new_cache(self, batch: int, max_len: int) -> StaticKVCache:
        """A zeroed :class:`StaticKVCache` for this model, on its device and in its dtype.

        Args:
            batch: rows ``B`` (sequences), an int ``>= 1``; :meth:`decode` takes exactly ``batch`` tokens a step,
                :meth:`prefill` at most ``batch`` prompts.
            max_len: capacity ``T_max`` in tokens per sequence (prompt + generated), an int ``>= 1``.

        Returns:
            a :class:`StaticKVCache` with K/V buffers ``[L, batch, H_k, max_len, d]`` and all lengths 0.

        Raises:
            WideError: ``batch`` or ``max_len`` not an int or below 1, or ``max_len`` beyond the model's context
                (``max_position_embeddings``) or its sliding attention window (not supported), or K/V buffers
                (``2 * L * batch * H_k * max_len * d`` elements) larger than the device's available memory
                (:func:`wide.memory.available_memory`).
        """
        batch, max_len = _positive_int("batch", batch), _positive_int("max_len", max_len)
        ctx = getattr(self.base.config, "max_position_embeddings", None)
        if ctx is not None and max_len > ctx:
            raise WideError(f"a KV cache of {max_len} tokens exceeds the model's context of {ctx} tokens "
                            "(max_position_embeddings)")
        if self.window is not None and max_len > self.window:
            raise WideError(f"a KV cache of {max_len} tokens exceeds the model's sliding attention window "
                            f"({self.window}); sliding-window attention is not supported by the inference engine")
        d = self.dims
        nbytes = StaticKVCache.buffer_bytes(d.num_layers, batch, d.num_kv_heads, d.head_dim, max_len, self.dtype)
        from wide.memory import available_memory

        avail = available_memory(self.device)
        if avail is not None and nbytes > avail[0]:  # the CPU would overcommit, then be killed while zeroing
            raise WideError(f"a KV cache of {batch} x {max_len} tokens needs {nbytes / 2**30:.2f} GiB on {self.device}, "
                            f"more than the {avail[0] / 2**30:.2f} GiB available ({avail[1]}): lower the batch or "
                            "max_len (--max-cache-len)")
        return StaticKVCache(d.num_layers, batch, d.num_kv_heads, d.head_dim, max_len, self.dtype, self.device)

    def reset_stats(self) -> None:
        """Zero the on-device sparsity counters (see :meth:`realized_sparsity`)."""
        self.stats.zero_()

    def realized_sparsity(self) -> dict:
        """``{"attn", "ffn", "overall"}`` skipped-group fractions accumulated since :meth:`reset_stats`
        (over valid tokens; overall = mean over the routed modules as in Eq. 6).  Host sync."""
        s = self.stats.tolist()
        out = {}
        if s[1] > 0:
            out["attn"] = 1.0 - s[0] / s[1]
        if s[3] > 0:
            out["ffn"] = 1.0 - s[2] / s[3]
        kinds = [out[k] for k in ("attn", "ffn") if k in out]
        if kinds:
            out["overall"] = sum(kinds) / len(kinds)  # every layer has one module of each routed kind
        return out

    def _route(self, kind: str, i: int, h: torch.Tensor, valid: torch.Tensor | None,
               add: torch.Tensor | None = None) -> torch.Tensor | None:
        """Bool mask ``[B, T, N_G]`` for layer ``i``'s ``kind`` sublayer (Eq. 4-5), None when not routed.
        ``add``: the pending residual add (the router reads ``h + add``, see :func:`router_mask`)."""
        if self.ops == "dense":
            return None
        routers = self.attn_routers if kind == "attn" else self.ffn_routers
        n = self.n_attn if kind == "attn" else self.n_ffn
        if routers is None:
            mask = self._all_true((*h.shape[:-1], n), h.device)
        else:
            mask = router_mask(routers[i], h, add=add)
        if self.track_sparsity:
            w = valid.to(torch.float64) if valid is not None else torch.ones(h.shape[:-1], dtype=torch.float64,
                                                                               device=h.device)
            j = 0 if kind == "attn" else 2
            self.stats[j] += (mask.sum(-1).to(torch.float64) * w).sum()
            self.stats[j + 1] += w.sum() * n
        if self.record_masks:
            self.masks[(kind, i)] = mask
        return mask

    def _all_true(self, shape: tuple, device) -> torch.Tensor:
        """A cached all-execute mask (no fill kernel per layer and step)."""
        key = (tuple(shape), str(device))
        cache = self.__dict__.setdefault("_ones", {})
        if key not in cache:
            cache[key] = torch.ones(shape, dtype=torch.bool, device=device)
        return cache[key]

    def _reorders(self, mask: torch.Tensor, attention: bool, mn_kernel: bool, k_kernel: bool, G: int):
        """One reorder per routing decision: ``(flat [B*T, N_G] or None, per-sequence [B, T, N_G] or None)``.

        The flat one only where a GEMM that runs as a routed kernel (``mn_kernel``: the N-axis op, ``k_kernel``:
        the K-axis op, of group size ``G``) consumes it at this row count."""
        if mask is None or not use_triton(mask):
            return None, None
        B, T, N = mask.shape
        M = B * T
        need_flat = (mn_kernel and _gemm_mn_uses_reorder(M)) or (k_kernel and _gemm_k_uses_reorder(M, G))
        need_attn = attention and T > 1
        flat = reorder(mask.view(M, N)) if need_flat else None
        per = None
        if need_attn:
            if flat is None:
                per = reorder(mask)
            elif B == 1:
                per = Reordered(flat.index.view(1, T, N), flat.mask.view(1, T, N), flat.counts.view(1, N))
            else:
                per = batch_reorder_view(flat, mask)
        return flat, per

    # --- one layer as named steps (also used by the per-op trace) ----------------------------------
    @property
    def fast(self) -> bool:
        """Whether the fused unrouted kernels (:mod:`wide.kernels.fused`) run (``fused`` and Triton)."""
        return self.fused and self.uses_kernels

    def overlaps_router(self, kind: str, phase: str) -> bool:
        """Whether a decode step runs the ``kind`` router concurrently with the RMSNorm before it.

        The router reads the residual stream ``h + add`` (the add inside its kernel) on a second CUDA stream
        while the fused add + RMSNorm runs on the current one; the current stream waits for both before the
        projections.  A few-row decode step is a chain of latency-bound kernels, so this hides the shorter of
        the two (~2 µs a router on an H200).  From 5 rows, where Q, K and V are separate projections (see
        :meth:`qkv_one_launch`), the attention router also runs beside the K / V projections, which do not
        depend on it (a router of 16-32 rows took 10-16 µs on the H200, the norm ~2 µs and K / V ~13 µs;
        ``benchmarks/e2e/e2e_h200-grid1_trace.json``).  Decode on CUDA with the fused kernels and routers, and
        :attr:`overlap` (default True); CUDA-graph capturable (the second stream forks from and joins the
        capturing one inside the step)."""
        routers = self.attn_routers if kind == "attn" else self.ffn_routers
        return (self.overlap and phase == "decode" and self.fast and self.ops != "dense" and routers is not None
                and self.device.type == "cuda")

    def overlaps_prefill_router(self, phase: str) -> bool:
        """Whether a prefill runs the attention router and its reorder concurrently with the K / V projections.

        The K and V projections do not depend on the routing; at a few hundred to a few thousand tokens neither
        they (a few dozen output tiles) nor the router (one program per row tile and D split) fill an H200, so
        the router and the reorder run on a second CUDA stream while K and V are projected on the current one,
        which then waits for both before the Q projection.  Prefill on CUDA with the fused kernels and attention
        routers, and :attr:`overlap`; CUDA-graph capturable like the decode overlap."""
        return (self.overlap and phase == "prefill" and self.fast and self.ops != "dense"
                and self.attn_routers is not None and self.device.type == "cuda")

    def overlaps_gate_up_router(self, phase: str, i: int, M: int) -> bool:
        """Whether layer ``i``'s FFN router runs concurrently with cuBLAS's gate and up GEMMs of ``M`` rows.

        Where both FFN projections around the activation run as cuBLAS (:meth:`naxis_dense`, :meth:`kaxis_dense`:
        prefill at high activity, decode from 5 rows) only the activation reads the mask (it zeroes the skipped
        groups, so ``down_proj`` on its zero-filled input computes the routed function), so the router runs on
        a second stream beside the two GEMMs instead of before them.  On CUDA with the fused kernels, FFN
        routers and :attr:`overlap`; CUDA-graph capturable like :meth:`overlaps_router`.  The decode router of
        the plain path (beside the norm) is then left out."""
        return self.routes_beside_gate_up() and self.naxis_dense("ffn", i, M) and self.kaxis_dense(M, self.g_ffn)

    def routes_beside_gate_up(self) -> bool:
        """Whether the FFN router can run beside cuBLAS's gate / up (CUDA, the fused kernels, FFN routers,
        :attr:`overlap`); it also sets the few-row SwiGLU rule of :func:`naxis_dense_above`."""
        return (self.overlap and self.fast and self.ops != "dense" and self.ffn_routers is not None
                and self.device.type == "cuda")

    def overlaps_q_router(self, phase: str, i: int, M: int) -> bool:
        """Whether layer ``i``'s attention router also runs beside the Q projection of ``M`` rows.

        Where the attention router already runs beside the K / V projections (decode from 5 rows,
        :meth:`overlaps_router`; prefill, :meth:`overlaps_prefill_router`) and the Q projection runs as cuBLAS
        (:meth:`naxis_dense`), Q does not depend on the routing either (the attention skips the inactive head
        groups and zeroes their outputs), so it joins K and V on the current stream and the router on the second
        stream has Q + K + V to hide behind (the router of 32 rows took 22.6 µs on the H200, the norm + K / V
        ~16 µs; ``benchmarks/e2e/decode_probe_h200-s12.md``)."""
        if self.qkv_one_launch(phase, M, i) or not self.naxis_dense("attn", i, M):
            return False
        return self.overlaps_router("attn", phase) if phase == "decode" else self.overlaps_prefill_router(phase)

    def _beside(self, side_fn, main_fn):
        """``(side_fn(), main_fn())`` with ``side_fn`` on a second CUDA stream forked from the current one and
        ``main_fn`` on the current one, which then waits for both.  Memory allocated on the second stream is only
        reused after a later fork, which orders it after every use issued so far on the current stream."""
        side = self.__dict__.get("_side")
        if side is None:
            side = self._side = torch.cuda.Stream(self.device)
        cur = torch.cuda.current_stream(self.device)
        side.wait_stream(cur)
        with torch.cuda.stream(side):
            res = side_fn()
        out = main_fn()
        cur.wait_stream(side)
        return res, out

    def _norm_route(self, module, h, add, kind: str, i: int, st: dict, overlap: bool):
        """``(h + add, norm(h + add), mask)``: :meth:`_norm`, and with ``overlap`` layer ``i``'s ``kind`` router
        reading ``h + add`` on a second stream meanwhile (else ``mask`` is None; see :meth:`_beside`)."""
        if not overlap:
            return (*self._norm(module, h, add), None)
        mask, (hn, x) = self._beside(lambda: self._route(kind, i, h, st.get("valid"), add=add),
                                     lambda: self._norm(module, h, add))
        return hn, x, mask

    def _norm(self, module, h, add):
        """``(h + add, module(h + add))``: fused kernel on the fast path, else the model's own module."""
        if self.fast:
            eps = getattr(module, "variance_epsilon", getattr(module, "eps", 1e-6))
            return add_rmsnorm(h, add, module.weight, eps)
        if add is not None:
            h = h + add
        return h, module(h)

    def layer_steps(self, i: int, st: dict, phase: str) -> list:
        """The ops of decoder layer ``i`` as ``[(name, fn)]``; ``fn(st)`` reads and writes the state dict.

        Every step writes keys it does not read (so a step can be replayed alone, as the per-op trace does).
        ``st`` holds ``h`` (residual ``[B, T, D]``), ``pending`` (the previous FFN output not yet added to ``h``,
        or None: the add is fused into the next norm), ``cos``/``sin`` (``[B, T, d]``, computed once per forward),
        ``pos`` (int64 ``[B, T]``), ``valid`` (bool ``[B, T]`` or None), ``cache``; for prefill ``pad`` (int64
        ``[B]``) and ``slots`` (``[B, T]``), for decode ``slot`` (int64 ``[B]``, also the attention's
        ``left_pad``).  ``phase``: "prefill" or "decode".
        """
        L = self.layers[i]
        d = self.dims
        dense = self.ops == "dense"
        fused_rope = self.fast and L.q_norm is None
        M = st["h"].shape[0] * st["h"].shape[1]
        qkv = self.qkv_one_launch(phase, M, i)

        ov_gu = self.overlaps_gate_up_router(phase, i, M)  # the FFN router beside cuBLAS's gate / up
        ov_attn, ov_ffn = self.overlaps_router("attn", phase), self.overlaps_router("ffn", phase) and not ov_gu
        ov_prefill = self.overlaps_prefill_router(phase) and not qkv
        ov_kv = ov_attn and not qkv  # decode of > 4 rows: the attention router beside the norm and K / V
        ov_q = (ov_kv or ov_prefill) and self.overlaps_q_router(phase, i, M)  # ... and beside a cuBLAS Q

        def input_norm(st):  # with ov_attn also the attention router (its own step is then left out)
            st["h_attn"], st["x"], m = self._norm_route(L.ln1, st["h"], st.get("pending"), "attn", i, st, ov_attn)
            if ov_attn:
                st["am"], st["am_flat"], st["am_per"] = m, None, None

        def input_norm_kv(st):  # decode with ov_kv: norm + K / V here, the attention router (reading h + add) beside
            def main():
                st["h_attn"], st["x"] = self._norm(L.ln1, st["h"], st.get("pending"))
                kv_proj(st)
                if ov_q:
                    q_dense(st)

            m, _ = self._beside(lambda: self._route("attn", i, st["h"], st.get("valid"), add=st.get("pending")),
                                main)
            st["am"], st["am_flat"], st["am_per"] = m, None, None

        def attn_router(st):
            st["am"] = self._route("attn", i, st["h_attn"], st.get("valid"))
            st["am_flat"], st["am_per"] = (None, None)

        def attn_reorder(st):
            M = st["x"].shape[0] * st["x"].shape[1]
            st["am_flat"], st["am_per"] = self._reorders(st["am"], not self.attn_dense(i, phase),
                                                         not self.naxis_dense("attn", i, M),
                                                         not self.kaxis_dense(M, self.g_attn), self.g_attn)

        def q_dense(st):  # cuBLAS: the routed attention ignores skipped head groups, so the same function
            x = st["x"]
            B, T, D = x.shape
            st["q_raw"] = F.linear(x.view(B * T, D), L.wq, L.bq).view(B, T, d.num_heads, d.head_dim)

        def q_proj(st):
            x = st["x"]
            B, T, D = x.shape
            x2 = x.view(B * T, D)
            if st["am"] is None or self.naxis_dense("attn", i, B * T):
                q_dense(st)
                return
            q = gemm_mn(x2, L.wq, st["am"].view(B * T, -1), self.g_attn, reordered=st["am_flat"])
            if L.bq is not None:
                q = q + L.bq
            st["q_raw"] = q.view(B, T, d.num_heads, d.head_dim)

        def kv_proj(st):
            x = st["x"]
            B, T, _ = x.shape
            st["k_raw"] = F.linear(x, L.wk, L.bk).view(B, T, d.num_kv_heads, d.head_dim)
            st["v_raw"] = F.linear(x, L.wv, L.bv).view(B, T, d.num_kv_heads, d.head_dim)

        def kv_proj_route(st):  # prefill with ov_prefill: K / V here, the attention router + reorder beside them
            self._beside(lambda: (attn_router(st), attn_reorder(st)),
                         lambda: (kv_proj(st), ov_q and q_dense(st)))

        def qkv_proj(st):  # decode, <= 4 rows: [Q routed | K | V] as one GEMV launch (see qkv_one_launch)
            x = st["x"]
            B, T, D = x.shape
            route, g = st["am"], self._qkv_group()
            if route is None:
                route = self._all_true((B, T, self.dims.attn_width // g), x.device)
            out = gemv_mn(x.view(B * T, D), L.wq, route.view(B * T, -1), g, tail=(L.wk, L.wv))
            if L.bqkv is not None:
                out = out + L.bqkv
            nq, nkv = d.num_heads * d.head_dim, d.num_kv_heads * d.head_dim
            out = out.view(B, T, -1)  # token strides (T * width, width) in the [B, T, H, d] views below
            st["q_raw"] = out[..., :nq].view(B, T, d.num_heads, d.head_dim)
            st["k_raw"] = out[..., nq:nq + nkv].view(B, T, d.num_kv_heads, d.head_dim)
            st["v_raw"] = out[..., nq + nkv:].view(B, T, d.num_kv_heads, d.head_dim)

        def slots_of(st):
            return st["slots"] if phase == "prefill" else st["slot"].view(-1, 1)

        def rope_kv_cache(st):  # fused: RoPE of Q and K + the cache write, one kernel
            c: StaticKVCache = st["cache"]
            q, k = rope_cache(st["q_raw"], st["k_raw"], st["v_raw"], st["cos"], st["sin"], c.k[i], c.v[i],
                              slots_of(st), want_k=(phase == "prefill"))
            st["q"] = q.transpose(1, 2)
            st["k"] = k.transpose(1, 2) if k is not None else None
            st["v"] = st["v_raw"].transpose(1, 2)

        def rope(st):  # the model's own RoPE (reference path, or Qwen3's q/k norms)
            from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

            q, k = st["q_raw"], st["k_raw"]
            if L.q_norm is not None:
                q, k = L.q_norm(q), L.k_norm(k)
            q, k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), st["cos"], st["sin"])
            st["q"], st["k"] = q, k
            st["v"] = st["v_raw"].transpose(1, 2)

        def cache_write(st):
            c: StaticKVCache = st["cache"]
            if phase == "prefill":
                c.write_prefill(i, st["k"], st["v"], st["slots"])
            else:
                c.write_decode(i, st["k"], st["v"], st["slot"])

        def attention(st):
            q = st["q"]
            B, Hq, T, hd = q.shape
            if phase == "prefill":
                k, v, lp = st["k"], st["v"], st["pad"]
            else:
                c = st["cache"]
                k, v, lp = c.k[i, :B], c.v[i, :B], st["slot"]
            if dense and phase == "prefill":
                st["a"] = _dense_prefill_attention(q, k, v, st.get("padded", True) and lp, L.scaling)
            elif st["am"] is not None and self.attn_dense(i, phase):
                a = _dense_prefill_attention(q, k, v, st.get("padded", True) and lp, L.scaling)
                st["a"] = zero_skipped_heads_(a, st["am"])  # skipped head groups output 0, as in Algorithm 4
            else:
                route = st["am"]
                if route is None:
                    route = self._all_true((B, T, self.n_attn), q.device)
                st["a"] = routed_attention(q, k, v, route, causal=(phase == "prefill"), left_pad=lp,
                                           scale=L.scaling, reordered=st["am_per"])

        def o_proj(st):
            a = st["a"]
            B, Hq, T, hd = a.shape
            a2 = a.transpose(1, 2).reshape(B * T, Hq * hd)  # a view when T == 1
            if st["am"] is None or self.kaxis_dense(B * T, self.g_attn):
                o = F.linear(a2, L.wo, L.bo)  # inactive head groups of a2 are exactly 0: same function
            else:
                o = gemm_k(a2, L.wo, st["am"].view(B * T, -1), self.g_attn, reordered=st["am_flat"])
                if L.bo is not None:
                    o = o + L.bo
            st["o"] = o.view(B, T, -1)

        def post_norm(st):  # with ov_ffn also the FFN router (its own step is then left out)
            st["h_ffn"], st["x_ffn"], m = self._norm_route(L.ln2, st["h_attn"], st["o"], "ffn", i, st, ov_ffn)
            if ov_ffn:
                st["fm"], st["fm_flat"] = m, None

        def ffn_router(st):
            st["fm"] = self._route("ffn", i, st["h_ffn"], st.get("valid"))
            st["fm_flat"] = None

        def ffn_reorder(st):
            M = st["x_ffn"].shape[0] * st["x_ffn"].shape[1]
            st["fm_flat"], _ = self._reorders(st["fm"], False, not self.naxis_dense("ffn", i, M),
                                              not self.kaxis_dense(M, self.g_ffn), self.g_ffn)

        def gate_up(st):
            x = st["x_ffn"]
            B, T, D = x.shape
            x2 = x.view(B * T, D)
            if st["fm"] is None:
                st["u"] = F.silu(F.linear(x2, L.wg)) * F.linear(x2, L.wu)
            elif self.naxis_dense("ffn", i, B * T):
                st["u"] = masked_swiglu_act(F.linear(x2, L.wg), F.linear(x2, L.wu), st["fm"].view(B * T, -1),
                                            self.g_ffn)
            else:
                st["u"] = swiglu(x2, L.wg, L.wu, st["fm"].view(B * T, -1), self.g_ffn, reordered=st["fm_flat"])

        def gate_up_route(st):  # ov_gu: the FFN router on the second stream, gate / up on this one
            x = st["x_ffn"]
            B, T, D = x.shape
            x2 = x.view(B * T, D)
            m, (g, u) = self._beside(lambda: self._route("ffn", i, st["h_ffn"], st.get("valid")),
                                     lambda: (F.linear(x2, L.wg), F.linear(x2, L.wu)))
            st["fm"], st["fm_flat"] = m, None
            st["u"] = masked_swiglu_act(g, u, m.view(B * T, -1), self.g_ffn)

        def down_proj(st):
            u = st["u"]
            B, T, D = st["x_ffn"].shape
            if st["fm"] is None or self.kaxis_dense(B * T, self.g_ffn):
                y = F.linear(u, L.wd)  # inactive groups of u are exactly 0: same function
            else:
                y = gemm_k(u, L.wd, st["fm"].view(B * T, -1), self.g_ffn, reordered=st["fm_flat"])
            st["h"] = st["h_ffn"]
            st["pending"] = y.view(B, T, D)  # added to h by the next norm (fused add)

        q_step = [] if ov_q else [("q_proj", q_proj)]  # with ov_q, Q is computed beside the router
        if ov_kv:  # the trace's "input_norm" then includes K / V and the router beside them (never ops="dense")
            steps = [("input_norm", input_norm_kv), ("attn_reorder", attn_reorder)] + q_step
        elif ov_prefill:  # the trace's "kv_proj" then includes the router and reorder that run beside it
            steps = [("input_norm", input_norm), ("kv_proj", kv_proj_route)] + q_step
        else:
            steps = [("input_norm", input_norm)] + ([] if ov_attn else [("attn_router", attn_router)])
            if not dense:
                steps.append(("attn_reorder", attn_reorder))
            steps += [("qkv_proj", qkv_proj)] if qkv else [("q_proj", q_proj), ("kv_proj", kv_proj)]
        if fused_rope:
            steps.append(("rope_kv_cache", rope_kv_cache))
        else:
            steps += [("rope", rope), ("kv_cache_write", cache_write)]
        steps += [("attention", attention), ("o_proj", o_proj), ("post_norm", post_norm)]
        if ov_gu:  # the trace's "gate_up" then includes the router beside it; nothing consumes a reorder
            steps += [("gate_up", gate_up_route), ("down_proj", down_proj)]
            return steps
        if not ov_ffn:
            steps.append(("ffn_router", ffn_router))
        if not dense:
            steps.append(("ffn_reorder", ffn_reorder))
        steps += [("gate_up", gate_up), ("down_proj", down_proj)]
        return steps

    def qkv_one_launch(self, phase: str, M: int, i: int = 0) -> bool:
        """Whether layer ``i``'s Q, K and V projections of ``M`` rows run as one decode GEMV launch,
        :func:`wide.kernels.gemv_mn` over the routed Q groups with K and V as its always-executed tail (no
        weight copy).  At batch 1 each projection alone is a latency-bound GEMV: cuBLAS streams the 2 x 8 MiB
        of Llama-3.1-8B's K and V at ~1.3 TB/s; one launch over all three keeps the GPU's memory system busy.
        Both engines do this (the dense one with every group executed), so the dense baseline gains as much.

        True for decode steps of ``M <= 4`` rows on the Triton path with the fused kernels, when the K/V width
        is a multiple of the head-group width ``g_attn`` (Llama 3.x, Mistral, SmolLM2; not e.g. Qwen2.5-0.5B,
        7 query heads per K/V head and 2 K/V heads; in the dense engine any model whose Q and K/V widths share a
        multiple of 16, see :meth:`_qkv_group`) and the Q projection would run its kernel (not ``naxis``
        "dense")."""
        if phase != "decode" or M > 4 or not self.fast or self._qkv_group() is None:
            return False
        return self.ops == "dense" or not self.naxis_dense("attn", i, M)

    def _qkv_group(self) -> int | None:
        """Group width of the one-launch [Q | K | V] GEMV: ``g_attn`` when the K/V width is a multiple of it; in
        the dense engine (every group executed, so any width dividing both will do) the largest multiple of 16
        dividing the Q and the K/V widths, e.g. 64 for a statically pruned SmolLM2 with 3 query heads and 1
        K/V head of 64 channels.  None when no such width exists."""
        q, kv = self.dims.attn_width, self.dims.num_kv_heads * self.dims.head_dim
        if kv % self.g_attn == 0:
            return self.g_attn
        if self.ops != "dense":
            return None
        g = math.gcd(q, kv)
        return g if g % 16 == 0 else None

    def kaxis_dense(self, M: int, G: int) -> bool:
        """Whether a K-axis projection (O, down) of ``M`` rows runs as a cuBLAS GEMM on its zero-filled input
        instead of ``gemm_k`` (``kaxis="dense"``, or ``"auto"`` where the H200 kernel measurements in
        benchmarks/kernels/README.md put ``gemm_k`` below cuBLAS: M > 4; the decode GEMV ``gemv_k`` beats
        cuBLAS's at every G measured since its rewrite, benchmarks/e2e/e2e_h200-quick3_trace.json)."""
        if self.kaxis == "kernel":
            return False
        if self.kaxis == "dense":
            return True
        return M > 4

    def naxis_dense(self, kind: str, i: int, M: int) -> bool:
        """Whether layer ``i``'s N-axis op (``kind`` "attn": the Q projection, "ffn": gate + up) of ``M`` rows runs
        as cuBLAS GEMMs instead of ``gemm_mn`` / ``swiglu`` (see ``naxis`` in the class docstring)."""
        if self.naxis == "kernel":
            return False
        if self.naxis == "dense":
            return True
        p = self.expected_active.get((kind, i))
        if M <= 4 or p is None:  # the decode GEMVs match cuBLAS with every group executed
            return False
        G = self.g_attn if kind == "attn" else self.g_ffn
        beside = kind == "ffn" and self.routes_beside_gate_up()
        return p > naxis_dense_above("gemm_mn" if kind == "attn" else "swiglu", G, M, router_beside=beside)

    def attn_dense(self, i: int, phase: str) -> bool:
        """Whether layer ``i``'s attention runs as SDPA + zeroed skipped head groups (prefill only; see ``attn`` in
        the class docstring)."""
        if phase != "prefill" or self.attn == "kernel":
            return False
        if self.attn == "dense":
            return True
        p = self.expected_active.get(("attn", i))
        return p is not None and p > ATTN_DENSE_ABOVE

    @torch.no_grad()
    def measure_activity(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> dict:
        """Measure each routed layer's executed fraction on a sample prefill, for ``naxis`` / ``attn="auto"``.

        Args:
            input_ids: int64 ``[B, T]`` sample prompts (left-padded), e.g. a slice of calibration text.
            attention_mask: ``[B, T]`` (1 = real token) or None.

        Returns:
            ``{(kind, layer): fraction}`` with kind "attn" / "ffn" and the fraction of executed (token, group)
            decisions over real tokens; also stored in :attr:`expected_active` (which holds 1.0 from the start for
            a sublayer kind without routers).  One host sync (call it before timing or graph capture, not per
            step).  Empty for ``ops="dense"`` or a model without routers.  The sample does not count in
            :meth:`realized_sparsity`.

        Raises:
            WideError: as :meth:`prefill`.
        """
        if self.ops == "dense":
            return {}
        self._check_ids(input_ids)
        B, T = input_ids.shape
        prev, track = self.record_masks, self.track_sparsity
        self.record_masks, self.track_sparsity = True, False  # the sample does not count in realized_sparsity
        try:
            self.prefill(input_ids, attention_mask, self.new_cache(B, T))
            masks = self.masks
        finally:
            self.record_masks, self.track_sparsity = prev, track
            self.masks = {}
        w = (attention_mask.bool().to(torch.float64) if attention_mask is not None
             else torch.ones((B, T), dtype=torch.float64, device=self.device))
        keys = [k for k in masks if (k[0] == "attn" and self.attn_routers is not None)
                or (k[0] == "ffn" and self.ffn_routers is not None)]
        if not keys:
            return {}
        fr = torch.stack([(masks[k].to(torch.float64).mean(-1) * w).sum() / w.sum() for k in keys]).tolist()
        measured = dict(zip(keys, fr))
        self.expected_active.update(measured)
        return measured

    def begin(self, st: dict) -> dict:
        """Per-forward state shared by all layers: RoPE cos/sin from the model's rotary module (once)."""
        st["cos"], st["sin"] = self.rotary(st["h"], st["pos"])
        st["pending"] = None
        return st

    def finish(self, st: dict, all_logits: bool) -> torch.Tensor:
        """Last residual add + final norm + ``lm_head``: logits ``[B, T, V]`` or last position ``[B, V]``."""
        h, pend = st["h"], st.get("pending")
        if not all_logits:
            h = h[:, -1].contiguous()
            pend = pend[:, -1].contiguous() if pend is not None else None
        _, x = self._norm(self.norm, h, pend)
        return self.lm_head(x)

    # --- forward passes --------------------------------------------------------------------------
    def _check_ids(self, input_ids: torch.Tensor) -> None:
        check_token_ids(input_ids)
        if input_ids.device != self.device:
            raise WideError(f"input_ids are on {input_ids.device}, the engine's model is on {self.device}")

    def _check_values(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> None:
        """Token ids inside the vocabulary and a left-padded 0/1 mask with a real token in every row: one host
        sync per prefill (skipped while a CUDA graph is being captured; decode steps never check)."""
        try:
            if torch.cuda.is_current_stream_capturing():
                return
        except Exception:  # noqa: BLE001 - no CUDA
            pass
        vocab = self.embed.num_embeddings
        checks = [((input_ids < 0) | (input_ids >= vocab)).any()]
        if attention_mask is not None:
            m = attention_mask
            checks += [~((m == 0) | (m == 1)).all(), (m[:, 1:] < m[:, :-1]).any(), (m[:, -1] != 1).any()]
        bad = torch.stack(checks).tolist()
        if bad[0]:
            raise outside_vocab(input_ids, vocab)
        if any(bad[1:]):
            raise WideError("attention_mask must be left-padded, each row [0]*pad + [1]*n with n >= 1 real tokens "
                            "(0/1 values); set tokenizer.padding_side = 'left'")

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, cache: StaticKVCache,
                all_logits: bool = False) -> torch.Tensor:
        """Prefill a left-padded batch into ``cache`` (rows ``0..B-1``) and return logits.

        Args:
            input_ids: int64 ``[B, T]``, left-padded (padding first).
            attention_mask: ``[B, T]`` (1 = real token) of the form ``[0]*pad + [1]*n``, or None (no padding).
                Every row needs at least one real token.
            cache: a :class:`StaticKVCache` with ``cache.batch >= B`` and ``cache.max_len >= T``; its lengths
                are set to the real token counts (rows ``>= B`` to 0).
            all_logits: return logits of every position ``[B, T, V]`` (default: last position ``[B, V]``).

        Returns:
            float logits in the model dtype.  Positions are ``0..n_b-1`` over each row's real tokens (padding
            does not shift them), so a padded row gives the logits of the same prompt run alone.

        Raises:
            WideError: empty prompt, non-integer ids or ids outside the vocabulary, a mask that is not left-padded
                0/1 with a real token in every row, wrong device, a cache too small or made for another model
                (layers, KV heads, head_dim, dtype or device).  (Checking the values is one host sync; it is
                skipped during CUDA-graph capture.)
        """
        self._check_ids(input_ids)
        self._check_cache(cache, "prefill")
        B, T = input_ids.shape
        if cache.batch < B:
            raise WideError(f"batch of {B} prompts does not fit a KV cache of {cache.batch} rows")
        if T > cache.max_len:
            raise WideError(f"prompt of {_tokens(T)} is longer than the KV cache ({_tokens(cache.max_len)})")
        if attention_mask is None:
            valid = None
            pad = torch.zeros(B, dtype=torch.int64, device=self.device)
            n = torch.full((B,), T, dtype=torch.int64, device=self.device)
            padded = False
        else:
            if attention_mask.shape != input_ids.shape or attention_mask.device != input_ids.device:
                raise WideError(f"attention_mask {tuple(attention_mask.shape)} on {attention_mask.device} must match "
                                f"input_ids {tuple(input_ids.shape)} on {input_ids.device}")
            valid = attention_mask.bool()
            n = valid.sum(1)
            pad = T - n
            padded = True
        self._check_values(input_ids, attention_mask)
        pos = (torch.arange(T, device=self.device).view(1, T) - pad.view(B, 1)).clamp_min(0)
        slots = cache.prefill_slots(pad, T)
        cache.lengths.zero_()
        cache.lengths[:B] = n
        self.masks = {}
        h = self.embed(input_ids)
        st = self.begin({"h": h, "pos": pos, "valid": valid, "cache": cache, "pad": pad, "slots": slots,
                         "padded": padded})
        for i in range(len(self.layers)):
            for _, fn in self.layer_steps(i, st, "prefill"):
                fn(st)
        return self.finish(st, all_logits)

    @torch.no_grad()
    def decode(self, tokens: torch.Tensor, cache: StaticKVCache, valid: torch.Tensor | None = None) -> torch.Tensor:
        """One decode step: append one token to every sequence of ``cache`` and return the next-token logits.

        Each row's token takes position ``cache.lengths[b]`` and is written to slot ``T_max - 1 - lengths[b]``;
        the lengths are then incremented on the device.  No host synchronisation on a GPU (CUDA-graph
        capturable).

        Args:
            tokens: int64 ``[B]`` token ids in ``[0, vocab)``, on the engine's device, with ``B == cache.batch``
                (one token per cache row; idle rows of a bucket take any valid id, e.g. 0).
            cache: the :class:`StaticKVCache` of this engine (:meth:`new_cache`) after :meth:`prefill`, with a
                free slot left in every row (``lengths < T_max``).
            valid: optional bool ``[B]`` on the same device; only weights the sparsity statistics (e.g. False for
                the idle padding rows of a CUDA-graph bucket).

        Returns:
            logits ``[B, V]`` in the model dtype; ``cache.lengths`` has grown by 1 in every row.

        Raises:
            WideError: ``tokens`` not an int64 ``[B]`` tensor, a batch that is not ``cache.batch``, tokens or
                ``valid`` on another device than the model, ``valid`` not bool ``[B]``, or a cache of another
                model, device or dtype (shape, dtype and device checks: host metadata, free).  On the CPU also
                token ids outside ``[0, vocab)`` and a full cache row (no slot left for the new token).  On a GPU
                those two value checks would need a device read (a host sync per step, impossible inside a CUDA
                graph), so they are the caller's job there (unchecked, the result is undefined):
                :func:`wide.inference.generate` sizes the cache on the host from the prompt length and
                ``max_new_tokens`` and feeds back the model's own argmax.
        """
        if not isinstance(tokens, torch.Tensor) or tokens.dim() != 1 or tokens.dtype != torch.int64:
            got = (f"{tokens.dtype} {list(tokens.shape)}" if isinstance(tokens, torch.Tensor)
                   else type(tokens).__name__)
            raise WideError(f"decode: tokens must be an int64 tensor [B] (one token id per cache row), got {got}")
        self._check_cache(cache, "decode")
        B = tokens.shape[0]
        if B != cache.batch:
            raise WideError(f"decode: {_tokens(B)} for a KV cache of {cache.batch} rows; pass one token per cache "
                            f"row (batch {cache.batch})")
        if tokens.device != self.device:
            raise WideError(f"decode: tokens are on {tokens.device}, the engine's model is on {self.device}")
        if valid is not None:
            if (not isinstance(valid, torch.Tensor) or valid.dtype != torch.bool or tuple(valid.shape) != (B,)
                    or valid.device != self.device):
                got = (f"{valid.dtype} {list(valid.shape)} on {valid.device}" if isinstance(valid, torch.Tensor)
                       else type(valid).__name__)
                raise WideError(f"decode: valid must be a bool tensor [{B}] on {self.device} or None, got {got}")
        if self.device.type == "cpu":  # value checks: a device read is free on the CPU (never on a GPU: no sync)
            self._check_decode_values(tokens, cache)
        slot = cache.max_len - 1 - cache.lengths[:B]
        st = self.begin({"h": self.embed(tokens.view(B, 1)), "pos": cache.lengths[:B].view(B, 1),
                         "valid": None if valid is None else valid.view(B, 1), "cache": cache, "slot": slot})
        self.masks = {}
        for i in range(len(self.layers)):
            for _, fn in self.layer_steps(i, st, "decode"):
                fn(st)
        cache.lengths[:B] += 1
        return self.finish(st, False)

    def _check_decode_values(self, tokens: torch.Tensor, cache: StaticKVCache) -> None:
        """Token ids inside the vocabulary and a free slot in every cache row (CPU tensors only)."""
        vocab = self.embed.num_embeddings
        lo, hi = int(tokens.min()), int(tokens.max())
        if lo < 0 or hi >= vocab:
            raise WideError(f"decode: tokens hold ids from {lo} to {hi}; the model's vocabulary is 0..{vocab - 1}")
        full = (cache.lengths >= cache.max_len).nonzero().view(-1).tolist()
        if full:
            b = full[0]
            raise WideError(f"decode: the KV cache is full (row {b} holds {_tokens(int(cache.lengths[b]))} of "
                            f"{cache.max_len}); no slot is left for the new token: make a larger cache "
                            f"(new_cache max_len >= prompt + new tokens)")

    def _check_cache(self, cache, where: str) -> None:
        """``cache`` is a :class:`StaticKVCache` shaped for this model, on its device and in its dtype (metadata
        only: no device read)."""
        if not isinstance(cache, StaticKVCache):
            raise WideError(f"{where}: cache must be a StaticKVCache (Engine.new_cache), got {type(cache).__name__}")
        d = self.dims
        want = (d.num_layers, d.num_kv_heads, d.head_dim)
        got = (cache.k.shape[0], cache.k.shape[2], cache.k.shape[4])
        if got != want or cache.device != self.device or cache.k.dtype != self.dtype:
            raise WideError(f"{where}: the KV cache (layers, KV heads, head_dim) = {got}, {cache.k.dtype} on "
                            f"{cache.device} does not fit this model: {want}, {self.dtype} on {self.device}; "
                            f"make it with this engine's new_cache")


def _dense_prefill_attention(q, k, v, pad, scale):
    """SDPA causal attention with GQA (dense baseline); ``pad`` int64 ``[B]`` or False (no padding)."""
    B, Hq, T, hd = q.shape
    rep = Hq // k.shape[1]
    if pad is False:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=rep > 1)
    j = torch.arange(T, device=q.device)
    causal = j.view(1, T) <= j.view(T, 1)
    allowed = causal.view(1, 1, T, T) & ((j.view(1, 1, 1, T) >= pad.view(B, 1, 1, 1)) | torch.eye(
        T, dtype=torch.bool, device=q.device).view(1, 1, T, T))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale, enable_gqa=rep > 1)


def _positive_int(name: str, v) -> int:
    """``v`` as an int ``>= 1`` (Python or NumPy integers, not bools) for :meth:`Engine.new_cache`."""
    import operator

    try:
        if isinstance(v, bool):
            raise TypeError
        n = operator.index(v)
    except TypeError:
        raise WideError(f"new_cache: {name}={v!r} must be an int >= 1") from None
    if n < 1:
        raise WideError(f"new_cache: {name}={n} must be >= 1")
    return n


def _tokens(n: int) -> str:
    """``"1 token"`` / ``"n tokens"`` for error messages."""
    return f"{n} token" if n == 1 else f"{n} tokens"
