"""wide: token-level dynamic width pruning (WIDE) for Llama-family LLMs.

Quick use::

    import wide
    model = wide.load("runs/smollm2-s50")        # WideModel with argmax routing
    out = model(input_ids)                        # Hugging Face CausalLMOutput
"""

from wide.config import ModelDims, WideConfig
from wide.errors import WideError

__version__ = "0.1.0"
__all__ = ["WideConfig", "ModelDims", "WideError", "WideModel", "load", "load_base_model", "__version__"]


def __getattr__(name):  # lazy: keep `import wide` light (no transformers import until needed)
    if name == "load":
        from wide.checkpoint import load
        return load
    if name == "WideModel":
        from wide.model import WideModel
        return WideModel
    if name == "load_base_model":
        from wide.model import load_base_model
        return load_base_model
    raise AttributeError(name)


def __dir__():
    return sorted(set(globals()) | set(__all__))
