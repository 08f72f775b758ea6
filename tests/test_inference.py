"""Inference engine (issue 5): the kernel-built forward pass against WideModel's masking path, left padding,
static KV cache decode, greedy generation, `wide generate`, bad input.  CPU only except the CUDA tests."""

from __future__ import annotations

import os

import pytest
import torch

from wide import WideConfig, WideError
from wide.kernels.reference import reorder_ref
from wide.model import WideModel
from wide_testutil import needs_bundled_model, tiny_model, tiny_tokenizer

ATOL = 2e-5


def _wide(seed=0, **cfg):
    torch.manual_seed(seed)
    base = tiny_model(seed=seed)
    wm = WideModel(base, WideConfig(ffn_group_size=cfg.pop("ffn_group_size", 32), **cfg), init_keep=0.5).eval()
    for r in [*wm.attn_routers, *wm.ffn_routers]:  # routers that really disagree between tokens
        torch.nn.init.normal_(r.w2.weight, std=1.0)
    return wm


def _positions(mask):
    return (mask.cumsum(-1) - 1).clamp_min(0)


def _ref_greedy(wm, ids, n):
    ids = list(ids)
    out, logits = [], []
    for _ in range(n):
        lg = wm(torch.tensor([ids])).logits[0, -1]
        logits.append(lg)
        t = int(lg.argmax())
        out.append(t)
        ids.append(t)
    return out, logits


