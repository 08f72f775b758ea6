"""Routed Triton kernels of WIDE (paper §3.3, Appendix B), one op per module; a leaf package (imports nothing else
from ``wide``).  Mask convention: bool ``[..., N_G]``, True = execute.

* :func:`reorder` (``reorder.py``): mask reordering, Eq. 7 / Algorithm 1, shared by the ops of a routing decision.
* :func:`gemm_mn`, :func:`swiglu`, :func:`gemv_mn`, :func:`gemv_swiglu` (``gemm_mn.py``; ``gemm_mn_ws.py`` the
  warp-specialized Hopper form): N-axis routing, Algorithm 2 (Q, gate, up).
* :func:`gemm_k`, :func:`gemv_k` (``gemm_k.py``): K-axis routing, Eq. 21 / Algorithm 3 (O, down).
* :func:`routed_attention` (``attention.py``), :func:`decode_attention` (``decode_attn.py``): Algorithm 4.
* :func:`router_mask` (``router.py``): Eq. 4-5.  :func:`add_rmsnorm`, :func:`rope_cache`, :func:`masked_swiglu_act`,
  :func:`zero_skipped_heads_`: the engine's fused unrouted and dense-form ops.
* ``reference.py``: one PyTorch reference per op; :func:`tuned_config`: per-GPU thresholds (``configs/*.json``).

Without Triton, or on the CPU without ``TRITON_INTERPRET=1``, every op runs its reference.
"""

from wide.kernels._common import HAS_TRITON, KernelArgumentError, Reordered, cache_dir, tuned_config
from wide.kernels.activation import masked_swiglu_act
from wide.kernels.attention import routed_attention
from wide.kernels.decode_attn import decode_attention
from wide.kernels.gemm_k import gemm_k, gemv_k
from wide.kernels.gemm_mn import gemm_mn, gemv_mn, gemv_swiglu, swiglu
from wide.kernels.reorder import reorder
from wide.kernels.rmsnorm import add_rmsnorm
from wide.kernels.rope import rope_cache
from wide.kernels.router import router_mask
from wide.kernels.zero_heads import zero_skipped_heads_

__all__ = [
    "HAS_TRITON", "KernelArgumentError", "Reordered", "add_rmsnorm", "cache_dir", "decode_attention", "gemm_k",
    "gemm_mn", "gemv_k", "gemv_mn", "gemv_swiglu", "masked_swiglu_act", "reorder", "rope_cache", "routed_attention",
    "router_mask", "swiglu", "tuned_config", "zero_skipped_heads_",
]
