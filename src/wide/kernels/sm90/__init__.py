"""CuTe backend on sm_90a (H100 / H200) of :func:`wide.kernels.gemm_mn` and :func:`wide.kernels.swiglu` (Algorithm 2),
of :func:`wide.kernels.o_proj` in the shared token order (Eq. 21) and of :func:`wide.kernels.routed_attention` for
prefill (Algorithm 4).

``gemm_mn_sm90.cu`` and ``attention_sm90.cu`` (CUTLASS 4 / CuTe headers from the ``nvidia-cutlass`` package, no torch
headers) and the thin torch binding ``binding.cpp`` are built with nvcc through ``torch.utils.cpp_extension`` (ninja)
once per source hash, architecture and torch version into ``<cache_dir()>/sm90/<name>/<name>.so``
(:func:`build_name`), then loaded; a ``.so`` already at that path (built on another machine with the same sources,
torch and CUDA) is loaded as it is.
Where nvcc, the headers or an sm_90 GPU are missing, or the build fails, :func:`module` returns None after one
warning line per process and the Triton kernels run.
"""

import functools
import hashlib
import importlib.util
import os
import shutil
import warnings

import torch

from wide.kernels._common import cache_dir, fail, tma_aligned, tuned_config

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCES = ("gemm_mn_sm90.cu", "attention_sm90.cu", "binding.cpp")
HEADERS = ("gemm_mn_sm90.h", "gemm_schedule_sm90.cuh", "attention_sm90.h", "attention_sm90_config.cuh",
           "common_sm90.cuh")
ARCH_FLAG = "-gencode=arch=compute_90a,code=sm_90a"
OPS = {"gemm_mn": 0, "swiglu": 1, "dense_swiglu": 2}
_WARNED: list = []


def cutlass_include() -> str | None:
    """``include`` folder of the CUTLASS / CuTe headers shipped by ``nvidia-cutlass`` (not imported), or None."""
    try:
        spec = importlib.util.find_spec("cutlass_library")
    except (ImportError, ValueError):
        return None
    for root in ([os.path.dirname(spec.origin)] if spec and spec.origin else []) + list(
            (spec.submodule_search_locations or []) if spec else []):
        inc = os.path.join(root, "source", "include")
        if os.path.isfile(os.path.join(inc, "cute", "tensor.hpp")):
            return inc
    return None


def nvcc() -> str | None:
    """Path of nvcc: ``$CUDA_HOME/bin/nvcc`` or the one on PATH; None when there is none."""
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home and os.path.isfile(os.path.join(home, "bin", "nvcc")):
        return os.path.join(home, "bin", "nvcc")
    return shutil.which("nvcc")


def nvcc_flags(include: str) -> list[str]:
    """nvcc flags of the kernel source (the CI compile test uses the same)."""
    return ["-O3", "-std=c++17", ARCH_FLAG, "--expt-relaxed-constexpr", "-DNDEBUG", f"-I{include}"]


def build_name(include: str) -> str:
    """``wide_sm90_<hash>``: a hash of the sources, the flags, torch's and CUDA's versions and the headers' package."""
    h = hashlib.sha256()
    for name in SOURCES + HEADERS:
        with open(os.path.join(HERE, name), "rb") as f:
            h.update(name.encode() + b"\0" + f.read())
    try:
        from importlib.metadata import version

        cutlass = version("nvidia-cutlass")
    except Exception:
        cutlass = include
    h.update(repr((nvcc_flags(""), torch.__version__, torch.version.cuda, cutlass)).encode())
    return "wide_sm90_" + h.hexdigest()[:16]


def build_dir(include: str) -> str:
    return os.path.join(cache_dir(), "sm90", build_name(include))


def _warn(why: str) -> None:
    if not _WARNED:
        _WARNED.append(why)
        warnings.warn(f"wide.kernels: the CuTe sm_90a backend is not used ({why}); the Triton kernels run",
                      RuntimeWarning, stacklevel=4)


