"""Inference engine (``wide.inference``): the kernel-built forward pass against WideModel's masking path (an
independent implementation: Hugging Face modules with masking hooks), left padding, static-cache decode, greedy
generation, the dispatch variants, `wide generate`, and the CPU dry run of `wide bench e2e`.  CPU, except the CUDA
tests at the end."""

from __future__ import annotations

import contextlib
import types

import pytest
import torch

from wide import WideConfig
from wide.kernels.reference import reorder_ref
from wide.model import WideModel
from wide_testutil import needs_bundled_model, tiny_model, tiny_tokenizer

ATOL = 2e-5
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _wide(seed=0, **cfg):
    """A tiny WideModel whose routers really disagree between tokens."""
    torch.manual_seed(seed)
    wm = WideModel(tiny_model(seed=seed), WideConfig(ffn_group_size=cfg.pop("ffn_group_size", 32), **cfg),
                   init_keep=0.5).eval()
    for r in [*wm.attn_routers, *wm.ffn_routers]:
        torch.nn.init.normal_(r.w2.weight, std=1.0)
    return wm


def _positions(mask):
    return (mask.cumsum(-1) - 1).clamp_min(0)


def _padded(B=2, T=9, pad=4, seed=0):
    ids = torch.randint(2, 128, (B, T), generator=torch.Generator().manual_seed(seed))
    am = torch.ones_like(ids)
    am[-1, :pad] = 0
    return ids, am


def _ref_greedy(wm, ids, n):
    """``n`` greedy tokens of the masking path, recomputing the whole sequence each step."""
    ids, out = list(ids), []
    for _ in range(n):
        out.append(int(wm(torch.tensor([ids])).logits[0, -1].argmax()))
        ids.append(out[-1])
    return out


@pytest.fixture
def reference_path(monkeypatch):
    """Every kernel runs its PyTorch reference (fast on the CPU)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")


# --- the forward pass against the masking path ---------------------------------------------------------------------
@pytest.mark.parametrize("B,T,N", [(1, 7, 3), (3, 50, 4), (4, 33, 1)])
def test_batch_reorder_view_equals_per_sequence_reorder(B, T, N):
    from wide.inference import batch_reorder_view

    mask = torch.rand(B, T, N, generator=torch.Generator().manual_seed(T)) < 0.4
    mask[0, :, 0] = False  # an empty column
    got, want = batch_reorder_view(reorder_ref(mask.view(B * T, N)), mask), reorder_ref(mask)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the Triton interpreter of the CPU machine")
def test_kernels_prefill_and_decode_match_masking_path():
    """Triton interpreter: 140 rows (the shared flat reorder and its per-sequence view), left padding, 2 decode
    steps; logits and every routing decision equal the masking path's."""
    from wide.inference import Engine

    wm, ids, am = _wide(), *_padded(2, 70, 9, seed=1)
    eng = Engine(wm)
    assert eng.fast
    v = am.bool()
    wm.record_masks = eng.record_masks = True
    ref = wm(ids, attention_mask=am, position_ids=_positions(am)).logits
    cache = eng.new_cache(2, 74)
    out = eng.prefill(ids, am, cache, all_logits=True)
    assert (out - ref)[v].abs().max().item() < ATOL
    assert all(torch.equal(m[v], wm.record.masks[k][v]) for k, m in eng.masks.items())
    sp = eng.realized_sparsity()
    assert 0.1 < sp["attn"] < 0.9 and 0.1 < sp["ffn"] < 0.9
    seqs, tok = [ids[b][v[b]].tolist() for b in range(2)], out[:, -1].argmax(-1)
    for _ in range(2):
        lg = eng.decode(tok, cache)
        for b in range(2):
            seqs[b].append(int(tok[b]))
            r = wm(torch.tensor([seqs[b]])).logits[0, -1]
            assert (lg[b] - r).abs().max().item() < ATOL
            assert all(torch.equal(m[b, 0], wm.record.masks[k][0, -1]) for k, m in eng.masks.items())
        tok = lg.argmax(-1)
    assert cache.lengths.tolist() == [72, 63]


