"""Shared helpers for the routed kernels: Triton guard, argument checks, the reorder result type,
and the on-disk autotuning cache.

Triton is imported in a guarded way: ``import wide.kernels`` works without Triton installed.  The
public ops then run the plain PyTorch reference (see :func:`use_triton`).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import statistics
import tempfile
import threading
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from wide.config import cache_dir  # noqa: F401 - re-exported: the autotuning cache's directory

try:  # pragma: no cover - exercised implicitly
    from wide.errors import WideError as _KernelError
except Exception:  # pragma: no cover
    _KernelError = ValueError

try:
    import triton  # noqa: F401
    import triton.language as tl  # noqa: F401

    HAS_TRITON = True
except Exception:  # pragma: no cover - only without triton
    triton = None
    tl = None
    HAS_TRITON = False


class KernelArgumentError(_KernelError):
    """Bad argument to a routed kernel; a ``ValueError`` naming the value and what is allowed."""


class Reordered(NamedTuple):
    """Result of :func:`wide.kernels.reorder` (Eq. 7, Algorithm 1).

    Attributes:
        index: int32 ``[..., M, N_G]``. ``index[j, g]`` is the original row of the j-th row of
            routing column g after the stable descending sort; active rows form the prefix.
        mask: bool ``[..., M, N_G]``, the sorted mask: ``mask[j, g] = route[index[j, g], g]``,
            equivalently ``j < counts[g]``.
        counts: int32 ``[..., N_G]``, number of active rows per routing column.
    """

    index: torch.Tensor
    mask: torch.Tensor
    counts: torch.Tensor


HALF_DTYPES = (torch.float16, torch.bfloat16)
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def interpret_mode() -> bool:
    """True when Triton runs in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def small_or_fallback(x: torch.Tensor, M: int, N: int, out, ref, gemv):
    """Shared front of the routed GEMM ops (``gemm_mn``, ``swiglu``, ``gemm_k``).

    Returns the finished result, or ``None`` when the tiled Triton kernel must run:

    * no Triton for ``x`` (see :func:`use_triton`): ``ref()``, copied into ``out`` if given;
    * ``M == 0``: ``out`` or an empty ``[0, N]`` tensor of ``x``'s dtype and device;
    * ``M <= 4``: ``gemv()``, the reorder-free decode path (Appendix B, GEMV variants).

    ``ref`` and ``gemv`` are zero-argument callables, so only the chosen path is computed.
    """
    if not use_triton(x):
        res = ref()
        return out.copy_(res) if out is not None else res
    if M == 0:
        return out if out is not None else torch.empty((0, N), dtype=x.dtype, device=x.device)
    if M <= 4:
        return gemv()
    return None


def use_triton(t: torch.Tensor) -> bool:
    """Whether the Triton kernels run for tensor ``t``.

    Triton runs on CUDA tensors, or on CPU tensors under ``TRITON_INTERPRET=1``.  Otherwise
    (no Triton, or CPU without the interpreter) the public ops fall back to the PyTorch reference
    in :mod:`wide.kernels.reference`, computed in float32 and returned in the input dtype.  A CUDA tensor, or a
    CPU tensor under ``TRITON_INTERPRET=1``, without Triton installed gets one ``RuntimeWarning`` per process: the
    GPU then skips no pruned work, and the interpreter does not run the kernels.
    """
    if not HAS_TRITON:
        if t.is_cuda or (interpret_mode() and t.device.type == "cpu"):
            _warn_no_triton(t.device)
        return False
    if t.is_cuda:
        return True
    return interpret_mode() and t.device.type == "cpu"


_WARNED_NO_TRITON = []


def _warn_no_triton(device) -> None:
    """One RuntimeWarning per process: routed ops on a GPU, or on the CPU under ``TRITON_INTERPRET=1``, fall back to
    the references (Triton missing)."""
    if not _WARNED_NO_TRITON:
        _WARNED_NO_TRITON.append(True)
        import warnings

        what = ("no pruned work is skipped; slower than dense" if torch.device(device).type == "cuda"
                else "TRITON_INTERPRET=1 is set, but no Triton kernel runs in the interpreter")
        warnings.warn(f"wide.kernels: Triton is not installed, so the routed ops on {device} run their PyTorch "
                      f"references ({what}). Install Triton: the project's 'kernels' extra, "
                      f"pip install -e '.[kernels]' (triton==3.6.0)", RuntimeWarning, stacklevel=3)


