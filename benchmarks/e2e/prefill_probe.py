"""Prefill overhead probe: the ops a WIDE layer adds or shares outside the GEMMs, at Llama-3.1-8B shapes.

Times, under CUDA-graph replay (median; ``wide.bench.kernels._graph_time_ms``), for M in {512, 2048, 16384} tokens:

* ``reorder`` (Eq. 7, Algorithm 1) of an FFN mask ``[M, 112]`` and of an attention mask ``[1, M, 8]``,
  Bernoulli(0.5), checked equal to ``reference.reorder_ref``;
* every many-row router implementation ``router_mask`` chooses from (``fused._router_many``; D = 4096, rank 16,
  N_G = 112 and 8): the tile kernel with tensor-core dots against W1's three bf16 pieces (``tile3``; also with D
  split over 4-8 programs per row tile, ``splitD``), with fp32 dots (``tile``), the split-W1 cuBLAS GEMM (``split3``) and the module + argmax (``module``); the fraction of
  decisions equal to the module's is recorded;
* the fused RoPE + K/V cache write (``fused.rope_cache``; 32 / 8 heads of 128) against its PyTorch reference
  (``rope_cache_ref``), checked equal.

GPU (< 60 s on an H200)::

    PYTHONPATH=src python3 benchmarks/e2e/prefill_probe.py --out $OUT

writes ``$OUT/prefill_probe.json`` and ``$OUT/prefill_probe.md`` and prints the table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="output folder (created)")
    p.add_argument("--M", default="512,2048,16384", help="comma-separated token counts")
    a = p.parse_args(argv)

    import torch

    from wide.bench.kernels import _graph_time_ms
    from wide.inference import StaticKVCache, fused
    from wide.kernels import reference, reorder
    from wide.routing import Router, argmax_mask

    if not torch.cuda.is_available():
        raise SystemExit("prefill_probe.py times CUDA graphs: it needs a CUDA GPU")
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    rows = []
    t_start = time.time()

    def add(op, M, impl, ms, base_ms=None, check=""):
        rows.append(dict(op=op, M=M, impl=impl, us=1e3 * ms, baseline_us=None if base_ms is None else 1e3 * base_ms,
                         check=check))
        print(f"{op:28s} M={M:6d} {impl:22s} {1e3 * ms:9.1f} us  {check}", flush=True)

    routers = {}
    for ng in (112, 8):
        torch.manual_seed(ng)
        r = Router(4096, ng, 16, init_keep=0.5)
        with torch.no_grad():
            r.w2.weight.normal_(std=1.0)
            r.w2.bias.normal_(std=0.5)
        routers[ng] = r.to(dev)

    for M in [int(x) for x in a.M.split(",")]:
        # reorder
        for shape, name in (((M, 112), "reorder ffn [M,112]"), ((1, M, 8), "reorder attn [1,M,8]")):
            mask = torch.rand(shape, device=dev, generator=gen) < 0.5
            got, want = reorder(mask), reference.reorder_ref(mask)
            ok = all(torch.equal(x, y) for x, y in zip(got, want))
            add(name, M, "reorder", _graph_time_ms([lambda m=mask: reorder(m)]), check=f"equal {ok}")
        # routers
        x = torch.randn((M, 4096), device=dev, generator=gen).to(torch.bfloat16)
        for ng, r in routers.items():
            want = argmax_mask(r(x))
            impls = {"module": lambda r=r: argmax_mask(r(x)), "split3": lambda r=r: fused._router_split3(r, x)}
            for bm, w in ((16, 4), (32, 4), (64, 4), (128, 8)):
                impls[f"tile3 BM{bm}"] = lambda r=r, bm=bm, w=w: fused._router_tile_launch(r, x, BM=bm, num_warps=w,
                                                                                        split3=True)
                impls[f"tile BM{bm}"] = lambda r=r, bm=bm, w=w: fused._router_tile_launch(r, x, BM=bm, num_warps=w)
            for bm, sd in ((64, 4), (64, 8), (32, 8)):
                impls[f"tile3 BM{bm} splitD{sd}"] = lambda r=r, bm=bm, sd=sd: fused._router_tile_launch(
                    r, x, BM=bm, num_warps=4, split3=True, splitd=sd)
            base = _graph_time_ms([impls["module"]])
            for name, fn in impls.items():
                eq = (fn() == want).float().mean().item()
                add(f"router N_G={ng}", M, name, base if name == "module" else _graph_time_ms([fn]), base,
                    f"decisions equal {eq:.5f}")
        # RoPE + cache write
        Hq, Hk, d = 32, 8, 128
        qkv = torch.randn((1, M, (Hq + 2 * Hk) * d), device=dev, generator=gen).to(torch.bfloat16)
        q = qkv[..., :Hq * d].view(1, M, Hq, d)
        k = qkv[..., Hq * d:(Hq + Hk) * d].view(1, M, Hk, d)
        v = qkv[..., (Hq + Hk) * d:].view(1, M, Hk, d)
        ang = torch.rand((1, M, d // 2), device=dev, generator=gen) * 6.28
        cos = torch.cat([ang.cos()] * 2, -1).to(torch.bfloat16)
        sin = torch.cat([ang.sin()] * 2, -1).to(torch.bfloat16)
        slots = torch.arange(M, device=dev).view(1, M)
        c1, c2 = (StaticKVCache(1, 1, Hk, d, M, torch.bfloat16, dev) for _ in range(2))
        qo, ko = fused.rope_cache(q, k, v, cos, sin, c1.k[0], c1.v[0], slots, want_k=True)
        qr, kr = fused.rope_cache_ref(q, k, v, cos, sin, c2.k[0], c2.v[0], slots, want_k=True)
        ok = torch.equal(qo, qr) and torch.equal(ko, kr) and torch.equal(c1.k, c2.k) and torch.equal(c1.v, c2.v)
        # largest difference in units of the reference's bf16 spacing (2**-7 of its magnitude's power of two)
        ulp = max((((x.float() - y.float()).abs() / torch.exp2(torch.floor(torch.log2(y.float().abs().clamp_min(
            1e-30)))) * 2 ** 7).max().item() for x, y in ((qo, qr), (ko, kr), (c1.k, c2.k), (c1.v, c2.v))))
        base = _graph_time_ms([lambda: fused.rope_cache_ref(q, k, v, cos, sin, c2.k[0], c2.v[0], slots, True)])
        ms = _graph_time_ms([lambda: fused.rope_cache(q, k, v, cos, sin, c1.k[0], c1.v[0], slots, want_k=True)])
        moved = 2 * M * (2 * (Hq + Hk) + 2 * Hk) * d  # bytes read + written (bf16), cos / sin not counted
        add("rope_cache (32/8 heads)", M, "fused", ms, base,
            f"equal {ok} (max diff {ulp:.2f} bf16 ulp); {moved / (ms * 1e-3) / 1e9:.0f} GB/s")
        add("rope_cache (32/8 heads)", M, "torch reference", base)

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, date=time.strftime("%Y-%m-%dT%H:%M:%SZ",
                time.gmtime()), command="PYTHONPATH=src python3 benchmarks/e2e/prefill_probe.py " + " ".join(
                    argv if argv is not None else sys.argv[1:]), wall_s=time.time() - t_start)
    (out / "prefill_probe.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1) + "\n")
    lines = [f"# prefill probe ({meta['gpu']}, torch {meta['torch']})", "",
             "CUDA-graph replay, median; µs per call.", "",
             "| op | M | impl | µs | baseline µs | check |", "|---|---|---|---|---|---|"]
    for r in rows:
        b = "" if r["baseline_us"] is None else f"{r['baseline_us']:.1f}"
        lines.append(f"| {r['op']} | {r['M']} | {r['impl']} | {r['us']:.1f} | {b} | {r['check']} |")
    lines += ["", "```", meta["command"], "```"]
    (out / "prefill_probe.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
