"""The CuTe sm_90a kernels (``wide/kernels/sm90/*.cu``) compile with nvcc on this GPU-less machine, with
the flags the runtime build uses, into every kernel the launcher instantiates, with no register spills and with
the warp specialization's register split applied; and the build module's pure parts (headers, cache name)."""

import os
import re
import subprocess

import pytest

from wide.kernels import sm90

# entry functions per source: routed GEMM 256 x 128 and 128 x 256 tiles, routed SwiGLU, dense SwiGLU, the shared-order O
# projection, each with clusters of 1 and 2 CTAs; attention
# causal or not, with or without the consumers' ping-pong; bf16 and fp16 each
KERNELS = {"gemm_mn_sm90.cu": 20, "attention_sm90.cu": 8}


def _toolchain():
    include, nvcc = sm90.cutlass_include(), sm90.nvcc()
    if nvcc is None:
        pytest.skip("nvcc is not installed")
    if include is None:
        pytest.skip("the CUTLASS headers (pip install nvidia-cutlass==4.2.0.0 --no-deps) are not installed")
    return include, nvcc


@pytest.mark.parametrize("source", sorted(KERNELS))
def test_kernels_compile_for_sm90a(source, tmp_path):
    include, nvcc = _toolchain()
    from torch.utils.cpp_extension import COMMON_NVCC_FLAGS  # what torch's extension build adds

    obj = tmp_path / source.replace(".cu", ".o")
    cmd = [nvcc, "-c", *sm90.nvcc_flags(include), *COMMON_NVCC_FLAGS, "-Xptxas", "-v", "-o", str(obj),
           os.path.join(sm90.HERE, source)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    log = r.stdout + r.stderr
    assert r.returncode == 0, log[-4000:]
    entries = re.findall(r"Compiling entry function '(\w+)' for 'sm_90a'", log)
    assert len(entries) == KERNELS[source], entries
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    assert len(spills) == KERNELS[source] and all(s == ("0", "0") for s in spills), spills
    assert "C7508" not in log, "ptxas ignored setmaxnreg: " + log[-2000:]
    assert os.path.getsize(obj) > 0


def test_attention_layouts_on_the_host(tmp_path):
    # the S / O accumulator rows and the P registers as the A operand of P V, for every consumer thread (CuTe's
    # layouts evaluated by a host program built from the kernel's own header)
    include, nvcc = _toolchain()
    exe = tmp_path / "layout"
    src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sm90_attention_layout.cu")
    r = subprocess.run([nvcc, "-std=c++17", "--expt-relaxed-constexpr", f"-I{include}", f"-I{sm90.HERE}", "-o",
                        str(exe), src], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60)
    # bf16 and fp16: 256 threads x (64 P values + 2 rows x (1 O row + 32 S values))
    assert run.returncode == 0 and run.stdout.split() == ["ok", "33280", "ok", "33280"], run.stdout + run.stderr


def test_gemm_work_order_on_the_host(tmp_path):
    # every output tile once (clusters of 1 and 2 CTAs, odd and even tile counts, many grids and L2 bands) and the O
    # projection's K steps exactly those of its groups: the kernel's own header in a host program
    _, nvcc = _toolchain()
    exe = tmp_path / "schedule"
    src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sm90_gemm_schedule.cu")
    r = subprocess.run([nvcc, "-std=c++17", f"-I{sm90.HERE}", "-o", str(exe), src], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and run.stdout.split() == ["ok", "4842"], run.stdout + run.stderr


def test_every_source_is_compiled_here():
    assert sorted(KERNELS) == sorted(s for s in sm90.SOURCES if s.endswith(".cu"))


def test_build_name_tracks_sources_and_flags(monkeypatch, tmp_path):
    name = sm90.build_name("/x")
    assert re.fullmatch(r"wide_sm90_[0-9a-f]{16}", name)
    assert sm90.build_name("/x") == name
    for src in sm90.SOURCES + sm90.HEADERS:
        assert os.path.isfile(os.path.join(sm90.HERE, src)), src
    monkeypatch.setattr(sm90, "ARCH_FLAG", "-gencode=arch=compute_90a,code=sm_90a -G")
    assert sm90.build_name("/x") != name
    monkeypatch.setenv("WIDE_CACHE_DIR", str(tmp_path))
    assert sm90.build_dir("/x").startswith(os.path.join(str(tmp_path), "sm90", "wide_sm90_"))


def test_cpu_device_takes_no_cute_path():
    import torch

    assert sm90.module(torch.device("cpu")) is None
    assert not sm90.available(torch.device("cpu"))


def test_prebuilt_library_absent_is_none(tmp_path):
    assert sm90._load_prebuilt("wide_sm90_0000000000000000", str(tmp_path)) is None


def test_cute_unsupported_names_the_reason():
    import torch

    from wide.kernels.gemm_mn import cute_unsupported

    def why(dtype=torch.bfloat16, K=128, G=128):
        x, w = torch.zeros(4, K, dtype=dtype), torch.zeros(256, K, dtype=dtype)
        return cute_unsupported(x, w, None, G, None)

    assert why(torch.float32).startswith("dtype float32")
    assert why(K=96).startswith("K=96, G=128")
    assert why(G=64).startswith("K=128, G=64")
    assert why().startswith("no sm_90 GPU")  # the CPU
