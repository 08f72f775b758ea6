"""CUDA-graph decode (§4.4 measures under CUDA graphs): a decode step does no host synchronisation, so the step and
the ``argmax`` feeding the next one are captured once per batch-size bucket and replayed; a batch of ``B`` prompts
runs in the smallest bucket ``>= B``, its idle rows left out of the sparsity statistics."""

from __future__ import annotations

import torch

from wide.inference.cache import StaticKVCache

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


def bucket_for(batch: int) -> int:
    """The smallest bucket holding ``batch`` rows (``batch`` itself above the largest)."""
    return next((b for b in BUCKETS if b >= batch), batch)


class DecodeRunner:
    """Greedy decode steps of ``engine`` over ``cache``, replayed from a CUDA graph when ``graph``: ``tokens`` int64
    ``[B]`` feeds a step and then holds its argmax, ``valid`` marks the rows counted in the statistics, ``logits``
    ``[B, V]`` are the last step's."""

    def __init__(self, engine, cache: StaticKVCache, graph: bool) -> None:
        self.engine, self.cache, self.logits, self.graph = engine, cache, None, None
        self.tokens = torch.zeros(cache.batch, dtype=torch.int64, device=cache.device)
        self.valid = torch.ones(cache.batch, dtype=torch.bool, device=cache.device)
        if graph:
            saved = cache.lengths.clone()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # compile and autotune the kernels outside the capture
                for _ in range(2):
                    self._step()
            torch.cuda.current_stream().wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self._step()
            cache.lengths.copy_(saved)

    def _step(self) -> None:
        self.logits = self.engine.decode(self.tokens, self.cache, valid=self.valid)
        self.tokens.copy_(self.logits.argmax(-1))

    def step(self) -> torch.Tensor:
        """Feed :attr:`tokens` and advance every row by one position; returns the next tokens (no host sync)."""
        if self.graph is not None:
            self.graph.replay()
        else:
            self._step()
        return self.tokens


def runner_for(engine, batch: int, max_len: int, graph: bool) -> DecodeRunner:
    """``engine``'s DecodeRunner of ``bucket_for(batch)`` rows and ``max_len`` tokens, kept (one captured at a time)."""
    key = (bucket_for(batch), max_len, graph)
    runners = engine.__dict__.setdefault("_runners", {})
    if key not in runners:
        if graph:
            runners.clear()
        runners[key] = DecodeRunner(engine, engine.new_cache(key[0], max_len), graph)
    return runners[key]
