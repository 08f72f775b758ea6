"""Kernel tests run on the CPU under Triton's interpreter when no CUDA device is present.

TRITON_INTERPRET must be set before ``triton.jit`` decorates the kernels (decoration time), so it
is set here, before ``wide.kernels`` is imported; if some other test module imported
``wide.kernels`` first, its modules are reloaded so that the kernels are re-decorated.
"""

import importlib
import os
import sys

import torch

if not torch.cuda.is_available():
    _was = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    if _was != "1" and "wide.kernels" in sys.modules:  # decorated without the interpreter: re-decorate
        for name in ("_common", "reference", "reorder", "gemm_mn", "swiglu", "gemm_k", "decode", "decode_attn", "attention"):
            mod = sys.modules.get(f"wide.kernels.{name}")
            if mod is not None:
                importlib.reload(mod)
        importlib.reload(sys.modules["wide.kernels"])

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_configure(config):
    # Triton 3.6's interpreter triggers a NumPy deprecation warning on every scalar conversion
    config.addinivalue_line("filterwarnings", "ignore:Conversion of an array with ndim > 0:DeprecationWarning")