def fail(msg: str) -> None:
    raise KernelArgumentError(msg)


def check_tensor(name: str, t, ndim: int | None = None, dtypes: Sequence[torch.dtype] | None = None):
    if not isinstance(t, torch.Tensor):
        fail(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        fail(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        fail(f"{name} has dtype {str(t.dtype).replace('torch.', '')}; allowed: {allowed}")


def check_same_device(**tensors: torch.Tensor) -> None:
    devs = {k: v.device for k, v in tensors.items() if v is not None}
    if len(set(devs.values())) > 1:
        desc = ", ".join(f"{k} on {v}" for k, v in devs.items())
        fail(f"all tensors must be on one device; got {desc}")


def check_group(G, dim: int, what: str) -> int:
    """G must be a positive multiple of 16 dividing ``dim`` (FFN: powers of two 16..512; attention
    projections: the head-group width, a multiple of head_dim such as 192)."""
    if isinstance(G, bool) or not isinstance(G, int):
        fail(f"G must be an int, got {G!r}")
    if G < 16 or G % 16 != 0:
        fail(f"G={G} is not allowed; G must be a multiple of 16 (FFN: 16, 32, ..., 512)")
    if dim % G != 0:
        fail(f"G={G} does not divide {what}={dim}")
    return G


def check_route(route: torch.Tensor, M: int, NG: int, name: str = "route") -> None:
    check_tensor(name, route, 2, (torch.bool,))
    if tuple(route.shape) != (M, NG):
        fail(f"{name} must have shape [M, N_G] = [{M}, {NG}], got {tuple(route.shape)}")


def check_reordered(r, shape: tuple, device: torch.device | None = None, name: str = "reordered") -> Reordered:
    """``r`` as a :class:`Reordered` whose index is int32 ``shape`` and counts int32 ``shape[:-2] + shape[-1:]``,
    on ``device`` (the route's) when given; index and counts are returned contiguous (the kernels index them
    row-major; a no-op for what :func:`wide.kernels.reorder` returns).

    Raises:
        ValueError (:class:`KernelArgumentError`): anything else, e.g. a tuple that does not hold three tensors,
            or tensors on another device than the route.
    """
    if not isinstance(r, tuple) or len(r) != 3 or not all(isinstance(t, torch.Tensor) for t in r):
        fail(f"{name} must be a Reordered(index, mask, counts) from wide.kernels.reorder; got "
             f"{type(r).__name__}{'' if not isinstance(r, tuple) else ' of ' + ', '.join(type(t).__name__ for t in r)}")
    r = Reordered(*r)
    if tuple(r.index.shape) != tuple(shape) or r.index.dtype != torch.int32:
        fail(f"{name}.index must be int32 with shape {tuple(shape)}, got {r.index.dtype} {tuple(r.index.shape)}")
    if tuple(r.counts.shape) != tuple(shape[:-2]) + (shape[-1],) or r.counts.dtype != torch.int32:
        fail(f"{name}.counts must be int32 with shape {tuple(shape[:-2]) + (shape[-1],)}, got "
             f"{r.counts.dtype} {tuple(r.counts.shape)}")
    if device is not None and (r.index.device != device or r.counts.device != device):
        fail(f"{name} must be on the route's device {device}; got index on {r.index.device}, counts on "
             f"{r.counts.device}")
    return Reordered(r.index.contiguous(), r.mask, r.counts.contiguous())


def check_no_overlap(out: torch.Tensor | None, *, _written: str = "out", **inputs: torch.Tensor | None) -> None:
    """Refuse an ``out`` whose memory overlaps one of ``inputs``: the kernels write tiles of ``out`` while other
    programs still read the inputs, so an aliased ``out`` would give a wrong result on the GPU (and the CPU
    reference, which computes before it copies, would hide it).  ``_written`` names the written tensor in the
    message (``"a"`` for an in-place ``overwrite_a``).

    Raises:
        ValueError (:class:`KernelArgumentError`): naming the overlapping input."""
    if out is None or out.numel() == 0 or out.device.type == "meta":
        return

    def span(t):
        extent = sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride())) + 1
        return t.data_ptr(), t.data_ptr() + extent * t.element_size()

    o0, o1 = span(out)
    for name, t in inputs.items():
        if t is None or t.numel() == 0 or t.device != out.device:
            continue
        t0, t1 = span(t)
        if o0 < t1 and t0 < o1:
            if _written != "out":
                fail(f"{_written} overlaps {name} in memory, and {_written} is written in place: pass tensors that "
                     f"do not share memory (or leave the in-place option off)")
            fail(f"out overlaps {name} in memory; the kernels read {name} while they write out: pass a separate "
                 "out tensor (or none)")


