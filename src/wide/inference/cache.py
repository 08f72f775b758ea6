"""Static KV cache for the inference engine (fixed shape, so decode steps can be captured in CUDA graphs).

Layout ("reversed slots"): for layer ``l`` the cache holds ``k[l], v[l]`` of shape ``[B, H_k, T_max, d]``
(SDPA layout).  The ``i``-th real token of sequence ``b`` (0-based, padding excluded) is stored at slot
``T_max - 1 - i``.  The visible keys of sequence ``b`` after ``n_b`` tokens are therefore the slots
``[T_max - n_b, T_max)``, which is exactly the key range the routed attention kernels keep when given
``left_pad[b] = T_max - n_b`` (they mask keys ``j < left_pad[b]``).  Attention over keys is
order-independent (RoPE is applied to K before it is cached), so this layout needs no "valid length"
argument in the kernels, and the per-step bookkeeping (``lengths``) lives on the device: a decode step
performs no host synchronisation.
"""

from __future__ import annotations

import torch

from wide.errors import WideError


class StaticKVCache:
    """Per-layer K/V buffers of a fixed batch size and capacity, plus per-sequence lengths on the device.

    Args:
        num_layers: ``L``.
        batch: ``B`` (rows; the engine pads a batch up to its CUDA-graph bucket).
        num_kv_heads: ``H_k``.
        head_dim: ``d``.
        max_len: ``T_max``, the capacity in tokens per sequence (prompt + generated).
        dtype, device: of the K/V buffers.

    Attributes:
        k, v: ``[L, B, H_k, T_max, d]`` tensors (``k[l]`` is what the attention kernels read).
        lengths: int64 ``[B]``, real tokens stored per sequence (``n_b``).

    Raises:
        WideError: a non-positive size.
    """

    def __init__(self, num_layers: int, batch: int, num_kv_heads: int, head_dim: int, max_len: int,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        if min(num_layers, batch, num_kv_heads, head_dim, max_len) < 1:
            raise WideError(f"KV cache sizes must be positive, got L={num_layers}, B={batch}, H_k={num_kv_heads}, "
                            f"d={head_dim}, T_max={max_len}")
        shape = (num_layers, batch, num_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.lengths = torch.zeros(batch, dtype=torch.int64, device=device)
        self.batch, self.max_len = batch, max_len

    @property
    def device(self) -> torch.device:
        """The device of the K and V buffers."""
        return self.k.device

    @staticmethod
    def buffer_bytes(num_layers: int, batch: int, num_kv_heads: int, head_dim: int, max_len: int,
                     dtype: torch.dtype) -> int:
        """Bytes the K and V buffers of a cache of these sizes take (what :meth:`nbytes` reports once made)."""
        return 2 * num_layers * batch * num_kv_heads * max_len * head_dim * dtype.itemsize

    def nbytes(self) -> int:
        """Bytes held by the K and V buffers."""
        return 2 * self.k.numel() * self.k.element_size()

    def reset(self) -> None:
        """Forget every sequence (lengths to 0); the buffers are not cleared (stale slots are never visible)."""
        self.lengths.zero_()

    def prefill_slots(self, pad: torch.Tensor, T: int) -> torch.Tensor:
        """Slot of every position of a left-padded prompt block ``[B, T]``.

        Real token ``t >= pad[b]`` (index ``i = t - pad[b]``) goes to slot ``T_max - 1 - i``; the padding
        positions take the slots just below the real ones (they are never visible, and the next decode
        token overwrites the highest of them before it is read).

        Args:
            pad: int64 ``[B]`` left-padding counts (``0 <= pad[b] < T``).
            T: padded prompt length, ``<= T_max``.

        Returns:
            int64 ``[B, T]`` slots, a permutation of ``[T_max - T, T_max)`` per row.
        """
        t = torch.arange(T, device=pad.device).unsqueeze(0)
        p = pad.view(-1, 1)
        i = torch.where(t >= p, t - p, T - 1 - t)
        return self.max_len - 1 - i

    def write_prefill(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """Store a prompt block's K/V (``[b, H_k, T, d]``, RoPE applied) at ``slots`` (``[b, T]``).

        ``b <= B``: the block fills the first ``b`` rows of the cache (the rest of a CUDA-graph bucket stays
        empty).
        """
        b = k.shape[0]
        idx = slots[:, None, :, None].expand_as(k)
        self.k[layer, :b].scatter_(2, idx, k)
        self.v[layer, :b].scatter_(2, idx, v)

    def write_decode(self, layer: int, k: torch.Tensor, v: torch.Tensor, slot: torch.Tensor) -> None:
        """Store one new token per sequence: ``k, v`` ``[B, H_k, 1, d]`` at ``slot`` (int64 ``[B]``).

        Device-side index writes only (capturable in a CUDA graph).
        """
        idx = slot.view(-1, 1, 1, 1).expand_as(k)
        self.k[layer].scatter_(2, idx, k)
        self.v[layer].scatter_(2, idx, v)
