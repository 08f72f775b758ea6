"""Compile Triton kernels for an H100 / H200 (sm_90) on a machine without a GPU (run by test_compile_sm90.py).

Triton's CPU interpreter runs kernel bodies as NumPy and does not type-check them as the GPU compiler does: a
variable given tensors of different shapes in the two branches of an ``if`` runs fine there and fails to compile
for the GPU.  ``triton.compile`` for an explicit target needs no GPU (Triton ships ptxas), so this script compiles
each kernel at constexpr values the library launches it with, prints one ``ok`` line per kernel and exits
non-zero on the first failure.  Run it without ``TRITON_INTERPRET`` (the kernels must be JIT functions).
"""

import importlib
import os
import sys

os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)


def compile_sm90(fn, types: dict, consts: dict, num_warps: int = 4, div16: tuple = (), **options):
    """Compile ``fn`` for sm_90: ``types`` maps every runtime argument to a Triton type string ("*bf16", "i32");
    ``div16`` names the arguments a real launch specializes as divisible by 16 (16-byte aligned pointers, strides
    and sizes that are multiples of 16), without which the loads compile unvectorized and unpipelined.
    Returns the compiled kernel (``.asm["ptx"]`` holds its PTX)."""
    sig = {n: ("constexpr" if n in consts else types[n]) for n in fn.arg_names}
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in div16}
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs), target=TARGET,
                       options={"num_warps": num_warps, **options})
    print(f"ok {fn.__name__} {consts}", flush=True)
    return k


def types_of(fn, **ptrs) -> dict:
    """Argument types of ``fn``: those given in ``ptrs``, else ``*_ptr`` arguments bf16 pointers, ``scale`` /
    ``eps`` fp32, everything else i32."""
    return {n: ptrs[n] if n in ptrs else "*bf16" if n.endswith("_ptr") else "fp32" if n in ("scale", "eps") else "i32"
            for n in fn.arg_names}