def check_in_place(a: torch.Tensor, what: str, layout: bool = True, **inputs: torch.Tensor | None) -> None:
    """A 2-D ``a`` that an op may overwrite in place (``overwrite_a=True``) must have no autograd history to break, no
    memory shared with ``inputs`` and, with ``layout`` (the op writes this very tensor rather than a copy), a unit
    column stride and rows that do not share memory (no ``expand``-ed or overlapping rows: row stride >= K).

    Raises:
        ValueError (:class:`KernelArgumentError`): naming ``what`` (the op and option) and the problem."""
    M, K = a.shape
    if M == 0 or K == 0:
        return
    if layout and a.stride(1) != 1:
        fail(f"{what} needs a with unit column stride, got strides {tuple(a.stride())}")
    if layout and M > 1 and abs(a.stride(0)) < K:
        fail(f"{what} needs a whose rows do not share memory (row stride >= K={K}), got strides {tuple(a.stride())} "
             "(an expanded or overlapping view): pass a.contiguous()")
    if a.requires_grad:
        fail(f"{what} cannot zero an a that requires grad in place (it would break autograd): pass a.detach() or "
             "leave it off")
    check_no_overlap(a, _written="a", **inputs)


def check_flag(name: str, value) -> bool:
    """``value`` must be a bool (not a truthy int or string).

    Raises:
        ValueError (:class:`KernelArgumentError`): naming the flag and the value."""
    if not isinstance(value, bool):
        fail(f"{name}={value!r} must be True or False")
    return value


def check_out(out, shape, dtype, device, name: str = "out", **inputs):
    """``out`` (None allowed) must be a contiguous ``shape`` tensor of ``dtype`` on ``device`` that overlaps none of
    ``inputs`` (name = tensor, see :func:`check_no_overlap`).

    Raises:
        ValueError (:class:`KernelArgumentError`): naming what is wrong with ``out``."""
    if out is None:
        return None
    check_tensor(name, out)
    if tuple(out.shape) != tuple(shape) or out.dtype != dtype or out.device != device:
        fail(f"{name} must be a {str(dtype).replace('torch.', '')} tensor of shape {tuple(shape)} on {device}; "
             f"got {str(out.dtype).replace('torch.', '')} {tuple(out.shape)} on {out.device}")
    if not out.is_contiguous():
        fail(f"{name} must be contiguous")
    check_no_overlap(out, **inputs)
    return out


