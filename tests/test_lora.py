"""Stage-2 LoRA recovery (paper §3.2) on a tiny random Llama, CPU: adapters, gating through LoRA, save /
load / merge, resume, CLI and bad input."""

import json

import pytest
import torch

pytest.importorskip("peft")

from wide.checkpoint import load, save_wide  # noqa: E402
from wide.cli import main  # noqa: E402
from wide.config import WideConfig  # noqa: E402
from wide.errors import WideError  # noqa: E402
from wide.lora import ADAPTER_DIR, LORA_TARGETS, LoraSettings, attach_lora, lora_named_parameters, peft_model  # noqa: E402
from wide.model import WideModel, decoder_layers  # noqa: E402
from wide.train.loop import CalibrationArgs, recover  # noqa: E402
from wide_testutil import tiny_model  # noqa: E402

PROJ = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
        "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def blocks(n=12, t=16):
    return torch.randint(0, 128, (n, t), generator=torch.Generator().manual_seed(3))


def stage1(tmp_path, seed=0):
    """A 'stage-1' checkpoint: routers perturbed away from their init, saved with save_wide."""
    torch.manual_seed(seed)
    wm = WideModel(tiny_model(), WideConfig(ffn_group_size=32, target_sparsity=0.5))
    with torch.no_grad():
        for p in wm.router_parameters():
            p.add_(0.3 * torch.randn_like(p))
    save_wide(wm, tmp_path / "s1", "tiny")
    return tmp_path / "s1"


def args(steps=4, **kw):
    return CalibrationArgs(steps=steps, batch_size=2, grad_accum=2, lr=1e-2, warmup_steps=1, save_every=2, **kw)


def test_lora_on_all_seven_projections_and_base_frozen(tmp_path):
    wm = load(stage1(tmp_path), model=tiny_model())
    attach_lora(wm)
    assert set(LORA_TARGETS) == set(PROJ)
    for layer in decoder_layers(wm.base):
        for name, parent in PROJ.items():
            mod = getattr(getattr(layer, parent), name)
            assert hasattr(mod, "lora_A") and hasattr(mod, "base_layer"), name
            assert mod.r["default"] == 16 and mod.scaling["default"] == pytest.approx(32 / 16)
            assert mod.lora_dropout["default"].p == pytest.approx(0.1)
            assert not mod.base_layer.weight.requires_grad
            assert mod.lora_A["default"].weight.requires_grad and mod.lora_B["default"].weight.requires_grad
    assert len(lora_named_parameters(wm)) == 2 * 7 * 2  # A and B, 7 projections, 2 layers
    trainable_base = [n for n, p in wm.base.named_parameters() if p.requires_grad and "lora_" not in n]
    assert trainable_base == []


@pytest.mark.parametrize("freeze", [True, False])
def test_routers_frozen_or_trained_base_unchanged(tmp_path, freeze):
    wm = load(stage1(tmp_path), model=tiny_model())
    base0 = {k: v.clone() for k, v in wm.base.state_dict().items()}
    r0 = {k: v.clone() for k, v in wm.router_state_dict().items()}
    recs = recover(wm, blocks(), args(steps=3), tmp_path / "out", "tiny", freeze_router=freeze, progress=False)
    assert [r["step"] for r in recs] == [1, 2, 3]
    lora_names = {n for n, _ in lora_named_parameters(wm)}
    sd = wm.base.state_dict()
    for k, v in base0.items():  # every base weight (now base_layer.*) unchanged
        k2 = k
        if k not in sd:
            k2 = k.replace(".weight", ".base_layer.weight")
        assert torch.equal(v, sd[k2]), k
    assert any(not torch.equal(p, torch.zeros_like(p)) for n, p in lora_named_parameters(wm) if "lora_B" in n)
    assert lora_names
    changed = [k for k, v in r0.items() if not torch.equal(v, wm.router_state_dict()[k])]
    assert (changed == []) if freeze else changed
    from wide.lora import KeyedDropout

    drops = [m for m in wm.base.modules() if isinstance(m, KeyedDropout)]
    assert len(drops) == 2 * 7 and all(d.p == pytest.approx(0.1) for d in drops)
    info = json.loads((tmp_path / "out" / "base_model.json").read_text())
    assert info["extra"]["stage"] == "lora" and info["extra"]["freeze_router"] is freeze