@pytest.fixture
def reference_path(monkeypatch):
    """Kernels fall back to their PyTorch references (fast on CPU)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")


def test_batch_reorder_view_equals_per_sequence_reorder():
    from wide.inference import batch_reorder_view

    g = torch.Generator().manual_seed(0)
    for B, T, N in [(1, 7, 3), (3, 50, 4), (4, 33, 1)]:
        mask = torch.rand(B, T, N, generator=g) < 0.4
        mask[0, :, 0] = False  # an empty column
        got = batch_reorder_view(reorder_ref(mask.view(B * T, N)), mask)
        want = reorder_ref(mask)
        assert torch.equal(got.index, want.index) and torch.equal(got.mask, want.mask)
        assert torch.equal(got.counts, want.counts)


@pytest.mark.skipif(torch.cuda.is_available(), reason="Triton-interpreter test of the CPU machine; on a GPU the "
                    "cuda tests below run the compiled kernels")
def test_kernels_prefill_and_decode_match_masking_path():
    """Triton interpreter: M = B*T > 128 (shared flat reorder + per-sequence view), left padding, 2 decode steps."""
    from wide.inference import Engine

    wm = _wide()
    eng = Engine(wm)
    assert eng.uses_kernels  # conftest sets TRITON_INTERPRET=1 without CUDA
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, 128, (2, 70), generator=g)
    am = torch.ones_like(ids)
    am[1, :9] = 0
    v = am.bool()
    wm.record_masks = True
    ref = wm(ids, attention_mask=am, position_ids=_positions(am)).logits
    eng.record_masks = True
    cache = eng.new_cache(2, 74)
    out = eng.prefill(ids, am, cache, all_logits=True)
    assert (out - ref)[v].abs().max().item() < ATOL
    for key, m in eng.masks.items():
        assert torch.equal(m[v], wm.record.masks[key][v]), key
    sp = eng.realized_sparsity()
    assert 0.1 < sp["attn"] < 0.9 and 0.1 < sp["ffn"] < 0.9
    seqs = [ids[b][v[b]].tolist() for b in range(2)]
    tok = out[:, -1].argmax(-1)
    for _ in range(2):
        lg = eng.decode(tok, cache)
        for b in range(2):
            seqs[b].append(int(tok[b]))
            wm.record_masks = True
            r = wm(torch.tensor([seqs[b]])).logits[0, -1]
            assert (lg[b] - r).abs().max().item() < ATOL
            for (kind, i), m in eng.masks.items():
                assert torch.equal(m[b, 0], wm.record.masks[(kind, i)][0, -1]), (kind, i)
        tok = lg.argmax(-1)
    assert cache.lengths.tolist() == [72, 63]


def test_left_padded_batch_equals_single_runs(reference_path):
    from wide.inference import Engine

    wm = _wide(seed=2)
    eng = Engine(wm)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, 128, (n,), generator=g) for n in (5, 12, 1)]
    T = 12
    ids = torch.zeros(3, T, dtype=torch.long)
    am = torch.zeros(3, T, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, T - len(p):] = p
        am[b, T - len(p):] = 1
    cache = eng.new_cache(4, 20)  # a bucket with an idle row
    out = eng.prefill(ids, am, cache, all_logits=True)
    toks = out[:, -1].argmax(-1)
    batch_steps = [torch.cat([toks, torch.zeros(1, dtype=torch.long)])]
    dec = [eng.decode(batch_steps[0], cache)[:3]]
    for b, p in enumerate(prompts):
        c1 = eng.new_cache(1, 20)
        single = eng.prefill(p.view(1, -1), None, c1, all_logits=True)[0]
        assert (single - out[b, T - len(p):]).abs().max().item() < ATOL
        d1 = eng.decode(toks[b:b + 1], c1)[0]
        assert (d1 - dec[0][b]).abs().max().item() < ATOL


def test_greedy_generation_matches_reference(reference_path):
    from wide.inference import Engine, generate

    wm = _wide(seed=4)
    eng = Engine(wm)
    tok = tiny_tokenizer()
    prompts = ["w1 w2 w3 w4", "w9 w8", "w5 w6 w7 w10 w11 w12 w13"]
    res = generate(eng, tok, prompts, max_new_tokens=10, stop_at_eos=False)
    assert res.path == "reference" and res.steps == 9
    for b, p in enumerate(prompts):
        want, _ = _ref_greedy(wm, tok(p)["input_ids"], 10)
        assert res.tokens[b] == want
    assert set(res.sparsity) == {"attn", "ffn", "overall"} and res.ttft_s > 0 and res.tpot_s > 0
    # the cached runner is reused by a second call (same bucket and capacity)
    res2 = generate(eng, tok, prompts, max_new_tokens=10, stop_at_eos=False)
    assert res2.tokens == res.tokens


def test_dense_model_through_kernels_and_dense_ops(reference_path):
    from wide.inference import Engine

    base = tiny_model(seed=5)
    ids = torch.randint(2, 128, (2, 11), generator=torch.Generator().manual_seed(5))
    ref = base(ids).logits
    for ops in ("routed", "dense"):
        eng = Engine(base, ops=ops)
        eng.record_masks = True
        out = eng.prefill(ids, None, eng.new_cache(2, 12), all_logits=True)
        assert (out - ref).abs().max().item() < ATOL
        if ops == "routed":
            assert all(bool(m.all()) for m in eng.masks.values())
            assert eng.realized_sparsity()["overall"] == 0.0


def test_kaxis_variants_same_function():
    """O / down as cuBLAS on the zero-filled routed activations equals gemm_k (Triton interpreter)."""
    from wide.inference import Engine

    wm = _wide(seed=12)
    ids = torch.randint(2, 128, (1, 9), generator=torch.Generator().manual_seed(12))
    outs = [Engine(wm, kaxis=k).prefill(ids, None, Engine(wm).new_cache(1, 9), all_logits=True)
            for k in ("kernel", "auto", "dense")]
    assert (outs[0] - outs[1]).abs().max().item() < ATOL and (outs[0] - outs[2]).abs().max().item() < ATOL
    with pytest.raises(WideError, match="kaxis"):
        Engine(wm, kaxis="fast")


def test_naxis_variants_same_function_and_measured_activity():
    """Q and gate + up as cuBLAS GEMMs (+ the masked SwiGLU activation) equal gemm_mn / swiglu, and SDPA with
    the skipped head groups zeroed equals the routed attention: forced (``"dense"``) and chosen per layer from
    the measured activity (``"auto"``, > 128 rows); Triton interpreter, left padding."""
    from wide.inference import Engine

    wm = _wide(seed=13)
    gen = torch.Generator().manual_seed(13)
    ids = torch.randint(2, 128, (2, 70), generator=gen)  # 140 rows: the many-row (reordered) path
    am = torch.ones_like(ids)
    am[1, :6] = 0
    cache = Engine(wm).new_cache(2, 70)
    ref_eng = Engine(wm)
    ref_eng.record_masks = True
    ref = ref_eng.prefill(ids, am, cache, all_logits=True)
    masks = dict(ref_eng.masks)
    dense = Engine(wm, naxis="dense").prefill(ids, am, cache, all_logits=True)
    sdpa = Engine(wm, attn="dense").prefill(ids, am, cache, all_logits=True)
    auto = Engine(wm, naxis="auto", kaxis="auto", attn="auto")
    assert not any(auto.naxis_dense(k, 0, 140) for k in ("attn", "ffn"))  # nothing measured: the kernels
    assert not auto.attn_dense(0, "prefill")
    act = auto.measure_activity(ids, am)
    n = len(auto.layers)
    assert set(act) == {(k, i) for k in ("attn", "ffn") for i in range(n)}
    w = am.double()
    for k, v in act.items():  # the executed fraction over real tokens, from the recorded masks
        assert v == pytest.approx(float((masks[k].double().mean(-1) * w).sum() / w.sum()), abs=1e-12)
    assert auto.expected_active == act and auto.masks == {} and not auto.record_masks
    plain = Engine(wm.base)  # no routers: every group executes, so the auto dispatch needs no measurement
    assert plain.naxis_dense("ffn", 0, 140) and plain.attn_dense(0, "prefill") and plain.naxis_dense("attn", 0, 9)
    assert not plain.naxis_dense("ffn", 0, 4)  # <= 4 rows: the decode GEMVs, as fast as cuBLAS at p = 1
    auto.expected_active = {k: 1.0 for k in act}  # above every threshold: cuBLAS for the N-axis ops
    assert all(auto.naxis_dense(k, i, 140) for k, i in act)
    # 5-64 rows (decode at batch 16): Q as cuBLAS, the fused SwiGLU routed at any activity; <= 4 rows: GEMVs
    assert auto.naxis_dense("attn", 0, 16) and not auto.naxis_dense("ffn", 0, 16)
    assert not auto.naxis_dense("ffn", 0, 4) and not auto.naxis_dense("attn", 0, 4)
    assert auto.attn_dense(0, "prefill") and not auto.attn_dense(0, "decode")
    out_auto = auto.prefill(ids, am, cache, all_logits=True)
    valid = am.bool()
    for out in (dense, sdpa, out_auto):
        assert (out - ref)[valid].abs().max().item() < ATOL
    with pytest.raises(WideError, match="naxis"):
        Engine(wm, naxis="fast")
    with pytest.raises(WideError, match="attn"):
        Engine(wm, attn="flash")
    with pytest.raises(WideError, match="overlap='yes'"):
        Engine(wm, overlap="yes")
    assert not Engine(wm).overlaps_router("attn", "decode")  # CPU: no second stream
    assert Engine(wm, ops="dense").measure_activity(ids, am) == {}


def test_dense_ops_left_padding_and_attn_only_routing(reference_path):
    from wide.inference import Engine

    wm = _wide(seed=6, routed="attn")
    ids = torch.randint(2, 128, (2, 9), generator=torch.Generator().manual_seed(6))
    am = torch.ones_like(ids)
    am[0, :4] = 0
    v = am.bool()
    ref = wm(ids, attention_mask=am, position_ids=_positions(am)).logits
    out = Engine(wm).prefill(ids, am, Engine(wm).new_cache(2, 9), all_logits=True)
    assert (out - ref)[v].abs().max().item() < ATOL
    with wm.masks_fixed(attn=True, ffn=True):
        dref = wm(ids, attention_mask=am, position_ids=_positions(am)).logits
    dense = Engine(wm, ops="dense")
    dout = dense.prefill(ids, am, dense.new_cache(2, 9), all_logits=True)
    assert (dout - dref)[v].abs().max().item() < ATOL


def test_bad_input(reference_path):
    from wide.inference import Engine, generate

    eng = Engine(_wide(seed=7))
    tok = tiny_tokenizer()
    with pytest.raises(WideError, match="empty prompt"):
        generate(eng, tok, ["w1", ""], max_new_tokens=2)
    with pytest.raises(WideError, match="longer than the KV cache"):
        generate(eng, tok, ["w1 w2 w3 w4 w5"], max_new_tokens=2, max_len=4)
    with pytest.raises(WideError, match="does not fit the KV cache"):
        generate(eng, tok, ["w1 w2 w3"], max_new_tokens=5, max_len=4)
    with pytest.raises(WideError, match="exceeds the model's context of 256 tokens"):  # max_position_embeddings
        generate(eng, tok, ["w1 w2"], max_new_tokens=100000)
    with pytest.raises(WideError, match="mixed devices"):
        generate(eng, tok, [torch.tensor([3, 4]), torch.tensor([5], device="meta")], max_new_tokens=2)
    with pytest.raises(WideError, match="empty prompt"):
        eng.prefill(torch.zeros(1, 0, dtype=torch.long), None, eng.new_cache(1, 4))
    with pytest.raises(WideError, match="longer than the KV cache"):
        eng.prefill(torch.ones(1, 6, dtype=torch.long), None, eng.new_cache(1, 4))
    if not torch.cuda.is_available():
        with pytest.raises(WideError, match="CUDA"):
            generate(eng, tok, ["w1"], max_new_tokens=2, graphs=True)
    # values: ids outside the vocabulary, float ids, masks that are not left-padded 0/1 with a real token per row
    ids = torch.randint(2, 128, (2, 5), generator=torch.Generator().manual_seed(7))
    vocab = eng.embed.num_embeddings
    with pytest.raises(WideError, match=f"vocabulary is 0..{vocab - 1}"):
        eng.prefill(torch.full((1, 3), vocab), None, eng.new_cache(1, 4))
    with pytest.raises(WideError, match="vocabulary"):
        eng.prefill(torch.full((1, 3), -1), None, eng.new_cache(1, 4))
    with pytest.raises(WideError, match="integer"):
        eng.prefill(ids.float(), None, eng.new_cache(2, 5))
    ones = torch.ones_like(ids)
    bad_masks = {"right-padded": torch.tensor([[1, 1, 1, 0, 0], [1] * 5]),
                 "holes": torch.tensor([[0, 1, 0, 1, 1], [1] * 5]),
                 "no real token": torch.tensor([[0] * 5, [1] * 5]), "values 0/1/2": ones * 2}
    for name, m in bad_masks.items():
        with pytest.raises(WideError, match="left-padded"):
            eng.prefill(ids, m, eng.new_cache(2, 5))
        with pytest.raises(WideError, match="left-padded"):
            eng.measure_activity(ids, m)
    for bad in (ids[0], torch.zeros(1, 0, dtype=torch.long), ids[None]):
        with pytest.raises(WideError, match="input_ids|empty"):
            eng.measure_activity(bad)
    eng.reset_stats()
    assert eng.measure_activity(ids, torch.tensor([[0, 0, 1, 1, 1], [1] * 5]))
    assert eng.stats.abs().sum().item() == 0  # the sample does not count in realized_sparsity


@pytest.fixture
def wide_ckpt(tmp_path, model_dir):
    from wide.checkpoint import save_wide
    from wide.model import load_base_model

    base, _, src = load_base_model(str(model_dir), device="cpu")
    wm = WideModel(base, WideConfig(ffn_group_size=32), init_keep=0.5)
    for r in [*wm.attn_routers, *wm.ffn_routers]:
        torch.nn.init.normal_(r.w2.weight, std=1.0)
    return save_wide(wm, tmp_path / "ckpt", src.ref)


def test_cli_generate_says_triton_is_missing(wide_ckpt, capsys, monkeypatch):
    """TRITON_INTERPRET=1 on a machine without Triton: the one-line notice says why the reference path runs."""
    from wide.cli import main
    from wide.kernels import _common

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(_common, "HAS_TRITON", False)
    rc = main(["generate", "--wide", str(wide_ckpt), "--prompt", "w1 w2", "--max-new-tokens", "1", "--device", "cpu"])
    err = capsys.readouterr().err
    assert rc == 0, err
    ours = [line for line in err.splitlines() if line.startswith("wide generate:")]
    assert len(ours) == 1 and "PyTorch reference" in ours[0] and "Triton is not installed" in ours[0], ours


def test_cli_generate(wide_ckpt, model_dir, capsys, reference_path):
    from wide.cli import main

    rc = main(["generate", "--wide", str(wide_ckpt), "--prompt", "w1 w2 w3", "--max-new-tokens", "5",
               "--device", "cpu"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    ours = [line for line in err.splitlines() if line.startswith("wide generate:")]
    why = "no CUDA device" if not torch.cuda.is_available() else "--device cpu"  # a GPU machine asked for the CPU
    assert len(ours) == 1 and why in ours[0]
    last = out.strip().splitlines()[-1]
    for key in ("TTFT", "TPOT", "tokens/s", "realized sparsity: attn", "path: reference"):
        assert key in last
    rc = main(["generate", "--model", str(model_dir), "--prompt", "w1 w2", "--prompt", "w3",
               "--max-new-tokens", "3", "--device", "cpu"])
    out, _ = capsys.readouterr()
    assert rc == 0 and "[1]" in out and "0 (dense)" in out


def test_cli_generate_bad_input(wide_ckpt, model_dir, tmp_path, capsys, reference_path):
    from wide.cli import main

    cases = [
        (["--wide", str(wide_ckpt), "--prompt", "  "], "empty prompt"),
        (["--model", str(model_dir), "--prompt", "w1 w2 w3 w4", "--max-cache-len", "3"], "longer than the KV cache"),
    ]
    if not torch.cuda.is_available():
        cases.append((["--model", str(model_dir), "--prompt", "w1", "--device", "cuda"], "no CUDA GPU"))
    other = tmp_path / "other"
    tiny_model(seed=9).save_pretrained(other)
    tiny_tokenizer().save_pretrained(other)
    cases.append((["--wide", str(wide_ckpt), "--model", str(other), "--prompt", "w1"], "made for base model"))
    for extra, msg in cases:
        rc = main(["generate", "--max-new-tokens", "2", *extra])
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 2, (extra, err)
        assert msg in err[-1] and err[-1].startswith("wide generate: error:"), err


def test_cli_bench_registered(capsys):
    from wide.cli import build_parser

    p = build_parser()
    a = p.parse_args(["bench", "e2e", "--quick"])
    assert a.quick and callable(a.func)
    a = p.parse_args(["bench", "kernels", "--quick"])
    assert a.quick and callable(a.func)
    if not torch.cuda.is_available():
        from wide.cli import main

        assert main(["bench", "e2e", "--quick", "--out-dir", os.devnull]) == 2
        assert "GPU" in capsys.readouterr().err


@pytest.mark.slow
@needs_bundled_model
def test_smollm2_calibrated_routers_match(reference_path):
    """Bundled SmolLM2-135M with the calibrated S=0.5 routers: 2 left-padded prompts, prefill + 8 decode steps."""
    import wide
    from wide.inference import Engine, generate

    ckpt = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "quality", "checkpoints",
                        "smollm2-global-s50-g128")
    wm, tok = wide.load(ckpt, device="cpu", tokenizer=True)
    eng = Engine(wm)
    prompts = ["The capital of France is", "Water boils at a temperature of one hundred degrees"]
    res = generate(eng, tok, prompts, max_new_tokens=8, stop_at_eos=False)
    assert 0.3 < res.sparsity["overall"] < 0.7
    for b, p in enumerate(prompts):
        ids = tok(p)["input_ids"]
        want, logits = _ref_greedy(wm, ids, 8)
        assert res.tokens[b] == want
    # logits and masks of the padded prefill against the masking path
    enc = [torch.tensor(tok(p)["input_ids"]) for p in prompts]
    T = max(len(e) for e in enc)
    ids = torch.zeros(2, T, dtype=torch.long)
    am = torch.zeros_like(ids)
    for b, e in enumerate(enc):
        ids[b, T - len(e):] = e
        am[b, T - len(e):] = 1
    wm.record_masks = True
    ref = wm(ids, attention_mask=am, position_ids=_positions(am)).logits
    eng.record_masks = True
    out = eng.prefill(ids, am, eng.new_cache(2, T), all_logits=True)
    v = am.bool()
    assert (out - ref)[v].abs().max().item() < 2e-3 * ref[v].abs().max().item()
    for key, m in eng.masks.items():
        assert torch.equal(m[v], wm.record.masks[key][v]), key


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@cuda
def test_cuda_graph_decode_and_fixed_mask_check():
    """bf16 on the GPU: a CUDA-graph decode step equals the same step run eagerly; the engine's prefill and decode
    logits equal the masking path given the engine's masks (bf16 tolerance); generation runs under graphs."""
    from wide.bench import e2e
    from wide.inference import Engine, generate

    wm = _wide(seed=8)
    wm.base.to("cuda", torch.bfloat16)
    wm.to("cuda")
    for h in wm._handles:
        h.remove()
    wm._handles = []
    ids = torch.randint(2, 128, (2, 20), device="cuda", generator=torch.Generator("cuda").manual_seed(8))
    mask = torch.ones_like(ids)
    mask[1, :6] = 0
    chk = e2e.check_engine(wm, wm.base, ids, mask, new_tokens=4)
    assert chk["prefill_logits_max_rel_err_fixed_masks"] < 3e-2, chk
    assert chk["decode_logits_max_rel_err_fixed_masks"] < 3e-2, chk
    assert chk["graph_vs_eager_max_abs_diff"] < 1e-2, chk
    res = generate(Engine(wm), tiny_tokenizer(), ["w1 w2 w3 w4", "w9 w8", "w5 w6 w7"], max_new_tokens=8,
                   stop_at_eos=False)
    assert res.path == "kernels+cuda-graphs" and all(len(t) == 8 for t in res.tokens)