def softmax_scale(scale, head_dim: int) -> float:
    """The attention softmax scale: ``1 / sqrt(head_dim)`` when ``scale`` is None, else ``float(scale)``.

    Raises:
        ValueError (:class:`KernelArgumentError`): a scale that is not a finite number (NaN, inf, not a number)."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    try:
        val = float(scale)
    except (TypeError, ValueError):
        val = float("nan")
    if not math.isfinite(val) or isinstance(scale, bool):
        fail(f"scale={scale!r} must be a finite number (default: 1/sqrt(head_dim))")
    return val


def pow2_part(G: int) -> int:
    """Largest power of two dividing G (the largest tile width that stays inside one group)."""
    return G & -G


TILE_COUNTERS: dict = {}  # (device, stream) -> int32 arrival counters, see tile_counters()


def tma_aligned(*tensors: torch.Tensor) -> bool:
    """Whether 2-D row-major ``tensors`` can be read through a TMA tensor descriptor: non-empty, 16-byte aligned
    base, a positive row stride that is a multiple of 16 bytes, unit column stride (the bulk tensor copy engine's
    rules; a broadcast row stride of 0 is not allowed).  A config that asks for TMA runs its pointer-load variant
    otherwise."""
    return all(t.numel() > 0 and t.data_ptr() % 16 == 0 and t.stride(0) > 0
               and (t.stride(0) * t.element_size()) % 16 == 0 and t.stride(1) == 1 for t in tensors)


def tile_counters(device: torch.device, n: int) -> torch.Tensor:
    """int32 arrival counters (at least ``n``, one per output tile) of the kernels whose last-arriving program
    finishes a tile (the split decode GEMVs, the split-D prefill router), one buffer per (device, stream).

    Zeroed once; the last program of each tile resets its counter, so no memset runs per call (CUDA-graph replays
    included).  Kernels on one stream run one after another, so they can share the buffer."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (str(device), stream)
    buf = TILE_COUNTERS.get(key)
    if buf is None or buf.numel() < n:
        buf = torch.zeros((max(n, 1024),), dtype=torch.int32, device=device)
        TILE_COUNTERS[key] = buf
    return buf


def next_pow2(x: int) -> int:
    return 1 if x <= 1 else 1 << (int(x) - 1).bit_length()


def m_bucket(M: int) -> int:
    """Autotuning key bucket for a row count (next power of two, capped)."""
    return min(next_pow2(M), 1 << 16)


# ----------------------------------------------------------------------------------------------
# Autotuning cache
# ----------------------------------------------------------------------------------------------

_CACHE_LOCK = threading.Lock()
_CACHE: dict | None = None
_LAUNCHABLE: dict = {}  # untuned choices that were checked to launch (this process only, never written)


def _cache_path() -> str:
    return os.path.join(cache_dir(), "kernel_autotune.json")


def _load_cache() -> dict:
    global _CACHE
    if _CACHE is None:
        try:
            with open(_cache_path()) as f:
                _CACHE = json.load(f)
        except Exception:
            _CACHE = {}
    return _CACHE


def _store_cache(key: str, value: dict) -> None:
    path = _cache_path()
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        try:
            with open(path) as f:
                disk = json.load(f)
        except Exception:
            disk = {}
        disk.update(_load_cache())
        disk[key] = value
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tune")
        with os.fdopen(fd, "w") as f:
            json.dump(disk, f, indent=0, sort_keys=True)
        os.replace(tmp, path)
    except OSError:
        pass  # cache is an optimisation only


def _device_tag(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device).replace(" ", "_")
    return device.type


def _capturing() -> bool:
    try:
        return torch.cuda.is_current_stream_capturing()
    except Exception:
        return False


def _graph_time_ms(run: Callable[[dict], None], cfg: dict, device: torch.device, copies: int = 20,
                   replays: int = 10) -> float:
    """Median milliseconds of one ``run(cfg)`` replayed inside a CUDA graph of ``copies`` launches.

    For microsecond kernels (decode GEMVs) the time between launches, not the kernel, dominates an
    eager ``do_bench``; inside a graph only GPU time counts, as in the engine's decode step.  ``run`` is
    called once eagerly on the capture stream first, so per-stream scratch (split-K arrival counters)
    is allocated outside the capture.
    """
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        run(cfg)
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(copies):
            run(cfg)
    graph.replay()
    torch.cuda.synchronize(device)
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / copies)
    del graph
    return statistics.median(times)


def _out_of_resources() -> tuple:
    try:
        from triton.runtime.errors import OutOfResources

        return (OutOfResources,)
    except Exception:  # noqa: BLE001 - no Triton / another layout: nothing to catch
        return ()


