"""``wide generate``: stream tokens (greedy, or sampled with ``--temperature`` / ``--top-k`` / ``--top-p``) from a
dense model or a WIDE checkpoint through the inference engine, then print TTFT, TPOT, tokens/s and the realized
sparsity.  This module imports no torch at import time."""

from __future__ import annotations

import argparse
import os
import sys

from wide.errors import WideError


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Options of ``wide generate``."""
    p.add_argument("--model", default=None,
                   help="base model: local HF dir, .gguf, or 'smollm2-135m' (default: the checkpoint's base, "
                        "else the bundled SmolLM2-135M)")
    p.add_argument("--wide", default=None, help="WIDE checkpoint directory (routers); omit for the dense model (s = 0)")
    p.add_argument("--prompt", action="append", required=True,
                   help="prompt text; repeat for a batch (left-padded prefill, batched decode)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate per prompt (>= 1; default: 64)")
    p.add_argument("--max-cache-len", type=int, default=None,
                   help="KV-cache capacity per sequence in tokens (default: longest prompt + --max-new-tokens)")
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda if available)")
    p.add_argument("--dense-ops", action="store_true",
                   help="run cuBLAS/SDPA dense ops instead of the routed kernels (routers ignored)")
    p.add_argument("--no-graphs", action="store_true", help="decode eagerly instead of replaying CUDA graphs")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the tokenizer's chat template")
    p.add_argument("--no-stream", action="store_true", help="print the texts at the end only")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sample with this softmax temperature (> 0); 0 = greedy (default: 0)")
    p.add_argument("--top-k", type=int, default=0,
                   help="with --temperature: sample among the k most likely tokens (default: 0 = all)")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="with --temperature: sample among the most likely tokens whose probability sums to p "
                        "(nucleus, 0 < p <= 1; default: 1 = all)")
    p.add_argument("--seed", type=int, default=None,
                   help="with --temperature: seed of the sampling, for reproducible tokens (default: random)")
    return p


def sampling_from(args):
    """The :class:`~wide.inference.sampling.Sampling` of ``--temperature`` / ``--top-k`` / ``--top-p`` / ``--seed``.

    Raises:
        WideError: a value out of range (as :class:`~wide.inference.sampling.Sampling`), or ``--top-k``,
            ``--top-p`` or ``--seed`` given at temperature 0, where generation is greedy and they would do nothing.
    """
    from wide.inference.sampling import Sampling

    sampling = Sampling(args.temperature, args.top_k, args.top_p, args.seed)
    if args.temperature == 0:
        unused = [f for f, on in (("--top-k", args.top_k != 0), ("--top-p", args.top_p != 1.0),
                                  ("--seed", args.seed is not None)) if on]
        if unused:
            raise WideError(f"{', '.join(unused)} only appl{'y' if len(unused) > 1 else 'ies'} when sampling: add "
                            f"--temperature T > 0 (e.g. 0.7); at temperature 0, the default, generation is greedy")
    return sampling


def check_sizes(args, hf_config=None, longest: int | None = None) -> None:
    """Refuse ``--max-new-tokens`` / ``--max-cache-len`` values that cannot work, with what is known so far.

    :func:`run` calls it before anything loads (the sizes against each other: every prompt has at least one
    token), then as soon as the base model's config is read (against its context ``max_position_embeddings``
    and its sliding attention window) and the prompts are tokenized (the longest prompt's token count): before
    the weights load, except that with ``--wide`` the tokenizer, and for a GGUF base also the config, only come
    with the loaded checkpoint.

    Args:
        args: the parsed ``wide generate`` options.
        hf_config: the base model's Hugging Face config, or None (not read yet).
        longest: tokens of the longest (chat-wrapped) prompt, or None (not tokenized yet: at least 1).

    Raises:
        WideError: ``--max-new-tokens`` below 1, ``--max-cache-len`` below 1 or too small for the prompt and the
            new tokens, or a KV cache (``--max-cache-len``, default prompt + ``--max-new-tokens``) longer than the
            model's context or sliding window.
    """
    from wide.inference.engine import _tokens

    n, cap = args.max_new_tokens, args.max_cache_len
    if n < 1:
        raise WideError(f"--max-new-tokens {n} must be >= 1")
    if cap is not None and cap < 1:
        raise WideError(f"--max-cache-len {cap} must be >= 1")
    lo = longest if longest is not None else 1
    prompt = f"prompt of {_tokens(longest)}" if longest is not None else "a prompt of at least 1 token"
    if cap is not None:
        if lo > cap:
            raise WideError(f"{prompt} is longer than the KV cache (--max-cache-len {cap})")
        if lo + n > cap:
            need_cap = (f">= {lo + n}" if longest is not None else
                        f">= {n} + the prompt's tokens (known once the tokenizer has read it)")
            raise WideError(f"{prompt} + --max-new-tokens {n} does not fit the KV cache (--max-cache-len {cap}); "
                            f"use --max-cache-len {need_cap} or fewer new tokens")
    if hf_config is None:
        return
    from wide.inference.engine import sliding_window

    need = cap if cap is not None else lo + n
    what = f"--max-cache-len {cap}" if cap is not None else f"{prompt} + --max-new-tokens {n}"
    ctx = getattr(hf_config, "max_position_embeddings", None)
    if ctx is not None and need > ctx:
        raise WideError(f"a KV cache of {need} tokens ({what}) exceeds the model's context of {ctx} tokens "
                        f"(max_position_embeddings)")
    win = sliding_window(hf_config)
    if win is not None and need > win:
        raise WideError(f"a KV cache of {need} tokens ({what}) exceeds the model's sliding attention window "
                        f"({win}); sliding-window attention is not supported by the inference engine")


def _chat_prompts(args, tok) -> list[str]:
    """The ``--prompt`` texts, wrapped in the tokenizer's chat template with ``--chat``."""
    prompts = list(args.prompt)
    if args.chat:
        if getattr(tok, "chat_template", None) is None:
            raise WideError("--chat: this tokenizer has no chat template")
        prompts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                           add_generation_prompt=True) for p in prompts]
    return prompts