def test_left_padded_batch_equals_single_runs(reference_path):
    from wide.inference import Engine

    eng = Engine(_wide(seed=2))
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, 128, (n,), generator=g) for n in (5, 12, 1)]
    ids, am = torch.zeros(3, 12, dtype=torch.long), torch.zeros(3, 12, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, 12 - len(p):], am[b, 12 - len(p):] = p, 1
    cache = eng.new_cache(4, 20)  # a bucket with an idle row
    out = eng.prefill(ids, am, cache, all_logits=True)
    toks = out[:, -1].argmax(-1)
    dec = eng.decode(torch.cat([toks, torch.zeros(1, dtype=torch.long)]), cache)
    for b, p in enumerate(prompts):
        c1 = eng.new_cache(1, 20)
        assert (eng.prefill(p.view(1, -1), None, c1, all_logits=True)[0] - out[b, 12 - len(p):]).abs().max() < ATOL
        assert (eng.decode(toks[b:b + 1], c1)[0] - dec[b]).abs().max().item() < ATOL


def test_greedy_generation_matches_reference(reference_path):
    from wide.inference import Engine, generate

    wm, tok = _wide(seed=4), tiny_tokenizer()
    eng = Engine(wm)
    prompts = ["w1 w2 w3 w4", "w9 w8", "w5 w6 w7 w10 w11 w12 w13"]
    res = generate(eng, tok, prompts, max_new_tokens=10, stop_at_eos=False)
    assert res.path == "reference" and res.steps == 9
    assert res.tokens == [_ref_greedy(wm, tok(p)["input_ids"], 10) for p in prompts]
    assert set(res.sparsity) == {"attn", "ffn", "overall"} and res.ttft_s > 0 and res.tpot_s > 0
    assert generate(eng, tok, prompts, max_new_tokens=10, stop_at_eos=False).tokens == res.tokens  # runner reused


@pytest.mark.parametrize("ops", ["routed", "dense"])
def test_dense_model_equals_the_hf_model(ops, reference_path):
    from wide.inference import Engine

    base = tiny_model(seed=5)
    ids, am = _padded(2, 11, 3, seed=5)
    ref = base(ids, attention_mask=am, position_ids=_positions(am)).logits
    eng = Engine(base, ops=ops)
    eng.record_masks = True
    out = eng.prefill(ids, am, eng.new_cache(2, 12), all_logits=True)
    assert (out - ref)[am.bool()].abs().max().item() < ATOL
    if ops == "routed":
        assert eng.masks and all(bool(m.all()) for m in eng.masks.values())
        assert eng.realized_sparsity()["overall"] == 0.0


@pytest.mark.parametrize("mode", ["kernel", "dense"])
def test_dispatch_variants_compute_the_same_function(mode):
    """Triton interpreter, 132 rows and left padding: every routed op as its kernel, or as cuBLAS / SDPA with the
    skipped groups zeroed, gives the masking path's logits."""
    from wide.inference import Engine

    wm, ids, am = _wide(seed=13), *_padded(2, 66, 6, seed=13)
    ref = wm(ids, attention_mask=am, position_ids=_positions(am)).logits
    eng = Engine(wm, kaxis=mode, naxis=mode, attn=mode)
    out = eng.prefill(ids, am, eng.new_cache(2, 66), all_logits=True)
    assert (out - ref)[am.bool()].abs().max().item() < ATOL