def first_launchable(candidates: Sequence[dict], run: Callable[[dict], None]) -> dict:
    """The first of ``candidates`` whose launch does not run out of GPU resources.

    A config's shared memory grows with the element size, so a tile list sized for bf16 can hold
    configs that do not fit an fp32 model (e.g. 245,760 B asked of the H200's 232,448 B).  Each
    ``run(cfg)`` is a real launch (``run`` must be repeatable, as for tuning); Triton raises
    ``OutOfResources`` before anything is queued.  Other errors propagate.

    Raises:
        triton.runtime.errors.OutOfResources: no candidate fits.
    """
    oor = _out_of_resources()
    last = None
    for c in candidates:
        try:
            run(c)
            return dict(c)
        except oor as e:  # noqa: PERF203 - one try per candidate
            last = e
    raise last


def pick_config(op: str, key: tuple, device: torch.device, candidates: Sequence[dict],
                run: Callable[[dict], None], graph: bool = False) -> dict:
    """Return the fastest of ``candidates`` for ``(op, key)`` on this GPU, tuning once.

    Tuning times each candidate with ``triton.testing.do_bench`` (median over a 40-ms window), or with
    ``graph=True`` as the median of CUDA-graph replays of 20 launches (:func:`_graph_time_ms`; for
    microsecond decode kernels, whose eager timing is mostly launch overhead), and stores the winner in
    ``$WIDE_CACHE_DIR/kernel_autotune.json`` (default ``~/.cache/wide``), so a second process reuses
    it.  Tuning never happens during CUDA-graph capture, under the interpreter, or with
    ``WIDE_AUTOTUNE=0``: then the cached winner is used, or else (``WIDE_AUTOTUNE=0``) the first
    candidate that launches (:func:`first_launchable`; remembered, so a later capture of the same
    shape reuses it), or during a capture ``candidates[0]``.  The cache key holds ``op``, the GPU's name,
    Triton's version, ``key`` and a hash of the candidate list, so a list that changes (a newer wide) is
    tuned afresh rather than served the old winner.  ``run(cfg)`` must launch the op with
    config ``cfg`` and be repeatable (it may write scratch outputs).
    """
    if len(candidates) == 1 or device.type != "cuda":
        return dict(candidates[0])
    # the candidate list is part of the key: a library version that adds a candidate re-tunes instead of reusing
    # the old winner
    cands_tag = hashlib.sha1(repr([sorted(c.items()) for c in candidates]).encode()).hexdigest()[:8]
    skey = (f"{op}|{_device_tag(device)}|triton{getattr(triton, '__version__', '?')}|" + ",".join(map(str, key))
            + f"|c{cands_tag}")
    with _CACHE_LOCK:
        cache = _load_cache()
        hit = cache.get(skey)
    if hit is not None:
        for c in candidates:
            if c == hit:
                return dict(c)
    if _capturing():
        return dict(_LAUNCHABLE.get(skey, candidates[0]))
    if os.environ.get("WIDE_AUTOTUNE", "1") == "0":
        if skey not in _LAUNCHABLE:
            _LAUNCHABLE[skey] = first_launchable(candidates, run)
        return dict(_LAUNCHABLE[skey])
    from triton.testing import do_bench

    best, best_t = None, float("inf")
    for c in candidates:
        try:
            run(c)  # compile + warm
            torch.cuda.synchronize(device)
            if graph:
                t = _graph_time_ms(run, c, device)
            else:
                t = do_bench(lambda: run(c), warmup=5, rep=40, return_mode="median")
        except Exception:  # a config that fails to compile (e.g. too much shared memory)
            continue
        if t < best_t:
            best, best_t = c, t
    if best is None:
        best = candidates[0]
    with _CACHE_LOCK:
        _load_cache()[skey] = dict(best)
        _store_cache(skey, dict(best))
    return dict(best)


_RESIDENT: dict = {}


