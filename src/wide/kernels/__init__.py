"""Routed Triton kernels for WIDE (paper §3.3, Appendix B): one op per module.

Public ops (mask convention: bool ``[M, N_G]``, True = execute):

* :func:`reorder` — unified mask reordering (Eq. 7, Algorithm 1), shared by all ops of a routing
  decision through their ``reordered=`` argument.
* :func:`gemm_mn` — N-axis routed GEMM (Q / up / gate; Algorithm 2).
* :func:`swiglu` — fused routed SwiGLU (gate + up in one pass).
* :func:`gemm_k` — K-axis routed GEMM (O / down; Algorithm 3).
* :func:`routed_attention` — routed flash attention prefill (Algorithm 4) and split-KV decode.
* :mod:`wide.kernels.decode` — GEMV paths for M <= 4 (used automatically by the ops above).
* :func:`decode_attention` (:mod:`wide.kernels.decode_attn`) — split-KV routed decode attention with GQA packing.
* :mod:`wide.kernels.reference` — plain PyTorch references and the Appendix-A naive baselines.

Triton is optional at import time.  On CPU without ``TRITON_INTERPRET=1`` (or without Triton)
every op falls back to its PyTorch reference (float32 compute, input dtype out).
"""

from wide.kernels._common import HAS_TRITON, KernelArgumentError, Reordered, cache_dir
from wide.kernels.attention import routed_attention
from wide.kernels.decode import gemv_k, gemv_mn, gemv_swiglu
from wide.kernels.decode_attn import decode_attention
from wide.kernels.gemm_k import gemm_k
from wide.kernels.gemm_mn import gemm_mn
from wide.kernels.reorder import reorder
from wide.kernels.swiglu import swiglu

__all__ = [
    "HAS_TRITON", "KernelArgumentError", "Reordered", "cache_dir", "decode_attention", "gemm_k", "gemm_mn",
    "gemv_k", "gemv_mn", "gemv_swiglu", "reorder", "routed_attention", "swiglu",
]
