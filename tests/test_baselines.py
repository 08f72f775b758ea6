"""Baselines: SkipGPT (WideConfig method="skipgpt") and static width pruning (fixed mask == sliced model)."""

from __future__ import annotations

import json

import pytest
import torch

from wide.config import ModelDims, WideConfig
from wide.errors import WideError
from wide.model import WideModel, dims_of, router_param_count
from wide_testutil import random_text, run_cli, tiny_model, tiny_tokenizer

SMOL = ModelDims(num_layers=30, hidden_size=576, num_heads=9, num_kv_heads=3, head_dim=64, intermediate_size=1536)
LLAMA8B = ModelDims(num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=8, head_dim=128,
                    intermediate_size=14336)


# --- SkipGPT --------------------------------------------------------------------------------------
def test_skipgpt_config_resolves_to_whole_modules():
    c = WideConfig(method="skipgpt", ffn_group_size=128).resolve(SMOL)
    assert (c.attn_group_size, c.ffn_group_size) == (576, 1536) and c.n_groups(SMOL) == (1, 1)
    with pytest.raises(WideError, match="method='skipdepth'"):
        WideConfig(method="skipdepth")


def test_skipgpt_config_json_round_trip_and_old_configs(tmp_path):
    c = WideConfig(method="skipgpt", router_rank=19).resolve(SMOL)
    c.save(tmp_path)
    assert json.loads((tmp_path / "wide_config.json").read_text())["method"] == "skipgpt"
    assert WideConfig.load(tmp_path) == c
    old = {k: v for k, v in WideConfig(ffn_group_size=64).to_dict().items() if k != "method"}
    (tmp_path / "wide_config.json").write_text(json.dumps(old))
    assert WideConfig.load(tmp_path).method == "wide"


@pytest.mark.parametrize("dims", [SMOL, LLAMA8B])
@pytest.mark.parametrize("g_ffn,r", [(16, 16), (128, 16), (512, 32), (128, 8)])
def test_skipgpt_capacity_matches_wide_within_one_rank_step(dims, g_ffn, r):
    from wide.baselines.skipgpt import matched_rank, skipgpt_config

    def router_params(dims, c):
        return router_param_count(dims, c.resolve(dims))

    w = WideConfig(ffn_group_size=g_ffn, router_rank=r)
    s = skipgpt_config(dims, w)
    assert s.method == "skipgpt" and s.router_rank == matched_rank(dims, w) >= r
    step = 2 * dims.num_layers * (dims.hidden_size + 3)  # parameters per SkipGPT rank step
    assert abs(router_params(dims, s) - router_params(dims, w)) <= step / 2
    for other in (s.router_rank - 1, s.router_rank + 1):  # it is the closest rank
        alt = skipgpt_config(dims, w, rank=other)
        gap = abs(router_params(dims, s) - router_params(dims, w))
        assert abs(router_params(dims, alt) - router_params(dims, w)) >= gap


def test_skipgpt_bad_inputs():
    from wide.baselines.skipgpt import matched_rank, skipgpt_config

    with pytest.raises(WideError, match="needs a WIDE config"):
        matched_rank(SMOL, WideConfig(method="skipgpt"))
    with pytest.raises(WideError, match="rank r=0"):
        skipgpt_config(SMOL, WideConfig(), rank=0)


def test_skipgpt_masks_are_per_module(model):
    from wide.baselines.skipgpt import skipgpt_config

    cfg = skipgpt_config(dims_of(model.config), WideConfig(ffn_group_size=16))
    wm = WideModel(model, cfg)
    assert (wm.n_attn_groups, wm.n_ffn_groups) == (1, 1)
    assert sum(p.numel() for p in wm.router_parameters()) == router_param_count(wm.dims, wm.config)
    wm.record_masks = True
    ids = torch.randint(0, 128, (2, 12))
    wm(ids)
    for (kind, i), m in wm.record.masks.items():
        assert m.shape == (2, 12, 1)


