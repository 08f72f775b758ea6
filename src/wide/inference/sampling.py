"""Next-token choice of :func:`~wide.inference.generation.generate`: greedy, or sampling with a temperature,
top-k and top-p (nucleus) filtering, in the order of Hugging Face's logits warpers (temperature, then top-k, then
top-p on the tempered, top-k-filtered distribution).

Sampling draws one uniform per vocabulary entry from a seeded :class:`torch.Generator` and takes the Gumbel-max
``argmax(scores - log(-log u))``, an exact draw from ``softmax(scores)``: only device ops, no host sync, so a
decode step's token stays on the GPU.  Greedy (``temperature == 0``) is the plain ``argmax``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from wide.config import SEED_MAX
from wide.errors import WideError


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen.

    Attributes:
        temperature: ``0`` for greedy (the default); else the softmax temperature ``T > 0`` (logits / T; below
            ~1.2e-38, float32's smallest normal, greedy: the limit T -> 0).
        top_k: keep the ``k`` highest-scoring tokens (``0`` = all).
        top_p: keep the smallest set of most probable tokens whose probability sums to at least ``p``
            (``0 < p <= 1``; ``1`` = all); always at least one token.
        seed: seed of the sampling generator, an int in ``[0, 2**32 - 1]`` as every ``--seed`` of the project
            (``None``: a random seed from the default generator).

    Raises:
        WideError: on construction, a value outside the ranges above, or a seed that is not such an int.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        """Raises WideError for a value outside the ranges above (naming it)."""
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise WideError(f"temperature {t!r} must be a finite number >= 0 (0 = greedy)")
        k = self.top_k
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise WideError(f"top-k {k!r} must be an int >= 0 (0 = no top-k filtering)")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not (0 < p <= 1):
            raise WideError(f"top-p {p!r} must be in (0, 1] (1 = no top-p filtering)")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not 0 <= self.seed <= SEED_MAX):
            raise WideError(f"seed {self.seed!r} must be an integer from 0 to {SEED_MAX} (2**32 - 1); leave it out "
                            "(None) for a random seed")

    @property
    def greedy(self) -> bool:
        """True when the next token is the ``argmax``: ``temperature == 0``, ``top_k == 1``, or a temperature
        below float32's smallest normal number (~1.2e-38), where the scores' float32 division would break down
        and the distribution is the argmax's anyway (T -> 0)."""
        return self.temperature < torch.finfo(torch.float32).tiny or self.top_k == 1

    def generator(self, device: torch.device) -> torch.Generator | None:
        """A generator on ``device`` seeded with :attr:`seed` (a fresh random seed when None); None when greedy."""
        if self.greedy:
            return None
        g = torch.Generator(device=device)
        g.manual_seed(self.seed if self.seed is not None else int(torch.randint(0, 2 ** 62, ()).item()))
        return g


def filtered_scores(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """The tempered scores with the tokens that top-k / top-p remove set to ``-inf``.

    Args:
        logits: ``[B, V]`` float (any float dtype; computed in float32).
        sampling: a non-greedy :class:`Sampling`.

    Returns:
        float32 ``[B, V]``: ``(logits - max) / T`` (the row's max subtracted first, which ``softmax`` ignores, so
        that a tiny T sends the other tokens to ``-inf`` instead of every positive logit to ``+inf``: T -> 0 is
        greedy), ``-inf`` outside the kept tokens; ``softmax`` of a row is the distribution a token is drawn from.
    """
    x = logits.float()
    scores = (x - x.amax(dim=-1, keepdim=True)) / sampling.temperature
    V = scores.shape[-1]
    if 0 < sampling.top_k < V:
        kth = scores.topk(sampling.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if sampling.top_p < 1:
        srt, idx = scores.sort(dim=-1, descending=True)
        probs = srt.softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # probability of the tokens ranked above each one
        srt = srt.masked_fill(before >= sampling.top_p, float("-inf"))  # the first token always stays
        scores = torch.full_like(scores, float("-inf")).scatter(-1, idx, srt)
    return scores


def next_tokens(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> torch.Tensor:
    """The next token of every row: ``argmax`` when greedy, else one draw from ``softmax(filtered_scores)``.

    Args:
        logits: ``[B, V]`` float on any device.
        sampling: the :class:`Sampling` settings.
        generator: from :meth:`Sampling.generator` on ``logits.device`` (ignored when greedy).

    Returns:
        int64 ``[B]`` on ``logits.device`` (no host sync).
    """
    if sampling.greedy:
        return logits.argmax(-1)
    scores = filtered_scores(logits, sampling)
    u = torch.rand(scores.shape, generator=generator, device=scores.device, dtype=torch.float32)
    gumbel = -torch.log(-torch.log(u.clamp_(min=torch.finfo(torch.float32).tiny, max=1.0 - 2.0 ** -24)))
    return (scores + gumbel).argmax(-1)
