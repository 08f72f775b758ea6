"""How many KV splits the active head packs of a decode batch should get (session 13): a sweep of
:func:`wide.kernels.decode_attention`'s ``splits`` (the dense split count, times 0.5 / 1 / 2 of the default)
and ``wave`` (1 = a fixed split count per pack; k x SMs = the active packs' programs rounded up to whole waves
of k programs per SM; ``grid`` = every program of the dense grid handed to the active packs), against SDPA's
flash decode in the same process.  Llama-3.1-8B attention (32 / 8 heads, head_dim 128), bf16, Bernoulli(1 - s)
masks per (batch row, head group); CUDA-graph replay, median (``wide.bench.kernels._graph_time_ms``).  GPU only::

    PYTHONPATH=src python3 benchmarks/kernels/decode_attn_waves.py --out $OUT/waves

writes ``decode_attn_waves.json`` (one record per point and variant) and ``decode_attn_waves.md`` (per point:
the best variant and each wave rule's time relative to the best).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import zlib

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "src"))


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="output folder (created)")
    p.add_argument("--batch", default="1,4,8,16,32,64")
    p.add_argument("--T", default="1024,4096,16384", help="KV lengths")
    p.add_argument("--sparsity", default="0,0.5,0.75")
    p.add_argument("--waves", default="1,1,2,3,4,grid,default",
                   help="wave rules: 1 (fixed), k (k programs per SM), grid, default (decode_attention's own); the "
                   "first '1' is the fixed split count, later integers are programs per SM")
    p.add_argument("--split-mult", default="0.5,1,2", help="multiples of the default dense split count")
    p.add_argument("--speculate", default="1",
                   help="decode_attn.SPECULATE values to time (1,0: the speculative dense numbering against the "
                   "session-13 numbering; the 0 variants are named '<rule>/nospec')")
    p.add_argument("--budget", type=float, default=300.0, help="seconds after which pending points are skipped")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = _parse(argv)
    import torch
    import triton

    from wide.bench.kernels import _graph_time_ms, _sdpa
    from wide.kernels import decode_attention
    from wide.kernels.reference import attention_ref

    os.makedirs(args.out, exist_ok=True)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    Hq, Hk, d = 32, 8, 128
    waves = args.waves.split(",")
    rules = [("fixed", 1)] + [(f"{w}/SM", int(w) * sms) for w in waves[1:] if w not in ("grid", "default")]
    rules += [("grid", None)] if "grid" in waves else []
    rules += [("default", "default")] if "default" in waves else []
    specs = [bool(int(x)) for x in args.speculate.split(",")]
    rules = [(n if sp else f"{n}/nospec", w, sp) for n, w in rules for sp in specs]
    import wide.kernels.decode_attn as decode_attn_mod
    t0 = time.time()
    records = []
    cmd = "python3 benchmarks/kernels/decode_attn_waves.py " + " ".join(argv if argv is not None else sys.argv[1:])
    for T in (int(x) for x in args.T.split(",")):
        for B in (int(x) for x in args.batch.split(",")):
            if time.time() - t0 > args.budget:
                print(f"budget: skip B={B} T={T}", flush=True)
                continue
            gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(repr((B, T)).encode()))
            q = torch.randn(B, Hq, 1, d, device="cuda", dtype=torch.bfloat16, generator=gen)
            k = torch.randn(B, Hk, T, d, device="cuda", dtype=torch.bfloat16, generator=gen)
            v = torch.randn(B, Hk, T, d, device="cuda", dtype=torch.bfloat16, generator=gen)
            out = torch.empty_like(q)
            dense_ms = _graph_time_ms([lambda: _sdpa(torch, q, k, v, False, True)])
            base = max(1, min(triton.cdiv(T, 128), triton.cdiv(8 * sms, B * Hk)))
            for s in (float(x) for x in args.sparsity.split(",")):
                route = torch.rand((B, 1, Hk), generator=gen, device="cuda") < (1.0 - s)
                act = float(route.float().mean())
                ref = attention_ref(q[:2].float(), k[:2].float(), v[:2].float(), route[:2], False)
                for mult in (float(x) for x in args.split_mult.split(",")):
                    splits = max(1, int(round(base * mult)))
                    for name, wave, spec in rules:
                        decode_attn_mod.SPECULATE = spec
                        w = B * Hk * splits if wave is None else None if wave == "default" else wave
                        fn = lambda: decode_attention(q, k, v, route, out=out, splits=splits, wave=w)  # noqa: E731
                        ms = _graph_time_ms([fn])
                        fn()
                        err = float((out[:2].float() - ref).norm() / ref.norm().clamp_min(1e-30))
                        if w is None:  # the default: the occupancy wave decode_attention computed
                            from wide.kernels._common import _RESIDENT
                            w = sms * next(iter(_RESIDENT.values()))
                        rec = dict(op="attention_decode", B=B, T=T, sparsity=s, active=round(act, 4),
                                   splits=splits, split_mult=mult, rule=name, wave=w, dense_ms=round(dense_ms, 5),
                                   wide_ms=round(ms, 5), speedup=round(dense_ms / ms, 4), rel_err=round(err, 5),
                                   gpu=torch.cuda.get_device_name(),
                                   date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), command=cmd)
                        records.append(rec)
                    decode_attn_mod.SPECULATE = True
                print(f"B={B} T={T} done ({time.time() - t0:.0f} s)", flush=True)
            del q, k, v
            torch.cuda.empty_cache()
            with open(os.path.join(args.out, "decode_attn_waves.json"), "w") as f:
                json.dump(records, f, indent=1)
    lines = ["| B | T | s | active | dense µs | best (splits x, rule) | best µs | "
             + " | ".join(f"{n} ×1" for n, _, _ in rules) + " |", "|---" * (7 + len(rules)) + "|"]
    pts = {}
    for r in records:
        pts.setdefault((r["B"], r["T"], r["sparsity"]), []).append(r)
    for (B, T, s), rs in pts.items():
        best = min(rs, key=lambda r: r["wide_ms"])
        rel = {r["rule"]: r["wide_ms"] / best["wide_ms"] for r in rs if r["split_mult"] == 1.0}
        lines.append(f"| {B} | {T} | {s} | {rs[0]['active']} | {rs[0]['dense_ms'] * 1e3:.1f} | "
                     f"{best['split_mult']:g}, {best['rule']} | {best['wide_ms'] * 1e3:.1f} | "
                     + " | ".join(f"{rel.get(n, float('nan')):.3f}" for n, _, _ in rules) + " |")
    with open(os.path.join(args.out, "decode_attn_waves.md"), "w") as f:
        f.write("# decode attention: split count and wave rule (time relative to the best variant of the point; "
                "columns at the default split count)\n\n" + "\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"elapsed {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
