"""``wide generate``: stream greedy tokens from a dense model or a WIDE checkpoint through the inference engine,
then print TTFT, TPOT, tokens/s and the realized sparsity.  This module imports no torch at import time."""

from __future__ import annotations

import argparse
import os
import sys

from ..errors import WideError


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
    return p


def run(args) -> int:
    """Run ``wide generate`` (see :func:`add_arguments`).

    Raises:
        WideError: empty prompt, prompt longer than the cache, a checkpoint made for another base model, bad
            sizes.  (A bad ``--device`` is refused earlier, by :func:`wide.cli.main`'s
            :func:`wide.cli.check_device`.)
    """
    from ..modeling import load_base_model
    from .engine import Engine
    from .generation import generate

    if args.max_new_tokens < 1:
        raise WideError(f"--max-new-tokens {args.max_new_tokens} must be >= 1")
    if args.max_cache_len is not None and args.max_cache_len < 1:
        raise WideError(f"--max-cache-len {args.max_cache_len} must be >= 1")
    if any(p.strip() == "" for p in args.prompt):
        raise WideError("empty prompt: every --prompt needs some text")
    dev = args.device  # already checked by wide.cli.main (check_device), before any command runs
    if args.wide:
        from ..checkpoint import load

        model, tok = load(args.wide, model=args.model, device=dev, tokenizer=True, merge_lora=True)
    else:
        model, tok, _ = load_base_model(args.model, device=dev)
    engine = Engine(model, ops="dense" if args.dense_ops else "routed")
    if engine.device.type != "cuda":
        if args.dense_ops:
            path = "dense PyTorch ops"
        else:
            path = "Triton interpreter" if engine.uses_kernels else "PyTorch reference of every kernel"
            from ..kernels._common import HAS_TRITON

            if not engine.uses_kernels and os.environ.get("TRITON_INTERPRET") == "1" and not HAS_TRITON:
                path += " (TRITON_INTERPRET=1, but Triton is not installed: pip install -e '.[kernels]')"
        print(f"wide generate: no CUDA device: running the {path} on {engine.device} (no CUDA graphs; slow)",
              file=sys.stderr)
    prompts = list(args.prompt)
    if args.chat:
        if getattr(tok, "chat_template", None) is None:
            raise WideError("--chat: this tokenizer has no chat template")
        prompts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                           add_generation_prompt=True) for p in prompts]
    stream = len(prompts) == 1 and not args.no_stream
    shown = [""]

    def on_token(row, tok_id, text):
        if stream and row == 0:
            sys.stdout.write(text[len(shown[0]):])
            sys.stdout.flush()
            shown[0] = text

    graphs = None if not args.no_graphs else False
    res = generate(engine, tok, prompts, args.max_new_tokens, max_len=args.max_cache_len, graphs=graphs,
                   on_token=on_token)
    if stream:
        print()
    else:
        for i, t in enumerate(res.texts):
            print(f"[{i}] {t}")
    sp = res.sparsity
    sp_txt = (f"attn {sp['attn']:.3f}, ffn {sp['ffn']:.3f}, overall {sp['overall']:.3f}" if len(sp) == 3 else
              ", ".join(f"{k} {v:.3f}" for k, v in sp.items()) or "0 (dense)")
    n = sum(len(t) for t in res.tokens)
    print(f"TTFT {res.ttft_s * 1e3:.1f} ms | TPOT {res.tpot_s * 1e3:.1f} ms | {res.tokens_per_s:.1f} tokens/s "
          f"({n} tokens, batch {len(prompts)}) | realized sparsity: {sp_txt} | path: {res.path}")
    return 0


def register(sub) -> None:
    """Add ``generate`` to the ``wide`` subcommands (``sub`` from ``ArgumentParser.add_subparsers``)."""
    s = sub.add_parser("generate", help="stream greedy tokens through the WIDE inference engine (TTFT, TPOT, "
                                        "tokens/s, realized sparsity)")
    add_arguments(s)
    s.set_defaults(func=run)
