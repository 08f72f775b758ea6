"""WIDE inference (paper §3.3, §4.4, Appendix B): ``engine`` (the routed forward pass), ``cache`` (the static KV
cache), ``graphs`` (CUDA-graph decode), ``generation`` (streaming generation) and ``sampling``.

    from wide.inference import Engine, generate
    result = generate(Engine(wide.load("runs/s50")), tokenizer, ["Hello"], max_new_tokens=32)
"""

from wide.inference.cache import StaticKVCache
from wide.inference.engine import Engine, batch_reorder_view
from wide.inference.generation import GenerationResult, generate
from wide.inference.graphs import DecodeRunner
from wide.inference.sampling import Sampling

__all__ = ["DecodeRunner", "Engine", "GenerationResult", "Sampling", "StaticKVCache", "batch_reorder_view", "generate"]
