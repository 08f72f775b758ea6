"""Streaming generation: a left-padded batched prefill, then batched decode steps (CUDA graphs on a GPU), greedy or
sampled, with TTFT, TPOT, tokens/s and the realized sparsity."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from wide.errors import WideError
from wide.inference.engine import Engine, tokens_str
from wide.inference.graphs import runner_for
from wide.inference.sampling import Sampling, next_tokens


@dataclass
class GenerationResult:
    """``tokens`` / ``texts`` per prompt (up to and including EOS); ``ttft_s`` (prefill + first token on the host);
    ``tpot_s`` (mean time of a batched decode step); ``tokens_per_s``; ``sparsity`` (realized skipped fractions,
    empty when nothing is routed); ``path`` (:func:`path_of`); ``steps`` (decode steps run)."""

    tokens: list = field(default_factory=list)
    texts: list = field(default_factory=list)
    ttft_s: float = 0.0
    tpot_s: float = 0.0
    tokens_per_s: float = 0.0
    sparsity: dict = field(default_factory=dict)
    path: str = "reference"
    steps: int = 0


def path_of(engine, graphs: bool) -> str:
    """What runs: ``"kernels"`` (Triton) or ``"reference"`` (each kernel's PyTorch reference) for the routed engine,
    ``"dense+kernels"`` or ``"dense"`` for ``ops="dense"``; ``"+cuda-graphs"`` when decode replays a CUDA graph."""
    path = ("dense+kernels" if engine.fast else "dense") if engine.ops == "dense" else (
        "kernels" if engine.fast else "reference")
    return path + ("+cuda-graphs" if graphs else "")


def encode_prompts(prompts, tokenizer, device: torch.device) -> list[torch.Tensor]:
    """Prompts (strings, 1-D token tensors or lists of token ids) as 1-D int64 tensors (text and lists on ``device``).
    Raises WideError for no prompt, an empty one, text that cannot be encoded, tensors on mixed devices or that are
    not one row of integers, an id beyond int64, or another kind of prompt."""
    if isinstance(prompts, (str, torch.Tensor)):
        prompts = [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise WideError(f"prompts must be a string, a token tensor, or a list of them; got {type(prompts).__name__}")
    if not prompts:
        raise WideError("no prompt given")
    devs = {p.device for p in prompts if isinstance(p, torch.Tensor)}
    if len(devs) > 1:
        raise WideError(f"the prompts' token tensors are on mixed devices {sorted(map(str, devs))}; put them on one")
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            if tokenizer is None:
                raise WideError("text prompts need a tokenizer")
            if not p.strip():
                raise WideError(f"empty prompt (prompt {i} is {'empty' if not p else 'only whitespace'})")
            try:
                t = torch.tensor(tokenizer(p, add_special_tokens=True)["input_ids"], dtype=torch.int64, device=device)
            except (TypeError, ValueError, UnicodeError) as e:
                raise WideError(f"prompt {i} cannot be tokenized ({' '.join(str(e).split())[:200]})") from None
        elif isinstance(p, torch.Tensor):
            if p.is_floating_point() or p.is_complex() or p.dtype == torch.bool:
                raise WideError(f"prompt {i} is a {str(p.dtype).replace('torch.', '')} tensor; token ids are integers")
            if p.dim() != 1 and not (p.dim() == 2 and p.shape[0] == 1):
                raise WideError(f"prompt {i} is a tensor of shape {tuple(p.shape)}: a prompt is one 1-D token tensor "
                                "(or [1, T]); for a batch pass a list of them")
            t = p.reshape(-1).to(torch.int64)
        elif isinstance(p, (list, tuple)) and all(isinstance(x, int) and not isinstance(x, bool) for x in p):
            try:
                t = torch.tensor(list(p), dtype=torch.int64, device=device)
            except (OverflowError, RuntimeError, ValueError):
                raise WideError(f"prompt {i} holds a token id beyond int64; token ids lie in [0, vocab size)") from None
        else:
            raise WideError(f"prompt {i} is a {type(p).__name__}: a prompt is a string, a 1-D token tensor or a list "
                            "of int token ids")
        if t.numel() == 0:
            raise WideError(f"empty prompt (prompt {i} has no tokens)")
        out.append(t)
    return out


def eos_ids(model, tokenizer=None) -> set[int]:
    """The ids that end a row: the tokenizer's EOS and the model's ``config`` / ``generation_config``
    ``eos_token_id`` (an int or a list; a chat model's end-of-turn token is often only in the latter)."""
    ids: set[int] = set()
    for src in (tokenizer, getattr(model, "config", None), getattr(model, "generation_config", None)):
        e = getattr(src, "eos_token_id", None)
        ids.update(x for x in (e if isinstance(e, (list, tuple)) else [e]) if isinstance(x, int)
                   and not isinstance(x, bool))
    return ids


def stream_delta(shown: str, text: str) -> tuple[str, str]:
    """``(text to print, new shown)`` streaming ``text`` after ``shown``, holding back a split character (U+FFFD)."""
    stable = text.rstrip("\ufffd")
    return ("", shown) if len(stable) <= len(shown) else (stable[len(shown):], stable)


def left_pad(seqs: list[torch.Tensor], pad_id: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """1-D token tensors stacked into ``[B, T]`` with left padding, and the mask (None when no row is padded)."""
    T = max(s.numel() for s in seqs)
    ids = torch.full((len(seqs), T), pad_id, dtype=torch.int64, device=seqs[0].device)
    mask = torch.zeros_like(ids)
    for b, s in enumerate(seqs):
        ids[b, T - s.numel():] = s
        mask[b, T - s.numel():] = 1
    return ids, (None if all(s.numel() == T for s in seqs) else mask)


@torch.no_grad()
def generate(engine: Engine, tokenizer, prompts, max_new_tokens: int = 32, *, max_len: int | None = None,
             graphs: bool | None = None, stop_at_eos: bool = True, on_token=None,
             sampling: Sampling | None = None) -> GenerationResult:
    """Up to ``max_new_tokens`` tokens for each of ``prompts`` (:func:`encode_prompts`) through ``engine``, greedy
    unless ``sampling`` (seeded: reproducible on one device).  ``max_len``: cache tokens per row (default: longest
    prompt + new tokens); ``graphs``: decode from a CUDA graph (default: on CUDA); ``stop_at_eos``: a row stops at an
    id of :func:`eos_ids`; ``on_token(row, token_id, text_so_far)`` streams.  Raises WideError for a bad argument or
    prompt, prompts on another device, a cache too small or beyond the model's context, or graphs without CUDA."""
    if not isinstance(engine, Engine):
        raise WideError(f"engine must be a wide.inference.Engine (e.g. Engine(wide.load(ckpt))), got "
                        f"{type(engine).__name__}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise WideError(f"max_new_tokens={max_new_tokens!r} must be an int >= 1")
    if max_len is not None and (isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 1):
        raise WideError(f"max_len={max_len!r} must be an int >= 1 (tokens per sequence) or None")
    if on_token is not None and not callable(on_token):
        raise WideError(f"on_token={on_token!r} must be callable as on_token(row, token_id, text) or None")
    if sampling is not None and not isinstance(sampling, Sampling):
        raise WideError(f"sampling={sampling!r} must be a wide.inference.Sampling (e.g. Sampling(temperature=0.7)) "
                        "or None for greedy")
    dev = engine.device
    if graphs and dev.type != "cuda":
        raise WideError(f"CUDA-graph decode needs a CUDA GPU and the model on it; this run is on {dev} (CUDA "
                        f"available: {torch.cuda.is_available()})")
    seqs = encode_prompts(prompts, tokenizer, dev)
    if seqs[0].device != dev:
        raise WideError(f"prompt tokens are on {seqs[0].device}, the model is on {dev}")
    longest = max(s.numel() for s in seqs)
    max_len = longest + max_new_tokens if max_len is None else max_len
    if longest > max_len:
        raise WideError(f"prompt of {tokens_str(longest)} is longer than the KV cache ({tokens_str(max_len)})")
    if longest + max_new_tokens > max_len:
        raise WideError(f"prompt of {tokens_str(longest)} + {max_new_tokens} new does not fit the KV cache "
                        f"({tokens_str(max_len)})")
    sampling = sampling or Sampling()
    pad_id = 0 if tokenizer is None else (
        tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id or 0)
    eos = eos_ids(engine.base, tokenizer) if stop_at_eos else set()
    ids, mask = left_pad(seqs, pad_id)
    B = ids.shape[0]
    runner = runner_for(engine, B, max_len, dev.type == "cuda" if graphs is None else graphs)
    runner.valid.zero_()
    runner.valid[:B] = True
    engine.reset_stats()
    res = GenerationResult(tokens=[[] for _ in range(B)], path=path_of(engine, runner.graph is not None))
    done = [False] * B

    def emit(toks: list) -> None:
        for b in range(B):
            if not done[b]:
                res.tokens[b].append(toks[b])
                if on_token is not None:
                    on_token(b, toks[b], tokenizer.decode(res.tokens[b], skip_special_tokens=True) if tokenizer else "")
                done[b] = toks[b] in eos

    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    t0 = time.perf_counter()
    gen = sampling.generator(dev)
    runner.tokens[:B] = next_tokens(engine.prefill(ids, mask, runner.cache), sampling, gen)
    emit(runner.tokens[:B].tolist())  # a host sync: the first token is out
    t1 = time.perf_counter()
    while res.steps < max_new_tokens - 1 and not all(done):
        nxt = runner.step()  # the greedy tokens (argmax inside the graph)
        if not sampling.greedy:
            nxt = runner.tokens.copy_(next_tokens(runner.logits, sampling, gen))
        emit(nxt[:B].tolist())
        res.steps += 1
    t2 = time.perf_counter()
    res.ttft_s, res.tpot_s = t1 - t0, (t2 - t1) / res.steps if res.steps else 0.0
    res.tokens_per_s = sum(map(len, res.tokens)) / max(t2 - t0, 1e-9)
    routed = engine.ops == "routed" and any(r is not None for layer in engine.layers
                                            for r in (layer.attn_router, layer.ffn_router))
    res.sparsity = engine.realized_sparsity() if routed else {}
    res.texts = [tokenizer.decode(t, skip_special_tokens=True) if tokenizer else "" for t in res.tokens]
    return res