def test_measured_activity_sets_the_auto_dispatch(reference_path):
    from wide.inference import Engine

    wm, ids, am = _wide(seed=13), *_padded(2, 70, 6, seed=13)
    auto = Engine(wm)
    assert not any(auto.naxis_dense(k, 0, 140) for k in ("attn", "ffn")) and not auto.attn_dense(0, 70)  # unmeasured
    wm.record_masks = True
    wm(ids, attention_mask=am, position_ids=_positions(am))
    act = auto.measure_activity(ids, am)
    w = am.double()
    assert set(act) == {(k, i) for k in ("attn", "ffn") for i in range(2)}
    for k, v in act.items():  # the executed fraction over real tokens
        assert v == pytest.approx(float((wm.record.masks[k].double().mean(-1) * w).sum() / w.sum()), abs=1e-12)
    assert auto.expected_active == act and auto.masks == {} and not auto.record_masks
    auto.expected_active = {k: 1.0 for k in act}  # above every threshold: cuBLAS / SDPA from 5 rows
    assert all(auto.naxis_dense(k, i, 140) for k, i in act) and auto.attn_dense(0, 70)
    assert auto.naxis_dense("attn", 0, 16) and not auto.naxis_dense("ffn", 0, 16)  # 5-64 rows: Q dense, SwiGLU routed
    assert not auto.naxis_dense("ffn", 0, 4) and not auto.naxis_dense("attn", 0, 4)  # the decode GEMVs
    plain = Engine(wm.base)  # no routers: every group executes, no measurement needed
    assert plain.naxis_dense("ffn", 0, 140) and plain.attn_dense(0, 70) and not plain.naxis_dense("ffn", 0, 4)
    assert Engine(wm, ops="dense").measure_activity(ids, am) == {}
    eng = Engine(wm)
    eng.reset_stats()
    eng.measure_activity(ids, am)
    assert eng.stats.abs().sum().item() == 0  # the sample does not count in realized_sparsity


def test_attn_only_routing_and_dense_ops(reference_path):
    from wide.inference import Engine

    wm, ids, am = _wide(seed=6, routed="attn"), *_padded(2, 9, 4, seed=6)
    v, pos = am.bool(), _positions(am)
    ref = wm(ids, attention_mask=am, position_ids=pos).logits
    eng = Engine(wm)
    assert (eng.prefill(ids, am, eng.new_cache(2, 9), all_logits=True) - ref)[v].abs().max().item() < ATOL
    with wm.masks_fixed(attn=True, ffn=True):
        dref = wm(ids, attention_mask=am, position_ids=pos).logits
    dense = Engine(wm, ops="dense")
    assert (dense.prefill(ids, am, dense.new_cache(2, 9), all_logits=True) - dref)[v].abs().max().item() < ATOL


@pytest.mark.parametrize("arch", ["qwen2", "mistral"])
def test_other_architectures(arch, monkeypatch):
    """Qwen2 (Q/K/V biases; Triton interpreter) and Mistral (a sliding window wider than the cache; references)."""
    from wide.inference import Engine

    if arch == "mistral":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    torch.manual_seed(13)
    base = tiny_model(arch, seed=13, **({"sliding_window": 32} if arch == "mistral" else {}))
    wm = WideModel(base, WideConfig(ffn_group_size=32), init_keep=0.5).eval()
    ids = torch.randint(2, 128, (1, 9), generator=torch.Generator().manual_seed(13))
    eng = Engine(wm)
    c = eng.new_cache(1, 10)
    out = eng.prefill(ids, None, c, all_logits=True)
    assert (out - wm(ids).logits).abs().max().item() < ATOL
    nxt = out[:, -1].argmax(-1)
    assert (eng.decode(nxt, c) - wm(torch.cat([ids, nxt[:, None]], 1)).logits[:, -1]).abs().max().item() < ATOL


