"""Static KV cache: fixed-shape buffers, so that decode steps can be captured in CUDA graphs.  Token ``i`` of row
``b`` (padding excluded) sits at slot ``T_max - 1 - i``: the visible keys after ``n_b`` tokens are the slots from
``left_pad[b] = T_max - n_b`` on, the attention kernels' key range (attention is order-independent over keys), and
the lengths live on the device, so a decode step needs no host synchronisation."""

from __future__ import annotations

import torch
from torch import nn


class StaticKVCache(nn.Module):
    """K / V buffers ``[L, B, H_k, T_max, d]`` (``k[l]`` is what the attention kernels read) and the int64 tokens
    stored per row, ``lengths [B]``."""

    def __init__(self, num_layers: int, batch: int, num_kv_heads: int, head_dim: int, max_len: int,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        shape = (num_layers, batch, num_kv_heads, max_len, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device))
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device))
        self.register_buffer("lengths", torch.zeros(batch, dtype=torch.int64, device=device))
        self.batch, self.max_len = batch, max_len

    @property
    def device(self) -> torch.device:
        return self.k.device

    def prefill_slots(self, pad: torch.Tensor, T: int) -> torch.Tensor:
        """int64 ``[B, T]`` slots of a prompt block left-padded by ``pad [B]``: real token ``i`` at ``T_max - 1 - i``,
        the padding just below (never visible; the first decode token overwrites the highest)."""
        t = torch.arange(T, device=pad.device).unsqueeze(0)
        p = pad.view(-1, 1)
        return self.max_len - 1 - torch.where(t >= p, t - p, T - 1 - t)