def main() -> None:
    mods = {n: importlib.import_module(f"wide.kernels.{n}") for n in (
        "router", "rope", "rmsnorm", "reorder", "zero_heads", "activation", "gemm_k", "gemm_mn", "gemm_mn_ws",
        "decode_attn", "attention")}
    router, rope, gemm_k, gemm_mn = mods["router"], mods["rope"], mods["gemm_k"], mods["gemm_mn"]
    f32, i32, b = "*fp32", "*i32", "*i1"

    # prefill router: fp32 or three-piece bf16 W1, D unsplit or split over programs
    t = dict(x_ptr="*bf16", b1_ptr="*fp32", w2_ptr="*fp32", b2_ptr="*fp32", out_ptr="*i1", logit_ptr="*fp32",
             part_ptr="*fp32", cnt_ptr="*i32", rows="i32", D="i32", N="i32", stride_xm="i32", DS="i32")
    for split3, splitd in ((True, 1), (True, 4), (False, 1), (False, 8)):
        compile_sm90(router._router_tile_kernel, {**t, "w1_ptr": "*bf16" if split3 else "*fp32"},
                     dict(R=16, BM=64, BD=64, NP=128, WRITE_LOGITS=splitd == 4, SPLIT3=split3, SPLITD=splitd))
    # fused RoPE + K/V cache write (prefill tile and decode's 2-token tile)
    t = {n: "i32" for n in rope._rope_cache_kernel.arg_names}
    t.update({n: "*bf16" for n in ("q_ptr", "k_ptr", "v_ptr", "cos_ptr", "sin_ptr", "qo_ptr", "ko_ptr", "ck_ptr",
                                   "cv_ptr")}, slot_ptr="*i64")
    k = compile_sm90(rope._rope_cache_kernel, t, dict(HALF=64, BT=32, WRITE_K=True), enable_fp_fusion=False)
    # launched without FMA contraction: each bf16 product and sum rounded on its own, as apply_rotary_pos_emb does
    if "fma.rn.bf16" in k.asm["ptx"] or "mul.rn.bf16" not in k.asm["ptx"]:
        raise RuntimeError("rope_cache kernel: expected separately rounded bf16 products and sums in its PTX")
    compile_sm90(rope._rope_cache_kernel, t, dict(HALF=32, BT=2, WRITE_K=False), num_warps=1, enable_fp_fusion=False)
    # reorder: the one-launch plan and the three phases, at the plans the H200 uses
    reorder = mods["reorder"]
    t = dict(mask_ptr="*i1", index_ptr="*i32", smask_ptr="*i1", count_ptr="*i32", blk_ptr="*i32", out_ptr="*i32",
             tmp_ptr="*i32", M="i32", NG="i32", NBLK="i32", W="i32")
    compile_sm90(reorder._columns_kernel, t, dict(MP=512, NGC=2))
    compile_sm90(reorder._block_counts_kernel, t, dict(BM=128, NGC=16))
    for direct in (True, False):
        compile_sm90(reorder._scatter_kernel, t, dict(BM=128, NGC=16, CB=64, DIRECT=direct))
    compile_sm90(reorder._transpose_kernel, t, dict(BJ=64, NGC=128))
    # the other engine kernels at one launch configuration each (Llama-3.1-8B shapes)
    rms = mods["rmsnorm"]._add_rmsnorm_kernel
    compile_sm90(rms, types_of(rms), dict(HAS_ADD=True, BLOCK=4096), num_warps=8)
    rt = types_of(router._router_kernel, w1_ptr=f32, b1_ptr=f32, w2_ptr=f32, b2_ptr=f32, out_ptr=b, part_ptr=f32,
                  cnt_ptr=i32, logit_ptr=f32)
    for one_step in (True, False):
        compile_sm90(router._router_kernel, rt, dict(R=16, RP=4, BDP=64, BDI=64, NP=16 if one_step else 128, PP=64,
                                                     ONE_STEP=one_step, WRITE_LOGITS=False, HAS_ADD=True, DOT=False,
                                                     PC=8, NC=16))
    # 9-32 rows: the last program finishes them with fp32 dots, over 64 or 32 programs
    for bdp, pp in ((64, 64), (128, 32)):
        compile_sm90(router._router_kernel, rt, dict(R=16, RP=16, BDP=bdp, BDI=16, NP=128, PP=pp, ONE_STEP=False,
                                                     WRITE_LOGITS=pp == 64, HAS_ADD=True, DOT=True, PC=8, NC=64))
    compile_sm90(router._router_finish_kernel, types_of(router._router_finish_kernel, y_ptr=f32, b1_ptr=f32,
                                                        w2_ptr=f32, b2_ptr=f32, out_ptr=b, logit_ptr=f32),
                 dict(R=16, NP=128, WRITE_LOGITS=False))
    zh = mods["zero_heads"]._zero_skipped_heads_kernel
    compile_sm90(zh, types_of(zh, route_ptr=b), dict(HPG=4, DH=128, BC=64, BT=32))
    act = mods["activation"]._masked_swiglu_kernel
    compile_sm90(act, types_of(act, route_ptr=b), dict(BN=64, BM=32))
    # gemm_k's split-K kernel: the decode GEMV (16 rows padded) and row tiles of 64 and 128
    kt = types_of(gemm_k._splitk_kernel, part_ptr=f32, cnt_ptr=i32, route_ptr=b)
    for g, bk, ngp, splits, fuse, bm, w in ((128, 128, 128, 8, True, 16, 4), (128, 128, 128, 8, False, 16, 4),
                                           (128, 128, 128, 2, True, 64, 4), (512, 64, 32, 1, False, 128, 8)):
        compile_sm90(gemm_k._splitk_kernel, kt, dict(G=g, BN=64, BK=bk, NGP=ngp, SPLITS=splits, EVEN_N=True,
                                                    FUSE_SUM=fuse, BM=bm), num_warps=w, num_stages=3)
    compile_sm90(gemm_k._splitk_sum_kernel, types_of(gemm_k._splitk_sum_kernel, part_ptr=f32),
                 dict(SPLITS=8, BLOCK=1024))
    # gemm_mn's decode GEMV and the fused SwiGLU's
    gt = types_of(gemm_mn._gemv_mn_split_kernel, part_ptr=f32, cnt_ptr=i32, route_ptr=b)
    for sw in (False, True):
        compile_sm90(gemm_mn._gemv_mn_split_kernel, gt, dict(G=128, BN=32, BK=128, NGP=128, SMAX=32, SWIGLU=sw,
                                                            EVEN_K=True), num_stages=3)
    da = mods["decode_attn"]
    compile_sm90(da._decode_attn_split_kernel,
                 types_of(da._decode_attn_split_kernel, route_ptr=b, lp_ptr=i32, mpart_ptr=f32, lpart_ptr=f32,
                          opart_ptr=f32, ns_ptr=i32), dict(D=128, RP=16, BN=64, HAS_LP=True, PP=128, GPP=1))
    compile_sm90(da._decode_attn_combine_kernel,
                 types_of(da._decode_attn_combine_kernel, route_ptr=b, mpart_ptr=f32, lpart_ptr=f32, opart_ptr=f32,
                          ns_ptr=i32), dict(D=128, SP=32, BN=64), num_warps=1)
    # gemm_mn's many-row tiles with TMA weight tiles (Llama-3.1-8B up shape), GEMM and fused SwiGLU: the gathered
    # token loads must pipeline through cp.async and the scattered store vectorize (checked in the PTX)
    gt = types_of(gemm_mn._gemm_mn_kernel, idx_ptr=i32, cnt_ptr=i32, route_ptr=b)
    div = ("x_ptr", "w_ptr", "w2_ptr", "out_ptr", "idx_ptr", "cnt_ptr", "N", "K", "stride_xm", "stride_wn", "stride_om")
    for bn, swiglu in ((256, False), (128, True)):
        gt.update(w_desc=f"tensordesc<bf16[{bn}, 64]>", w2_desc=f"tensordesc<bf16[{bn}, 64]>")
        k = compile_sm90(gemm_mn._gemm_mn_kernel, gt, dict(BM=128, BN=bn, BK=64, GROUP_M=8, EVEN_K=True, SWIGLU=swiglu,
                                                           DIRECT=False, USE_TMA=True), num_warps=8, num_stages=4,
                         div16=div)
        ptx = k.asm["ptx"]
        if "cp.async.cg.shared.global" not in ptx or "st.global.v4" not in ptx or "wgmma.mma_async" not in ptx:
            raise RuntimeError(f"gemm_mn tile 128x{bn} swiglu={swiglu}: expected cp.async token loads, wgmma and "
                               "16-byte stores in its PTX")
    # gemm_k's masked path: the select that zeroes the inactive groups of a (down shape, G = 128) must move 16 bytes
    # per load and store; in place (overwrite_a) only 16-byte stores of zeros, no load of a
    st = types_of(gemm_k._select_kernel, a_ptr="*bf16", route_ptr=b, out_ptr="*bf16")
    div = ("a_ptr", "route_ptr", "out_ptr", "NG", "stride_am", "stride_om")
    for inplace in (False, True):
        ptx = compile_sm90(gemm_k._select_kernel, st, dict(G=128, BR=8, GB=8, GP=128, INPLACE=inplace),
                           div16=div).asm["ptx"]
        if "st.global.v4" not in ptx or ("ld.global.v4" in ptx) != (not inplace):
            raise RuntimeError(f"gemm_k mask select (in place: {inplace}): unexpected 16-byte loads / stores in PTX")
    # gemm_mn's warp-specialized Gluon kernel (Hopper): a producer warpgroup of cp.async token rows + TMA weight
    # tiles, signalled per stage by cp.async mbarrier arrivals, two wgmma warpgroups (GEMM 128 x 256, SwiGLU 128 x 128)
    ws = mods["gemm_mn_ws"]
    if ws.HAS_GLUON:
        from triton.experimental.gluon import language as gl
        from triton.experimental.gluon._runtime import GluonASTSource

        for bn, swiglu in ((256, False), (128, True)):
            cfg = ws.default_config(bn, swiglu)
            a_l = gl.NVMMASharedLayout.get_default_for([cfg["BM"], cfg["BK"]], gl.bfloat16)
            b_l = gl.NVMMASharedLayout.get_default_for([bn, cfg["BK"]], gl.bfloat16)
            consts = dict(BM=cfg["BM"], BN=bn, BK=cfg["BK"], GROUP_M=8, STAGES=cfg["STAGES"], PW=cfg["PW"],
                          PREGS=cfg["PREGS"], A_LAYOUT=a_l, SWIGLU=swiglu, num_warps=cfg["num_warps"])
            fn = ws._gemm_mn_ws_kernel
            desc = f"tensordesc<bf16[{bn}, {cfg['BK']}],{b_l!r}>"
            t = dict(x_ptr="*bf16", out_ptr="*bf16", idx_ptr=i32, cnt_ptr=i32, w_desc=desc, w2_desc=desc)
            sig = {n: ("constexpr" if n in consts else t.get(n, "i32")) for n in fn.arg_names}
            attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]]
                     for n in ("x_ptr", "out_ptr", "idx_ptr", "cnt_ptr", "N", "K", "stride_xm", "stride_om")}
            k = triton.compile(GluonASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs), target=TARGET,
                               options=dict(num_warps=cfg["num_warps"], maxnreg=cfg["maxnreg"]))
            print(f"ok {fn.__name__} {dict(BN=bn, SWIGLU=swiglu)}", flush=True)
            ptx = k.asm["ptx"]
            for op in ("cp.async.mbarrier.arrive.noinc", "cp.async.bulk.tensor", "wgmma.mma_async", "setmaxnreg"):
                if op not in ptx:
                    raise RuntimeError(f"gemm_mn_ws BN={bn} swiglu={swiglu}: expected {op} in its PTX")
            if k.metadata.shared > 227 * 1024:
                raise RuntimeError(f"gemm_mn_ws BN={bn} swiglu={swiglu}: {k.metadata.shared} bytes of shared memory")
    att = mods["attention"]._attn_fwd_kernel
    compile_sm90(att, types_of(att, idx_ptr=i32, cnt_ptr=i32, lp_ptr=i32, kd="*bf16", vd="*bf16"),
                 dict(D=128, BM=128, BN=64, CAUSAL=True, HAS_LP=False, DESC=False), num_warps=8, num_stages=3)
    desc = "tensordesc<bf16[1, 1, 128, 128]>"  # K / V through TMA, the H200's 128 x 128 tiles
    k = compile_sm90(att, types_of(att, idx_ptr=i32, cnt_ptr=i32, lp_ptr=i32, kd=desc, vd=desc),
                     dict(D=128, BM=128, BN=128, CAUSAL=True, HAS_LP=True, DESC=True), num_warps=8, num_stages=3)
    if "cp.async.bulk.tensor" not in k.asm["ptx"]:
        raise RuntimeError("attention with DESC: expected TMA loads (cp.async.bulk.tensor) in its PTX")


if __name__ == "__main__":
    try:
        main()
    except Exception as e:  # one line naming the failure, for the test's message
        print(f"FAILED: {type(e).__name__}: {e}", file=sys.stderr)
        raise SystemExit(1)