def _load_prebuilt(name: str, folder: str):
    path = os.path.join(folder, name + ".so")
    if not os.path.isfile(path):
        return None
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@functools.cache
def _build():
    include, compiler = cutlass_include(), nvcc()
    if torch.version.cuda is None:
        return None, "torch was built without CUDA"
    try:
        mod = _load_prebuilt(build_name(include or ""), build_dir(include or ""))
    except Exception as e:  # a library that does not load here: rebuilt below
        mod = None
        warnings.warn(f"wide.kernels: rebuilding the CuTe kernels ({type(e).__name__}: {e})", RuntimeWarning)
    if mod is not None:
        return mod, ""
    if compiler is None:
        return None, "nvcc not found; set CUDA_HOME or put nvcc on PATH"
    if include is None:
        return None, "CUTLASS headers not found; pip install nvidia-cutlass==4.2.0.0 --no-deps"
    from torch.utils import cpp_extension

    out = build_dir(include)
    os.makedirs(out, exist_ok=True)
    # torch takes the toolkit from CUDA_HOME or the folder above nvcc's; where that has no CUDA headers (nvcc on PATH
    # as a wrapper script, say), the toolkit of nvcc's real path or /usr/local/cuda
    for home in (cpp_extension.CUDA_HOME, os.path.dirname(os.path.dirname(os.path.realpath(compiler))),
                 "/usr/local/cuda"):
        if home and os.path.isfile(os.path.join(home, "include", "cuda_runtime.h")):
            cpp_extension.CUDA_HOME = home
            break
    try:
        mod = cpp_extension.load(name=build_name(include), sources=[os.path.join(HERE, s) for s in SOURCES],
                                 extra_cflags=["-O3"], extra_cuda_cflags=nvcc_flags(include),
                                 extra_include_paths=[include, HERE], build_directory=out, verbose=False)
    except Exception as e:  # a failed build: the Triton path runs
        return None, f"build failed in {out}: {type(e).__name__}: {str(e).strip().splitlines()[-1][:200]}"
    return mod, ""


def module(device: torch.device | None = None):
    """The built extension (``run``, ``smem_bytes``, ``attention``) when ``device`` is an sm_90 GPU and the build
    works, else None (with one warning line per process naming why)."""
    if device is None or device.type != "cuda" or not torch.cuda.is_available():
        return None
    if torch.cuda.get_device_capability(device) != (9, 0):
        return None  # not a Hopper GPU: the Triton kernels are this GPU's path, nothing to warn about
    mod, why = _build()
    if mod is None:
        _warn(why)
    return mod


def available(device: torch.device | None) -> bool:
    """Whether the CuTe kernels run on ``device`` (builds them on first use)."""
    return module(device) is not None


def launch_shape(device: torch.device, op: str) -> tuple[int, int]:
    """``(cluster_m, group_m)`` of the CuTe GEMM kernel of ``op`` ("gemm_mn", "swiglu", "dense_swiglu", "o_proj") on
    ``device``, from the tuned config's ``cute_launch[op]``: CTAs per cluster along M (1, or 2 for pairs that share each
    weight tile by TMA multicast) and row tiles per band of the persistent tile order (its L2 raster).  Per op, since
    the best pair differs between them on one GPU (``benchmarks/kernels/gemm_cluster_ab.py`` measures them)."""
    c = tuned_config(device)["cute_launch"][op]
    return int(c["cluster_m"]), int(c["group_m"])


def run(op: str, x: torch.Tensor, w: torch.Tensor, w2, index, counts, out: torch.Tensor, G: int,
        group_m: int | None = None, cluster: int | None = None, mask: torch.Tensor | None = None) -> None:
    """Launch ``op`` (``gemm_mn``, ``swiglu``, ``dense_swiglu``) on checked, supported arguments (see
    ``gemm_mn_sm90.h``) on the current stream; ``cluster`` CTAs along M per cluster and ``group_m`` row tiles per band
    (None: :func:`launch_shape`); ``mask`` the dense SwiGLU's contiguous bool route ``[M, N / G]``."""
    props = torch.cuda.get_device_properties(x.device)
    cm, gm = launch_shape(x.device, op)
    module(x.device).run(OPS[op], x, w, w2, index, counts, mask, out, G, gm if group_m is None else group_m,
                         props.multi_processor_count, cm if cluster is None else cluster)


