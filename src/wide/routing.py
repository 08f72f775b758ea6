"""WIDE routers (paper §3.1, Eq. 4-5) and the sparsity objective (Eq. 6 and Eq. 22).

Mask convention (the project's single one): a routing decision is a tensor ``[..., N_G]`` where
True / 1.0 means *execute* the group and False / 0.0 means skip it.
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn


class Router(nn.Module):
    """Bottleneck router ``R = reshape(X W1 W2)`` (Eq. 4) with biases, giving ``[..., N_G, 2]`` logits.

    Class 0 means execute, class 1 means skip. Parameters are kept in float32 (master weights);
    the input is upcast to float32.

    Args:
        hidden_size: ``D``, the residual-stream width the router reads.
        n_groups: ``N_G``, the number of groups it decides for.
        rank: bottleneck rank ``r``.
        init_keep: initial probability of executing a group (sets the bias of ``W2``), in ``(0, 1)``.
    """

    def __init__(self, hidden_size: int, n_groups: int, rank: int, init_keep: float = 0.5) -> None:
        super().__init__()
        self.n_groups = n_groups
        self.w1 = nn.Linear(hidden_size, rank, bias=True, dtype=torch.float32)
        self.w2 = nn.Linear(rank, 2 * n_groups, bias=True, dtype=torch.float32)
        self.reset_parameters(init_keep)

    @torch.no_grad()
    def reset_parameters(self, init_keep: float = 0.5) -> None:
        d = self.w1.in_features
        nn.init.normal_(self.w1.weight, std=1.0 / math.sqrt(d))
        nn.init.zeros_(self.w1.bias)
        nn.init.normal_(self.w2.weight, std=1.0 / math.sqrt(self.w2.in_features) * 0.1)
        p = min(max(float(init_keep), 0.02), 0.98)
        half = 0.5 * math.log(p / (1 - p))
        bias = self.w2.bias.view(self.n_groups, 2)
        bias[:, 0] = half
        bias[:, 1] = -half

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Router logits.

        Args:
            x: residual stream entering the sublayer, ``[B, T, D]``, any float dtype.

        Returns:
            float32 logits ``[B, T, N_G, 2]`` (class 0 = execute).
        """
        with torch.autocast(x.device.type, enabled=False):  # routers stay float32 under bf16 autocast
            h = self.w2(self.w1(x.float()))
        return h.view(*x.shape[:-1], self.n_groups, 2)


_UNIFORM_SOURCE = None  # optional callable(shape, device, dtype) -> U(0, 1) tensor; see uniform_noise()


@contextmanager
def uniform_noise(source):
    """Within the block, :func:`gumbel_hard_mask` calls without a ``generator`` draw their uniforms from ``source``.

    Training uses this to make the Gumbel noise a pure function of (seed, sample index, layer, module),
    independent of the world size and of recomputation under activation checkpointing (paper §3.2 training
    is unchanged; only where the random numbers come from).

    Args:
        source: callable ``source(shape, device, dtype) -> Tensor`` returning uniforms in ``[0, 1)`` of
            exactly that shape ``[..., N_G, 2]``, device and dtype; ``None`` restores torch's global RNG.
    """
    global _UNIFORM_SOURCE
    old, _UNIFORM_SOURCE = _UNIFORM_SOURCE, source
    try:
        yield
    finally:
        _UNIFORM_SOURCE = old


def gumbel_hard_mask(logits: torch.Tensor, tau: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """Training mask: hard Gumbel-softmax with a straight-through gradient (Eq. 5, training branch).

    Args:
        logits: ``[..., N_G, 2]`` float32 router logits.
        tau: temperature ``> 0``.
        generator: optional RNG for the Gumbel noise (default: the source installed by
            :func:`uniform_noise` if any, else torch's global RNG).

    Returns:
        float mask ``[..., N_G]`` with values exactly 0.0 or 1.0 in the forward pass (1.0 = execute)
        whose gradient is that of ``softmax((logits + g) / tau)[..., 0]``.
    """
    if generator is None and _UNIFORM_SOURCE is not None:
        u = _UNIFORM_SOURCE(logits.shape, logits.device, logits.dtype)
    else:
        u = torch.rand(logits.shape, device=logits.device, dtype=logits.dtype, generator=generator)
    e = (-torch.log(u.clamp_min(1e-20))).clamp_min(1e-20)  # Exp(1) sample, > 0
    g = -torch.log(e)  # Gumbel(0, 1)
    soft = torch.softmax((logits + g) / tau, dim=-1)
    hard = F.one_hot(soft.argmax(-1), 2).to(soft.dtype)
    return (hard - soft.detach() + soft)[..., 0]


def argmax_mask(logits: torch.Tensor) -> torch.Tensor:
    """Inference mask (Eq. 5, inference branch): ``argmax_c R[..., c] == 0`` as bool ``[..., N_G]``.

    Deterministic: ties (equal logits) execute.
    """
    return logits[..., 0] >= logits[..., 1]


def masked_mean(mask: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    """Mean of a ``[B, T, N_G]`` mask over valid tokens (``valid``: bool ``[B, T]`` or None = all)."""
    m = mask.float()
    if valid is None:
        return m.mean()
    w = valid.to(m.dtype).unsqueeze(-1).expand_as(m)
    return (m * w).sum() / w.sum().clamp_min(1.0)


def sparsity_loss(
    attn_keep: list[torch.Tensor],
    ffn_keep: list[torch.Tensor],
    target: float,
    alpha: float,
    mode: str = "global",
) -> torch.Tensor:
    """Sparsity term of the calibration objective.

    ``global`` (Eq. 6): ``alpha * |S - mean over the 2N routed modules of (1 - keep ratio)|``.
    ``uniform`` (Eq. 22): ``alpha / 2 * (|S - mean_i (1 - keep_attn_i)| + |S - mean_i (1 - keep_ffn_i)|)``.

    Args:
        attn_keep, ffn_keep: per-layer scalar keep ratios (mean of the mask over valid tokens and
            groups), differentiable; either list may be empty when that module is not routed.
        target: ``S`` in ``[0, 1)``.
        alpha: weight ``>= 0``.
        mode: ``"global"`` or ``"uniform"``.

    Returns:
        scalar float32 tensor.

    Raises:
        ValueError: unknown mode, or no routed module at all.
    """
    if not attn_keep and not ffn_keep:
        raise ValueError("sparsity_loss needs at least one routed module")
    if mode == "global":
        sp = torch.stack([1.0 - k for k in [*attn_keep, *ffn_keep]]).mean()
        return alpha * (target - sp).abs()
    if mode == "uniform":
        terms = [(target - torch.stack([1.0 - k for k in ks]).mean()).abs() for ks in (attn_keep, ffn_keep) if ks]
        # alpha/2 * (t_attn + t_ffn) == alpha * mean(terms); with one routed module it reduces to Eq. 6.
        return alpha * torch.stack(terms).mean()
    raise ValueError(f"sparsity mode {mode!r} is not one of global, uniform")