def test_gate_hooks_gate_the_lora_path(tmp_path):
    wm = load(stage1(tmp_path), model=tiny_model())
    attach_lora(wm)
    with torch.no_grad():
        for n, p in lora_named_parameters(wm):
            if "lora_B" in n:
                p.normal_()  # fresh B is zero: make the LoRA path visible
    wm.eval()
    outs = {}
    layer = decoder_layers(wm.base)[0]
    hs = [layer.mlp.register_forward_hook(lambda m, a, o: outs.__setitem__("mlp", o)),
          layer.self_attn.o_proj.register_forward_hook(lambda m, a, o: outs.__setitem__("o", o))]
    x = torch.randint(0, 128, (2, 9))
    with torch.no_grad(), wm.masks_fixed(attn=False, ffn=False):
        wm(x)
    assert torch.count_nonzero(outs["mlp"]) == 0 and torch.count_nonzero(outs["o"]) == 0
    # the LoRA path alone would not be zero: ungated input through down_proj's adapter
    down = layer.mlp.down_proj
    z = torch.randn(1, 3, down.in_features)
    assert torch.count_nonzero(down.lora_B["default"](down.lora_A["default"](z))) > 0
    with torch.no_grad(), wm.masks_fixed(attn=True, ffn=True):
        wm(x)
    assert torch.count_nonzero(outs["mlp"]) > 0
    for h in hs:
        h.remove()


def test_save_load_round_trip_and_merge(tmp_path):
    wm = load(stage1(tmp_path), model=tiny_model())
    recover(wm, blocks(), args(steps=3), tmp_path / "out", "tiny", progress=False)
    out = tmp_path / "out"
    ad = out / ADAPTER_DIR
    assert (ad / "adapter_config.json").is_file() and (ad / "adapter_model.safetensors").is_file()
    assert not list(ad.glob("*.bin")) and not list(out.glob(".*"))
    cfg = json.loads((ad / "adapter_config.json").read_text())
    assert cfg["r"] == 16 and cfg["lora_alpha"] == 32 and cfg["lora_dropout"] == 0.1
    assert sorted(cfg["target_modules"]) == sorted(LORA_TARGETS)
    x = torch.randint(0, 128, (2, 11))
    with torch.no_grad():
        ref = wm.eval()(x).logits
        un = load(out, model=tiny_model())
        assert peft_model(un) is not None
        got = un(x).logits
        merged = load(out, model=tiny_model(), merge_lora=True)
        assert peft_model(merged) is None and not any("lora_" in n for n, _ in merged.named_parameters())
        got_m = merged(x).logits
    assert torch.equal(ref, got)
    torch.testing.assert_close(got_m, got, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got, load(tmp_path / "s1", model=tiny_model())(x).logits, atol=1e-4)  # LoRA matters


def _losses(path):
    return [(r["step"], r["lm_loss"], r["sparsity_loss"]) for r in map(json.loads, path.read_text().splitlines())]


def test_resume_gives_identical_losses(tmp_path):
    s1 = stage1(tmp_path)
    a = load(s1, model=tiny_model())
    recover(a, blocks(), args(steps=5), tmp_path / "a", "tiny", progress=False)

    class Stop(Exception):
        pass

    def cb(r):
        if r["step"] == 3:
            raise Stop

    b = load(s1, model=tiny_model())
    with pytest.raises(Stop):
        recover(b, blocks(), args(steps=5), tmp_path / "b", "tiny", progress=False, on_step=cb)
    b = load(s1, model=tiny_model())
    recover(b, blocks(), args(steps=5), tmp_path / "b", "tiny", progress=False, resume=True)
    la, lb = _losses(tmp_path / "a" / "train_log.jsonl"), _losses(tmp_path / "b" / "train_log.jsonl")
    assert [s for s, *_ in lb] == [1, 2, 3, 4, 5] and la == lb
    pa, pb = dict(lora_named_parameters(a)), dict(lora_named_parameters(b))
    assert all(torch.equal(pa[k], pb[k]) for k in pa)
    assert a.router_state_dict().keys() == b.router_state_dict().keys()
    assert all(torch.equal(v, b.router_state_dict()[k]) for k, v in a.router_state_dict().items())


def test_resume_with_other_lora_settings(tmp_path):
    s1 = stage1(tmp_path)
    recover(load(s1, model=tiny_model()), blocks(), args(steps=2), tmp_path / "o", "tiny", progress=False)
    with pytest.raises(WideError, match="other settings"):
        recover(load(s1, model=tiny_model()), blocks(), args(steps=2), tmp_path / "o", "tiny", progress=False,
                resume=True, freeze_router=True)


