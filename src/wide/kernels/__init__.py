"""Routed Triton kernels of WIDE (paper §3.3, Appendix B), one op per module, importing nothing else from ``wide``:
``reorder`` (Eq. 7), ``gemm_mn`` (Algorithm 2, with ``swiglu`` and the GEMVs; ``gemm_mn_ws`` on Hopper), ``gemm_k``
(Algorithm 3), ``attention`` and ``decode_attn`` (Algorithm 4), ``router`` (Eq. 4-5), ``activation`` and
``zero_heads`` (the dense forms of routed ops), and the engine's internal ``rmsnorm`` and ``rope``; ``reference``
holds one PyTorch reference per op, ``configs/`` the per-GPU thresholds (:func:`tuned_config`).  Masks: bool
``[..., N_G]``, True = execute.  Without Triton, or on the CPU without ``TRITON_INTERPRET=1``, ops run references.
"""

from wide.kernels._common import HAS_TRITON, KernelArgumentError, Reordered, cache_dir, tuned_config
from wide.kernels.activation import masked_swiglu_act
from wide.kernels.attention import routed_attention
from wide.kernels.decode_attn import decode_attention
from wide.kernels.gemm_k import gemm_k, gemv_k
from wide.kernels.gemm_mn import gemm_mn, gemv_mn, gemv_swiglu, swiglu
from wide.kernels.reorder import reorder
from wide.kernels.router import router_mask
from wide.kernels.zero_heads import zero_skipped_heads_

__all__ = [
    "HAS_TRITON", "KernelArgumentError", "Reordered", "cache_dir", "decode_attention", "gemm_k", "gemm_mn", "gemv_k",
    "gemv_mn", "gemv_swiglu", "masked_swiglu_act", "reorder", "routed_attention", "router_mask", "swiglu",
    "tuned_config", "zero_skipped_heads_",
]
