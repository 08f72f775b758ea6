"""SkipGPT (Zhao et al., 2025), the dynamic-depth baseline of the WIDE paper (§4.1).

SkipGPT routes each token through or around whole sublayers: one router per attention module and one
per FFN module, each giving one execute/skip decision per token. In this project it is WIDE with
``N_G = 1`` per module (``WideConfig(method="skipgpt")``): the same bottleneck router (Eq. 4), the same
hard Gumbel-softmax / argmax masks (Eq. 5), the same loss (Eq. 6 or Eq. 22) and the same calibration.
A skipped module contributes exactly zero to the residual stream (its output is gated before
``o_proj`` / ``down_proj``, which have no bias in the supported architectures).

§4.1: "For SkipGPT, we additionally increase the router rank r to match the router capacity of WIDE."
:func:`matched_rank` picks the SkipGPT rank whose router parameter count is closest to WIDE's.
"""

from __future__ import annotations

import dataclasses

from wide.config import ModelDims, WideConfig
from wide.errors import WideError


def router_params(dims: ModelDims, config: WideConfig) -> int:
    """Router parameters (weights and biases, Eq. 4) that ``config`` adds to a model of ``dims``.

    Args:
        dims: the base model's shape facts.
        config: a WIDE or SkipGPT config (resolved or not; it is resolved against ``dims`` here).

    Returns:
        the count, an int: per routed module ``D*r + r + r*2*N_G + 2*N_G``, summed over layers.

    Raises:
        WideError: group sizes that do not fit ``dims``.
    """
    from wide.model import router_param_count

    return router_param_count(dims, config.resolve(dims))


def matched_rank(dims: ModelDims, wide_config: WideConfig) -> int:
    """SkipGPT router rank whose parameter count is closest to that of ``wide_config``'s routers (§4.1).

    A SkipGPT router has ``r (D + 3) + 2`` parameters (``N_G = 1``), so the count grows by ``D + 3`` per
    routed module and layer for each rank step; the returned rank is within half a step of WIDE's count
    (rounded to nearest, at least the WIDE rank's floor of 1).

    Args:
        dims: the base model's shape facts.
        wide_config: the WIDE config whose router capacity is matched (``method`` must be ``"wide"``).

    Returns:
        the rank, an int ``>= 1``.

    Raises:
        WideError: ``wide_config.method`` is not ``"wide"``, or its group sizes do not fit ``dims``.
    """
    if wide_config.method != "wide":
        raise WideError(f"matched_rank needs a WIDE config to match, got method={wide_config.method!r}")
    target = router_params(dims, wide_config)
    n_modules = dims.num_layers * (int(wide_config.route_attn) + int(wide_config.route_ffn))
    per_rank = n_modules * (dims.hidden_size + 3)
    fixed = n_modules * 2
    return max(1, round((target - fixed) / per_rank))


def skipgpt_config(dims: ModelDims, wide_config: WideConfig, rank: int | None = None) -> WideConfig:
    """The SkipGPT config compared against ``wide_config``: same S, alpha, tau schedule, mode and routed
    modules, whole-module gates, and the rank from :func:`matched_rank` (or ``rank`` when given).

    Args:
        dims: the base model's shape facts.
        wide_config: the WIDE config of the comparison (``method="wide"``).
        rank: explicit SkipGPT rank ``>= 1``; default: matched to WIDE's router capacity.

    Returns:
        a resolved ``WideConfig(method="skipgpt")``.

    Raises:
        WideError: as :func:`matched_rank`, or ``rank < 1``.
    """
    r = matched_rank(dims, wide_config) if rank is None else rank
    if not isinstance(r, int) or r < 1:
        raise WideError(f"SkipGPT router rank {r!r} must be a positive integer")
    return dataclasses.replace(wide_config, method="skipgpt", router_rank=r).resolve(dims)
