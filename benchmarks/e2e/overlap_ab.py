"""A/B of the router overlaps of session 12, full forward passes at Llama-3.1-8B shapes, one process.

The auto engine (``kaxis`` / ``naxis`` / ``attn`` = "auto") in three variants, each against the dense CUDA-graph
engine timed in the same round:

* ``old``: the engine before session 12 (the FFN router beside the norm only, the few-row SwiGLU always routed,
  the attention router beside K / V only): ``routes_beside_gate_up`` and ``overlaps_q_router`` patched to False;
* ``gu``: the FFN router beside cuBLAS's gate / up where both FFN projections run dense
  (:meth:`Engine.overlaps_gate_up_router`, with the few-row rule of ``naxis_dense_above(router_beside=True)``);
* ``gu+q``: also the attention router beside a cuBLAS Q projection (:meth:`Engine.overlaps_q_router`);
* ``fixed-split`` (session 13): ``gu+q`` with the decode attention of before session 13, a fixed number of KV
  splits per head pack (``decode_attention(wave=1)``), against ``gu+q``'s default (the active packs' splits
  rounded up to whole waves of the GPU's resident programs).

Prefill TTFT and decode TPOT as in ``wide bench e2e`` (CUDA-graph replay, median of 50 after warm-up); the
variants are timed in turn, ``--rounds`` times, and the median over rounds is reported, so slow drift of the
GPU's clocks hits every variant alike.  GPU only::

    PYTHONPATH=src python3 benchmarks/e2e/overlap_ab.py --out $OUT/ab

writes ``overlap_ab.json`` (one record per point and variant) and ``overlap_ab.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "src"))


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="output folder (created)")
    p.add_argument("--decode", default="8:0,16:0,32:0,8:0.5,16:0.5,32:0.5,1:0.5",
                   help="decode points batch:sparsity (context --ctx)")
    p.add_argument("--prefill", default="512:0,2048:0,512:0.25,2048:0.25,2048:0.5",
                   help="prefill points tokens:sparsity (batch 1)")
    p.add_argument("--ctx", type=int, default=2048, help="decode context (tokens)")
    p.add_argument("--G", type=int, default=128, help="FFN group size")
    p.add_argument("--split", default="paper", choices=("paper", "uniform"), help="attention / FFN sparsity split")
    p.add_argument("--rounds", type=int, default=2, help="times each variant is timed per point (median)")
    p.add_argument("--budget", type=float, default=400.0, help="seconds after which pending points are skipped")
    p.add_argument("--variants", default="old,gu,gu+q",
                   help=f"comma-separated variants from {','.join(VARIANTS)} (default: old,gu,gu+q)")
    return p.parse_args(argv)


VARIANTS = ("old", "gu", "gu+q", "fixed-split")


@contextlib.contextmanager
def _fixed_split(on: bool):
    """While on: the engine's decode attention keeps a fixed split count per head pack (graphs captured inside
    keep it)."""
    from wide.kernels import decode_attn

    orig = decode_attn.decode_attention
    if on:
        decode_attn.decode_attention = functools.partial(orig, wave=1)
    try:
        yield
    finally:
        decode_attn.decode_attention = orig


def _pts(s):
    return [(int(a), float(b)) for a, b in (x.split(":") for x in s.split(",") if x)]


def main(argv=None) -> int:
    args = _parse(argv)
    names = [v for v in args.variants.split(",") if v]
    bad = [v for v in names if v not in VARIANTS]
    if bad or not names:
        raise SystemExit(f"--variants: {','.join(bad) or 'empty'} not among {','.join(VARIANTS)}")
    import torch

    from wide import WideConfig
    from wide.bench import e2e
    from wide.inference.engine import Engine
    from wide.model import WideModel

    os.makedirs(args.out, exist_ok=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    t0 = time.time()
    base = e2e.build_llama8b()
    vocab = base.config.vocab_size
    calib = torch.randint(0, vocab, (1, 2048), device="cuda")
    dense = Engine(base, ops="dense", track_sparsity=False)
    records = []
    by_s = {}
    for _, s in _pts(args.decode) + _pts(args.prefill):
        by_s.setdefault(s, None)

    def variants(wm):
        out = {}
        for name in names:
            eng = Engine(wm, track_sparsity=False, kaxis="auto", naxis="auto", attn="auto")
            if name == "old":
                eng.routes_beside_gate_up = lambda: False
            if name in ("old", "gu"):
                eng.overlaps_q_router = lambda phase, i, M: False
            eng.measure_activity(calib)
            out[name] = eng
        return out

    for s in sorted(by_s):
        if time.time() - t0 > args.budget:
            break
        sa, sf = e2e.split_sparsity(s, args.split)
        wm = WideModel(base, WideConfig(ffn_group_size=args.G, target_sparsity=s), init_keep=0.5)
        for h in wm._handles:
            h.remove()
        e2e.bias_routers(Engine(wm, track_sparsity=False, kaxis="kernel", naxis="kernel", attn="kernel"),
                         calib, sa, sf)
        engines = {"dense": dense, **variants(wm)}
        for phase, pts in (("decode", _pts(args.decode)), ("prefill", _pts(args.prefill))):
            for n, ps in pts:
                if ps != s:
                    continue
                if time.time() - t0 > args.budget:
                    print(f"budget: skip {phase} {n} s={s}", flush=True)
                    continue
                times = {k: [] for k in engines}
                if phase == "decode":
                    cache = dense.new_cache(n, args.ctx + 8)
                    torch.manual_seed(n)
                    cache.k.normal_(0, 1)
                    cache.v.normal_(0, 1)
                    ids = None
                else:
                    g = torch.Generator(device="cuda").manual_seed(n)
                    ids = torch.randint(0, vocab, (1, n), device="cuda", generator=g)
                for _ in range(args.rounds):
                    for k, eng in engines.items():
                        with _fixed_split(k == "fixed-split"):
                            if phase == "decode":
                                times[k].append(e2e.decode_ms(eng, cache, args.ctx, vocab, 50))
                            else:
                                times[k].append(e2e.prefill_ms(eng, ids, 50)[0])
                d = statistics.median(times["dense"])
                for k in engines:
                    if k == "dense":
                        continue
                    ms = statistics.median(times[k])
                    rec = dict(phase=phase, batch=n if phase == "decode" else 1,
                               prompt_len=args.ctx if phase == "decode" else n, sparsity=s, G_ffn=args.G,
                               split=args.split, variant=k, dense_ms=round(d, 4), wide_ms=round(ms, 4),
                               speedup=round(d / ms, 4), rounds=[round(x, 4) for x in times[k]],
                               dense_rounds=[round(x, 4) for x in times["dense"]],
                               gpu=torch.cuda.get_device_name(), date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                               command="python3 benchmarks/e2e/overlap_ab.py " + " ".join(argv or sys.argv[1:]))
                    records.append(rec)
                    print(f"{phase} n={n} s={s} {k}: dense {d:.4f} ms, wide {ms:.4f} ms, {d / ms:.4f}x", flush=True)
                with open(os.path.join(args.out, "overlap_ab.json"), "w") as f:
                    json.dump(records, f, indent=1)
        del engines, wm
        torch.cuda.empty_cache()
    lines = ["| phase | batch | tokens | s | " + " | ".join(names) + " |", "|---|---|---|---|" + "---|" * len(names)]
    keyed = {}
    for r in records:
        keyed.setdefault((r["phase"], r["batch"], r["prompt_len"], r["sparsity"]), {})[r["variant"]] = r["speedup"]
    for (ph, b, t, s), v in keyed.items():
        lines.append(f"| {ph} | {b} | {t} | {s} | " + " | ".join(f"{v.get(k, '–')}" for k in names)
                     + " |")
    with open(os.path.join(args.out, "overlap_ab.md"), "w") as f:
        f.write("# router overlap A/B (speedup of the auto engine over dense, same process)\n\n" + "\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"elapsed {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