def test_dense_engine_one_launch_qkv_for_narrow_kv():
    """3 query heads per K/V head and 1 K/V head (a statically pruned SmolLM2's shape): the dense engine runs Q, K
    and V as one GEMV launch of 16-column groups and its decode logits equal the model's; the routed engine cannot."""
    from wide.inference import Engine

    shape = dict(hidden_size=48, num_attention_heads=3, num_key_value_heads=1)
    base = tiny_model(seed=3, **shape)
    eng = Engine(base, ops="dense")
    assert eng.qkv_group == 16 and eng.g_attn == 48 and eng.qkv_one_launch(2) == eng.fast
    ids = torch.randint(2, 128, (2, 7), generator=torch.Generator().manual_seed(3))
    cache = eng.new_cache(2, 9)
    tok = eng.prefill(ids, None, cache).argmax(-1)
    ref = base(torch.cat([ids, tok[:, None]], 1)).logits[:, -1]
    assert (eng.decode(tok, cache) - ref).abs().max().item() < ATOL
    routed = Engine(WideModel(tiny_model(seed=3, **shape), WideConfig(ffn_group_size=32)))
    assert routed.qkv_group is None and not routed.qkv_one_launch(1)


def _stub_cuda_streams(monkeypatch):
    fake = types.SimpleNamespace(wait_stream=lambda other: None)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: fake)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: fake)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())


def _prefill_decode(eng, ids, steps=2):
    """Every logits tensor and mask of a prefill of ``ids`` and ``steps`` greedy decode steps."""
    cache = eng.new_cache(ids.shape[0], ids.shape[1] + steps + 1)
    eng.record_masks = True
    logits = [eng.prefill(ids, None, cache)]
    masks = [dict(eng.masks)]
    for _ in range(steps):
        logits.append(eng.decode(logits[-1].argmax(-1), cache))
        masks.append(dict(eng.masks))
    return logits, masks


@pytest.mark.parametrize("naxis", ["auto", "dense"])
@pytest.mark.parametrize("B", [2, 6])
def test_routers_beside_the_projections(naxis, B, monkeypatch, reference_path):
    """The routers on a second stream (CUDA's stream calls stubbed): with ``naxis="dense"`` the FFN router beside
    cuBLAS's gate / up and the attention router beside Q, K and V; the same masks and logits as in sequence."""
    from wide.inference import Engine

    wm = _wide(seed=11)
    ids = torch.randint(2, 128, (B, 9), generator=torch.Generator().manual_seed(B))
    plain = _prefill_decode(Engine(wm, naxis=naxis), ids)
    _stub_cuda_streams(monkeypatch)
    eng = Engine(wm, naxis=naxis)
    eng.streams = True
    beside = _prefill_decode(eng, ids)
    assert all(torch.equal(a, b) for a, b in zip(plain[0], beside[0]))
    assert all(a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a) for a, b in zip(plain[1], beside[1]))
    assert any(not m.all() for m in plain[1][0].values())  # the routers skip groups: the masks matter


# --- wide generate ----------------------------------------------------------------------------------------------------
@pytest.fixture
def wide_ckpt(tmp_path, model_dir):
    from wide.checkpoint import save_wide
    from wide.hub import load_base_model

    base, _, src = load_base_model(str(model_dir), device="cpu")
    wm = WideModel(base, WideConfig(ffn_group_size=32), init_keep=0.5)
    for r in [*wm.attn_routers, *wm.ffn_routers]:
        torch.nn.init.normal_(r.w2.weight, std=1.0)
    return save_wide(wm, tmp_path / "ckpt", src.ref)


