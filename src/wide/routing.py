"""WIDE routers (paper §3.1, Eq. 4-5), the sparsity objective (Eq. 6, Eq. 22) and sample-keyed training noise.
A routing decision is ``[..., N_G]``: True / 1.0 executes the group, False / 0.0 skips it."""

from __future__ import annotations

import hashlib
import math
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from wide.config import ModelDims, WideConfig
from wide.errors import WideError


class Router(nn.Module):
    """Bottleneck router ``R = reshape(X W1 W2)`` (Eq. 4, with biases): ``[..., D] -> [..., N_G, 2]`` float32 logits,
    class 0 executes; ``init_keep`` is the initial probability of executing a group."""

    def __init__(self, hidden_size: int, n_groups: int, rank: int, init_keep: float = 0.5) -> None:
        super().__init__()
        self.n_groups = n_groups
        self.w1 = nn.Linear(hidden_size, rank, dtype=torch.float32)
        self.w2 = nn.Linear(rank, 2 * n_groups, dtype=torch.float32)
        with torch.no_grad():
            nn.init.normal_(self.w1.weight, std=1.0 / math.sqrt(hidden_size))
            nn.init.zeros_(self.w1.bias)
            nn.init.normal_(self.w2.weight, std=0.1 / math.sqrt(rank))
            p = min(max(float(init_keep), 0.02), 0.98)
            half = 0.5 * math.log(p / (1 - p))
            self.w2.bias.view(n_groups, 2).copy_(torch.tensor([half, -half]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[B, T, D]`` (any float dtype) -> float32 logits ``[B, T, N_G, 2]``."""
        with torch.autocast(x.device.type, enabled=False):
            h = self.w2(self.w1(x.float()))
        return h.view(*x.shape[:-1], self.n_groups, 2)


def gumbel_hard_mask(logits: torch.Tensor, tau: float, uniform: torch.Tensor | None = None) -> torch.Tensor:
    """Training mask (Eq. 5): hard Gumbel-softmax ``one_hot(argmax((R + g) / tau))[..., 0]``, float ``[..., N_G]`` of
    0.0 / 1.0, with the gradient of ``softmax((R + g) / tau)[..., 0]`` (straight-through); ``logits`` float32
    ``[..., N_G, 2]``, ``g = -log(-log u)`` from ``uniform`` draws of the same shape (default ``torch.rand``)."""
    u = torch.rand_like(logits) if uniform is None else uniform
    g = -torch.log((-torch.log(u.clamp_min(1e-20))).clamp_min(1e-20))
    soft = torch.softmax((logits + g) / tau, dim=-1)
    hard = F.one_hot(soft.argmax(-1), 2).to(soft.dtype)
    return (hard - soft.detach() + soft)[..., 0]


def argmax_mask(logits: torch.Tensor) -> torch.Tensor:
    """Inference mask (Eq. 5): bool ``[..., N_G]``, ``R[..., 0] >= R[..., 1]`` (ties execute)."""
    return logits[..., 0] >= logits[..., 1]


def masked_mean(mask: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    """Keep ratio: mean of a ``[B, T, N_G]`` mask over the valid tokens (bool ``[B, T]``, None = all)."""
    m = mask.float()
    if valid is None:
        return m.mean()
    w = valid.to(m.dtype).unsqueeze(-1).expand_as(m)
    return (m * w).sum() / w.sum().clamp_min(1.0)


def module_flops(dims: ModelDims, config: WideConfig, seq_len: int) -> tuple[float, float]:
    """Per-token FLOPs of one routed attention and one routed FFN module of a resolved ``config``: an attention
    group of ``G`` channels costs Q ``2·D·G`` + O ``2·G·D`` + its heads' attention core over the causal mean of
    ``(T + 1) / 2`` keys (QK^T and PV: ``4·G·(T + 1) / 2``); an FFN group ``6·D·G`` (gate, up, down)."""
    d, t = dims.hidden_size, float(seq_len)
    return (float(dims.attn_width) * (4.0 * d + 2.0 * (t + 1.0)), 6.0 * d * float(dims.intermediate_size))


def flops_context(config: WideConfig, seq_len: int | None = None) -> int:
    """The context length ``T`` of the FLOP weights: the config's ``seq_len`` (the training context), else
    ``seq_len``. Raises WideError when neither is known."""
    t = config.seq_len if config.seq_len is not None else seq_len
    if t is None:
        raise WideError("the flops sparsity unit needs the context length T: set WideConfig.seq_len (the training "
                        "--seq-len)")
    return int(t)


def module_weights(dims: ModelDims, config: WideConfig, unit: str | None = None,
                   seq_len: int | None = None) -> list[float]:
    """Each routed module's weight in the sparsity of ``unit`` (default ``config.sparsity_unit``), in the order
    attention modules of layers ``0..L-1`` then FFN modules: ``"groups"`` 1.0 each (Eq. 6), ``"flops"`` the
    module's per-token FLOPs at ``T`` = :func:`flops_context` (:func:`module_flops`)."""
    unit = unit or config.sparsity_unit
    w_attn, w_ffn = (1.0, 1.0) if unit == "groups" else module_flops(dims, config, flops_context(config, seq_len))
    L = dims.num_layers
    return [w_attn] * (L if config.route_attn else 0) + [w_ffn] * (L if config.route_ffn else 0)


def sparsity_loss(attn_keep: list[torch.Tensor], ffn_keep: list[torch.Tensor], target: float, alpha: float,
                  mode: str = "global", weights: list[float] | None = None,
                  max_module: float = 1.0) -> torch.Tensor:
    """The sparsity loss, a float32 scalar: ``global`` (Eq. 6) ``alpha * |S - sum_m W_m (1 - keep_m) / sum_m W_m|``
    over the routed modules ``m`` (attention first, then FFN; ``weights`` ``W_m`` from :func:`module_weights`, None:
    all 1, Eq. 6's mean); ``uniform`` (Eq. 22) ``alpha / 2 * (|S - mean_i (1 - keep_attn_i)| + |S - mean_i (1 -
    keep_ffn_i)|)`` whatever the weights: the modules of one class cost the same, so a class's FLOP-weighted mean is
    its plain mean, and both classes at ``S`` skip ``S`` of the routed compute too. ``max_module < 1`` adds
    ``alpha * sum_m relu((1 - keep_m) - max_module)``. Either list may be empty; raises ValueError for an unknown
    mode or no routed module."""
    if not attn_keep and not ffn_keep:
        raise ValueError("sparsity_loss needs at least one routed module")
    skip = torch.stack([1.0 - k for k in [*attn_keep, *ffn_keep]])
    if mode == "global":
        if weights is None:
            loss = alpha * (target - skip.mean()).abs()
        else:
            w = torch.tensor(weights, dtype=torch.float64, device=skip.device)
            loss = alpha * (target - ((w / w.sum()).to(skip.dtype) * skip).sum()).abs()
    elif mode == "uniform":
        terms = [(target - torch.stack([1.0 - k for k in ks]).mean()).abs() for ks in (attn_keep, ffn_keep) if ks]
        loss = alpha * torch.stack(terms).mean()
    else:
        raise ValueError(f"sparsity mode {mode!r} is not one of global, uniform")
    if max_module < 1.0:
        loss = loss + alpha * torch.relu(skip - max_module).sum()
    return loss


def realized_sparsity(attn_keep: list[float], ffn_keep: list[float], dims: ModelDims, config: WideConfig,
                      seq_len: int | None = None) -> dict:
    """Realized sparsity in both units from the per-module keep rates over valid tokens (attention modules of the
    layers, FFN modules; an empty list for a kind without routers, one class mean per list also works since
    the modules of a class weigh the same): ``{"groups": Eq. 6's mean of the module skip rates, "flops": the
    fraction of the routed compute skipped (:func:`module_weights` at ``T`` = :func:`flops_context`), "attn",
    "ffn": each class's mean skip rate (0.0 without routers), "flops_context": T, "per_module": {"attn": [...],
    "ffn": [...]}}`` (skip rates)."""
    attn, ffn = [1.0 - float(k) for k in attn_keep], [1.0 - float(k) for k in ffn_keep]
    mods = [*attn, *ffn]
    t = flops_context(config, seq_len)
    w_attn, w_ffn = module_flops(dims, config, t)
    total = w_attn * len(attn) + w_ffn * len(ffn)
    return {"groups": sum(mods) / len(mods) if mods else 0.0,
            "flops": (w_attn * sum(attn) + w_ffn * sum(ffn)) / total if total else 0.0,
            "attn": sum(attn) / len(attn) if attn else 0.0, "ffn": sum(ffn) / len(ffn) if ffn else 0.0,
            "flops_context": t, "per_module": {"attn": attn, "ffn": ffn}}


def mix(*parts) -> int:
    """A 63-bit seed from ints and strings, the same in every process."""
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:8], "little") & ((1 << 63) - 1)


_SAMPLES: list[tuple[int, list[int]]] = []  # stack of (seed, stream positions of this process's rows)


@contextmanager
def sample_keyed(seed: int, positions: list[int]):
    """Within the block, :func:`keyed_uniform` draws row ``b`` from a generator seeded with
    ``(seed, positions[b], *key)``: training noise (Gumbel, LoRA dropout) depends on the sample, not on the
    world size, the batch split or recomputation under activation checkpointing."""
    _SAMPLES.append((seed, list(positions)))
    try:
        yield
    finally:
        _SAMPLES.pop()


def keyed_uniform(shape, device, key: tuple) -> torch.Tensor | None:
    """float32 ``U(0, 1)`` of ``shape`` ``[B, ...]`` keyed per row (see :func:`sample_keyed`); None outside it."""
    if not _SAMPLES:
        return None
    seed, positions = _SAMPLES[-1]
    return torch.stack([torch.rand(tuple(shape[1:]), device=device,
                                   generator=torch.Generator(device=device).manual_seed(mix(seed, p, *key)))
                        for p in positions])