def test_skipgpt_skip_is_identity_residual(model):
    """A skipped module adds exactly nothing: all-skip equals a model whose o_proj / down_proj output 0."""
    wm = WideModel(model, WideConfig(method="skipgpt"))
    ids = torch.randint(0, 128, (2, 10))
    with wm.masks_fixed(attn=False, ffn=False):
        skipped = wm(ids).logits
    for h in wm._handles:
        h.remove()
    hooks = [lin.register_forward_hook(lambda mod, a, out: torch.zeros_like(out))
             for layer in model.model.layers for lin in (layer.self_attn.o_proj, layer.mlp.down_proj)]
    try:
        ref = model(ids).logits
    finally:
        for h in hooks:
            h.remove()
    torch.testing.assert_close(skipped, ref, rtol=0, atol=1e-6)


def test_cli_calibrate_skipgpt(model_dir, text_file, tmp_path, capsys):
    out = tmp_path / "sg"
    rc, _, err = run_cli(["calibrate", "--model", model_dir, "--text", text_file, "-o", out, "--method", "skipgpt",
                          "--ffn-group-size", "16", "--steps", "2", "--batch-size", "2", "--seq-len", "32",
                          "--device", "cpu"], capsys)
    assert rc == 0, err
    cfg = WideConfig.load(out)
    dims = dims_of(tiny_model().config)
    from wide.baselines.skipgpt import matched_rank

    assert cfg.method == "skipgpt" and cfg.router_rank == matched_rank(dims, WideConfig(ffn_group_size=16))
    import wide

    wm = wide.load(out, device="cpu")
    assert (wm.n_attn_groups, wm.n_ffn_groups) == (1, 1)


# --- static width pruning -------------------------------------------------------------------------
def _blocks(tok, n=4, T=48):
    from wide.data import pack

    return pack([random_text(n * T, seed=s) for s in range(2)], tok, T, max_blocks=n)


def test_group_scores_against_a_direct_computation():
    """sum over a group's channels of sqrt(sum_t x_tc^2) * ||W[:, c]||, from the o_proj / down_proj inputs."""
    from wide.baselines.static import group_scores

    m, blocks = tiny_model(seed=2), _blocks(tiny_tokenizer())
    inputs = {}
    hooks = [lin.register_forward_pre_hook(lambda mod, a, key=(kind, i): inputs.setdefault(key, []).append(a[0]))
             for i, layer in enumerate(m.model.layers)
             for kind, lin in (("attn", layer.self_attn.o_proj), ("ffn", layer.mlp.down_proj))]
    m(blocks)
    for h in hooks:
        h.remove()
    got = group_scores(m, blocks, 32, 16, batch_size=3)
    for (kind, i), xs in inputs.items():
        x = torch.cat(xs).double().flatten(0, 1)
        lin = m.model.layers[i].self_attn.o_proj if kind == "attn" else m.model.layers[i].mlp.down_proj
        channel = x.pow(2).sum(0).sqrt() * lin.weight.double().norm(dim=0)
        torch.testing.assert_close(got[kind][i], channel.view(-1, 32 if kind == "attn" else 16).sum(-1))


@pytest.mark.parametrize("arch,s,ffn_g", [("llama", 0.5, 16), ("llama", 0.25, 32), ("qwen2", 0.5, 16),
                                          ("mistral", 0.4, 16)])