def _stub_cuda_streams(monkeypatch, wm):
    """Stub CUDA's stream calls (fork / join become no-ops) after every lazily imported module has loaded."""
    import contextlib
    import types

    from wide.inference import Engine

    warm = Engine(wm)
    warm.decode(warm.prefill(torch.tensor([[5, 6]]), None, c := warm.new_cache(1, 4)).argmax(-1), c)
    fake = types.SimpleNamespace(wait_stream=lambda other: None)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: fake)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: fake)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())


def _prefill_decode(eng, ids, steps: int):
    """``(logits, masks)`` of a prefill of ``ids`` and ``steps`` greedy decode steps through ``eng`` (the masks of
    the prefill keyed ``("prefill", kind, layer)``, those of the last decode step ``(kind, layer)``)."""
    cache = eng.new_cache(ids.shape[0], ids.shape[1] + steps + 1)
    eng.record_masks = True
    logits = [eng.prefill(ids, None, cache)]
    masks = {("prefill",) + k: v for k, v in eng.masks.items()}
    for _ in range(steps):
        logits.append(eng.decode(logits[-1].argmax(-1), cache))
    masks.update(eng.masks)
    return logits, masks


def _assert_equal_runs(a, b):
    """Two :func:`_prefill_decode` results are bitwise equal (every logits tensor and every mask)."""
    assert len(a[0]) == len(b[0]) and all(torch.equal(x, y) for x, y in zip(a[0], b[0]))
    assert a[1].keys() == b[1].keys() and all(torch.equal(a[1][k], b[1][k]) for k in a[1])


