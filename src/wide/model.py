"""`WideModel`: WIDE routers on a Llama-family Hugging Face model (paper §3.1, Eq. 2-5), through forward pre-hooks
so the base model's own forward runs unchanged. The attention router reads the residual stream entering
``input_layernorm`` and gates the attention output per head group before ``o_proj`` (K and V stay, Eq. 2); the FFN
router reads the stream entering ``post_attention_layernorm`` and gates ``act(gate) * up`` before ``down_proj``
(Eq. 3)."""

from __future__ import annotations

import hashlib
import json
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from wide.config import ModelDims, WideConfig
from wide.errors import WideError
from wide.routing import Router, argmax_mask, gumbel_hard_mask, keyed_uniform, masked_mean

SUPPORTED_ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
                           "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}
_LAYOUT = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "input_layernorm", "post_attention_layernorm")


def check_architecture(hf_config) -> str:
    """The architecture class name of a Hugging Face config. Raises WideError if WIDE does not support it."""
    archs = list(getattr(hf_config, "architectures", None) or [])
    if archs:
        name = archs[0]
    else:  # a config read from GGUF metadata carries only model_type
        mt = getattr(hf_config, "model_type", None)
        name = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}.get(
            mt, f"{type(hf_config).__name__} (model_type={mt!r})")
    if name not in SUPPORTED_ARCHITECTURES:
        raise WideError(f"unsupported architecture {name}: WIDE supports {', '.join(SUPPORTED_ARCHITECTURES)}")
    return name


def dims_of(hf_config) -> ModelDims:
    """:class:`ModelDims` of a Hugging Face config."""
    heads = hf_config.num_attention_heads
    return ModelDims(num_layers=hf_config.num_hidden_layers, hidden_size=hf_config.hidden_size, num_heads=heads,
                     num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or heads,
                     head_dim=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads,
                     intermediate_size=hf_config.intermediate_size)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of a ``*ForCausalLM`` (also through a peft wrapper)."""
    inner = model
    while not hasattr(inner, "layers"):
        nxt = getattr(inner, "model", None) or getattr(inner, "base_model", None)
        if nxt is None or nxt is inner:
            raise WideError(f"cannot find decoder layers in {type(model).__name__}")
        inner = nxt
    return inner.layers


def _get(module: nn.Module, dotted: str) -> nn.Module:
    for part in dotted.split("."):
        module = getattr(module, part)
    return module


def fingerprint(model: nn.Module) -> str:
    """``"v2:"`` + 16 hex digits identifying the base weights whatever their dtype or file format: a SHA-256 of the
    dims, the first 64 embedding rows and, in every layer, the first and last two rows of each projection and
    both norms, rounded to bf16 (a peft-wrapped projection is read through its ``base_layer``)."""
    h = hashlib.sha256(json.dumps(dims_of(model.config).__dict__, sort_keys=True).encode())
    parts = [model.get_input_embeddings().weight[:64]]
    for layer in decoder_layers(model):
        for name in _LAYOUT:
            w = getattr(_get(layer, name), "base_layer", _get(layer, name)).weight.detach()
            parts += [w] if w.dim() == 1 or w.shape[0] <= 4 else [w[:2], w[-2:]]
    for t in parts:
        h.update(t.detach().to("cpu", torch.bfloat16).contiguous().view(torch.int16).numpy().tobytes())
    return "v2:" + h.hexdigest()[:16]


def check_token_ids(input_ids) -> None:
    """Raises WideError unless ``input_ids`` is an integer tensor ``[B, T]`` with ``B, T >= 1`` (no host sync)."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise WideError(f"input_ids must be an integer tensor [B, T] (batch, tokens), got {shape}; a single "
                        f"sequence is ids.unsqueeze(0)")
    if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
        raise WideError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")
    if input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
        raise WideError(f"empty prompt: input_ids of shape {tuple(input_ids.shape)} has no tokens")


def outside_vocab(input_ids: torch.Tensor, vocab: int) -> WideError:
    """The error for token ids outside ``[0, vocab)`` (a host sync)."""
    return WideError(f"input_ids hold token ids from {int(input_ids.min())} to {int(input_ids.max())}; the model's "
                     f"vocabulary is 0..{vocab - 1}")