def test_cli_generate(wide_ckpt, model_dir, capsys, reference_path):
    from wide.cli import main

    assert main(["generate", "--wide", str(wide_ckpt), "--prompt", "w1 w2 w3", "--max-new-tokens", "5",
                 "--device", "cpu"]) == 0
    out, err = capsys.readouterr()
    assert len([ln for ln in err.splitlines() if ln.startswith("wide generate:")]) == 1
    lines = out.splitlines()
    assert len(lines) == 2 and lines[0].strip(), out  # the streamed text, then the summary: no blank line
    for key in ("TTFT", "TPOT", "tokens/s", "(5 tokens, batch 1)", "realized sparsity: attn", "path: reference"):
        assert key in lines[1]
    assert main(["generate", "--model", str(model_dir), "--prompt", "w1 w2", "--prompt", "w3", "--max-new-tokens", "3",
                 "--device", "cpu"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [ln[:4] for ln in out[:2]] == ["[0] ", "[1] "] and "0 (dense)" in out[2] and len(out) == 3


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("text", ["w1 w2", "w1\n", "", "\n\n"])
def test_cli_generate_prints_no_blank_line_of_its_own(model_dir, capsys, monkeypatch, reference_path, stream, text):
    """The text as generated, then the summary line: a newline only where the text did not end one."""
    import wide.inference.generation as G
    from wide.cli import main

    def fake(engine, tok, prompts, n, on_token=None, **kw):
        for i in range(1, len(text) + 1):
            on_token(0, 5, text[:i])
        return G.GenerationResult(tokens=[[5] * max(len(text), 1)], texts=[text], path="reference")

    monkeypatch.setattr(G, "generate", fake)
    assert main(["generate", "--model", str(model_dir), "--prompt", "w1", "--device", "cpu"]
                + ([] if stream else ["--no-stream"])) == 0
    out = capsys.readouterr().out
    head = text if stream else f"[0] {text}"
    assert out.startswith(head + ("" if head.endswith("\n") or not head else "\n")) and out.count("TTFT") == 1, out
    assert out[len(head):].lstrip("\n").startswith("TTFT") and "\n\n" not in out[len(head) - 1:], out


def test_cli_generate_says_triton_is_missing(wide_ckpt, capsys, monkeypatch):
    from wide.cli import main
    from wide.kernels import _common

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(_common, "HAS_TRITON", False)
    assert main(["generate", "--wide", str(wide_ckpt), "--prompt", "w1 w2", "--max-new-tokens", "1",
                 "--device", "cpu"]) == 0
    ours = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("wide generate:")]
    assert len(ours) == 1 and "PyTorch reference" in ours[0] and "Triton is not installed" in ours[0], ours


@pytest.mark.slow
@needs_bundled_model
def test_bundled_model_matches_masking_path(reference_path):
    """The bundled SmolLM2-135M (GQA 3:1, 30 layers) with routers at about half activity: 2 left-padded prompts,
    prefill logits and masks, then 8 greedy tokens each."""
    from wide.hub import load_base_model
    from wide.inference import Engine, generate

    base, tok, _ = load_base_model(None, device="cpu")
    wm = WideModel(base, WideConfig(), init_keep=0.5).eval()
    for r in [*wm.attn_routers, *wm.ffn_routers]:
        torch.nn.init.normal_(r.w2.weight, std=0.05, generator=torch.Generator().manual_seed(0))
    eng = Engine(wm)
    prompts = ["The capital of France is", "Water boils at a temperature of one hundred degrees"]
    res = generate(eng, tok, prompts, max_new_tokens=8, stop_at_eos=False)
    assert 0.2 < res.sparsity["overall"] < 0.8
    assert res.tokens == [_ref_greedy(wm, tok(p)["input_ids"], 8) for p in prompts]
    enc = [tok(p)["input_ids"] for p in prompts]
    T = max(map(len, enc))
    ids, am = torch.zeros(2, T, dtype=torch.long), torch.zeros(2, T, dtype=torch.long)
    for b, e in enumerate(enc):
        ids[b, T - len(e):], am[b, T - len(e):] = torch.tensor(e), 1
    v = am.bool()
    wm.record_masks = eng.record_masks = True
    ref = wm(ids, attention_mask=am, position_ids=_positions(am)).logits
    out = eng.prefill(ids, am, eng.new_cache(2, T), all_logits=True)
    assert (out - ref)[v].abs().max().item() < 2e-3 * ref[v].abs().max().item()
    assert all(torch.equal(m[v], wm.record.masks[k][v]) for k, m in eng.masks.items())


# --- wide bench e2e (its CPU parts and a dry run) -------------------------------------------------------------------
def test_bench_helpers(tmp_path, reference_path):
    """Router biasing to a target split, the Amdahl attribution and the report."""
    from wide.bench import e2e
    from wide.inference import Engine

    sa, sf = e2e.split_sparsity(0.5, "paper")
    assert (sa + sf) / 2 == pytest.approx(0.5) and sa > 2 * sf and e2e.split_sparsity(0.25, "uniform") == (0.25, 0.25)
    wm = _wide(seed=10, ffn_group_size=16)
    for r in [*wm.attn_routers, *wm.ffn_routers]:
        torch.nn.init.normal_(r.w2.weight, std=0.3)
    eng = Engine(wm)
    ids = torch.randint(2, 128, (2, 64), generator=torch.Generator().manual_seed(10))
    for s_attn, s_ffn in ((0.7, 0.3), (0.0, 0.0)):
        e2e.bias_routers(eng, ids, s_attn, s_ffn)
        eng.reset_stats()
        eng.prefill(ids, None, eng.new_cache(2, 64))
        sp = eng.realized_sparsity()
        assert abs(sp["attn"] - s_attn) < 0.15 and abs(sp["ffn"] - s_ffn) < 0.1, sp

    def tr(scale, routing):
        ops = {**{k: scale for k in e2e.ROUTED_OPS}, **{k: routing for k in e2e.ROUTING_OPS}}
        return {"ops": ops, "layers": 2, "total_ms": 2 * sum(ops.values()) + 1.0, "full_ms": None}

    a = e2e.amdahl(tr(0.5, 0.05), tr(1.0, 0.0))
    assert a["routed_path_speedup"] == pytest.approx(2.0) and a["dense_unrouted_ms"] == pytest.approx(1.0)
    assert a["amdahl_bound_no_overhead"] > a["predicted_speedup_sum_of_ops"] > 1.0
    rec = dict(phase="prefill", model="llama8b-shapes", split="paper", batch=1, prompt_len=512, sparsity=0.5,
               G_ffn=128, dense_ms=2.0, wide_ms=1.5, speedup=1.33, realized_sparsity={"overall": 0.5})
    e2e.write_report([rec, dict(rec, phase="decode")], str(tmp_path), "t")
    assert "| prefill | llama8b-shapes |" in (tmp_path / "e2e_t.md").read_text()


def test_bench_points_dry_run(monkeypatch, tmp_path, reference_path):
    """Every benchmark point and the per-op trace, run eagerly on the CPU with a tiny model (the GPU timers swapped
    for wall time), so that the GPU run cannot fail on plain Python errors."""
    import time

    import triton.testing

    from wide.bench import e2e

    def wall_ms(fn, runs=1, **kw):
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3

    monkeypatch.setattr(e2e, "DEVICE", "cpu")
    monkeypatch.setattr(e2e, "gpu_ms", wall_ms)
    monkeypatch.setattr(triton.testing, "do_bench", wall_ms)
    wm = _wide(seed=11)
    for h in wm._handles:
        h.remove()
    records = []
    run = types.SimpleNamespace(args=types.SimpleNamespace(runs=50, no_hf=False), add=records.append)
    engs = e2e.engines(wm.base, wm)
    e2e.bias_routers(engs["wide"], torch.randint(0, 128, (1, 64)), *e2e.split_sparsity(0.5, "paper"))
    extra = dict(sparsity=0.5, G_ffn=32, split="paper")
    e2e.bench_prefill(run, "tiny", wm.base, engs, 2, 24, extra)
    e2e.bench_decode(run, "tiny", wm.base, engs, 2, 24, extra)
    assert [r["phase"] for r in records] == ["prefill", "decode"]
    for r in records:
        assert {"op", "batch", "prompt_len", "dense_ms", "wide_ms", "wide_auto_ms", "hf_eager_ms",
                "realized_sparsity"} <= set(r)
    for phase, T in (("prefill", 24), ("decode", 24)):
        tr = {name: e2e.trace(eng, 2, T, phase) for name, eng in engs.items()}
        assert {"q_proj", "attend", "attn_router", "gate_up", "down_proj"} <= set(tr["wide"]["ops"])
        assert tr["wide"]["total_ms"] > sum(tr["wide"]["ops"].values())
        e2e.amdahl(tr["wide"], tr["dense"])


# --- CUDA -----------------------------------------------------------------------------------------------------------
def _fixed_mask_logits(wm, masks: list, ids, am):
    """The masking path given the engine's masks (a list of ``{(kind, layer): [B, t, N_G]}``, concatenated over t)."""
    fixed = {kind: torch.stack([torch.cat([m[(kind, i)] for m in masks], 1) for i in range(len(wm.attn_routers))])
             for kind in ("attn", "ffn")}
    with wm.masks_fixed(**fixed):
        return wm(ids, attention_mask=am, position_ids=_positions(am)).logits.float()


def _cuda_wide(seed):
    wm = _wide(seed=seed)
    wm.base.to("cuda", torch.bfloat16)
    return wm.to("cuda")


@cuda
def test_cuda_engine_matches_the_masking_path_and_graphs_replay_eager():
    """bf16 on the GPU: the prefill and 4 teacher-forced decode steps equal the masking path given the engine's own
    masks (bf16 tolerance); a decode step replayed from a CUDA graph equals the eager step; generation runs under
    graphs."""
    from wide.inference import Engine, generate
    from wide.inference.graphs import DecodeRunner

    wm = _cuda_wide(8)
    eng = Engine(wm)
    ids = torch.randint(2, 128, (2, 20), device="cuda", generator=torch.Generator("cuda").manual_seed(8))
    am = torch.ones_like(ids)
    am[1, :6] = 0
    eng.record_masks = True
    cache = eng.new_cache(2, 24)
    lg = eng.prefill(ids, am, cache, all_logits=True).float()
    masks = [dict(eng.masks)]
    rel = lambda a, b: ((a - b).abs().max() / b.abs().max()).item()  # noqa: E731
    v = am.bool()
    assert rel(lg[v], _fixed_mask_logits(wm, masks, ids, am)[v]) < 3e-2
    tok = lg[:, -1].argmax(-1)
    for _ in range(4):
        step = eng.decode(tok, cache).float()
        masks.append(dict(eng.masks))
        ids, am = torch.cat([ids, tok[:, None]], 1), torch.cat([am, torch.ones_like(am[:, :1])], 1)
        assert rel(step, _fixed_mask_logits(wm, masks, ids, am)[:, -1]) < 3e-2
        tok = step.argmax(-1)
    eng.record_masks = False
    eager_c, graph_c = eng.new_cache(2, 24), eng.new_cache(2, 24)
    first = eng.prefill(ids[:, :20], am[:, :20], eager_c).argmax(-1)
    eng.prefill(ids[:, :20], am[:, :20], graph_c)
    runner = DecodeRunner(eng, graph_c, graph=True)
    runner.tokens.copy_(first)
    runner.step()
    e = eng.decode(first, eager_c).float()
    assert (runner.logits.float() - e).abs().max().item() < 1e-2 and torch.equal(runner.tokens, e.argmax(-1))
    res = generate(Engine(wm), tiny_tokenizer(), ["w1 w2 w3 w4", "w9 w8", "w5 w6 w7"], max_new_tokens=8,
                   stop_at_eos=False)
    assert res.path == "kernels+cuda-graphs" and all(len(t) == 8 for t in res.tokens)


@cuda
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="needs an sm_90 GPU (H100 / H200)")
@pytest.mark.parametrize("ops", ["dense", "routed"])
def test_cuda_fused_dense_swiglu_matches_cublas(ops):
    """bf16 on an sm_90 GPU: the dense gate / up as the fused CuTe SwiGLU (from one row here) gives the logits of two
    cuBLAS GEMMs and the activation pass, the skipped groups zeroed in the routed engine's dense path."""
    from wide.inference import Engine

    wm = _cuda_wide(10)
    ids = torch.randint(2, 128, (2, 40), device="cuda", generator=torch.Generator("cuda").manual_seed(10))
    am = torch.ones_like(ids)
    am[1, :7] = 0
    out = []
    for rows in (None, 1):
        eng = Engine(wm, ops=ops, naxis="dense")
        eng.fused_swiglu_min_rows = rows
        out.append(eng.prefill(ids, am, eng.new_cache(2, 40), all_logits=True).float())
    v = am.bool()
    assert ((out[1] - out[0])[v].abs().max() / out[0][v].abs().max()).item() < 1e-2


