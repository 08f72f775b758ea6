"""Engine vs WideModel's masking path on the bundled SmolLM2-135M with its calibrated routers (issue 5).

20 prompts in one left-padded batch, ``--steps`` greedy decode steps.  For every prompt:

* free-running greedy: the engine's tokens (batched, static cache) vs the masking path's own greedy loop
  (HF DynamicCache, one prompt at a time); positions equal up to the first divergence, and overall;
* teacher-forced on the engine's tokens: max |logit difference| / max |logit| per step, the fraction of
  equal router decisions (attention and FFN, every layer, every generated token), and the fraction of steps
  where both pick the same next token from the same prefix (greedy agreement without the compounding of a
  free-running comparison, where one early divergence makes every later position differ);
* with fixed masks: the masking path given the engine's own decisions at every position, against the
  engine's logits: the kernels' error on the real model without decision flips;
* the masking path's own noise floor: the same tokens fed one at a time through its KV cache against its
  one full pass (same two metrics).  In bf16 the routers' hard decisions flip wherever two summation
  orders round a near-tie differently, and every flip changes the residual stream of later layers, so
  this floor, not 0, is what the engine can be held to (``--reference-only`` measures only it);
* with ``--truth`` (for a bf16 / fp16 run): both the engine and the masking path against the masking path in
  float32 on the same device, which stands for the exact function: free-running greedy positions equal to
  the fp32 greedy, next-token agreement on the same prefix, and router decisions.  Two bf16 implementations
  that round differently need not agree with each other; what a user needs is that the engine is no further
  from the exact model than the masking path in the same dtype is.

Run on the CPU (float32, PyTorch references of the kernels; ``TRITON_INTERPRET=0``) or on a GPU (bf16 by
default, ``--dtype float32`` for an exact check of the Triton kernels and CUDA graphs on the real model)::

    PYTHONPATH=src python benchmarks/e2e/check_smollm2.py --steps 64 --out benchmarks/e2e/check_smollm2_cpu.json

The per-prompt checks run the masking path one token at a time in Python (20-30 s a prompt on a GPU), so a run
can be split: ``--shard i/n`` still generates every prompt with the engine in one batch but checks only the
prompts ``b`` with ``b % n == i``; ``--merge A.json B.json ... --out ALL.json`` joins the shards' per-prompt
records (in prompt order) and recomputes the summary::

    python benchmarks/e2e/check_smollm2.py --device cuda --shard 0/2 --out s0.json &   # and --shard 1/2
    python benchmarks/e2e/check_smollm2.py --merge s0.json s1.json --out check.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
import time

from wide.errors import WideError

PROMPTS = [
    "The capital of France is", "Water boils at a temperature of", "The largest planet in the solar system is",
    "In 1492, Christopher Columbus", "The chemical symbol for gold is", "A healthy breakfast usually includes",
    "The theory of relativity was developed by", "To bake bread you need flour, water and",
    "The Great Wall of China was built to", "Photosynthesis is the process by which plants",
    "The first person to walk on the moon was", "Machine learning is a field of",
    "The river that flows through Egypt is the", "Shakespeare wrote many plays, including",
    "The human heart has four", "Mount Everest is located in", "The speed of light is approximately",
    "Honey bees communicate with each other by", "The Pacific Ocean is the", "A prime number is a number that",
]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Check the inference engine against WideModel's masking path on the "
                                "bundled SmolLM2-135M with its calibrated routers (greedy tokens, router decisions, "
                                "logits).")
    p.add_argument("--ckpt", default="benchmarks/quality/checkpoints/smollm2-global-s50-g128",
                   help="WIDE checkpoint (default: the committed S = 0.5 routers)")
    p.add_argument("--model", default=None,
                   help="base model (path or --model string) instead of the one recorded in the checkpoint")
    p.add_argument("--steps", type=int, default=64, help="greedy decode steps per prompt (default: 64)")
    p.add_argument("--prompts", type=int, default=20, help=f"how many of the {len(PROMPTS)} prompts (default: 20)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="model dtype (default: bf16 on a GPU, fp32 on the CPU)")
    p.add_argument("--reference-only", action="store_true",
                   help="skip the engine; measure only the masking path against itself (noise floor)")
    p.add_argument("--truth", action="store_true",
                   help="also compare the engine and the masking path with the masking path in float32")
    p.add_argument("--out", default=None, help="JSON file for the summary (written after every prompt)")
    p.add_argument("--shard", default="0/1", type=_shard,
                   help="i/n: check only the prompts b with b %% n == i (the engine still generates all of them "
                        "in one batch); default 0/1, every prompt")
    p.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                   help="join the summaries of shards written with --shard (and --out) into --out; runs nothing")
    args = p.parse_args(argv)
    if args.merge:
        if not args.out:
            p.error("--merge needs --out")
        try:
            return _merge(args.merge, args.out)
        except (OSError, ValueError, KeyError) as e:
            print(f"check_smollm2: error: --merge: {e}", file=sys.stderr)
            return 2
    if not 1 <= args.prompts <= len(PROMPTS):
        p.error(f"--prompts {args.prompts}: choose 1 to {len(PROMPTS)}")
    if args.steps < 1:
        p.error(f"--steps {args.steps}: at least 1")
    try:
        return _check(args)
    except WideError as e:
        print(f"check_smollm2: error: {e}", file=sys.stderr)
        return 2


def _shard(text: str) -> tuple[int, int]:
    """``"i/n"`` -> ``(i, n)`` with ``0 <= i < n``."""
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected i/n, e.g. 0/2") from None
    if not 0 <= i < n:
        raise argparse.ArgumentTypeError(f"{text!r}: needs 0 <= i < n")
    return i, n


_TRUTH_KEYS = ("reference_greedy_positions_equal_fp32", "engine_greedy_positions_equal_fp32",
               "reference_next_token_agreement_fp32", "reference_incremental_next_token_agreement_fp32",
               "engine_next_token_agreement_fp32", "reference_mask_agreement_fp32", "engine_mask_agreement_fp32")


def _aggregate(per_prompt: list[dict], steps: int, engine: bool, truth: bool) -> dict:
    """The summary statistics over the per-prompt records (means, minima and maxima as named)."""
    n = len(per_prompt)
    out = {
        "prompts": n, "steps": steps,
        "reference_incremental_max_rel_logit_err": max(r["reference_incremental_max_rel_logit_err"]
                                                        for r in per_prompt),
        "reference_incremental_mask_agreement_min": min(r["reference_incremental_mask_agreement"] for r in per_prompt),
        "reference_incremental_next_token_agreement": sum(r["reference_incremental_next_token_agreement"]
                                                          for r in per_prompt) / n,
    }
    if engine:
        out.update({
            "greedy_positions_equal": sum(r["equal_positions"] for r in per_prompt) / (n * steps),
            "prompts_fully_equal": sum(r["first_divergence"] is None for r in per_prompt),
            "teacher_forced_max_rel_logit_err": max(r["teacher_forced_max_rel_logit_err"] for r in per_prompt),
            "teacher_forced_mask_agreement_min": min(r["teacher_forced_mask_agreement"] for r in per_prompt),
            "fixed_masks_max_rel_logit_err": max(r["fixed_masks_max_rel_logit_err"] for r in per_prompt),
            "teacher_forced_next_token_agreement": sum(r["teacher_forced_next_token_agreement"]
                                                       for r in per_prompt) / n})
    if truth:
        def mean(k):
            vals = [r[k] for r in per_prompt if k in r]
            return sum(vals) / len(vals) if vals else None

        out["vs_fp32"] = {k: mean(k) for k in _TRUTH_KEYS}
    return out


def _merge(paths: list[str], out_path: str) -> int:
    """Join shard summaries (same checkpoint, dtype and steps) into one, per-prompt records in prompt order."""
    parts = []
    for path in paths:
        with open(path) as f:
            parts.append(json.load(f))
    first = parts[0]
    for path, part in zip(paths, parts):
        for key in ("checkpoint", "dtype", "steps", "path", "prompts_planned"):
            if part.get(key) != first.get(key):
                raise ValueError(f"{path}: {key}={part.get(key)!r} differs from {paths[0]}'s {first.get(key)!r}")
    per_prompt = sorted((r for part in parts for r in part["per_prompt"]), key=lambda r: r["index"])
    idx = [r["index"] for r in per_prompt]
    if len(set(idx)) != len(idx):
        raise ValueError(f"prompt indices overlap between the shards: {idx}")
    summary = {k: v for k, v in first.items() if k not in ("per_prompt", "shard", "command", "seconds", "date")}
    summary.update(_aggregate(per_prompt, first["steps"], "greedy_positions_equal" in first, "vs_fp32" in first))
    summary.update({"seconds": max(p["seconds"] for p in parts), "date": max(p["date"] for p in parts),
                    "merged_from": [{"file": os.path.basename(p), "shard": part.get("shard"),
                                     "command": part["command"]} for p, part in zip(paths, parts)],
                    "command": "python " + " ".join(sys.argv), "per_prompt": per_prompt})
    print(json.dumps({k: v for k, v in summary.items() if k not in ("per_prompt", "merged_from")}, indent=1))
    tmp = out_path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(summary, f, indent=1)
    os.replace(tmp, out_path)
    return 0


def _check(args) -> int:
    os.environ.setdefault("TRITON_INTERPRET", "0")
    import torch
    from transformers import DynamicCache

    import wide

    if args.device is not None and args.device.startswith("cuda") and not torch.cuda.is_available():
        raise WideError(f"--device {args.device}: no CUDA GPU is available")
    from wide.bench.e2e import _fixed_mask_logits
    from wide.inference import Engine, generate

    t0 = time.time()
    dtype = getattr(torch, args.dtype) if args.dtype else None
    wm, tok = wide.load(args.ckpt, model=args.model, device=args.device, dtype=dtype, tokenizer=True)
    dev = next(wm.base.parameters()).device
    prompts = PROMPTS[: args.prompts]
    wm32 = None
    if args.truth:
        wm32 = wide.load(args.ckpt, model=args.model, device=args.device, dtype=torch.float32)
    eng = res = None
    if not args.reference_only:
        eng = Engine(wm)
        res = generate(eng, tok, prompts, args.steps, stop_at_eos=False)
    per_prompt = []
    def summarize(final: bool) -> None:
        """Write the summary of the prompts done so far (after each prompt: a killed run keeps its part)."""
        summary = {
            "checkpoint": args.ckpt, "device": str(dev),
            "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
            "dtype": str(next(wm.base.parameters()).dtype),
            "path": res.path if res is not None else "reference only", "prompts_planned": len(prompts),
            "shard": f"{args.shard[0]}/{args.shard[1]}",
            **_aggregate(per_prompt, args.steps, res is not None, wm32 is not None),
        }
        if res is not None:
            summary["engine_realized_sparsity"] = res.sparsity
        summary.update({
            "seconds": round(time.time() - t0, 1),
            "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "command": "python " + " ".join(sys.argv), "per_prompt": per_prompt,
        })
        if final:
            print(json.dumps({k: v for k, v in summary.items() if k != "per_prompt"}, indent=1))
        if args.out:
            tmp = args.out + ".tmp"
            with open(tmp, "w") as f:
                json.dump(summary, f, indent=1)
            os.replace(tmp, args.out)

    def greedy(model, ids):
        """``args.steps`` free-running greedy tokens of a masking-path model, with its own KV cache."""
        cache = DynamicCache(config=model.base.config)
        out = model(ids, past_key_values=cache, use_cache=True)
        tokens = []
        for _ in range(args.steps):
            t = int(out.logits[0, -1].argmax())
            tokens.append(t)
            out = model(torch.tensor([[t]], device=dev), past_key_values=cache, use_cache=True)
        return tokens

    def mask_agreement(masks, truth_masks, n):
        """Fraction of equal router decisions over the first ``n`` positions of every routed module."""
        return (sum(int((masks[k][0, :n] == m[0, :n]).sum()) for k, m in truth_masks.items())
                / sum(m[0, :n].numel() for m in truth_masks.values()))

    with torch.no_grad():
        for b, p in enumerate(prompts):
            if b % args.shard[1] != args.shard[0]:
                continue
            ids = torch.tensor([tok(p)["input_ids"]], device=dev)
            n_prompt = ids.shape[1]
            ref_tokens = greedy(wm, ids)  # free-running greedy of the masking path, with its own KV cache
            eng_tokens = res.tokens[b] if res is not None else ref_tokens
            truth = {}
            if wm32 is not None:  # the fp32 masking path: free-running greedy
                t32 = greedy(wm32, ids)
                truth["reference_greedy_positions_equal_fp32"] = sum(int(x == y) for x, y in zip(ref_tokens, t32)) / args.steps
                if res is not None:
                    truth["engine_greedy_positions_equal_fp32"] = sum(int(x == y) for x, y in zip(eng_tokens, t32)) / args.steps
            first_div = next((i for i, (x, y) in enumerate(zip(eng_tokens, ref_tokens)) if x != y), None)
            # teacher-forced on the engine's tokens: logits and masks of every step
            full = torch.tensor([tok(p)["input_ids"] + eng_tokens], device=dev)
            wm.record_masks = True
            ref_logits = wm(full).logits[0].float()
            ref_masks = dict(wm.record.masks)
            # the noise floor of the masking path itself: the same tokens one at a time through its KV cache
            # (other kernels and summation orders than the one full pass) against that full pass
            cache = DynamicCache(config=wm.base.config)
            inc_logits, inc_agree, inc_n = [], 0, 0
            for s in range(args.steps):
                lo, hi = (0, n_prompt) if s == 0 else (n_prompt + s - 1, n_prompt + s)
                inc_logits.append(wm(full[:, lo:hi], past_key_values=cache, use_cache=True).logits[0, -1].float())
                for k, m in wm.record.masks.items():
                    inc_agree += int((m[0] == ref_masks[k][0, lo:hi]).sum())
                    inc_n += m[0].numel()
            wm.record_masks = False
            span = slice(n_prompt - 1, n_prompt - 1 + args.steps)
            n_seen = n_prompt + args.steps - 1  # positions with a decision: the prompt and all but the last token
            if wm32 is not None:  # fp32 full pass on the same tokens: next token and decisions at every position
                wm32.record_masks = True
                truth_next = wm32(full).logits[0, span].float().argmax(-1)
                truth_masks = dict(wm32.record.masks)
                wm32.record_masks = False
                truth["reference_next_token_agreement_fp32"] = float(
                    (ref_logits[span].argmax(-1) == truth_next).float().mean())
                truth["reference_incremental_next_token_agreement_fp32"] = float(
                    (torch.stack(inc_logits).argmax(-1) == truth_next).float().mean())
                truth["reference_mask_agreement_fp32"] = mask_agreement(ref_masks, truth_masks, n_seen)
            self_err = max(((x - ref_logits[n_prompt - 1 + s]).abs().max() / ref_logits[n_prompt - 1 + s].abs().max()).item()
                           for s, x in enumerate(inc_logits))
            ref_next = ref_logits[n_prompt - 1:n_prompt - 1 + args.steps].argmax(-1)
            inc_next = torch.stack(inc_logits).argmax(-1)
            rec = {"index": b, "prompt": p, "reference_incremental_max_rel_logit_err": self_err,
                   "reference_incremental_mask_agreement": inc_agree / max(inc_n, 1),
                   # the floor of the teacher-forced next-token agreement below
                   "reference_incremental_next_token_agreement": float((inc_next == ref_next).float().mean()),
                   "reference_text": tok.decode(ref_tokens), **truth}
            if eng is None:
                per_prompt.append(rec)
                summarize(final=False)
                print(f"[{b}] reference incremental vs full: max rel logit err {self_err:.2e} mask agreement "
                      f"{rec['reference_incremental_mask_agreement']:.5f}", flush=True)
                continue
            c = eng.new_cache(1, full.shape[1])
            eng.record_masks = True
            lg = eng.prefill(full[:, :n_prompt], None, c, all_logits=False).float()
            agree_n = sum(int((m[0] == ref_masks[k][0, :n_prompt]).sum()) for k, m in eng.masks.items())
            agree_d = sum(m[0].numel() for m in eng.masks.values())
            eng_masks = {k: [m.clone()] for k, m in eng.masks.items()}  # the engine's decisions, every position
            eng_logits, errs = [], []
            for s in range(args.steps):
                r = ref_logits[n_prompt - 1 + s]
                eng_logits.append(lg[0])
                errs.append(((lg[0] - r).abs().max() / r.abs().max()).item())
                if s == args.steps - 1:
                    break
                lg = eng.decode(full[:, n_prompt + s], c).float()
                for k, m in eng.masks.items():
                    rm = ref_masks[k][0, n_prompt + s]
                    agree_n += int((m[0, 0] == rm).sum())
                    agree_d += rm.numel()
                    eng_masks[k].append(m.clone())
            eng.record_masks = False
            if wm32 is not None:
                rec["engine_next_token_agreement_fp32"] = float(
                    (torch.stack(eng_logits).argmax(-1) == truth_next).float().mean())
                em = {k: torch.cat([x.view(1, -1, x.shape[-1]) for x in v], 1) for k, v in eng_masks.items()}
                rec["engine_mask_agreement_fp32"] = mask_agreement(em, truth_masks, n_seen)
            # the masking path given the engine's decisions: the kernels' own error, without decision flips
            fixed = _fixed_mask_logits(wm, eng_masks, full[:, :n_seen], torch.ones_like(full[:, :n_seen]))[0]
            fixed_err = max(((x - fixed[n_prompt - 1 + s]).abs().max() / fixed[n_prompt - 1 + s].abs().max()).item()
                            for s, x in enumerate(eng_logits))
            per_prompt.append({**rec, "equal_positions": sum(int(x == y) for x, y in zip(eng_tokens, ref_tokens)),
                               "first_divergence": first_div, "teacher_forced_max_rel_logit_err": max(errs),
                               "teacher_forced_mask_agreement": agree_n / max(agree_d, 1),
                               "fixed_masks_max_rel_logit_err": fixed_err,
                               # same prefix (the engine's tokens), same greedy choice of the next token?
                               "teacher_forced_next_token_agreement": float(
                                   (torch.stack(eng_logits).argmax(-1) == ref_next).float().mean()),
                               "engine_text": tok.decode(eng_tokens)})
            summarize(final=False)
            print(f"[{b}] equal {per_prompt[-1]['equal_positions']}/{args.steps} first divergence {first_div} "
                  f"max rel logit err {max(errs):.2e} mask agreement {per_prompt[-1]['teacher_forced_mask_agreement']:.5f} "
                  f"fixed-mask max rel logit err {fixed_err:.2e}",
                  flush=True)
    summarize(final=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
