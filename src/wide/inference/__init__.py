"""WIDE inference: the routed forward pass from the kernels, a static KV cache, CUDA-graph decode and
streaming generation, greedy or sampled (issue 5; paper §3.3, §4.4, Appendix B).

::

    import wide
    from wide.inference import Engine, generate
    engine = Engine(wide.load("runs/s50"))
    result = generate(engine, tokenizer, ["Hello"], max_new_tokens=32)

Modules: ``engine`` (the forward pass), ``cache`` (static KV cache), ``graphs`` (CUDA-graph decode per
batch-size bucket), ``generation`` (streaming generation), ``sampling`` (greedy / temperature / top-k / top-p),
``cli`` (``wide generate``).
Imports are lazy so that ``wide --help`` does not load torch.
"""

_EXPORTS = {
    "Engine": "engine", "batch_reorder_view": "engine", "StaticKVCache": "cache",
    "generate": "generation", "GenerationResult": "generation", "DecodeRunner": "graphs", "Sampling": "sampling",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(name)
