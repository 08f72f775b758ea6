"""Shared fixtures: a tiny random Llama (and its tokenizer) built inside the tests, no downloads."""

from __future__ import annotations

import faulthandler
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
if not torch.cuda.is_available():
    # Triton's interpreter must be chosen before any kernel module is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Decorate every Triton kernel now, in the mode chosen above: a test that sets TRITON_INTERPRET=0 (the
# ``reference_path`` fixtures) must not be the first to import a kernel module, or its kernels would stay
# compiled-mode for the tests after it (which then fail for want of a GPU driver).
import wide.inference.engine  # noqa: E402,F401  (imports wide.kernels.fused)
import wide.kernels  # noqa: E402,F401
from wide_testutil import random_text, tiny_model, tiny_tokenizer  # noqa: E402,F401

GPU_TEST_LIMIT_S = 240  # a GPU test past this is a kernel waiting forever, not a slow test


@pytest.fixture(autouse=True)
def gpu_hang_guard(request):
    """A ``gpu`` test still running after GPU_TEST_LIMIT_S ends the test process (exit code 1; ``pytest -v`` names the
    test it was in), so a kernel that never finishes fails the run at once instead of holding the GPU until an outer
    limit.  Module fixtures, such as the CuTe build, run before the clock starts."""
    if request.node.get_closest_marker("gpu") is None or not torch.cuda.is_available():
        yield
        return
    faulthandler.dump_traceback_later(GPU_TEST_LIMIT_S, exit=True)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


@pytest.fixture
def model():
    return tiny_model()


@pytest.fixture
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture
def model_dir(tmp_path):
    """A tiny Llama checkpoint directory with its tokenizer, usable as ``--model``."""
    d = tmp_path / "tiny-llama"
    tiny_model().save_pretrained(d)
    tiny_tokenizer().save_pretrained(d)
    return d


@pytest.fixture
def text_file(tmp_path):
    p = tmp_path / "text.txt"
    p.write_text("\n\n".join(random_text(300, seed=s) for s in range(4)))
    return p
