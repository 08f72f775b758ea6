"""Decode-kernel probe: the WIDE decode ops one by one at Llama-3.1-8B shapes, under CUDA-graph replay.

Times, per decoder-layer op, B = 1 and B = 4 rows:

* the router (Eq. 4-5; attention: D=4096 -> 8 groups, FFN: D=4096 -> 112 groups, rank 16): the split-D
  kernel behind ``router_mask``, the former one-program-per-row kernel, and the PyTorch router + argmax;
* ``gemv_k`` (Eq. 21, decode) for down (N=4096, K=14336, G=128) and o_proj (N=4096, K=4096, G=512 and 128)
  at sparsity s in {0, 0.3, 0.5} against cuBLAS ``x @ w.T`` (dense);
* ``gemv_swiglu`` (Eq. 3; K=4096, N=14336, G=128) against cuBLAS gate + up, and ``gemv_mn`` for q_proj
  (N=K=4096, G=512) against cuBLAS;
* every ``gemv_k`` config candidate at down, B=1, s=0.3 (what the autotuner chooses from);
* every ``gemv_mn`` (q_proj) and ``gemv_swiglu`` config candidate at B=1, s in {0, 0.5}, against cuBLAS:
  the per-tile kernel (configs ``BN, BK``) and the split kernel (``BN, BK, SPLIT, SMAX``: dense-sized
  grid over the device-compacted active tiles x K splits); the row marked "(default)" is the untuned
  default (``_gemv_mn_cands``' first entry).

Masks are Bernoulli(1 - s) per (row, group).  Each op is captured ~20 times (or more) into one CUDA graph
and the replay time / count is reported (median of the replays, after warm-up), which removes the launch
floor as in the engine's decode step.  Successive copies use different weight copies, enough that the
bytes touched between two uses of one copy exceed the L2 cache: weights come from HBM as in a real step.
Every timed op is also checked against a PyTorch reference (relative L2 error; router: fraction of equal
decisions, after the graph replays).

GPU (< 120 s on an H200)::

    PYTHONPATH=src python3 benchmarks/e2e/decode_probe.py --out $OUT

(with the gemv_mn / gemv_swiglu config parts, give it ``--budget 240``) writes ``$OUT/decode_probe.json``, ``$OUT/decode_probe.md`` and the autotuning cache it filled
(``$OUT/autotune/kernel_autotune.json``), and prints the table.  A part that fails is skipped with its error
recorded; parts still pending when ``--budget`` seconds have passed are skipped.  ``--smoke`` runs tiny
shapes on the CPU under ``TRITON_INTERPRET=1`` (wall-clock, no graphs) to check that the script works.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from types import SimpleNamespace


class _ProbeRouter(SimpleNamespace):
    """A router's weights without the module (weak-referenceable: the fused router caches W1's bf16 pieces per
    router in a WeakKeyDictionary)."""

    __hash__ = object.__hash__  # identity, as for the nn.Module routers (SimpleNamespace compares by value)
    __eq__ = object.__eq__

def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="output folder (created)")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU under TRITON_INTERPRET=1")
    p.add_argument("--budget", type=float, default=90.0, help="seconds after which pending parts are skipped")
    p.add_argument("--reps", type=int, default=20, help="minimum copies of an op inside one graph")
    p.add_argument("--replays", type=int, default=15, help="timed graph replays (median)")
    p.add_argument("--B", default="1,4", help="comma-separated decode batch sizes (rows; default: 1,4)")
    p.add_argument("--parts", default="router,gemv",
                   help="comma-separated parts to run: router, gemv (the GEMV ops and their configs), mn-up (every gemv_mn "
                   "config at the up shape, s = 0 and 0.5); default router,gemv")
    return p.parse_args(argv)


ARGS = None
if __name__ == "__main__":
    ARGS = _parse(sys.argv[1:])
    if ARGS.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton.jit decorates the kernels
    os.makedirs(ARGS.out, exist_ok=True)
    os.environ.setdefault("WIDE_CACHE_DIR", os.path.join(os.path.abspath(ARGS.out), "autotune"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from wide.inference import fused  # noqa: E402
from wide.kernels import decode, gemv_k, gemv_mn, gemv_swiglu  # noqa: E402
from wide.kernels.reference import gemm_k_ref, gemm_mn_ref, swiglu_ref  # noqa: E402
from wide.routing import argmax_mask  # noqa: E402

# Llama-3.1-8B
FULL = dict(D=4096, FF=14336, G_FFN=128, G_ATT=512, NG_ATT=8, RANK=16)
SMOKE = dict(D=64, FF=96, G_FFN=16, G_ATT=32, NG_ATT=2, RANK=16)


class Probe:
    def __init__(self, args):
        self.args = args
        self.smoke = args.smoke
        self.dev = torch.device("cpu" if self.smoke else "cuda")
        self.t0 = time.time()
        self.rows: list[dict] = []
        self.parts: dict[str, str] = {}
        self.l2 = 50 << 20
        if not self.smoke:
            self.l2 = int(getattr(torch.cuda.get_device_properties(self.dev), "L2_cache_size", 0) or self.l2)
        self.gen = torch.Generator(device="cpu").manual_seed(0)

    # ---------------------------------------------------------------- helpers
    def randn(self, *shape, dtype=torch.bfloat16, std=1.0):
        return (torch.randn(*shape, generator=self.gen) * std).to(dtype).to(self.dev)

    def mask(self, M, NG, s):
        return (torch.rand(M, NG, generator=self.gen) >= s).to(self.dev)

    def copies(self, nbytes):
        """Weight copies so that cycling through them touches > 2.5x the L2 between two uses of one copy."""
        if self.smoke:
            return 1
        return max(1, min(512, math.ceil(2.5 * self.l2 / max(1, nbytes))))

    def time_ops(self, fns):
        """Median seconds per op of ``fns`` (closures, run in order) replayed in one CUDA graph."""
        if self.smoke:
            for f in fns:
                f()
            t = time.perf_counter()
            for f in fns:
                f()
            return (time.perf_counter() - t) / len(fns)
        for f in fns[:2]:
            f()  # compile / autotune outside the capture
        torch.cuda.synchronize()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for f in fns[:2]:
                f()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for f in fns:
                f()
        for _ in range(3):
            g.replay()
        torch.cuda.synchronize()
        ts = []
        for _ in range(self.args.replays):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            g.replay()
            b.record()
            b.synchronize()
            ts.append(a.elapsed_time(b) * 1e-3 / len(fns))
        ts.sort()
        del g
        return ts[len(ts) // 2]

    def n_ops(self, ncopy):
        return max(self.args.reps, ncopy) if not self.smoke else 1

    def part(self, name, fn):
        if time.time() - self.t0 > self.args.budget:
            self.parts[name] = f"skipped: time budget of {self.args.budget:.0f} s spent"
            print(f"[probe] {name}: {self.parts[name]}", flush=True)
            return
        t = time.time()
        try:
            fn()
            self.parts[name] = f"ok ({time.time() - t:.1f} s)"
        except Exception as e:  # fail soft: record and go on
            self.parts[name] = f"skipped: {type(e).__name__}: {e}"
            traceback.print_exc()
        print(f"[probe] {name}: {self.parts[name]}", flush=True)

    def add(self, **row):
        self.rows.append(row)

    @staticmethod
    def rel(out, ref):
        o, r = out.double().cpu(), ref.double().cpu()
        n = r.norm().item()
        return (o - r).norm().item() / n if n > 0 else o.abs().max().item()

    # ---------------------------------------------------------------- parts
    def router(self, kind, N, B):
        S = FULL if not self.smoke else SMOKE
        D, r = S["D"], S["RANK"]
        nbytes = (D * r + 2 * N * r + r + 2 * N) * 4
        ncopy = self.copies(nbytes)
        routers = []
        for _ in range(ncopy):
            w1 = SimpleNamespace(weight=self.randn(r, D, dtype=torch.float32, std=D ** -0.5),
                                 bias=self.randn(r, dtype=torch.float32, std=0.1), out_features=r, in_features=D)
            w2 = SimpleNamespace(weight=self.randn(2 * N, r, dtype=torch.float32),
                                 bias=self.randn(2 * N, dtype=torch.float32, std=0.5), out_features=2 * N,
                                 in_features=r)
            routers.append(_ProbeRouter(w1=w1, w2=w2, n_groups=N))
        x = self.randn(B, 1, D)
        n = self.n_ops(ncopy)

        def torch_ref(R):
            h = F.linear(F.linear(x.float(), R.w1.weight, R.w1.bias), R.w2.weight, R.w2.bias)
            return argmax_mask(h.view(*x.shape[:-1], N, 2))

        want = [torch_ref(routers[i % ncopy]) for i in range(n)]
        res = {}
        impls = [("split-D kernel", fused.router_mask), ("row kernel (old)", fused._router_mask_rowwise),
                 ("torch", lambda R, x: torch_ref(R))]
        if r >= 16:  # the two ways the split-D kernel's last program can finish the rows, forced
            impls += [(f"split-D, finish {'dot' if d else 'rows'}{f', {p} programs' if p else ''}",
                       lambda R, x, d=d, p=p: fused._router_launch(R, x.view(-1, D), dot=d, programs=p).view(
                           *x.shape[:-1], N))
                      for d in (True, False) for p in (None, 32, 16)]
        if x.dtype == torch.bfloat16:  # two launches: a GEMM against W1's three bf16 pieces, then the finish
            impls.append(("GEMM (W1 in 3 pieces) + finish", lambda R, x: fused._router_mm_launch(
                R, x.view(-1, D)).view(*x.shape[:-1], N)))
        for name, f in impls:
            outs = [None] * n

            def mk(i, f=f, outs=outs):
                def run():
                    outs[i] = f(routers[i % ncopy], x)
                return run

            res[name] = self.time_ops([mk(i) for i in range(n)])
            if not self.smoke:
                torch.cuda.synchronize()
            agree = min(float((o == w).float().mean()) for o, w in zip(outs, want) if o is not None)
            self.add(op=f"router {kind} (N_G={N})", B=B, s=None, impl=name, us=res[name] * 1e6,
                     baseline_us=None, check=f"decisions equal {agree:.4f}", bytes=nbytes)
        new = res["split-D kernel"]
        for row in self.rows[-len(impls):]:
            row["baseline_us"] = res["torch"] * 1e6
            row["speedup"] = res["torch"] / (row["us"] * 1e-6)
        self.add(op=f"router {kind} (N_G={N})", B=B, s=None, impl="new vs old", us=new * 1e6,
                 baseline_us=res["row kernel (old)"] * 1e6, speedup=res["row kernel (old)"] / new, check="",
                 bytes=nbytes)

    def _routed_gemv(self, label, impl, fn, ref, N, K, G, B, sparsities, groups):
        """One [N, K] weight, routed over ``groups`` groups of G (K for gemv_k, N for gemv_mn), vs cuBLAS."""
        nbytes = N * K * 2
        ncopy = self.copies(nbytes)
        ws = [self.randn(N, K, std=K ** -0.5) for _ in range(ncopy)]
        a = self.randn(B, K)
        n = self.n_ops(ncopy)
        out = torch.empty(B, N, dtype=torch.bfloat16, device=self.dev)
        dense = self.time_ops([lambda i=i: torch.matmul(a, ws[i % ncopy].t(), out=out) for i in range(n)])
        for s in sparsities:
            route = self.mask(B, groups, s)
            active = route.any(0).float().mean().item()
            o = torch.empty(B, N, dtype=torch.bfloat16, device=self.dev)
            t = self.time_ops([lambda i=i: fn(a, ws[i % ncopy], route, G, out=o) for i in range(n)])
            err = self.rel(o, ref(a.double(), ws[(n - 1) % ncopy].double(), route, G))
            self.add(op=label, B=B, s=s, impl=impl, us=t * 1e6, baseline_us=dense * 1e6, speedup=dense / t,
                     active=active, GBps=active * nbytes / t * 1e-9, dense_GBps=nbytes / dense * 1e-9,
                     check=f"rel err {err:.1e}", bytes=nbytes)

    def gemv_k(self, name, N, K, G, B, sparsities):
        self._routed_gemv(f"gemv_k {name} (N={N},K={K},G={G})", "gemv_k", gemv_k, gemm_k_ref, N, K, G, B,
                          sparsities, K // G)

    def gemv_k_configs(self, N, K, G, B, s):
        nbytes = N * K * 2
        ncopy = self.copies(nbytes)
        ws = [self.randn(N, K, std=K ** -0.5) for _ in range(ncopy)]
        a = self.randn(B, K)
        route = self.mask(B, K // G, s)
        active = route.any(0).float().mean().item()
        n = self.n_ops(ncopy)
        cands = decode._gemv_k_cands(G, K, N, B)
        orig = decode._gemv_k_cands
        o = torch.empty(B, N, dtype=torch.bfloat16, device=self.dev)
        try:
            for c in cands:
                if time.time() - self.t0 > self.args.budget:
                    break
                decode._gemv_k_cands = lambda *_, c=c: [dict(c)]
                try:
                    t = self.time_ops([lambda i=i: gemv_k(a, ws[i % ncopy], route, G, out=o) for i in range(n)])
                    err = self.rel(o, gemm_k_ref(a.double(), ws[(n - 1) % ncopy].double(), route, G))
                    self.add(op=f"gemv_k config down (N={N},K={K},G={G})", B=B, s=s, impl=json.dumps(c),
                             us=t * 1e6, baseline_us=None, active=active, GBps=active * nbytes / t * 1e-9,
                             check=f"rel err {err:.1e}", bytes=nbytes)
                except Exception as e:
                    self.add(op="gemv_k config", B=B, s=s, impl=json.dumps(c), us=None, check=f"failed: {e}")
        finally:
            decode._gemv_k_cands = orig

    def mn_configs(self, swiglu, N, K, G, B, s, name="q_proj"):
        """Every ``_gemv_mn_cands`` config of gemv_mn (one [N, K] weight) or gemv_swiglu (gate + up), forced in
        turn, vs cuBLAS (x @ w.T, or gate and up)."""
        nw = 2 if swiglu else 1
        nbytes = nw * N * K * 2
        ncopy = self.copies(nbytes)
        ws = [[self.randn(N, K, std=K ** -0.5) for _ in range(ncopy)] for _ in range(nw)]
        a = self.randn(B, K)
        route = self.mask(B, N // G, s)
        active = route.any(0).float().mean().item()
        n = self.n_ops(ncopy)
        od = [torch.empty(B, N, dtype=torch.bfloat16, device=self.dev) for _ in range(nw)]

        def dense_op(i):
            for j in range(nw):
                torch.matmul(a, ws[j][i % ncopy].t(), out=od[j])

        dense = self.time_ops([lambda i=i: dense_op(i) for i in range(n)])
        if swiglu:
            fn = lambda i, o: gemv_swiglu(a, ws[0][i % ncopy], ws[1][i % ncopy], route, G, out=o)  # noqa: E731
            label = f"gemv_swiglu config (N={N},K={K},G={G})"
        else:
            fn = lambda i, o: gemv_mn(a, ws[0][i % ncopy], route, G, out=o)  # noqa: E731
            label = f"gemv_mn config {name} (N={N},K={K},G={G})"
        j = (n - 1) % ncopy
        ref = (swiglu_ref(a.double(), ws[0][j].double(), ws[1][j].double(), route, G) if swiglu
               else gemm_mn_ref(a.double(), ws[0][j].double(), route, G))
        cands = decode._gemv_mn_cands(K, swiglu, G, N)
        orig = decode._gemv_mn_cands
        o = torch.empty(B, N, dtype=torch.bfloat16, device=self.dev)
        try:
            for k, c in enumerate(cands):
                if time.time() - self.t0 > self.args.budget:
                    break
                decode._gemv_mn_cands = lambda *_, c=c: [dict(c)]
                kind = ("split" if "SPLIT" in c else "tile") + (
                    " (default)" if k == 0 else "")
                try:
                    t = self.time_ops([lambda i=i: fn(i, o) for i in range(n)])
                    err = self.rel(o, ref)
                    self.add(op=label, B=B, s=s, impl=f"{kind} {json.dumps(c)}", us=t * 1e6,
                             baseline_us=dense * 1e6, speedup=dense / t, active=active,
                             GBps=active * nbytes / t * 1e-9, dense_GBps=nbytes / dense * 1e-9,
                             check=f"rel err {err:.1e}", bytes=nbytes)
                except Exception as e:
                    self.add(op=label, B=B, s=s, impl=f"{kind} {json.dumps(c)}", us=None, check=f"failed: {e}")
        finally:
            decode._gemv_mn_cands = orig

    def swiglu(self, N, K, G, B, sparsities):
        nbytes = 2 * N * K * 2
        ncopy = self.copies(nbytes)
        wg = [self.randn(N, K, std=K ** -0.5) for _ in range(ncopy)]
        wu = [self.randn(N, K, std=K ** -0.5) for _ in range(ncopy)]
        x = self.randn(B, K)
        n = self.n_ops(ncopy)
        og = torch.empty(B, N, dtype=torch.bfloat16, device=self.dev)
        ou = torch.empty_like(og)

        def dense_op(i):
            torch.matmul(x, wg[i % ncopy].t(), out=og)
            torch.matmul(x, wu[i % ncopy].t(), out=ou)

        dense = self.time_ops([lambda i=i: dense_op(i) for i in range(n)])
        for s in sparsities:
            route = self.mask(B, N // G, s)
            active = route.any(0).float().mean().item()
            o = torch.empty(B, N, dtype=torch.bfloat16, device=self.dev)
            t = self.time_ops([lambda i=i: gemv_swiglu(x, wg[i % ncopy], wu[i % ncopy], route, G, out=o)
                               for i in range(n)])
            j = (n - 1) % ncopy
            err = self.rel(o, swiglu_ref(x.double(), wg[j].double(), wu[j].double(), route, G))
            self.add(op=f"gemv_swiglu (N={N},K={K},G={G})", B=B, s=s, impl="gemv_swiglu", us=t * 1e6,
                     baseline_us=dense * 1e6, speedup=dense / t, active=active, GBps=active * nbytes / t * 1e-9,
                     dense_GBps=nbytes / dense * 1e-9, check=f"rel err {err:.1e}", bytes=nbytes)

    def gemv_mn(self, N, K, G, B, sparsities):
        self._routed_gemv(f"gemv_mn q_proj (N={N},K={K},G={G})", "gemv_mn", gemv_mn, gemm_mn_ref, N, K, G, B,
                          sparsities, N // G)

    # ---------------------------------------------------------------- driver
    def run(self):
        S = SMOKE if self.smoke else FULL
        D, FF, GF, GA = S["D"], S["FF"], S["G_FFN"], S["G_ATT"]
        sp = (0.0, 0.3, 0.5)
        Bs = tuple(int(b) for b in self.args.B.split(","))
        want = set(self.args.parts.split(","))
        if "router" in want:
            for B in Bs:
                self.part(f"router B={B}", lambda B=B: (self.router("attn", S["NG_ATT"], B),
                                                        self.router("ffn", FF // GF, B)))
        if "mn-up" in want:  # one weight of the up shape: which config serves s = 0 and s = 0.5 alike
            for s in (0.0, 0.5):
                self.part(f"gemv_mn configs up B=1 s={s}", lambda s=s: self.mn_configs(False, FF, D, GF, 1, s, "up"))
        if "gemv" not in want:
            return
        for B in Bs:
            self.part(f"gemv_k down B={B}", lambda B=B: self.gemv_k("down", D, FF, GF, B, sp))
            self.part(f"gemv_k o_proj G={GA} B={B}", lambda B=B: self.gemv_k("o_proj", D, D, GA, B, sp))
            self.part(f"gemv_k o_proj G={GF} B={B}", lambda B=B: self.gemv_k("o_proj", D, D, GF, B, sp))
            self.part(f"gemv_swiglu B={B}", lambda B=B: self.swiglu(FF, D, GF, B, sp))
            self.part(f"gemv_mn q_proj B={B}", lambda B=B: self.gemv_mn(D, D, GA, B, sp))
        for s in (0.0, 0.5):
            self.part(f"gemv_mn configs q_proj B=1 s={s}", lambda s=s: self.mn_configs(False, D, D, GA, 1, s))
            self.part(f"gemv_swiglu configs B=1 s={s}", lambda s=s: self.mn_configs(True, FF, D, GF, 1, s))
        self.part("gemv_k configs down B=1 s=0.3", lambda: self.gemv_k_configs(D, FF, GF, 1, 0.3))

    def report(self):
        import triton

        meta = dict(device=getattr(self, "device_name", None) or (
                        "cpu (TRITON_INTERPRET=1, smoke)" if self.smoke else torch.cuda.get_device_name(self.dev)),
                    torch=torch.__version__, triton=triton.__version__, smoke=self.smoke,
                    l2_bytes=self.l2, elapsed_s=round(time.time() - self.t0, 1), timing=(
                        "wall clock, 1 run" if self.smoke else
                        f"CUDA graph of >= {self.args.reps} copies, median of {self.args.replays} replays / copies"))
        cache = os.path.join(os.environ.get("WIDE_CACHE_DIR", ""), "kernel_autotune.json")
        tuned = {}
        try:
            with open(cache) as f:
                tuned = {k: v for k, v in json.load(f).items() if k.startswith(("gemv", "gemm"))}
        except OSError:
            pass
        doc = dict(meta=meta, parts=self.parts, rows=self.rows, autotune=tuned)
        with open(os.path.join(self.args.out, "decode_probe.json"), "w") as f:
            json.dump(doc, f, indent=1)

        def fmt(v, spec):
            return "–" if v is None else format(v, spec)

        lines = [f"# decode probe ({meta['device']}, torch {meta['torch']}, triton {meta['triton']})", "",
                 f"timing: {meta['timing']}; speedup = baseline / WIDE (router: vs torch, 'new vs old' row: "
                 "vs the former kernel; GEMVs: vs cuBLAS dense). GB/s counts the weight bytes of the active groups.",
                 "", "| op | B | s | impl | µs | baseline µs | speedup | active | GB/s | dense GB/s | check |",
                 "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in self.rows:
            lines.append(f"| {r['op']} | {r['B']} | {fmt(r.get('s'), '.1f')} | {r.get('impl', '')} | "
                         f"{fmt(r.get('us'), '.1f')} | {fmt(r.get('baseline_us'), '.1f')} | "
                         f"{fmt(r.get('speedup'), '.2f')} | {fmt(r.get('active'), '.2f')} | "
                         f"{fmt(r.get('GBps'), '.0f')} | {fmt(r.get('dense_GBps'), '.0f')} | {r.get('check', '')} |")
        lines += ["", "| part | status |", "|---|---|"] + [f"| {k} | {v} |" for k, v in self.parts.items()]
        lines += ["", f"elapsed {meta['elapsed_s']} s"]
        text = "\n".join(lines) + "\n"
        with open(os.path.join(self.args.out, "decode_probe.md"), "w") as f:
            f.write(text)
        print(text, flush=True)


def main(args) -> int:
    if not args.smoke and not torch.cuda.is_available():
        print("decode_probe: no CUDA device (use --smoke for the CPU check)", file=sys.stderr)
        os.makedirs(args.out, exist_ok=True)
        p = Probe.__new__(Probe)
        p.args, p.smoke, p.rows, p.t0, p.l2, p.device_name = args, False, [], time.time(), 0, "no CUDA device"
        p.parts = {"all": "skipped: no CUDA device"}
        p.report()
        return 0
    torch.backends.cuda.matmul.allow_tf32 = False
    p = Probe(args)
    try:
        p.run()
    finally:
        p.report()
    return 0


if __name__ == "__main__":
    sys.exit(main(ARGS))