def test_routers_beside_cublas_projections_logic_on_cpu(monkeypatch):
    """Where gate / up and down run as cuBLAS (``naxis="dense"``, from 5 rows), the FFN router runs inside the
    gate / up step (beside the two GEMMs on CUDA), and where Q runs as cuBLAS the attention router runs beside
    Q, K and V: the router, reorder and Q steps are left out and the masks and logits equal the plain path's,
    at prefill and decode, batch 2 (decode of 2 rows: the plain path) and 6."""
    from wide.inference import Engine

    wm = _wide(seed=11)
    _stub_cuda_streams(monkeypatch, wm)
    for B in (2, 6):
        ids = torch.randint(2, 128, (B, 9), generator=torch.Generator().manual_seed(B))
        outs = []
        for beside in (True, False):
            eng = Engine(wm, naxis="dense")
            eng.overlaps_gate_up_router = (lambda phase, i, M, on=beside: on and M > 4)
            eng.overlaps_router = (lambda kind, phase, on=beside: on and phase == "decode")
            eng.overlaps_prefill_router = (lambda phase, on=beside: on and phase == "prefill")
            for phase, T in (("prefill", 9), ("decode", 1)):
                names = [n for n, _ in eng.layer_steps(0, {"h": torch.zeros(B, T, 8)}, phase)]
                on = beside and B * T > 4
                # the FFN router's own step is left out with any overlap (beside the norm at 1-4 decode rows)
                assert ("ffn_router" in names) != beside and ("ffn_reorder" in names) != on, (phase, B, names)
                assert names[-2:] == ["gate_up", "down_proj"]
                on_q = beside and not eng.qkv_one_launch(phase, B * T)  # naxis "dense": never one launch
                assert ("q_proj" in names) != on_q and eng.overlaps_q_router(phase, 0, B * T) == on_q, (phase, B)
            outs.append(_prefill_decode(eng, ids, steps=1))
        _assert_equal_runs(*outs)
        assert any(not m.all() for m in outs[0][1].values())  # the routers skip something: the masks matter


