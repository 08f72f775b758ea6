"""``wide generate``: stream tokens (greedy or sampled) from a dense model or a WIDE checkpoint through the inference
engine, then one line of TTFT, TPOT, tokens/s and the realized sparsity.  Imports no torch at import time."""

from __future__ import annotations

import argparse
import os
import sys

from wide.errors import WideError


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--model", default=None, help="base model: local HF dir, .gguf, or 'smollm2-135m' (default: the "
                   "checkpoint's base, else the bundled SmolLM2-135M)")
    p.add_argument("--wide", default=None, help="WIDE checkpoint directory (routers); omit for the dense model (s = 0)")
    p.add_argument("--prompt", action="append", required=True, help="prompt text; repeat for a batch")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate per prompt (>= 1; default: 64)")
    p.add_argument("--max-cache-len", type=int, default=None, help="KV-cache capacity per sequence in tokens "
                   "(default: longest prompt + --max-new-tokens)")
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda if available)")
    p.add_argument("--sparsity", type=float, default=None, help="dial the --wide routers to realize this sparsity in "
                   "[0, 1) without training (a logit shift fitted on held-out calibration text; default: the "
                   "checkpoint's own)")
    p.add_argument("--sparsity-unit", choices=["groups", "flops"], default=None, help="unit of --sparsity: groups "
                   "(Eq. 6) or flops (the routed compute skipped) (default: the checkpoint's)")
    p.add_argument("--dense-ops", action="store_true", help="run cuBLAS/SDPA dense ops (routers ignored)")
    p.add_argument("--no-graphs", action="store_true", help="decode eagerly instead of replaying CUDA graphs")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the tokenizer's chat template")
    p.add_argument("--no-stream", action="store_true", help="print the texts at the end only")
    p.add_argument("--temperature", type=float, default=0.0, help="sample at this temperature (> 0); 0 = greedy "
                   "(default: 0)")
    p.add_argument("--top-k", type=int, default=0, help="with --temperature: sample among the k most likely tokens "
                   "(default: 0 = all)")
    p.add_argument("--top-p", type=float, default=1.0, help="with --temperature: sample among the most likely tokens "
                   "whose probability sums to p (nucleus, 0 < p <= 1; default: 1 = all)")
    p.add_argument("--seed", type=int, default=None, help="with --temperature: seed of the sampling, for "
                   "reproducible tokens (default: random)")
    return p


def sampling_from(args):
    """The Sampling of ``--temperature / --top-k / --top-p / --seed``; refuses the last three at temperature 0."""
    from wide.inference.sampling import Sampling

    try:
        sampling = Sampling(args.temperature, args.top_k, args.top_p, args.seed)
    except WideError as e:  # its messages start with the field's name, the option's without the dashes
        raise WideError(f"--{e}") from None
    unused = [f for f, on in (("--top-k", args.top_k != 0), ("--top-p", args.top_p != 1.0),
                              ("--seed", args.seed is not None)) if on]
    if args.temperature == 0 and unused:
        raise WideError(f"{', '.join(unused)} only appl{'y' if len(unused) > 1 else 'ies'} when sampling: add "
                        "--temperature T > 0 (e.g. 0.7); at temperature 0, the default, generation is greedy")
    return sampling


def check_sizes(args, hf_config=None, longest: int | None = None) -> None:
    """Refuse ``--max-new-tokens`` / ``--max-cache-len`` with what is known: before anything loads, then against the
    base config (context, sliding window) and the longest prompt's token count, before the weights load."""
    from wide.inference.engine import sliding_window, tokens_str

    n, cap = args.max_new_tokens, args.max_cache_len
    if n < 1:
        raise WideError(f"--max-new-tokens {n} must be >= 1")
    if cap is not None and cap < 1:
        raise WideError(f"--max-cache-len {cap} must be >= 1")
    lo = longest if longest is not None else 1
    prompt = f"prompt of {tokens_str(longest)}" if longest is not None else "a prompt of at least 1 token"
    if cap is not None and lo > cap:
        raise WideError(f"{prompt} is longer than the KV cache (--max-cache-len {cap})")
    if cap is not None and lo + n > cap:
        need = f">= {lo + n}" if longest is not None else f">= {n} + the prompt's tokens (known once the tokenizer " \
                                                           "has read it)"
        raise WideError(f"{prompt} + --max-new-tokens {n} does not fit the KV cache (--max-cache-len {cap}); use "
                        f"--max-cache-len {need} or fewer new tokens")
    if hf_config is None:
        return
    need = cap if cap is not None else lo + n
    what = f"--max-cache-len {cap}" if cap is not None else f"{prompt} + --max-new-tokens {n}"
    ctx, win = getattr(hf_config, "max_position_embeddings", None), sliding_window(hf_config)
    if ctx is not None and need > ctx:
        raise WideError(f"a KV cache of {need} tokens ({what}) exceeds the model's context of {ctx} tokens "
                        "(max_position_embeddings)")
    if win is not None and need > win:
        raise WideError(f"a KV cache of {need} tokens ({what}) exceeds the model's sliding attention window "
                        f"({win}); sliding-window attention is not supported by the inference engine")


def _chat_prompts(args, tok) -> list[str]:
    if not args.chat:
        return list(args.prompt)
    if getattr(tok, "chat_template", None) is None:
        raise WideError("--chat: this tokenizer has no chat template")
    return [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
            for p in args.prompt]