@cuda
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="needs an sm_90 GPU (H100 / H200)")
def test_cuda_fused_swiglu_applies_the_route_in_its_epilogue():
    """bf16 on an sm_90 GPU, G = 128 (three FFN groups): the fused SwiGLU that zeroes the skipped groups in its
    epilogue (the router first) gives the logits of the masking pass after it (the router beside) and of two cuBLAS
    GEMMs with the masked activation."""
    from wide.inference import Engine

    torch.manual_seed(11)
    wm = WideModel(tiny_model(seed=11, intermediate_size=384), WideConfig(ffn_group_size=128), init_keep=0.5).eval()
    for r in [*wm.attn_routers, *wm.ffn_routers]:
        torch.nn.init.normal_(r.w2.weight, std=1.0)
    wm.base.to("cuda", torch.bfloat16)
    wm = wm.to("cuda")
    ids = torch.randint(2, 128, (2, 40), device="cuda", generator=torch.Generator("cuda").manual_seed(11))
    out, masks = [], []
    for rows, in_kernel in ((None, False), (1, False), (1, True)):
        eng = Engine(wm, naxis="dense", kaxis="dense")
        eng.fused_swiglu_min_rows, eng.fused_swiglu_route = rows, in_kernel
        eng.record_masks = True
        out.append(eng.prefill(ids, None, eng.new_cache(2, 40), all_logits=True).float())
        masks.append({k: v.clone() for k, v in eng.masks.items()})
    ffn = [v for k, v in masks[0].items() if k[0] == "ffn"]
    assert ffn and any(bool(v.any()) and not bool(v.all()) for v in ffn), "the FFN routers must skip some groups"
    assert all(torch.equal(masks[0][k], m[k]) for m in masks[1:] for k in masks[0])
    for o in out[1:]:
        assert ((o - out[0]).abs().max() / out[0].abs().max()).item() < 1e-2
    assert ((out[2] - out[1]).abs().max() / out[1].abs().max()).item() < 1e-3


