"""WIDE inference (paper §3.3, §4.4, Appendix B): ``engine`` (the routed forward pass), ``cache`` (the static KV
cache), ``graphs`` (CUDA-graph decode), ``generation`` (streaming generation), ``sampling``.

    from wide.inference import Engine, generate
    result = generate(Engine(wide.load("runs/s50")), tokenizer, ["Hello"], max_new_tokens=32)

Imports are lazy, so that ``wide --help`` does not load torch.
"""

_EXPORTS = {"Engine": "engine", "batch_reorder_view": "engine", "StaticKVCache": "cache", "generate": "generation",
            "GenerationResult": "generation", "DecodeRunner": "graphs", "Sampling": "sampling"}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(name)