def _cpu_notice(engine, args) -> str:
    """The one stderr line of a run off CUDA: which path the engine takes there, and why."""
    import torch

    from wide.kernels._common import HAS_TRITON

    why = "no CUDA device" if not torch.cuda.is_available() else f"--device {args.device}"
    if engine.ops == "dense":
        how = "runs dense PyTorch ops on the CPU" + (", its few Triton kernels (fused norm / RoPE, decode attention, "
                                                     "Q/K/V GEMV) in the Triton interpreter (TRITON_INTERPRET=1)"
                                                     if engine.fast else "")
    elif engine.fast:
        how = "runs the routed Triton kernels in the Triton interpreter on the CPU (TRITON_INTERPRET=1)"
    else:
        how = "falls back to the reference path on the CPU (the PyTorch reference of every kernel)" + (
            " (TRITON_INTERPRET=1, but Triton is not installed: pip install -e '.[kernels]')"
            if os.environ.get("TRITON_INTERPRET") == "1" and not HAS_TRITON else "")
    return f"wide generate: {why}: the engine {how}; no CUDA graphs, slow"


def run(args) -> int:
    """Run ``wide generate``.  Raises WideError for an empty prompt, bad sizes (before the weights load) or sampling
    options, ``--chat`` without a chat template, or a checkpoint made for another base model."""
    from wide.cli.common import check_sparsity
    from wide.hub import load_base_model
    from wide.inference.engine import Engine
    from wide.inference.generation import generate, stream_delta

    check_sizes(args)
    check_sparsity(args)
    if args.sparsity_unit is not None and args.sparsity is None:
        raise WideError(f"--sparsity-unit {args.sparsity_unit} is the unit of a dialed --sparsity: give --sparsity")
    if args.dense_ops and args.sparsity is not None:
        raise WideError(f"--dense-ops and --sparsity {args.sparsity:g} exclude each other: --dense-ops runs every "
                        "group (the routers are ignored), so a dialed sparsity would not be used; give one of them")
    sampling = sampling_from(args)
    if any(not p.strip() for p in args.prompt):
        raise WideError("empty prompt: every --prompt needs some text")
    early: dict = {}

    def check(hf_config, tok):  # run by the loaders before any weight is read
        early["prompts"] = prompts = _chat_prompts(args, tok)
        early["longest"] = max(len(tok(p, add_special_tokens=True)["input_ids"]) for p in prompts)
        check_sizes(args, hf_config, early["longest"])

    if args.wide:
        from wide.checkpoint import load

        model, tok = load(args.wide, model=args.model, device=args.device, tokenizer=True, merge_lora=True,
                          check=check, sparsity=args.sparsity, sparsity_unit=args.sparsity_unit)
        if args.sparsity is not None:
            from wide.calibrate import calibration_line

            print(calibration_line(model.calibration), file=sys.stderr)
    else:
        model, tok, _ = load_base_model(args.model, device=args.device, check=check)
    engine = Engine(model, ops="dense" if args.dense_ops else "routed")
    if engine.device.type != "cuda":
        print(_cpu_notice(engine, args), file=sys.stderr)
    stream = len(args.prompt) == 1 and not args.no_stream
    shown = [""]

    def on_token(row, tok_id, text):
        if stream:
            delta, shown[0] = stream_delta(shown[0], text)
            sys.stdout.write(delta)
            sys.stdout.flush()

    def end_line():  # end the streamed text's line, unless it ended one itself
        if shown[0] and not shown[0].endswith("\n"):
            print(flush=True)

    try:
        res = generate(engine, tok, early["prompts"], args.max_new_tokens, max_len=args.max_cache_len,
                       graphs=False if args.no_graphs else None, on_token=on_token, sampling=sampling)
    except KeyboardInterrupt:
        end_line()
        raise
    end_line()
    if not stream:
        for i, t in enumerate(res.texts):
            print(f"[{i}] {t}", end="" if t.endswith("\n") else "\n")
    n = sum(map(len, res.tokens))
    sp = res.sparsity
    sp_txt = ", ".join(f"{k} {v:.3f}" for k, v in sp.items()) or "0 (dense)"
    if sp and args.wide:
        from wide.routing import realized_sparsity

        keep = {k: [1.0 - sp[k]] if k in sp else [] for k in ("attn", "ffn")}
        both = realized_sparsity(keep["attn"], keep["ffn"], model.dims, model.config,
                                 seq_len=args.max_cache_len or early["longest"] + args.max_new_tokens)
        sp_txt += f"; groups {both['groups']:.3f} (Eq. 6), flops {both['flops']:.3f} (T={both['flops_context']})"
    tpot = f"{res.tpot_s * 1e3:.1f} ms" if res.steps else "n/a (no decode step)"
    print(f"TTFT {res.ttft_s * 1e3:.1f} ms | TPOT {tpot} | {res.tokens_per_s:.1f} tokens/s ({n} token"
          f"{'' if n == 1 else 's'}, batch {len(args.prompt)}) | realized sparsity: {sp_txt} | path: {res.path}")
    return 0


def register(sub) -> None:
    """Add ``generate`` to the ``wide`` subcommands."""
    s = sub.add_parser("generate", help="stream tokens (greedy or sampled) through the WIDE inference engine "
                                        "(TTFT, TPOT, tokens/s, realized sparsity)")
    add_arguments(s)
    s.set_defaults(func=run)
