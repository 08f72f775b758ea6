"""SkipGPT (Zhao et al., 2025), the dynamic-depth baseline of §4.1: WIDE with one group per module
(``WideConfig(method="skipgpt")``: the same router (Eq. 4), masks (Eq. 5), loss and calibration, each token executing
or skipping whole sublayers), its router rank raised to match WIDE's router capacity as §4.1 prescribes."""

from __future__ import annotations

import dataclasses

from wide.config import ModelDims, WideConfig
from wide.errors import WideError
from wide.model import router_param_count


def matched_rank(dims: ModelDims, wide_config: WideConfig) -> int:
    """The SkipGPT rank (>= 1) whose router parameters, ``r (D + 3) + 2`` per routed module, are closest to those
    of ``wide_config``'s routers; WideError for a config that is not WIDE's or does not fit ``dims``."""
    if wide_config.method != "wide":
        raise WideError(f"matched_rank needs a WIDE config to match, got method={wide_config.method!r}")
    target = router_param_count(dims, wide_config.resolve(dims))
    modules = dims.num_layers * (int(wide_config.route_attn) + int(wide_config.route_ffn))
    return max(1, round((target - 2 * modules) / (modules * (dims.hidden_size + 3))))


def skipgpt_config(dims: ModelDims, wide_config: WideConfig, rank: int | None = None) -> WideConfig:
    """The resolved SkipGPT config compared with ``wide_config``: the same objective and routed modules,
    whole-module gates, and :func:`matched_rank` (or ``rank``); WideError as there, or for a rank below 1."""
    r = matched_rank(dims, wide_config) if rank is None else rank
    return dataclasses.replace(wide_config, method="skipgpt", router_rank=r).resolve(dims)
