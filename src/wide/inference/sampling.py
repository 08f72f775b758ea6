"""Next-token choice: greedy, or a draw from the tempered distribution filtered by top-k, then top-p (Hugging Face's
warper order).  A draw is the Gumbel-max ``argmax(scores - log(-log u))`` with one seeded uniform per vocabulary
entry: device ops only, so a decode step's token stays on the GPU."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from wide.config import SEED_MAX
from wide.errors import WideError

TINY = torch.finfo(torch.float32).tiny


@dataclass(frozen=True)
class Sampling:
    """``temperature`` 0 = greedy, else T > 0 (below float32's smallest normal: greedy, the limit T -> 0);
    ``top_k`` 0 = all; ``top_p`` in (0, 1], the smallest most-probable set reaching it (at least one token);
    ``seed`` an int in ``[0, 2**32 - 1]``, or None for a random one.  Raises WideError for a value outside these."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        t, k, p, s = self.temperature, self.top_k, self.top_p, self.seed
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise WideError(f"temperature {t!r} must be a finite number >= 0 (0 = greedy)")
        if not isinstance(k, int) or isinstance(k, bool) or k < 0:
            raise WideError(f"top-k {k!r} must be an int >= 0 (0 = no top-k filtering)")
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1:
            raise WideError(f"top-p {p!r} must be in (0, 1] (1 = no top-p filtering)")
        if s is not None and (not isinstance(s, int) or isinstance(s, bool) or not 0 <= s <= SEED_MAX):
            raise WideError(f"seed {s!r} must be an integer from 0 to {SEED_MAX} (2**32 - 1); leave it out (None) "
                            "for a random seed")

    @property
    def greedy(self) -> bool:
        return self.temperature < TINY or self.top_k == 1

    def generator(self, device: torch.device) -> torch.Generator | None:
        """A generator on ``device`` seeded with :attr:`seed` (random when None); None when greedy."""
        if self.greedy:
            return None
        g = torch.Generator(device=device)
        g.manual_seed(self.seed if self.seed is not None else int(torch.randint(0, 2 ** 62, ()).item()))
        return g


def filtered_scores(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """float32 ``[B, V]`` scores ``(logits - max) / T`` of ``logits [B, V]`` with the tokens top-k / top-p remove at
    ``-inf``; a token is drawn from their softmax (the max is subtracted first so that a tiny T stays greedy)."""
    x = logits.float()
    scores = (x - x.amax(dim=-1, keepdim=True)) / sampling.temperature
    if 0 < sampling.top_k < scores.shape[-1]:
        kth = scores.topk(sampling.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if sampling.top_p < 1:
        srt, idx = scores.sort(dim=-1, descending=True)
        probs = srt.softmax(dim=-1)
        srt = srt.masked_fill(probs.cumsum(dim=-1) - probs >= sampling.top_p, float("-inf"))  # the first stays
        scores = torch.full_like(scores, float("-inf")).scatter(-1, idx, srt)
    return scores


def next_tokens(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> torch.Tensor:
    """int64 ``[B]`` next tokens of ``logits [B, V]``: the argmax when greedy, else a draw (no host sync)."""
    if sampling.greedy:
        return logits.argmax(-1)
    scores = filtered_scores(logits, sampling)
    u = torch.rand(scores.shape, generator=generator, device=scores.device, dtype=torch.float32)
    return (scores - torch.log(-torch.log(u.clamp_(min=TINY, max=1.0 - 2.0 ** -24)))).argmax(-1)