def test_router_overlap_logic_on_cpu(monkeypatch):
    """The overlap paths' logic (decode: router reading h + add inside its kernel, the router steps left out;
    prefill: the attention router and reorder inside the K / V step, before the Q projection) on the CPU
    interpreter, with CUDA's stream calls stubbed: the same masks and logits as the plain path, batch 1, 3 and
    6 (from 5 rows, with Q, K and V separate, decode runs the attention router beside the norm and K / V)."""
    from wide.inference import Engine

    wm = _wide(seed=9)
    _stub_cuda_streams(monkeypatch, wm)
    for B in (1, 3, 6):
        ids = torch.randint(2, 128, (B, 9), generator=torch.Generator().manual_seed(B))
        outs = []
        for overlap in (True, False):
            eng = Engine(wm, overlap=overlap)
            eng.overlaps_router = (lambda kind, phase, on=overlap: on and phase == "decode")
            eng.overlaps_prefill_router = (lambda phase, on=overlap: on and phase == "prefill")
            names = [n for n, _ in eng.layer_steps(0, {"h": torch.zeros(B, 1, 8)}, "decode")]
            assert ("attn_router" in names) != overlap and ("ffn_router" in names) != overlap
            qkv = eng.qkv_one_launch("decode", B)
            assert ("kv_proj" in names) == (not qkv and not overlap), (B, names)  # K / V inside input_norm
            assert names.index("input_norm") < names.index("attn_reorder") < names.index("q_proj" if not qkv
                                                                                         else "qkv_proj")
            names = [n for n, _ in eng.layer_steps(0, {"h": torch.zeros(B, 9, 8)}, "prefill")]
            assert ("attn_router" in names) != overlap and ("attn_reorder" in names) != overlap
            assert names.index("kv_proj") < names.index("q_proj") if overlap else "kv_proj" in names
            outs.append(_prefill_decode(eng, ids, steps=2))
        _assert_equal_runs(*outs)


def _cuda_prefill_decode_graph(eng, ids):
    """``(decode logits, masks, graph-replayed decode logits, prefill logits)`` of ``eng`` on ``ids`` ``[B, 12]``:
    a prefill, one eager decode step, and the same step (position 12) replayed from a CUDA graph, which must
    match the eager one within bf16 noise."""
    from wide.inference.graphs import capture

    cache = eng.new_cache(ids.shape[0], 20)
    eng.record_masks = True
    pre = eng.prefill(ids, None, cache)
    masks = {("prefill",) + k: v.clone() for k, v in eng.masks.items()}
    tok = pre.argmax(-1)
    eager = eng.decode(tok, cache)
    masks.update({k: v.clone() for k, v in eng.masks.items()})
    eng.record_masks = False
    res = {}
    g = capture(lambda: res.__setitem__("logits", eng.decode(tok, cache)))
    cache.lengths.fill_(12)  # replay the same step (position 12) from the graph
    g.replay()
    torch.cuda.synchronize()
    assert (res["logits"].float() - eager.float()).abs().max().item() < 5e-2
    return eager.float(), masks, res["logits"].float().clone(), pre.float()