def _longest(tok, prompts) -> int:
    """Tokens of the longest prompt, counted as :func:`wide.inference.generation.encode_prompts` does."""
    return max(len(tok(p, add_special_tokens=True)["input_ids"]) for p in prompts)


def _cpu_notice(engine, args) -> str:
    """The one stderr line of a run off CUDA: which path the engine takes on the CPU, and why."""
    import torch

    from wide.kernels._common import HAS_TRITON

    why = "no CUDA device" if not torch.cuda.is_available() else f"--device {args.device}"
    if engine.ops == "dense":
        how = ("runs dense PyTorch ops on the CPU, its few Triton kernels (fused norm / RoPE, decode attention, "
               "Q/K/V GEMV) in the Triton interpreter (TRITON_INTERPRET=1)"
               if engine.uses_kernels else "runs dense PyTorch ops on the CPU")
    elif engine.uses_kernels:
        how = "runs the routed Triton kernels in the Triton interpreter on the CPU (TRITON_INTERPRET=1)"
    else:
        how = "falls back to the reference path on the CPU (the PyTorch reference of every kernel)"
        if os.environ.get("TRITON_INTERPRET") == "1" and not HAS_TRITON:
            how += " (TRITON_INTERPRET=1, but Triton is not installed: pip install -e '.[kernels]')"
    return f"wide generate: {why}: the engine {how}; no CUDA graphs, slow"


def run(args) -> int:
    """Run ``wide generate`` (see :func:`add_arguments`).

    Bad sizes are refused as early as the information allows: before anything loads, then right after the base
    model's config and tokenizer are read (before its weights; with ``--wide``, before the checkpoint loads when
    its base model is a Hugging Face directory, else after loading), see :func:`check_sizes`.

    Raises:
        WideError: empty prompt, prompt longer than the cache, a cache longer than the model's context, a
            checkpoint made for another base model, bad sizes, bad sampling options (:func:`sampling_from`),
            ``--chat`` without a chat template.  (A bad
            ``--device`` is refused earlier, by :func:`wide.cli.main`'s :func:`wide.cli.check_device`.)
    """
    from wide.inference.engine import Engine
    from wide.inference.generation import generate, stream_delta
    from wide.model import load_base_model

    check_sizes(args)
    sampling = sampling_from(args)
    if any(p.strip() == "" for p in args.prompt):
        raise WideError("empty prompt: every --prompt needs some text")
    dev = args.device  # already checked by wide.cli.main (check_device), before any command runs
    early: dict = {}

    def check(hf_config, tok):  # run by load_base_model before any weight is read
        early["prompts"] = _chat_prompts(args, tok)
        check_sizes(args, hf_config, _longest(tok, early["prompts"]))

    if args.wide:
        from wide.checkpoint import load

        model, tok = load(args.wide, model=args.model, device=dev, tokenizer=True, merge_lora=True, check=check)
    else:
        model, tok, _ = load_base_model(args.model, device=dev, check=check)
    prompts = early["prompts"]  # set by check(), which both loaders run before reading any weight
    engine = Engine(model, ops="dense" if args.dense_ops else "routed")
    if engine.device.type != "cuda":
        print(_cpu_notice(engine, args), file=sys.stderr)
    stream = len(prompts) == 1 and not args.no_stream
    shown = [""]

    def on_token(row, tok_id, text):
        if stream and row == 0:
            delta, shown[0] = stream_delta(shown[0], text)
            if delta:
                sys.stdout.write(delta)
                sys.stdout.flush()

    graphs = None if not args.no_graphs else False
    try:
        res = generate(engine, tok, prompts, args.max_new_tokens, max_len=args.max_cache_len, graphs=graphs,
                       on_token=on_token, sampling=sampling)
    except KeyboardInterrupt:
        if stream and shown[0]:
            print(flush=True)  # end the streamed line: "wide generate: interrupted" goes on a line of its own
        raise
    if stream:
        print()
    else:
        for i, t in enumerate(res.texts):
            print(f"[{i}] {t}")
    sp = res.sparsity
    sp_txt = (f"attn {sp['attn']:.3f}, ffn {sp['ffn']:.3f}, overall {sp['overall']:.3f}" if len(sp) == 3 else
              ", ".join(f"{k} {v:.3f}" for k, v in sp.items()) or "0 (dense)")
    n = sum(len(t) for t in res.tokens)
    tpot = f"{res.tpot_s * 1e3:.1f} ms" if max(len(t) for t in res.tokens) > 1 else "n/a (no decode step)"
    print(f"TTFT {res.ttft_s * 1e3:.1f} ms | TPOT {tpot} | {res.tokens_per_s:.1f} tokens/s "
          f"({n} token{'' if n == 1 else 's'}, batch {len(prompts)}) | realized sparsity: {sp_txt} | path: {res.path}")
    return 0


def register(sub) -> None:
    """Add ``generate`` to the ``wide`` subcommands (``sub`` from ``ArgumentParser.add_subparsers``)."""
    s = sub.add_parser("generate", help="stream tokens (greedy or sampled) through the WIDE inference engine "
                                        "(TTFT, TPOT, tokens/s, realized sparsity)")
    add_arguments(s)
    s.set_defaults(func=run)