def resident_programs(kernel, key: tuple, device: torch.device, args: tuple, consts: dict, opts: dict,
                      fallback: int = 2) -> int:
    """Programs of ``kernel`` (a ``triton.jit`` function) that run at once on the whole GPU: SMs x the programs one
    SM holds, limited by its shared memory, registers and threads for the compiled kernel (no launch; cached per
    ``key``).  ``args`` / ``consts`` / ``opts`` (``num_warps`` / ``num_stages``) are those of the real launch.
    ``fallback`` programs per SM if the compiled kernel cannot be inspected."""
    props = torch.cuda.get_device_properties(device)
    key = (device.index, *key)
    if key not in _RESIDENT:
        warps = opts.get("num_warps", 4)
        try:
            k = kernel.warmup(*args, grid=(1,), **consts, **opts)
            k._init_handles()
            smem = getattr(props, "shared_memory_per_multiprocessor", 0) or 228 * 1024
            regs = getattr(props, "regs_per_multiprocessor", 0) or 65536
            threads = getattr(props, "max_threads_per_multi_processor", 0) or 2048
            shared = int(getattr(k.metadata, "shared", 0)) + 1024  # + the 1 KB the driver reserves per block
            per_sm = min(smem // shared, regs // max(1, int(k.n_regs) * 32 * warps), threads // (32 * warps), 32)
        except Exception:  # an inspection API that moved: the estimate only sets how work is split
            per_sm = fallback
        _RESIDENT[key] = max(1, int(per_sm))
    return _RESIDENT[key] * props.multi_processor_count


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA ``device`` (the program count of a persistent grid); 3 elsewhere (the
    interpreter), so that a persistent kernel's programs each take several tiles in the CPU tests."""
    if device.type != "cuda":
        return 3
    return torch.cuda.get_device_properties(device).multi_processor_count


def cfg_kwargs(cfg: dict) -> dict:
    return {k: v for k, v in cfg.items() if k not in ("num_warps", "num_stages")}


def launch_opts(cfg: dict) -> dict:
    if interpret_mode():
        return {}
    return {"num_warps": cfg.get("num_warps", 4), "num_stages": cfg.get("num_stages", 3)}


if HAS_TRITON:
    # Triton 3.6's CPU interpreter computes bf16 ``tl.dot`` wrongly; under the interpreter the
    # operands are upcast to fp32 (exact for bf16/fp16 inputs).  Compiled kernels use native MMA.
    DOT_F32 = tl.constexpr(interpret_mode())

    @triton.jit
    def mma(a, b, acc):
        """``acc + a @ b`` with fp32 accumulation.  fp32 operands multiply in full fp32 (``ieee``), like
        torch's default fp32 matmul, not TF32."""
        if DOT_F32:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        if a.dtype == tl.float32:
            return tl.dot(a, b, acc, input_precision="ieee")
        return tl.dot(a, b, acc)

    @triton.jit
    def swiglu_act(g, u, DT: tl.constexpr):
        """``silu(g) * u`` from fp32 accumulators with the rounding points of the model's own MLP in
        dtype DT (``act_fn(gate_proj(x)) * up_proj(x)``: gate, up, SiLU and product each rounded to DT),
        so the fused kernel computes what the unfused model computes; a no-op rounding in fp32."""
        g = round_to(g, DT)
        u = round_to(u, DT)
        a = round_to(g / (1.0 + tl.exp(-g)), DT)
        return a * u

    @triton.jit
    def round_to(x, DT: tl.constexpr):
        """fp32 ``x`` rounded to dtype DT (round to nearest even) and returned as fp32.  Triton 3.6's CPU
        interpreter casts fp32 to bf16 by truncation; there the rounding is done on the bits."""
        if DOT_F32 and DT == tl.bfloat16:
            b = x.to(tl.uint32, bitcast=True)
            b = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) << 16
            return b.to(tl.float32, bitcast=True)
        else:
            return x.to(DT).to(tl.float32)

    @triton.jit
    def left_pad_at(lp_ptr, b, Tk):
        """``left_pad[b]`` clamped to ``[0, Tk]`` before the int32 cast (int32 or int64 ``left_pad``): a negative
        pad masks no key, one ``>= Tk`` every key, as in :func:`wide.kernels.reference.attention_ref`, and no key
        index leaves the K / V buffers."""
        return tl.minimum(tl.maximum(tl.load(lp_ptr + b), 0), Tk).to(tl.int32)

    @triton.jit
    def mm(a, b):
        """``a @ b`` in fp32 (fp32 operands: ``ieee``, as :func:`mma`)."""
        if DOT_F32:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        if a.dtype == tl.float32:
            return tl.dot(a, b, input_precision="ieee")
        return tl.dot(a, b)