def _assert_same_outputs(a, b):
    """Two :func:`_cuda_prefill_decode_graph` results are bitwise equal (logits and every mask)."""
    assert all(torch.equal(a[i], b[i]) for i in (0, 2, 3))
    assert a[1].keys() == b[1].keys() and all(torch.equal(a[1][k], b[1][k]) for k in a[1])


@cuda
def test_cuda_router_overlap_and_one_launch_qkv_change_nothing():
    """bf16 on the GPU, batch 1 and 3: decode steps with the routers on a second stream (reading h + add in
    their kernel), the prefill's attention router beside its K / V projections, and the one-launch [Q | K | V]
    GEMV give the same masks and logits as the plain engine
    (the same values reach the same kernels), eagerly and replayed from a CUDA graph; batch 6 (Q, K, V
    separate) with the attention router beside the norm and the K / V projections."""
    from wide.inference import Engine

    wm = _wide(seed=9)
    wm.base.to("cuda", torch.bfloat16)
    wm.to("cuda")
    for B in (1, 3, 6):
        ids = torch.randint(2, 128, (B, 12), device="cuda", generator=torch.Generator("cuda").manual_seed(B))
        outs = []
        for overlap in (True, False):
            eng = Engine(wm, overlap=overlap)
            assert eng.overlaps_router("attn", "decode") == overlap and eng.qkv_one_launch("decode", B) == (B <= 4)
            assert not eng.overlaps_gate_up_router("decode", 0, B)  # no measured activity: the SwiGLU is routed
            names = [n for n, _ in eng.layer_steps(0, {"h": torch.zeros(B, 1, 8)}, "decode")]
            assert ("attn_router" in names) != overlap
            assert ("qkv_proj" in names) == (B <= 4) and ("kv_proj" in names) == (B > 4 and not overlap)
            assert eng.overlaps_prefill_router("prefill") == overlap
            outs.append(_cuda_prefill_decode_graph(eng, ids))
        _assert_same_outputs(*outs)


@cuda
def test_cuda_routers_beside_cublas_projections_change_nothing():
    """bf16 on the GPU with ``naxis="dense"`` (cuBLAS Q and gate / up, the masked activation), batch 6: the FFN
    router on the second stream beside the two GEMMs and the attention router beside Q, K and V give the same
    masks and logits as with ``overlap=False``, at prefill and decode, eagerly and replayed from a CUDA graph."""
    from wide.inference import Engine

    wm = _wide(seed=11)
    wm.base.to("cuda", torch.bfloat16)
    wm.to("cuda")
    B = 6
    ids = torch.randint(2, 128, (B, 12), device="cuda", generator=torch.Generator("cuda").manual_seed(B))
    outs = []
    for overlap in (True, False):
        eng = Engine(wm, overlap=overlap, naxis="dense")
        for phase, M in (("decode", B), ("prefill", B * 12)):
            assert eng.overlaps_gate_up_router(phase, 0, M) == overlap
            assert eng.overlaps_q_router(phase, 0, M) == overlap
        outs.append(_cuda_prefill_decode_graph(eng, ids))
    _assert_same_outputs(*outs)


def test_bench_helpers_on_cpu(tmp_path, reference_path):
    """The parts of `wide bench e2e` that need no GPU: router biasing to a target split, Amdahl attribution,
    the report."""
    from wide.bench import e2e
    from wide.inference import Engine

    sa, sf = e2e.split_sparsity(0.5, "paper")
    assert abs((sa + sf) / 2 - 0.5) < 1e-9 and sa > 2 * sf
    assert e2e.split_sparsity(0.25, "uniform") == (0.25, 0.25)
    wm = _wide(seed=10, ffn_group_size=16)
    for layer in (wm.attn_routers, wm.ffn_routers):  # not the biased routers of the other tests
        for r in layer:
            torch.nn.init.normal_(r.w2.weight, std=0.3)
    eng = Engine(wm)
    ids = torch.randint(2, 128, (2, 64), generator=torch.Generator().manual_seed(10))
    e2e.bias_routers(eng, ids, 0.7, 0.3)
    eng.reset_stats()
    eng.prefill(ids, None, eng.new_cache(2, 64))
    sp = eng.realized_sparsity()
    assert abs(sp["attn"] - 0.7) < 0.15 and abs(sp["ffn"] - 0.3) < 0.1, sp
    e2e.bias_routers(eng, ids, 0.0, 0.0)
    eng.reset_stats()
    eng.prefill(ids, None, eng.new_cache(2, 64))
    assert eng.realized_sparsity()["overall"] == 0.0

    def tr(scale, routing):
        ops = {k: 1.0 * scale for k in e2e.ROUTED_OPS}
        ops.update({k: routing for k in e2e.ROUTING_OPS})
        ops.update(input_norm=0.1, kv_proj=0.2, rope=0.1)
        return {"ops": ops, "layer_ms": sum(ops.values()), "embed_ms": 0.0, "head_ms": 0.4, "full_ms": 0.0 + (
            sum(ops.values()) * 2 + 0.4), "layers": 2}

    a = e2e.amdahl(tr(0.5, 0.05), tr(1.0, 0.0))
    assert abs(a["routed_path_speedup"] - 2.0) < 1e-9
    assert a["amdahl_bound_no_overhead"] > a["predicted_speedup_sum_of_ops"] > 1.0
    rec = dict(phase="prefill", model="llama8b-shapes", split="paper", batch=1, prompt_len=512, sparsity=0.5,
               G_ffn=128, dense_ms=2.0, wide_ms=1.5, speedup=1.33, realized_sparsity={"overall": 0.5})
    e2e.write_report([rec, dict(rec, phase="decode")], str(tmp_path), "t")
    assert "| prefill | llama8b-shapes |" in (tmp_path / "e2e_t.md").read_text()