def test_grad_checkpoint_recomputes_and_matches(tmp_path):
    s1 = stage1(tmp_path)
    calls = {"n": 0}
    plain = load(s1, model=tiny_model())
    ra = recover(plain, blocks(), args(steps=2), tmp_path / "a", "tiny", progress=False)
    ck = load(s1, model=tiny_model())
    h = ck.attn_routers[0].register_forward_hook(lambda *a: calls.__setitem__("n", calls["n"] + 1))
    rb = recover(ck, blocks(), args(steps=2, grad_checkpoint=True), tmp_path / "b", "tiny", progress=False)
    h.remove()
    assert calls["n"] == 2 * 2 * 2  # 2 steps x 2 micro-batches x (forward + recompute)
    for x, y in zip(ra, rb):
        assert x["lm_loss"] == pytest.approx(y["lm_loss"], rel=1e-6)
        assert x["sparsity_loss"] == pytest.approx(y["sparsity_loss"], rel=1e-6, abs=1e-7)


def test_bad_settings():
    with pytest.raises(WideError, match="--lora-r 0"):
        LoraSettings(r=0).validate()
    with pytest.raises(WideError, match="--lora-dropout 1.0"):
        LoraSettings(dropout=1.0).validate()
    with pytest.raises(WideError, match="--lora-alpha"):
        LoraSettings(alpha=0).validate()


# --- CLI ---------------------------------------------------------------------------------------------
def run(argv, capsys):
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_cli_calibrate_then_lora_then_load(tmp_path, model_dir, text_file, capsys):
    common = ["--model", model_dir, "--text", text_file, "--seq-len", "32", "--batch-size", "2", "--device", "cpu"]
    rc, _, err = run(["calibrate", *common, "-o", tmp_path / "s1", "--steps", "2", "--ffn-group-size", "32"], capsys)
    assert rc == 0, err
    rc, out, err = run(["lora", *common, "--wide", tmp_path / "s1", "-o", tmp_path / "s2", "--steps", "2",
                        "--freeze-router"], capsys)
    assert rc == 0, err
    assert "routers frozen" in out
    recs = [json.loads(ln) for ln in (tmp_path / "s2" / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2] and recs[0]["lr"] <= 2e-4
    s1r = (tmp_path / "s1" / "routers.safetensors").read_bytes()
    assert (tmp_path / "s2" / "routers.safetensors").read_bytes() == s1r  # frozen routers saved unchanged
    wm = load(tmp_path / "s2", model=model_dir, device="cpu", merge_lora=True)
    assert wm.config.ffn_group_size == 32


@pytest.mark.parametrize("case", ["missing", "corrupt_routers", "no_config", "has_adapter", "bad_r"])
def test_cli_lora_bad_input(tmp_path, model_dir, text_file, capsys, case):
    s1 = stage1(tmp_path)
    extra = []
    if case == "missing":
        s1, msg = tmp_path / "nope", "stage-1 checkpoint"
    elif case == "corrupt_routers":
        (s1 / "routers.safetensors").write_bytes(b"\x00garbage" * 8)
        msg = "corrupt checkpoint file"
    elif case == "no_config":
        (s1 / "wide_config.json").unlink()
        msg = "no wide_config.json"
    elif case == "has_adapter":
        (s1 / ADAPTER_DIR).mkdir()
        msg = "already holds a LoRA adapter"
    else:
        extra, msg = ["--lora-r", "0"], "--lora-r 0 must be >= 1"
    rc, _, err = run(["lora", "--model", model_dir, "--text", text_file, "--wide", s1, "-o", tmp_path / "out",
                      "--steps", "1", "--seq-len", "32", "--device", "cpu", *extra], capsys)
    assert rc == 2 and msg in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_load_corrupt_adapter(tmp_path):
    wm = load(stage1(tmp_path), model=tiny_model())
    recover(wm, blocks(), args(steps=2), tmp_path / "out", "tiny", progress=False)
    (tmp_path / "out" / ADAPTER_DIR / "adapter_model.safetensors").write_bytes(b"junk")
    with pytest.raises(WideError, match="corrupt checkpoint file .*adapter_model.safetensors: does not match its SHA"):
        load(tmp_path / "out", model=tiny_model())


def test_keyed_dropout_depends_on_sample_not_batch():
    from wide.lora import KeyedDropout
    from wide.routing import sample_keyed

    d = KeyedDropout(0.5, "layers.0.mlp.down_proj").train()
    x = torch.ones(4, 3, 8)
    with sample_keyed(7, [10, 11, 12, 13]):
        full = d(x)
    with sample_keyed(7, [12, 13]):
        half = d(x[2:])
    assert torch.equal(full[2:], half)  # rows are a function of their sample position alone
    assert set(full.unique().tolist()) == {0.0, 2.0}  # inverted dropout scaling 1 / (1 - p)
    assert torch.equal(d.eval()(x), x)