def test_static_sliced_equals_fixed_mask(arch, s, ffn_g):
    from wide.baselines.static import param_count, prune, slice_model

    m = tiny_model(arch, seed=1)
    if arch == "qwen2":  # exercise q/k/v biases
        for layer in m.model.layers:
            for lin in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(lin.bias, std=0.5)
    tok = tiny_tokenizer()
    blocks = _blocks(tok)
    p = prune(m, blocks, s, ffn_group_size=ffn_g, batch_size=2)
    assert abs(p.sparsity - s) <= 0.25 / (len(p.ffn_keep[0])) + 1e-9 or p.calib.get("allocation_losses") is None
    assert len({sum(r) for r in p.attn_keep}) == 1 and len({sum(r) for r in p.ffn_keep}) == 1
    small = slice_model(m, p)
    assert param_count(small) < param_count(m)
    assert small.config.intermediate_size == sum(p.ffn_keep[0]) * ffn_g
    assert small.config.num_attention_heads == sum(p.attn_keep[0]) * 2  # tiny: 2 query heads per KV head
    ids = torch.randint(0, 128, (3, 20))
    wm = p.apply(m)
    masked = wm(ids).logits
    for h in wm._handles:
        h.remove()
    torch.testing.assert_close(small(ids).logits, masked, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(m(ids).logits, masked)  # the pruning changes the function
    assert 0 < wm.record.attn_keep[0] < 1 or p.attn_sparsity == 0  # counted as realized keep ratio


def test_static_masks_and_realized_sparsity(model):
    from wide.baselines.static import StaticPruning
    from wide.eval.perplexity import SparsityMeter

    p = StaticPruning([[True, False], [False, True]], [[True] * 4 + [False] * 4] * 2, 32, 16, 0.5)
    assert p.attn_sparsity == 0.5 and p.ffn_sparsity == 0.5 and p.sparsity == 0.5
    wm = p.apply(model)
    ids = torch.randint(0, 128, (2, 9))
    wm(ids, attention_mask=torch.ones(2, 9))
    meter = SparsityMeter(2)
    meter.update(wm, ids.numel())
    rep = meter.report(wm, 9)
    assert rep["attn_sparsity"] == pytest.approx(0.5) and rep["ffn_sparsity"] == pytest.approx(0.5)


def test_static_allocation_choice_uses_loss_on_ties():
    from wide.baselines.static import closest_pairs, prune

    assert sorted(closest_pairs(3, 12, 0.5)) == [(1, 8), (2, 4)]  # SmolLM2: both exactly 50 %
    assert closest_pairs(2, 8, 0.5) == [(1, 4)]
    assert closest_pairs(3, 12, 0.0) == [(0, 0)]
    from wide.baselines.static import slice_model
    from wide.eval.perplexity import perplexity

    # 3 attention and 12 FFN groups per layer, as SmolLM2: two splits reach S = 0.5 exactly
    m = tiny_model(seed=3, hidden_size=96, num_attention_heads=6, num_key_value_heads=3, intermediate_size=192)
    blocks = _blocks(tiny_tokenizer())
    p = prune(m, blocks, 0.5, ffn_group_size=16, batch_size=2)
    losses = p.calib["allocation_losses"]
    assert sorted(losses) == ["attn 0.333 / ffn 0.667", "attn 0.667 / ffn 0.333"]
    chosen = losses[f"attn {p.attn_sparsity:.3f} / ffn {p.ffn_sparsity:.3f}"]
    assert chosen == min(losses.values())  # the lower calibration loss, here measured on the sliced model too
    assert perplexity(slice_model(m, p), blocks[:4], 2, progress=False)["nll"] == pytest.approx(chosen, rel=1e-5)


def test_static_save_load_round_trip(tmp_path):
    from wide.baselines.static import StaticPruning, prune, save_pruned, slice_model
    from wide.hub import load_base_model

    m, tok = tiny_model(), tiny_tokenizer()
    p = prune(m, _blocks(tok), 0.5, ffn_group_size=16, batch_size=2)
    small = slice_model(m, p)
    save_pruned(small, tok, p, tmp_path / "pruned")
    back, tok2, _ = load_base_model(str(tmp_path / "pruned"), device="cpu")
    ids = torch.randint(0, 128, (2, 11))
    torch.testing.assert_close(back(ids).logits, small(ids).logits, rtol=1e-5, atol=1e-5)
    q = StaticPruning.load(tmp_path / "pruned")
    assert q.attn_keep == p.attn_keep and q.ffn_keep == p.ffn_keep and q.sparsity == p.sparsity


def test_static_bad_inputs(tmp_path):
    from wide.baselines.static import StaticPruning, prune, slice_model

    m, tok = tiny_model(), tiny_tokenizer()
    blocks = _blocks(tok)
    with pytest.raises(WideError, match="S=1.0 is outside"):
        prune(m, blocks, 1.0, ffn_group_size=16)
    with pytest.raises(WideError, match="multiple of the GQA group 32"):
        prune(m, blocks, 0.5, attn_group_size=16, ffn_group_size=16)
    with pytest.raises(WideError, match="power of two"):
        prune(m, blocks, 0.5, ffn_group_size=24)
    with pytest.raises(WideError, match="give both"):
        prune(m, blocks, 0.5, ffn_group_size=16, attn_sparsity=0.5)
    uneven = StaticPruning([[True, False], [True, True]], [[True] * 8] * 2, 32, 16, 0.2)
    with pytest.raises(WideError, match="same, non-zero number"):
        slice_model(m, uneven)
    with pytest.raises(WideError, match="not a `wide prune-static` output"):
        StaticPruning.load(tmp_path)


def test_cli_prune_static(model_dir, text_file, tmp_path, capsys):
    out = tmp_path / "static50"
    rc, _, err = run_cli(["prune-static", "--model", model_dir, "--text", text_file, "-S", "0.5", "-o", out,
                          "--ffn-group-size", "16", "--calib-blocks", "4", "--seq-len", "32", "--device", "cpu"],
                         capsys)
    assert rc == 0, err
    assert (out / "config.json").is_file() and (out / "static_pruning.json").is_file()
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["num_attention_heads"] == 2 and cfg["num_key_value_heads"] == 1 and cfg["intermediate_size"] == 64
    rc, stdout, err = run_cli(["info", "--model", out, "--ffn-group-size", "16"], capsys)  # usable as --model
    assert rc == 0 and "heads / KV heads   2 / 1" in stdout, err


def test_cli_prune_static_summary_and_rounding_warning(model_dir, text_file, tmp_path, capsys):
    split = ["--ffn-group-size", "16", "--calib-blocks", "2", "--seq-len", "32", "--device", "cpu"]
    base = ["prune-static", "--model", model_dir, "--text", text_file, *split]
    rc, stdout, err = run_cli([*base, "-o", tmp_path / "a", "--attn-sparsity", "0.5", "--ffn-sparsity", "0.25"],
                              capsys)
    assert rc == 0, err
    line = next(ln for ln in stdout.splitlines() if ln.startswith("static pruning of"))
    assert "(--attn-sparsity 0.5 --ffn-sparsity 0.25)" in line and "S=" not in line
    assert "removed attention 0.500" in line and "FFN 0.250" in line and "overall 0.375" in line
    assert "warning" not in err
    # fractions whole groups cannot reach: one stderr line naming each fraction that differs
    rc, stdout, err = run_cli([*base, "-o", tmp_path / "b", "--attn-sparsity", "0.1", "--ffn-sparsity", "0.02"],
                              capsys)
    assert rc == 0, err
    assert "removed attention 0.000" in stdout and "FFN 0.000" in stdout
    warn = [ln for ln in err.splitlines() if ln.startswith("warning:")]
    assert len(warn) == 1, err
    assert ("warning: only whole groups are removed, so the sparsity removed differs from the one asked: attention "
            "0.000 (asked 0.1), FFN 0.000 (asked 0.02), overall 0.000 (asked 0.06); each layer has") in warn[0]
    assert "and keeps at least one of each" in warn[0]


def test_cli_prune_static_files_get_the_new_file_mode(tmp_path, model_dir, text_file, capsys, monkeypatch):
    """safetensors writes 0600: every file the save writes gets 0644 under umask 022; a user's file keeps its mode.
    Runs with the memory check skipped, which refuses it with 1 MiB available."""
    import os
    import stat

    import wide.memory as M

    monkeypatch.setattr(M, "available_memory", lambda device: (2 ** 20, "MemAvailable of this machine"))
    out = tmp_path / "pruned"
    out.mkdir()
    (out / "mine.txt").write_text("x")
    (out / "mine.txt").chmod(0o600)
    old = os.umask(0o022)
    try:
        rc, stdout, err = run_cli(["prune-static", "--model", model_dir, "-S", "0.5", "-o", out, "--text", text_file,
                                   "--seq-len", "32", "--calib-blocks", "2", "--ffn-group-size", "16", "--device",
                                   "cpu", "--overwrite", "--no-memory-check"], capsys)
    finally:
        os.umask(old)
    assert rc == 0 and "(S=0.5): removed attention" in stdout and "overall 0.500" in stdout, err
    assert "warning" not in err
    modes = {str(f.relative_to(out)): stat.S_IMODE(f.stat().st_mode) for f in out.rglob("*") if f.is_file()}
    assert modes.pop("mine.txt") == 0o600
    assert "model.safetensors" in modes and set(modes.values()) == {0o644}, modes