def test_bench_points_dry_run_on_cpu(monkeypatch, tmp_path, reference_path):
    """Every benchmark point, the per-op trace and the GPU self-check, run eagerly on the CPU with a tiny model
    (graphs and CUDA events swapped for eager calls and wall time), so the one GPU run cannot fail on plain
    Python errors."""
    import types

    from wide.bench import e2e
    from wide.inference.graphs import DecodeRunner

    class Eager:
        def __init__(self, fn, warmup=2):
            for _ in range(warmup):
                fn()
            self.replay = fn

    def median_ms(fn, runs, before=None):
        import time as _t

        out = []
        for _ in range(min(runs, 3)):
            if before:
                before()
            t = _t.perf_counter()
            fn()
            out.append((_t.perf_counter() - t) * 1e3)
        return sorted(out)[len(out) // 2]

    monkeypatch.setattr(e2e, "DEVICE", "cpu")
    monkeypatch.setattr(e2e, "_capture", lambda fn, warmup=2: Eager(fn, warmup))
    monkeypatch.setattr(e2e, "_decode_runner", lambda eng, cache: DecodeRunner(eng, cache, graph=False))
    monkeypatch.setattr(e2e, "_median_ms", median_ms)
    wm = _wide(seed=11)
    for h in wm._handles:
        h.remove()
    wm._handles = []
    base = wm.base
    records = []
    args = types.SimpleNamespace(runs=50, no_hf=False, out_dir=str(tmp_path), tag="cpu")
    ctx = types.SimpleNamespace(args=args, add=records.append, over=lambda: False)
    wide_eng, dense_eng = e2e._engine_pair(base, wm)
    e2e.smoke(wide_eng, dense_eng, 128)
    e2e.bias_routers(wide_eng, torch.randint(0, 128, (1, 64)), *e2e.split_sparsity(0.5, "paper"))
    extra = dict(sparsity=0.5, G_ffn=32, split="paper")
    e2e.bench_prefill(ctx, "tiny", base, wide_eng, dense_eng, 2, 24, extra)
    e2e.bench_decode(ctx, "tiny", base, wide_eng, dense_eng, 2, 24, extra)
    for r in records:
        for key in ("phase", "model", "batch", "prompt_len", "sparsity", "G_ffn", "dense_ms", "wide_ms", "speedup",
                    "hf_eager_ms", "realized_sparsity", "wide_auto_ms", "speedup_auto"):
            assert key in r, key
    assert [r["phase"] for r in records] == ["prefill", "decode"]
    tw = e2e.trace_layer(wide_eng, 1, 24, "prefill", runs=2)
    td = e2e.trace_layer(dense_eng, 1, 24, "prefill", runs=2)
    assert {"q_proj", "attention", "attn_reorder", "gate_up", "down_proj", "input_norm"} <= set(tw["ops"])
    e2e.amdahl(tw, td)
    e2e.amdahl(e2e.trace_layer(wide_eng, 2, 24, "decode", runs=2), e2e.trace_layer(dense_eng, 2, 24, "decode", runs=2))
    ids = torch.randint(0, 128, (2, 20))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    chk = e2e.check_engine(wm, base, ids, mask, new_tokens=3)
    assert chk["prefill_logits_max_rel_err_fixed_masks"] < 1e-5 and chk["decode_logits_max_rel_err_fixed_masks"] < 1e-5
    assert chk["free_routing_mask_agreement_min"] == 1.0 and chk["decode_steps"] == 3
    assert wm._handles == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_kernels_match_model_ops(dtype):
    """Triton interpreter: add+RMSNorm equals the HF norm module, fused RoPE + cache write equals
    apply_rotary_pos_emb + scatter (bitwise in fp32), the router kernel equals argmax routing.  Triton 3.6's CPU
    interpreter truncates fp32 -> bf16 (the GPU rounds to nearest even), so bf16 is checked to one bf16 ulp."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

    from wide.inference import StaticKVCache
    from wide.kernels.fused import add_rmsnorm, rope_cache, router_mask
    from wide.routing import Router, argmax_mask

    g = torch.Generator().manual_seed(0)
    h = torch.randn(3, 5, 64, generator=g).to(dtype)
    add = torch.randn(3, 5, 64, generator=g).to(dtype)
    norm = LlamaRMSNorm(64, eps=1e-5).to(dtype)
    torch.nn.init.normal_(norm.weight, generator=g)
    def close(a, b):
        if dtype == torch.float32:
            return torch.equal(a, b) or (a - b).abs().max().item() <= 1e-6 * b.abs().max().item()
        return bool(((a.float() - b.float()).abs() <= 2 ** -6 * b.float().abs() + 1e-6).all())

    h2, y = add_rmsnorm(h, add, norm.weight, 1e-5)
    assert close(h2, h + add)
    ref = norm(h + add)
    assert close(y, ref) if dtype == torch.float32 else bool(
        ((y.float() - ref.float()).abs() <= 2 ** -5 * ref.float().abs() + 1e-3).all())
    B, T, Hq, Hk, d = 2, 3, 4, 2, 16
    q = torch.randn(B, T, Hq * d, generator=g).to(dtype).view(B, T, Hq, d)
    kv = torch.randn(B, T, 2, Hk * d, generator=g).to(dtype)
    k, v = kv[:, :, 0].view(B, T, Hk, d), kv[:, :, 1].view(B, T, Hk, d)
    ang = torch.randn(B, T, d // 2, generator=g)
    cos, sin = torch.cat([ang.cos()] * 2, -1).to(dtype), torch.cat([ang.sin()] * 2, -1).to(dtype)
    cache = StaticKVCache(1, 3, Hk, d, 8, dtype, "cpu")
    slots = torch.tensor([[7, 6, 5], [4, 7, 6]])
    qo, ko = rope_cache(q, k, v, cos, sin, cache.k[0], cache.v[0], slots, want_k=True)
    qr, kr = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    exact = torch.equal if dtype == torch.float32 else (
        lambda a, b: bool(((a.float() - b.float()).abs() <= 2 ** -5 * b.float().abs() + 1e-2).all()))
    assert exact(qo.transpose(1, 2), qr) and exact(ko.transpose(1, 2), kr)
    for b in range(B):
        for t in range(T):
            assert exact(cache.k[0, b, :, slots[b, t]], kr[b, :, t])
            assert torch.equal(cache.v[0, b, :, slots[b, t]], v[b, t])
    assert cache.k[0, 2].abs().sum() == 0  # rows past the batch untouched
    r = Router(64, 6, 16, init_keep=0.5)
    torch.nn.init.normal_(r.w2.weight, std=1.0, generator=g)
    x = torch.randn(4, 1, 64, generator=g).to(dtype)
    assert torch.equal(router_mask(r, x), argmax_mask(r(x)))


@pytest.mark.parametrize("B,T", [(1, 1), (3, 1), (2, 37)])
@pytest.mark.parametrize("want_k", [True, False])
def test_rope_cache_token_blocks(B, T, want_k):
    """Triton interpreter, fp32: the fused RoPE + cache write moves blocks of tokens per program (a partial last
    block at 74 tokens, one token at decode); bitwise equal to :func:`rope_cache_ref`, other cache slots untouched."""
    from wide.inference import StaticKVCache
    from wide.kernels.fused import rope_cache, rope_cache_ref

    g = torch.Generator().manual_seed(B * 100 + T)
    Hq, Hk, d, Tmax = 4, 2, 16, 48
    q = torch.randn(B, T, Hq * d, generator=g).view(B, T, Hq, d)
    kv = torch.randn(B, T, 2, Hk * d, generator=g)
    k, v = kv[:, :, 0].view(B, T, Hk, d), kv[:, :, 1].view(B, T, Hk, d)
    ang = torch.randn(B, T, d // 2, generator=g)
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    slots = torch.stack([torch.randperm(Tmax, generator=g)[:T] for _ in range(B)])
    got, want = StaticKVCache(1, B + 1, Hk, d, Tmax, torch.float32, "cpu"), StaticKVCache(
        1, B + 1, Hk, d, Tmax, torch.float32, "cpu")
    for c in (got, want):
        c.k.fill_(7.0)
        c.v.fill_(-7.0)
    qo, ko = rope_cache(q, k, v, cos, sin, got.k[0], got.v[0], slots, want_k=want_k)
    qr, kr = rope_cache_ref(q, k, v, cos, sin, want.k[0], want.v[0], slots, want_k=want_k)
    assert torch.equal(qo, qr) and torch.equal(got.k, want.k) and torch.equal(got.v, want.v)
    assert (ko is None) == (not want_k) and (ko is None or torch.equal(ko, kr))


@pytest.mark.parametrize("arch", ["qwen2", "mistral"])
def test_other_architectures(arch, monkeypatch):
    """Qwen2 (Q/K/V biases, Triton interpreter) and Mistral (sliding window wider than the cache, references)."""
    from wide.inference import Engine

    if arch == "mistral":
        monkeypatch.setenv("TRITON_INTERPRET", "0")

    torch.manual_seed(13)
    base = tiny_model(arch, seed=13, **({"sliding_window": 32} if arch == "mistral" else {}))
    wm = WideModel(base, WideConfig(ffn_group_size=32), init_keep=0.5).eval()
    ids = torch.randint(2, 128, (1, 9), generator=torch.Generator().manual_seed(13))
    wm.record_masks = True
    ref = wm(ids).logits
    eng = Engine(wm)
    c = eng.new_cache(1, 10)
    out = eng.prefill(ids, None, c, all_logits=True)
    assert (out - ref).abs().max().item() < ATOL
    nxt = out[:, -1].argmax(-1)
    dec = eng.decode(nxt, c)
    r = wm(torch.cat([ids, nxt[:, None]], 1)).logits[:, -1]
    assert (dec - r).abs().max().item() < ATOL
    if arch == "mistral":
        with pytest.raises(WideError, match="sliding attention window"):
            eng.new_cache(1, 33)


def test_dense_engine_one_launch_qkv_for_narrow_kv():
    """A model whose K/V width is not a multiple of its head-group width (3 query heads per K/V head, 1 K/V
    head: a statically pruned SmolLM2 has this shape): the dense engine still runs Q, K and V as one GEMV
    launch, with a group width dividing both (16 here), and its decode logits equal the model's own."""
    from wide.inference import Engine

    base = tiny_model(seed=3, hidden_size=48, num_attention_heads=3, num_key_value_heads=1)
    eng = Engine(base, ops="dense")
    assert eng._qkv_group() == 16 and eng.g_attn == 48
    fast = eng.fast
    assert eng.qkv_one_launch("decode", 2) == fast
    ids = torch.randint(2, 128, (2, 7), generator=torch.Generator().manual_seed(3))
    cache = eng.new_cache(2, 9)
    tok = eng.prefill(ids, None, cache).argmax(-1)
    out = eng.decode(tok, cache)
    with torch.no_grad():
        ref = base(torch.cat([ids, tok[:, None]], 1)).logits[:, -1]
    assert (out - ref).abs().max().item() < ATOL
    wm = WideModel(tiny_model(seed=3, hidden_size=48, num_attention_heads=3, num_key_value_heads=1), WideConfig(ffn_group_size=32))
    assert Engine(wm)._qkv_group() is None and not Engine(wm).qkv_one_launch("decode", 1)  # routed: g_attn only
