"""Streaming generation with the inference engine (greedy, or sampled with temperature / top-k / top-p):
batched left-padded prefill, then decode steps (under CUDA graphs on a GPU), with TTFT, TPOT, tokens/s and
realized sparsity."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from wide.errors import WideError
from wide.inference.engine import Engine, _tokens
from wide.inference.graphs import runner_for
from wide.inference.sampling import Sampling, next_tokens


@dataclass
class GenerationResult:
    """Outcome of :func:`generate`.

    Attributes:
        tokens: generated token ids per prompt (up to and including EOS when it was produced).
        texts: their decoded text (when a tokenizer was given, else empty strings).
        ttft_s: time to first token, seconds: prefill of the batch + first token on the host.
        tpot_s: time per output token, seconds: mean wall time of one batched decode step (0 if none).
        tokens_per_s: generated tokens of all prompts / (TTFT + decode time).
        sparsity: realized skipped fractions over valid tokens, ``{"attn", "ffn", "overall"}`` (empty when
            nothing is routed).
        path: what ran, see :func:`path_of`: ``"kernels+cuda-graphs"``, ``"kernels"`` (Triton, eager) or
            ``"reference"`` (PyTorch fallback of every kernel) for the routed engine;
            ``"dense+kernels+cuda-graphs"``, ``"dense+kernels"`` or ``"dense"`` for ``ops="dense"``.
    """

    tokens: list = field(default_factory=list)
    texts: list = field(default_factory=list)
    ttft_s: float = 0.0
    tpot_s: float = 0.0
    tokens_per_s: float = 0.0
    sparsity: dict = field(default_factory=dict)
    path: str = "reference"
    steps: int = 0


def path_of(engine, graphs: bool) -> str:
    """The execution path of ``engine`` as :attr:`GenerationResult.path` names it.

    Routed engine (``ops="routed"``): ``"kernels"`` when the project's Triton kernels run (CUDA, or the CPU under
    ``TRITON_INTERPRET=1``), else ``"reference"`` (each kernel's PyTorch reference).  Dense engine
    (``ops="dense"``): ``"dense"`` (cuBLAS / PyTorch linears and SDPA; with Triton also the decode attention, the
    one-launch Q/K/V GEMV and the fused norm / RoPE kernels, then ``"dense+kernels"``).  ``"+cuda-graphs"`` is
    appended when the decode steps replay a CUDA graph.
    """
    if engine.ops == "dense":
        path = "dense+kernels" if engine.uses_kernels else "dense"
    else:
        path = "kernels" if engine.uses_kernels else "reference"
    return path + ("+cuda-graphs" if graphs else "")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def encode_prompts(prompts, tokenizer, device: torch.device) -> list[torch.Tensor]:
    """Prompts (strings, or int token tensors / lists) as 1-D int64 tensors (text and lists on ``device``,
    tensors on their own device).

    Raises:
        WideError: no prompt, an empty prompt, strings without a tokenizer or that it cannot encode, token tensors
            on mixed devices, a token tensor that is not integer or not one row (a padded ``[B, T]`` batch: pass one
            1-D tensor per prompt), a token id beyond int64, or prompts that are not a string, a token tensor, a list
            of token ids, or a list / tuple of these.
    """
    if isinstance(prompts, (str, torch.Tensor)):
        prompts = [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise WideError(f"prompts must be a string, a token tensor, or a list of them; got {type(prompts).__name__}")
    prompts = list(prompts)
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
            if p.strip() == "":
                raise WideError(f"empty prompt (prompt {i} is {'empty' if not p else 'only whitespace'})")
            try:
                ids = tokenizer(p, add_special_tokens=True)["input_ids"]
            except (TypeError, ValueError, UnicodeError) as e:
                raise WideError(f"prompt {i} cannot be tokenized ({' '.join(str(e).split())[:200]})") from None
            t = torch.tensor(ids, dtype=torch.int64)
        elif isinstance(p, torch.Tensor):
            if p.is_floating_point() or p.is_complex() or p.dtype == torch.bool:
                raise WideError(f"prompt {i} is a {str(p.dtype).replace('torch.', '')} tensor; token ids are integers")
            if p.dim() != 1 and not (p.dim() == 2 and p.shape[0] == 1):
                raise WideError(f"prompt {i} is a tensor of shape {tuple(p.shape)}: a prompt is one 1-D token tensor "
                                "(or [1, T]); for a batch pass a list of them (a padded [B, T] tensor would make its "
                                "padding part of the prompts)")
            t = p.reshape(-1).to(torch.int64)  # stays on its own device (checked by the caller)
            if t.numel() == 0:
                raise WideError(f"empty prompt (prompt {i} has no tokens)")
            out.append(t)
            continue
        elif isinstance(p, (list, tuple)) and all(isinstance(x, int) and not isinstance(x, bool) for x in p):
            try:
                t = torch.tensor(list(p), dtype=torch.int64)
            except (OverflowError, RuntimeError, ValueError):
                raise WideError(f"prompt {i} holds a token id beyond int64; token ids lie in [0, vocab size)") from None
        else:
            raise WideError(f"prompt {i} is a {type(p).__name__}: a prompt is a string, a 1-D token tensor or a list "
                            "of int token ids")
        if t.numel() == 0:
            raise WideError(f"empty prompt (prompt {i} has no tokens)")
        out.append(t.to(device))
    return out


def eos_ids(model, tokenizer=None) -> set[int]:
    """The token ids that end a row: the union of the tokenizer's EOS and the model's ``config`` /
    ``generation_config`` ``eos_token_id`` (an int or a list; a chat model's end-of-turn token is often only
    in the latter, e.g. SmolLM2-Instruct's ``<|im_end|>`` while its GGUF tokenizer's EOS is ``<|im_start|>``)."""
    ids: set[int] = set()
    for src in (tokenizer, getattr(model, "config", None), getattr(model, "generation_config", None)):
        e = getattr(src, "eos_token_id", None) if src is not None else None
        for x in (e if isinstance(e, (list, tuple)) else [e]):
            if isinstance(x, int) and not isinstance(x, bool):
                ids.add(x)
    return ids


def stream_delta(shown: str, text: str) -> tuple[str, str]:
    """For streaming ``text`` (the decoded tokens so far) after ``shown`` was printed: ``(new text to print, the
    new shown)``.  A multi-byte character split over tokens decodes to U+FFFD until its last token arrives, so
    trailing U+FFFD are held back, and the completed character is printed once it is there."""
    stable = text.rstrip("\ufffd")
    if len(stable) <= len(shown):
        return "", shown
    return stable[len(shown):], stable


def left_pad(seqs: list[torch.Tensor], pad_id: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Stack 1-D token tensors into ``[B, T]`` with left padding; the mask is None when no row is padded."""
    T = max(int(s.numel()) for s in seqs)
    ids = torch.full((len(seqs), T), pad_id, dtype=torch.int64, device=seqs[0].device)
    mask = torch.zeros((len(seqs), T), dtype=torch.int64, device=seqs[0].device)
    for b, s in enumerate(seqs):
        ids[b, T - s.numel():] = s
        mask[b, T - s.numel():] = 1
    return ids, (None if bool(mask.all()) else mask)


@torch.no_grad()
def generate(engine, tokenizer, prompts, max_new_tokens: int = 32, *, max_len: int | None = None,
             graphs: bool | None = None, stop_at_eos: bool = True, on_token=None,
             sampling: Sampling | None = None) -> GenerationResult:
    """Generation for a batch of prompts (left-padded prefill, then batched decode steps), greedy by default.

    Args:
        engine: an :class:`~wide.inference.engine.Engine`.
        tokenizer: a Hugging Face tokenizer (needed for text prompts and for ``texts``), or None.
        prompts: a string, a list of strings, or token tensors/lists (all on one device).
        max_new_tokens: tokens to generate per prompt, ``>= 1``.
        max_len: KV-cache capacity per sequence in tokens (default: longest prompt + ``max_new_tokens``).
        graphs: replay decode steps from a CUDA graph (default: when the engine runs on CUDA).
        stop_at_eos: stop a row at the tokenizer's / model's EOS; the loop ends when every row stopped.
        on_token: optional ``callback(row, token_id, text_so_far)`` called as tokens arrive (streaming).
        sampling: a :class:`~wide.inference.sampling.Sampling` (temperature, top-k, top-p, seed); default greedy.
            Greedy decode steps take the ``argmax`` inside the CUDA graph; a sampled step replays the graph and
            then draws from its logits with device ops (a few small launches per step, no host sync). With a
            ``seed`` the tokens are reproducible on one device.

    Returns:
        :class:`GenerationResult`.

    Raises:
        WideError: empty prompt, mixed devices, ``max_new_tokens`` not an int >= 1, ``sampling`` not a
            :class:`~wide.inference.sampling.Sampling` or None, a cache longer than the model's
            context (``max_position_embeddings``), a prompt (+ new tokens) longer than
            the cache, or ``graphs=True`` without a GPU.
    """
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
    if graphs and (not torch.cuda.is_available() or dev.type != "cuda"):
        raise WideError("CUDA-graph decode needs a CUDA GPU and the model on it; this run is on "
                        f"{dev} (CUDA available: {torch.cuda.is_available()})")
    seqs = encode_prompts(prompts, tokenizer, dev)
    if seqs[0].device != dev:
        raise WideError(f"prompt tokens are on {seqs[0].device}, the model is on {dev}")
    longest = max(int(s.numel()) for s in seqs)
    need = longest + max_new_tokens
    if max_len is None:
        max_len = need
    if longest > max_len:
        raise WideError(f"prompt of {_tokens(longest)} is longer than the KV cache ({_tokens(max_len)})")
    if need > max_len:
        raise WideError(f"prompt of {_tokens(longest)} + {max_new_tokens} new does not fit the KV cache "
                        f"({_tokens(max_len)})")
    ctx = getattr(engine.base.config, "max_position_embeddings", None)
    if ctx is not None and max_len > ctx:
        raise WideError(f"a KV cache of {max_len} tokens (prompt of {longest} + {max_new_tokens} new, or "
                        f"--max-cache-len) exceeds the model's context of {ctx} tokens (max_position_embeddings)")
    graphs = (dev.type == "cuda") if graphs is None else graphs
    pad_id = 0
    if tokenizer is not None:
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    eos_set = eos_ids(engine.base, tokenizer)
    ids, mask = left_pad(seqs, pad_id)
    B = ids.shape[0]

    runner = runner_for(engine, B, max_len, graphs)
    cache = runner.cache
    runner.valid.zero_()
    runner.valid[:B] = True
    engine.reset_stats()
    res = GenerationResult(path=path_of(engine, runner.graph is not None))
    res.tokens = [[] for _ in range(B)]
    done = [False] * B

    def emit(tok_host):
        for b in range(B):
            if done[b]:
                continue
            t = int(tok_host[b])
            res.tokens[b].append(t)
            if on_token is not None:
                on_token(b, t, tokenizer.decode(res.tokens[b], skip_special_tokens=True) if tokenizer else "")
            if stop_at_eos and t in eos_set:
                done[b] = True

    _sync(dev)
    t0 = time.perf_counter()
    sampling = sampling if sampling is not None else Sampling()
    gen = sampling.generator(dev)
    logits = engine.prefill(ids, mask, cache)
    first = next_tokens(logits, sampling, gen)
    runner.tokens[:B] = first
    emit(first.tolist())  # host sync: the first token is out
    t1 = time.perf_counter()
    res.ttft_s = t1 - t0
    steps = 0
    while steps < max_new_tokens - 1 and not all(done):
        nxt = runner.step()  # greedy tokens of the step (argmax in the graph)
        if not sampling.greedy:
            nxt = runner.tokens.copy_(next_tokens(runner.logits, sampling, gen))
        emit(nxt[:B].tolist())
        steps += 1
    t2 = time.perf_counter()
    res.steps = steps
    res.tpot_s = (t2 - t1) / steps if steps else 0.0
    n_tok = sum(len(t) for t in res.tokens)
    res.tokens_per_s = n_tok / max(t2 - t0, 1e-9)
    res.sparsity = engine.realized_sparsity() if engine.ops == "routed" and (
        engine.attn_routers is not None or engine.ffn_routers is not None) else {}
    res.texts = [tokenizer.decode(t, skip_special_tokens=True) if tokenizer else "" for t in res.tokens]
    return res
