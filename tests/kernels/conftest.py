"""Kernel tests run on the CPU under Triton's interpreter when no CUDA device is present.

TRITON_INTERPRET must be set before ``triton.jit`` decorates the kernels; if ``wide.kernels`` was imported without
it, its modules are reloaded (in import order) so that the kernels are decorated again.
"""

import importlib
import os
import sys

import torch

MODULES = ("_common", "reference", "reorder", "gemm_mn_ws", "gemm_mn", "gemm_k", "token_order", "o_proj", "decode_attn",
           "attention", "router", "rmsnorm", "rope", "activation", "zero_heads")

if not torch.cuda.is_available():
    _was = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    if _was != "1" and "wide.kernels" in sys.modules:
        for name in MODULES:
            if f"wide.kernels.{name}" in sys.modules:
                importlib.reload(sys.modules[f"wide.kernels.{name}"])
        importlib.reload(sys.modules["wide.kernels"])

import pytest  # noqa: E402


@pytest.fixture(scope="module")
def built():
    """The CuTe sm_90a extension, built once (minutes on a fresh cache); a failed build fails the GPU tests."""
    from wide.kernels import sm90

    assert sm90.available(torch.device("cuda")), "the CuTe sm_90a kernels did not build (see the warning)"


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
