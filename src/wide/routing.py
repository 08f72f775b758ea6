"""WIDE routers (paper §3.1, Eq. 4-5), the sparsity objective (Eq. 6, Eq. 22) and sample-keyed training noise.
A routing decision is ``[..., N_G]``: True / 1.0 executes the group, False / 0.0 skips it."""

from __future__ import annotations

import hashlib
import math
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn


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


def sparsity_loss(attn_keep: list[torch.Tensor], ffn_keep: list[torch.Tensor], target: float, alpha: float,
                  mode: str = "global") -> torch.Tensor:
    """The sparsity loss, a float32 scalar: ``global`` (Eq. 6) ``alpha * |S - mean over routed modules of (1 - keep)|``;
    ``uniform`` (Eq. 22) ``alpha / 2 * (|S - mean_i (1 - keep_attn_i)| + |S - mean_i (1 - keep_ffn_i)|)``. Either list
    may be empty; raises ValueError for an unknown mode or no routed module."""
    if not attn_keep and not ffn_keep:
        raise ValueError("sparsity_loss needs at least one routed module")
    if mode == "global":
        return alpha * (target - torch.stack([1.0 - k for k in [*attn_keep, *ffn_keep]]).mean()).abs()
    if mode == "uniform":
        terms = [(target - torch.stack([1.0 - k for k in ks]).mean()).abs() for ks in (attn_keep, ffn_keep) if ks]
        return alpha * torch.stack(terms).mean()
    raise ValueError(f"sparsity mode {mode!r} is not one of global, uniform")


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
