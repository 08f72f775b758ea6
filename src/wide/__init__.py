"""wide: token-level dynamic width pruning (WIDE) for Llama-family LLMs.

    import wide
    model = wide.load("runs/smollm2-s50")  # a WideModel with argmax routing (and the fitted logit shift)
    out = model(input_ids)                  # a Hugging Face CausalLMOutput
    model = wide.load("runs/smollm2-s50", sparsity=0.3)  # dialed to realize 30 % without training
"""

from wide.config import ModelDims, WideConfig
from wide.errors import WideError

__version__ = "0.1.0"
__all__ = ["WideConfig", "ModelDims", "WideError", "WideModel", "load", "load_base_model", "dial", "__version__"]
_LAZY = {"load": "wide.checkpoint", "WideModel": "wide.model", "load_base_model": "wide.hub", "dial": "wide.calibrate"}


def __getattr__(name):  # `import wide` stays light: transformers loads on first use
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(name)


def __dir__():
    return sorted(set(globals()) | set(__all__))