@dataclass
class RoutingRecord:
    """One forward pass's routing: per-layer differentiable keep ratios and, when recording, the masks."""

    attn_keep: list = field(default_factory=list)
    ffn_keep: list = field(default_factory=list)
    masks: dict = field(default_factory=dict)  # (kind, layer) -> bool [B, T, N_G]


class WideModel(nn.Module):
    """A supported ``*ForCausalLM`` with WIDE routers on its sublayers (WideError for another architecture or group
    sizes that do not fit); ``init_keep`` is each router's initial execute probability (near 1: near dense). Set
    ``stochastic`` (Gumbel masks at temperature ``tau``), ``fixed_masks`` ``{"attn", "ffn"}`` (True / False: all /
    none, or masks ``[B, T, N_G]`` / ``[L, B, T, N_G]``) or ``record_masks``."""

    def __init__(self, base: nn.Module, config: WideConfig, init_keep: float = 0.95) -> None:
        super().__init__()
        check_architecture(base.config)
        self.base = base
        self.dims = dims_of(base.config)
        self.config = config.resolve(self.dims)
        self.n_attn_groups, self.n_ffn_groups = self.config.n_groups(self.dims)
        d, r, L = self.dims.hidden_size, self.config.router_rank, self.dims.num_layers
        self.attn_routers = nn.ModuleList(
            [Router(d, self.n_attn_groups, r, init_keep) for _ in range(L)] if self.config.route_attn else [])
        self.ffn_routers = nn.ModuleList(
            [Router(d, self.n_ffn_groups, r, init_keep) for _ in range(L)] if self.config.route_ffn else [])
        self.to(next(base.parameters()).device)
        self.stochastic = False
        self.tau = self.config.tau_start
        self.fixed_masks: dict | None = None
        self.record_masks = False
        self.record = RoutingRecord()
        self._valid: torch.Tensor | None = None
        self._cur: dict = {}
        self._handles: list = []
        self._bias0: dict | None = None
        self.router_shifts: dict | None = None
        self.calibration: dict | None = None
        self.install_hooks()

    def install_hooks(self) -> None:
        """(Re-)register the routing hooks; call again after peft replaced the projections."""
        for h in self._handles:
            h.remove()
        self._handles = []
        for i, layer in enumerate(decoder_layers(self.base)):
            for name in _LAYOUT:
                _get(layer, name)  # an AttributeError now on a foreign layout
            for kind, norm, proj, g in (("attn", "input_layernorm", "self_attn.o_proj", self.config.attn_group_size),
                                        ("ffn", "post_attention_layernorm", "mlp.down_proj",
                                         self.config.ffn_group_size)):
                if self.config.route_attn if kind == "attn" else self.config.route_ffn:
                    self._handles += [_get(layer, norm).register_forward_pre_hook(self._router_hook(kind, i)),
                                      _get(layer, proj).register_forward_pre_hook(self._gate_hook(kind, i, g))]

    def _router_hook(self, kind: str, i: int):
        def hook(module, args):
            self._cur[(kind, i)] = self.route(kind, i, args[0])
        return hook

    def _gate_hook(self, kind: str, i: int, group: int):
        def hook(module, args):
            x, mask = args[0], self._cur.pop((kind, i))
            return ((x.view(*x.shape[:-1], -1, group) * mask.unsqueeze(-1).to(x.dtype)).view_as(x), *args[1:])
        return hook

    def route(self, kind: str, i: int, x: torch.Tensor) -> torch.Tensor:
        """Float mask ``[B, T, N_G]`` (1.0 = execute) of layer ``i``'s ``kind`` sublayer for the residual stream
        ``x`` ``[B, T, D]`` (Eq. 4-5); appends its keep ratio over the valid tokens to ``record``."""
        n = self.n_attn_groups if kind == "attn" else self.n_ffn_groups
        fixed = None if self.fixed_masks is None else self.fixed_masks.get(kind)
        if fixed is None:
            logits = (self.attn_routers if kind == "attn" else self.ffn_routers)[i](x)
            mask = (gumbel_hard_mask(logits, self.tau, keyed_uniform(logits.shape, logits.device, (kind, i)))
                    if self.stochastic else argmax_mask(logits).float())
        elif isinstance(fixed, bool):
            mask = torch.full((*x.shape[:-1], n), float(fixed), device=x.device)
        else:
            mask = (fixed[i] if fixed.dim() == 4 else fixed).float().to(x.device).expand(*x.shape[:-1], n)
        valid = self._valid
        if valid is not None and valid.shape != mask.shape[:-1]:
            valid = valid[..., -mask.shape[-2]:]  # decoding with a KV cache: the new positions only
        (self.record.attn_keep if kind == "attn" else self.record.ffn_keep).append(masked_mean(mask, valid))
        if self.record_masks:
            self.record.masks[(kind, i)] = mask.detach().bool()
        return mask

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs):
        """The base model's ``CausalLMOutput`` with routing (``self.record`` holds it) for integer ``input_ids``
        ``[B, T]`` and a 2-D padding ``attention_mask`` (1 / 0; ``[B, past + T]`` with ``past_key_values``), which
        keeps padding out of the keep ratios.

        Raises:
            WideError: ids or mask of the wrong type or shape; in eval mode also ids outside the vocabulary and mask
                values other than 0 / 1 (a host sync, skipped during CUDA graph capture).
        """
        if input_ids is not None or "inputs_embeds" not in kwargs:
            self._check_inputs(input_ids, attention_mask, kwargs.get("past_key_values") is not None)
        self.record, self._cur = RoutingRecord(), {}
        self._valid = attention_mask.bool() if attention_mask is not None else None
        try:
            return self.base(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        finally:
            self._valid = None

    def _check_inputs(self, input_ids, attention_mask, has_past: bool) -> None:
        check_token_ids(input_ids)
        B, T = input_ids.shape
        m = attention_mask
        if m is not None and not isinstance(m, torch.Tensor):
            raise WideError(f"attention_mask must be a [B, T] tensor (1 = real token, 0 = padding) or None; got "
                            f"{type(m).__name__}")
        if m is not None and m.dim() != 2:
            raise WideError(f"attention_mask of shape {tuple(m.shape)}: WIDE takes a 2-D [B, T] padding mask (1 = "
                            f"real token, 0 = padding; the model adds the causal mask), not a {m.dim()}-D one")
        if m is not None and (m.shape[0] != B or m.shape[1] < T or (m.shape[1] != T and not has_past)):
            raise WideError(f"attention_mask of shape {tuple(m.shape)} does not fit input_ids {(B, T)}: it needs "
                            f"[B, T] (or [B, past + T] with past_key_values)")
        if self.training or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
            return
        vocab = self.base.get_input_embeddings().num_embeddings
        if bool(((input_ids < 0) | (input_ids >= vocab)).any()):
            raise outside_vocab(input_ids, vocab)
        if m is not None and m.dtype != torch.bool and bool(((m != 0) & (m != 1)).any()):
            bad = m[(m != 0) & (m != 1)].flatten()[0].item()
            raise WideError(f"attention_mask holds {bad!r}: a padding mask takes 1 (real token) or 0 (padding) only")

    @contextmanager
    def masks_fixed(self, attn=None, ffn=None):
        """Within the block, override routing: True executes all, False skips all, or a tensor of masks."""
        old, self.fixed_masks = self.fixed_masks, {"attn": attn, "ffn": ffn}
        try:
            yield self
        finally:
            self.fixed_masks = old

    def router_parameters(self) -> list[nn.Parameter]:
        """The routers' parameters, attention routers first: what stage 1 trains."""
        return [*self.attn_routers.parameters(), *self.ffn_routers.parameters()]

    def router_state_dict(self) -> dict[str, torch.Tensor]:
        """Router weights as ``{"attn.<i>.w1.weight": tensor, ...}`` (float32, CPU, contiguous)."""
        return {f"{kind}.{k}": v.detach().to("cpu", torch.float32).contiguous()
                for kind, mods in (("attn", self.attn_routers), ("ffn", self.ffn_routers))
                for k, v in mods.state_dict().items()}

    def load_router_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        """Load router weights (checked by the caller: :func:`check_router_weights`); drops any logit shift."""
        for kind, mods in (("attn", self.attn_routers), ("ffn", self.ffn_routers)):
            mods.load_state_dict({k[len(kind) + 1:]: v for k, v in sd.items() if k.startswith(kind + ".")})
        self._bias0, self.router_shifts, self.calibration = None, None, None

    @torch.no_grad()
    def set_router_shifts(self, shifts: dict[str, list[float]] | None) -> None:
        """Fold a logit shift ``t`` per routed module into its router's ``w2`` bias (class 0 ``+ t / 2``, class 1
        ``- t / 2``, in float64, rounded once to float32): each margin ``R0 - R1`` grows by ``t``, so argmax
        (Eq. 5) and every path that reads the router weights (the inference engine's fused router) execute more
        groups for ``t > 0``. ``shifts`` ``{"attn": [L floats], "ffn": [L floats]}`` (a routed kind only); None
        puts the routers' own biases back. Shifts replace earlier ones, they do not add up."""
        if self._bias0 is None:
            self._bias0 = {(kind, i): r.w2.bias.detach().clone() for kind, mods in
                           (("attn", self.attn_routers), ("ffn", self.ffn_routers)) for i, r in enumerate(mods)}
        for kind, mods in (("attn", self.attn_routers), ("ffn", self.ffn_routers)):
            for i, r in enumerate(mods):
                b0 = self._bias0[(kind, i)]
                t = 0.0 if shifts is None else float(shifts[kind][i])
                half = torch.tensor([t / 2, -t / 2], dtype=torch.float64, device=b0.device)
                r.w2.bias.copy_((b0.view(-1, 2).double() + half).view(-1).to(b0.dtype))
        self.router_shifts = None if shifts is None else {k: [float(x) for x in v] for k, v in shifts.items()}

    def router_param_count(self) -> int:
        return sum(p.numel() for p in self.router_parameters())


def router_shapes(dims: ModelDims, config: WideConfig) -> dict[str, tuple[int, ...]]:
    """Keys and shapes of :meth:`WideModel.router_state_dict` without building a model: per routed layer ``w1.weight``
    ``[r, D]``, ``w1.bias`` ``[r]``, ``w2.weight`` ``[2 N_G, r]``, ``w2.bias`` ``[2 N_G]`` (Eq. 4)."""
    cfg = config.resolve(dims)
    d, r = dims.hidden_size, cfg.router_rank
    out: dict[str, tuple[int, ...]] = {}
    for kind, n, routed in zip(("attn", "ffn"), cfg.n_groups(dims), (cfg.route_attn, cfg.route_ffn)):
        for i in range(dims.num_layers if routed else 0):
            out.update({f"{kind}.{i}.w1.weight": (r, d), f"{kind}.{i}.w1.bias": (r,),
                        f"{kind}.{i}.w2.weight": (2 * n, r), f"{kind}.{i}.w2.bias": (2 * n,)})
    return out


def router_param_count(dims: ModelDims, config: WideConfig) -> int:
    """Router parameters a ``config`` adds to a model of ``dims`` (Eq. 4, with biases)."""
    return sum(torch.Size(s).numel() for s in router_shapes(dims, config).values())


def check_router_weights(sd: dict[str, torch.Tensor], shapes: dict[str, tuple[int, ...]]) -> None:
    """Raises WideError when router weights ``sd`` lack or add keys of ``shapes`` or differ in shape."""
    hint = "they were likely made for another model or another WIDE config (routed modules, group sizes, rank)"
    missing, unexpected = sorted(set(shapes) - set(sd)), sorted(set(sd) - set(shapes))

    def few(keys: list[str]) -> str:
        return f" ({', '.join(keys[:3])}{', ...' if len(keys) > 3 else ''})" if keys else ""

    if missing or unexpected:
        raise WideError(f"router weights do not match the model: {len(missing)} missing{few(missing)}, "
                        f"{len(unexpected)} unexpected{few(unexpected)}, of the {len(shapes)} it needs; {hint}")
    for k, v in sd.items():
        if tuple(v.shape) != tuple(shapes[k]):
            raise WideError(f"router weight {k} has shape {tuple(v.shape)}, the model needs {tuple(shapes[k])}; "
                            f"{hint}")
