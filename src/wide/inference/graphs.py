"""CUDA-graph capture of decode steps, one graph per batch-size bucket (paper §4.4 measures under CUDA graphs).

A decode step of :class:`~wide.inference.engine.Engine` does no host synchronisation: routing, the kernels'
path choices, the KV-cache writes (device-side slots) and the length update all stay on the GPU, so the whole
step, including the greedy ``argmax`` that feeds the next step, is captured once and replayed.  A batch of
``B`` prompts runs in the smallest bucket ``>= B`` (rows past ``B`` are idle sequences of length 0, excluded
from the sparsity statistics).
"""

from __future__ import annotations

import torch

from wide.errors import WideError
from wide.inference.cache import StaticKVCache

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


def bucket_for(batch: int) -> int:
    """Smallest bucket in :data:`BUCKETS` holding ``batch`` rows (``batch`` itself above the largest).

    Raises:
        WideError: ``batch < 1``.
    """
    if batch < 1:
        raise WideError(f"batch size {batch} must be >= 1")
    for b in BUCKETS:
        if b >= batch:
            return b
    return batch


def capture(fn, warmup: int = 2) -> torch.cuda.CUDAGraph:
    """Run ``fn`` ``warmup`` times on a side stream (compiles and autotunes the kernels outside capture),
    then capture one call into a CUDA graph and return it (not yet replayed).

    ``fn`` must only read and write tensors that stay alive while the graph is used; its side effects run
    ``warmup`` times here.

    Raises:
        WideError: no CUDA device.
    """
    if not torch.cuda.is_available():
        raise WideError("CUDA graphs need a CUDA GPU; none is available on this machine")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


class DecodeRunner:
    """Greedy decode steps over a static cache of one bucket, replayed from a CUDA graph when ``graph=True``.

    Args:
        engine: the :class:`~wide.inference.engine.Engine`.
        cache: its :class:`StaticKVCache` (``cache.batch`` = the bucket).
        graph: capture the step in a CUDA graph (needs the engine on CUDA); False runs it eagerly.

    Attributes:
        tokens: int64 ``[bucket]``: the tokens fed to the next step; after :meth:`step` it holds the greedy
            next tokens (``argmax`` of :attr:`logits`).
        valid: bool ``[bucket]``: rows counted in the sparsity statistics.
        logits: ``[bucket, V]`` of the last step.

    Raises:
        WideError: ``graph=True`` on a machine without CUDA, or an engine not on CUDA.
    """

    def __init__(self, engine, cache: StaticKVCache, graph: bool) -> None:
        self.engine, self.cache = engine, cache
        B = cache.batch
        self.tokens = torch.zeros(B, dtype=torch.int64, device=cache.device)
        self.valid = torch.ones(B, dtype=torch.bool, device=cache.device)
        self.logits = None
        self.graph = None
        if graph:
            if not torch.cuda.is_available():
                raise WideError("CUDA-graph decode needs a CUDA GPU; none is available on this machine")
            if cache.device.type != "cuda":
                raise WideError(f"CUDA-graph decode needs the model on a CUDA device, it is on {cache.device}")
            saved = cache.lengths.clone()
            self.graph = capture(self._step)
            cache.lengths.copy_(saved)  # warm-up runs advanced the lengths; stale slots are never visible

    def _step(self) -> None:
        self.logits = self.engine.decode(self.tokens, self.cache, valid=self.valid)
        self.tokens.copy_(self.logits.argmax(-1))

    def step(self) -> torch.Tensor:
        """Feed :attr:`tokens`, advance every row by one position; returns the next tokens (device, no sync)."""
        if self.graph is not None:
            self.graph.replay()
        else:
            self._step()
        return self.tokens


def runner_for(engine, batch: int, max_len: int, graph: bool) -> DecodeRunner:
    """The cached :class:`DecodeRunner` of ``engine`` for ``bucket_for(batch)`` rows and ``max_len`` tokens
    (captured on first use, reused by later calls with the same bucket and capacity)."""
    cache_key = (bucket_for(batch), int(max_len), bool(graph))
    runners = engine.__dict__.setdefault("_runners", {})
    r = runners.get(cache_key)
    if r is None:
        if graph:
            runners.clear()  # one captured cache at a time (they can be large)
        cache = engine.new_cache(cache_key[0], max_len)
        r = runners[cache_key] = DecodeRunner(engine, cache, graph)
    return r