@cuda
@pytest.mark.parametrize("naxis", ["auto", "dense"])
@pytest.mark.parametrize("B", [1, 3, 6])
def test_cuda_second_stream_changes_nothing(naxis, B):
    """bf16 on the GPU: the routers on the second stream (beside the norm, K / V, a cuBLAS Q or gate / up) give the
    masks and logits of the same engine in one stream, eagerly and replayed from a CUDA graph; the one-launch
    [Q | K | V] GEMV runs up to 4 rows where Q is routed."""
    from wide.inference import Engine
    from wide.inference.graphs import DecodeRunner

    wm = _cuda_wide(9)
    ids = torch.randint(2, 128, (B, 12), device="cuda", generator=torch.Generator("cuda").manual_seed(B))
    outs = []
    for streams in (True, False):
        eng = Engine(wm, naxis=naxis)
        assert eng.streams and eng.qkv_one_launch(B) == (B <= 4 and naxis == "auto")
        eng.streams = streams
        logits, masks = _prefill_decode(eng, ids, steps=1)
        cache = eng.new_cache(B, 14)
        eng.prefill(ids, None, cache)
        runner = DecodeRunner(eng, cache, graph=True)
        runner.tokens.copy_(logits[0].argmax(-1))
        runner.step()
        outs.append((logits, masks, runner.logits.clone()))
    (la, ma, ga), (lb, mb, gb) = outs
    assert all(torch.equal(a, b) for a, b in zip(la, lb)) and torch.equal(ga, gb)
    assert all(a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a) for a, b in zip(ma, mb))
    assert (ga.float() - la[1].float()).abs().max().item() < 5e-2