def o_proj(a: torch.Tensor, w: torch.Tensor, perm: torch.Tensor, unions: torch.Tensor, out: torch.Tensor,
           G: int) -> torch.Tensor:
    """Launch the K-axis O projection in the shared token order on checked, supported arguments (see
    ``gemm_mn_sm90.h``: ``a`` sorted and zero in its skipped blocks, G columns per K group) on the current stream;
    returns ``out``."""
    props = torch.cuda.get_device_properties(a.device)
    cm, gm = launch_shape(a.device, "o_proj")
    module(a.device).o_proj(a, w, perm, unions, out, G, gm, props.multi_processor_count, cm)
    return out


def dense_swiglu(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, out: torch.Tensor | None = None,
                 route: torch.Tensor | None = None) -> torch.Tensor:
    """Dense fused SwiGLU ``silu(x Wg^T) * (x Wu^T)`` (Eq. 3 with every group executed, the model MLP's rounding), the
    dense baseline of the routed SwiGLU: x ``[M, K]`` bf16 / fp16 on an sm_90 GPU, w_gate and w_up ``[N, K]``, K a
    multiple of 64, N of 128, out optional contiguous ``[M, N]``.  With ``route`` (bool ``[M, N_G]``, True = execute,
    G = N / N_G a multiple of 128) every row still runs, and the epilogue writes 0 for the skipped (row, group)
    blocks: Eq. 3's output at the dense kernel's speed, with no masking pass after it.  Returns ``[M, N]``.  Raises
    KernelArgumentError where the kernel cannot run (other shapes, dtypes or devices, or no build)."""
    ok = (isinstance(x, torch.Tensor) and x.dim() == 2 and x.dtype in (torch.bfloat16, torch.float16)
          and all(isinstance(t, torch.Tensor) and t.dim() == 2 and t.dtype == x.dtype and t.device == x.device
                  and t.shape == w_gate.shape for t in (w_gate, w_up))
          and w_gate.shape[1] == x.shape[1] and x.shape[1] % 64 == 0 and w_gate.shape[0] % 128 == 0)
    if not ok:
        fail("dense_swiglu takes x [M, K] bfloat16 / float16 and w_gate, w_up [N, K] of its dtype and device, K a "
             "multiple of 64 and N of 128")
    M, N = x.shape[0], w_gate.shape[0]
    out = torch.empty((M, N), dtype=x.dtype, device=x.device) if out is None else out
    if tuple(out.shape) != (M, N) or out.dtype != x.dtype or out.device != x.device or not out.is_contiguous():
        fail(f"out must be a contiguous {x.dtype} tensor of shape {(M, N)} on {x.device}")
    G = N
    if route is not None:
        ng = route.shape[1] if isinstance(route, torch.Tensor) and route.dim() == 2 else 0
        if (not isinstance(route, torch.Tensor) or route.dtype != torch.bool or route.device != x.device
                or route.dim() != 2 or route.shape[0] != M or ng == 0 or N % ng or (N // ng) % 128):
            fail(f"route must be a bool tensor [M={M}, N_G] on {x.device} with N={N} a multiple of N_G and G = N / N_G "
                 f"a multiple of 128")
        G = N // ng
    if M == 0:
        return out
    if w_up.stride(0) != w_gate.stride(0):
        w_gate, w_up = w_gate.contiguous(), w_up.contiguous()
    if not tma_aligned(x, w_gate, w_up, out):
        fail("dense_swiglu needs 16-byte aligned tensors with unit column stride")
    if not available(x.device):
        fail(f"dense_swiglu needs an sm_90 GPU and the built CuTe kernels; {x.device} has neither")
    run("dense_swiglu", x, w_gate, w_up, None, None, out, G, mask=None if route is None else route.contiguous())
    return out
