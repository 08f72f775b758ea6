"""The logit-shift fit (exact realized sparsity), its storage in the checkpoint, the uncalibrated routing and the
serve-time dial, on a tiny random Llama; every realized value is counted again from the argmax masks."""

import json
import warnings

import numpy as np
import pytest
import torch

from wide.calibrate import TOLERANCE, check_target, dial, fit_shifts, fit_text, heldout_split, heldout_windows
from wide.checkpoint import BASE_NAME, CALIBRATION_NAME, load, save_calibration, save_wide
from wide.config import WideConfig
from wide.errors import WideError, WideWarning
from wide.model import WideModel
from wide_testutil import random_text, tiny_model, tiny_tokenizer


def spread(wm: WideModel) -> WideModel:
    """Routers far from one another: sharp margins, some modules all-skip and some all-execute before the fit."""
    with torch.no_grad():
        for j, r in enumerate([*wm.attn_routers, *wm.ffn_routers]):
            r.w2.weight.mul_(30)
            r.w2.bias.view(-1, 2)[:, 0] += (j - 2.5) * 0.5
    return wm


def routed(base=None, **kw) -> WideModel:
    torch.manual_seed(0)
    cfg = WideConfig(**{"ffn_group_size": 16, "seq_len": 64, **kw})
    return spread(WideModel(base if base is not None else tiny_model(num_hidden_layers=3), cfg, init_keep=0.5))


WINDOWS = torch.randint(0, 128, (8, 64), generator=torch.Generator().manual_seed(1))


def measured(wm: WideModel, ids: torch.Tensor) -> tuple[dict, dict]:
    """Per-module skip rates of one argmax forward pass (from the recorded masks) and the masks."""
    wm.record_masks = True
    try:
        with torch.no_grad():
            wm(ids)
    finally:
        wm.record_masks = False
    masks = dict(wm.record.masks)
    return {k: 1.0 - m.double().mean().item() for k, m in masks.items()}, masks


def unit_value(wm: WideModel, rates: dict, unit: str, mode: str) -> dict:
    """The fitted quantity by hand in float64: per class (uniform) or overall, groups or FLOP-weighted."""
    d, t, L = 64.0, float(wm.config.seq_len), wm.dims.num_layers
    w = {"attn": 64 * (4 * d + 2 * (t + 1)), "ffn": 6 * d * 128} if unit == "flops" else {"attn": 1.0, "ffn": 1.0}
    if mode == "uniform":
        return {k: sum(rates[(k, i)] for i in range(L)) / L for k in ("attn", "ffn")}
    return {"global": sum(w[k] * r for (k, _), r in rates.items()) / sum(w[k] for (k, _) in rates)}


@pytest.mark.parametrize("unit,mode,bound,target", [
    ("groups", "global", 1.0, 0.2), ("flops", "global", 1.0, 0.7), ("groups", "uniform", 1.0, 0.3),
    ("flops", "uniform", 1.0, 0.6), ("flops", "global", 0.45, 0.3), ("groups", "uniform", 0.4, 0.3)])
def test_fit_realizes_the_target(unit, mode, bound, target):
    wm = routed(sparsity_unit=unit, sparsity_mode=mode, max_module_sparsity=bound)
    before, _ = measured(wm, WINDOWS)
    with warnings.catch_warnings():
        warnings.simplefilter("error", WideWarning)
        rec = fit_shifts(wm, WINDOWS, target)
    rates, _ = measured(wm, WINDOWS)
    for value in unit_value(wm, rates, unit, mode).values():
        assert abs(value - target) <= TOLERANCE
    n = WINDOWS.numel()
    for (kind, _), r in rates.items():  # the bound holds within the tolerance or one decision
        assert r <= bound + max(TOLERANCE, 1.0 / (n * (wm.n_attn_groups if kind == "attn" else wm.n_ffn_groups)))
    assert max(before.values()) == 1.0 and min(before.values()) == 0.0  # the fit had work to do
    assert rec["converged"] and rec["unit"] == unit and rec["mode"] == mode and rec["target"] == target
    assert rec["realized"]["groups"] == pytest.approx(unit_value(wm, rates, "groups", "global")["global"])
    assert rec["realized"]["flops"] == pytest.approx(unit_value(wm, rates, "flops", "global")["global"])
    assert rec["uncalibrated"]["groups"] == pytest.approx(unit_value(wm, before, "groups", "global")["global"])
    assert set(rec["shifts"]) == ({"global"} if mode == "global" else {"attn", "ffn"})


def test_unreachable_target_warns_with_the_value_reached():
    wm = routed(max_module_sparsity=0.3)
    with pytest.warns(WideWarning, match=r"reached global 0\.\d+ \(groups, global mode\) for the target 0.5"):
        rec = fit_shifts(wm, WINDOWS, 0.5)
    assert not rec["converged"] and rec["realized"]["groups"] == pytest.approx(0.3, abs=0.01)


def test_shifts_fold_into_the_bias_and_zero_restores_it():
    wm = routed()
    ids = WINDOWS[:2]
    _, plain = measured(wm, ids)
    bias = [r.w2.bias.clone() for r in wm.attn_routers]
    shifts = {"attn": [0.5, -1.0, 2.0], "ffn": [0.0, 0.25, -0.25]}
    wm.set_router_shifts(shifts)
    for b, r, t in zip(bias, wm.attn_routers, shifts["attn"]):
        margin, before = r.w2.bias.view(-1, 2).double(), b.view(-1, 2).double()
        assert torch.allclose(margin[:, 0] - margin[:, 1], before[:, 0] - before[:, 1] + t, atol=1e-6)
    wm.set_router_shifts(None)
    assert all(torch.equal(b, r.w2.bias) for b, r in zip(bias, wm.attn_routers))
    _, again = measured(wm, ids)
    assert all(torch.equal(plain[k], again[k]) for k in plain)


@pytest.fixture
def long_text(tmp_path):
    p = tmp_path / "long.jsonl"
    p.write_text("".join(json.dumps({"text": random_text(200, seed=s)}) + "\n" for s in range(60)))
    return p


@pytest.fixture
def fitted(tmp_path, model_dir, long_text):
    """A checkpoint of ``model_dir`` with fitted shifts (its text: ``long_text``), its masks with and without them
    on some ids."""
    from wide.hub import load_base_model

    base, _, src = load_base_model(str(model_dir), device="cpu")
    wm = routed(base, target_sparsity=0.4)
    ids = torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(5))
    _, plain = measured(wm, ids)
    save_wide(wm, tmp_path / "ckpt", src.ref)
    rec = fit_shifts(wm, WINDOWS, 0.4)
    _, calibrated = measured(wm, ids)
    save_calibration(tmp_path / "ckpt", {**rec, "text": str(long_text)})
    return tmp_path / "ckpt", ids, plain, calibrated, rec


def test_stored_shifts_give_identical_masks_and_uncalibrated_the_paper_routing(fitted):
    path, ids, plain, calibrated, rec = fitted
    info = json.loads((path / BASE_NAME).read_text())
    assert CALIBRATION_NAME in info["files"]  # its SHA-256 is checked on load
    wm = load(path, device="cpu")
    assert wm.calibration["module_shifts"] == rec["module_shifts"]
    _, got = measured(wm, ids)
    assert any(not torch.equal(plain[k], calibrated[k]) for k in plain)
    assert all(torch.equal(got[k], calibrated[k]) for k in got)
    wm = load(path, device="cpu", calibrated=False)
    assert wm.calibration is None
    _, got = measured(wm, ids)
    assert all(torch.equal(got[k], plain[k]) for k in got)
    # an edited calibration file is refused, naming it
    (path / CALIBRATION_NAME).write_text((path / CALIBRATION_NAME).read_text().replace("wide-calibration", "x"))
    with pytest.raises(WideError, match=CALIBRATION_NAME):
        load(path, device="cpu")


@pytest.mark.parametrize("x,unit", [(0.15, None), (0.6, "flops")])
def test_dial_realizes_the_value_asked(fitted, long_text, tokenizer, x, unit):
    path, text_file = fitted[0], long_text
    wm = load(path, device="cpu", sparsity=x, sparsity_unit=unit)  # on the held-out part of the fit's text
    rec = wm.calibration
    assert rec["dialed"] and rec["converged"] and rec["unit"] == (unit or "groups") and rec["target"] == x
    from wide.data import load_texts

    held = heldout_windows(heldout_split(load_texts(str(text_file)))[1], tokenizer, 64, 2048)
    rates, _ = measured(wm, held)
    assert abs(unit_value(wm, rates, unit or "groups", "global")["global"] - x) <= TOLERANCE
    # the same dial on a model already loaded, from its stored curve
    wm2 = load(path, device="cpu")
    assert dial(wm2, x, tokenizer, unit=unit, text=str(text_file))["module_shifts"] == rec["module_shifts"]


@pytest.mark.parametrize("x", [1.0, -0.1, float("nan")])
def test_bad_dial_values_are_refused(tmp_path, x):
    with pytest.raises(WideError, match=rf"wide.load: sparsity {x!r} is outside \[0, 1\)"):
        load(tmp_path, device="cpu", sparsity=x)  # before any file is read
    with pytest.raises(WideError, match=r"outside \[0, 1\)"):
        check_target(x)


@pytest.mark.parametrize("x,kind", [("0.3", "str"), (True, "bool"), (None, "NoneType"), ([0.3], "list")])
def test_dial_values_that_are_not_numbers_are_named_so(tmp_path, x, kind):
    with pytest.raises(WideError) as e:
        load(tmp_path, device="cpu", sparsity=x) if x is not None else check_target(x, "wide.load: sparsity")
    assert str(e.value) == (f"wide.load: sparsity {x!r} must be a number (got {kind}): the fraction of the routed "
                            "groups (or FLOPs) to skip, in [0, 1), e.g. 0.5")
    assert check_target(np.float32(0.25)) == 0.25 and check_target(0) == 0.0


def test_bad_dial_unit_is_refused(tmp_path):
    with pytest.raises(WideError, match="sparsity unit 'params' is not one of groups, flops"):
        load(tmp_path, device="cpu", sparsity=0.5, sparsity_unit="params")
    with pytest.raises(WideError, match="give sparsity= too"):
        load(tmp_path, device="cpu", sparsity_unit="flops")
    with pytest.raises(WideError) as e:  # a bad unit is named as such, even without sparsity=
        load(tmp_path, device="cpu", sparsity_unit="bogus")
    assert str(e.value) == "sparsity unit 'bogus' is not one of groups, flops"


def test_heldout_split():
    docs = [random_text(20, seed=s) for s in range(40)]
    train, held = heldout_split(docs)
    assert held and train and not set(train) & set(held) and sorted(train + held) == sorted(docs)
    assert heldout_split(docs) == (train, held)
    for n in (2, 3):  # a few documents: some held out all the same
        train, held = heldout_split(docs[:n])
        assert train and held and sorted(train + held) == sorted(docs[:n])
    assert heldout_split(docs[:1]) == (docs[:1], []) and fit_text(docs[:1]) == (docs[:1], False)
    assert fit_text(docs) == (heldout_split(docs)[1], True)
    w = heldout_windows(held, tiny_tokenizer(), 4, 9)
    assert w.shape == (2, 4) and w.dtype == torch.long


def test_cli_fits_stores_reports_and_dials(tmp_path, model_dir, long_text, capsys):
    from wide_testutil import calibrate_args, run_cli

    out = tmp_path / "run"
    rc, stdout, err = run_cli(calibrate_args(model_dir, long_text, out, "--sparsity-unit", "flops"), capsys)
    assert rc == 0, err
    rec = json.loads((out / CALIBRATION_NAME).read_text())
    assert rec["unit"] == "flops" and rec["target"] == 0.5 and "calibrated routing to S=0.5 (flops, global)" in stdout
    assert "sparsity of the last step's training masks: groups 0." in stdout and "(Eq. 6), flops 0." in stdout
    assert WideConfig.load(out).seq_len == 32
    js = tmp_path / "r.json"
    rc, stdout, err = run_cli(["eval-ppl", "--wide", out, "--text", long_text, "--ctx", "32", "--max-tokens", "64",
                               "--device", "cpu", "--sparsity", "0.3", "--json", js], capsys)
    assert rc == 0, err
    assert "dialed routing to S=0.3 (flops, global): realized 0." in stdout and "groups" in stdout
    r = json.loads(js.read_text())["wide"]
    assert {"groups_sparsity", "flops_sparsity", "flops_context"} <= set(r) and r["calibration"]["dialed"]
    assert r["calibration"]["heldout_realized"]["flops"] == pytest.approx(0.3, abs=TOLERANCE)
    # --no-fit-bias: no held-out text, no shift
    rc, _, err = run_cli(calibrate_args(model_dir, long_text, tmp_path / "plain", "--no-fit-bias"), capsys)
    assert rc == 0, err and not (tmp_path / "plain" / CALIBRATION_NAME).exists()


def test_lm_eval_model_args_dial(fitted):
    pytest.importorskip("lm_eval")
    from wide.eval.lm_eval import WideLM

    lm = WideLM(wide=str(fitted[0]), device="cpu", sparsity="0.25", sparsity_unit="flops")
    rec = lm.wide_model.calibration
    assert rec["dialed"] and rec["unit"] == "flops" and abs(rec["realized"]["flops"] - 0.25) <= TOLERANCE
    lm = WideLM(wide=str(fitted[0]), device="cpu", calibrated="False")
    assert lm.wide_model.calibration is None
    with pytest.raises(WideError, match="sparsity 'x' is not a number"):
        WideLM(wide=str(fitted[0]), device="cpu", sparsity="x")
    with pytest.raises(WideError, match=r"sparsity 1.5 is outside \[0, 1\)"):
        WideLM(wide=str(fitted[0]), device="cpu", sparsity=1.5)


def test_cli_generate_dials(fitted, capsys):
    from wide_testutil import run_cli

    rc, out, err = run_cli(["generate", "--wide", fitted[0], "--prompt", "w1 w2 w3", "--max-new-tokens", "3",
                            "--device", "cpu", "--sparsity", "0.35", "--no-stream"], capsys)
    assert rc == 0, err
    assert "dialed routing to S=0.35 (groups, global): realized 0.3" in err
    assert "realized sparsity: attn" in out and "groups 0." in out and "flops 0." in out


# --- a finished run whose fit was interrupted ------------------------------------------------------------------
def test_a_fit_interrupted_after_training_is_named_on_load_until_resume_fits_it(tmp_path, model_dir, long_text,
                                                                              capsys, monkeypatch):
    """Interrupted after the last step, before calibration.json is written: the checkpoint records the planned fit,
    so wide.load and eval-ppl warn once (naming --resume) instead of silently using the uncalibrated routers; the
    --resume fits it and the warning goes away."""
    import wide.calibrate as K
    from wide_testutil import calibrate_args, run_cli

    out = tmp_path / "run"

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(K, "fit_shifts", interrupted)
    rc, _, err = run_cli(calibrate_args(model_dir, long_text, out), capsys)
    assert rc == 130, err
    monkeypatch.undo()
    assert not (out / CALIBRATION_NAME).exists()
    extra = json.loads((out / BASE_NAME).read_text())["extra"]
    assert extra["fit_bias"] is True and extra["step"] == extra["steps"] == 1
    with pytest.warns(WideWarning) as seen:
        wm = load(out, device="cpu")
    assert len(seen) == 1 and len(str(seen[0].message).splitlines()) == 1
    assert str(seen[0].message) == (
        f"WIDE checkpoint {str(out)!r} has no {CALIBRATION_NAME}: its wide calibrate run finished training but "
        f"stopped before the logit-shift fit was saved, so it loads uncalibrated (the routers as trained); to finish "
        f"the fit, run wide calibrate -o {str(out)!r} --resume")
    assert wm.calibration is None and wm.router_shifts is None
    with warnings.catch_warnings():  # asked for: the routers as trained, or a dial that fits anyway
        warnings.simplefilter("error", WideWarning)
        load(out, device="cpu", calibrated=False)
    rc, _, err = run_cli(["eval-ppl", "--wide", out, "--text", long_text, "--ctx", "32", "--max-tokens", "64",
                          "--device", "cpu"], capsys)
    assert rc == 0, err
    warned = [ln for ln in err.splitlines() if "warning" in ln]
    assert len(warned) == 1 and warned[0].startswith("wide eval-ppl: warning: ") and "--resume" in warned[0], err
    rc, stdout, err = run_cli(["calibrate", "-o", out, "--resume"], capsys)
    assert rc == 0, err
    assert "calibrated routing to S=0.5" in stdout and (out / CALIBRATION_NAME).is_file()
    with warnings.catch_warnings():
        warnings.simplefilter("error", WideWarning)
        wm = load(out, device="cpu")
    assert wm.calibration["target"] == 0.5 and wm.router_shifts is not None


def test_no_fit_planned_and_older_checkpoints_load_without_the_fit_warning(tmp_path, model_dir, long_text, capsys):
    from wide_testutil import calibrate_args, run_cli

    out = tmp_path / "plain"
    rc, _, err = run_cli(calibrate_args(model_dir, long_text, out, "--no-fit-bias"), capsys)
    assert rc == 0, err
    assert json.loads((out / BASE_NAME).read_text())["extra"]["fit_bias"] is False
    old = tmp_path / "old"  # a finished run saved before the field existed
    save_wide(load(out, device="cpu"), old, str(model_dir), extra={"stage": "router", "step": 1, "steps": 1})
    with warnings.catch_warnings():
        warnings.simplefilter("error", WideWarning)
        for path in (out, old):
            assert load(path, device="cpu").calibration is None
    info = json.loads((old / BASE_NAME).read_text())
    info["extra"]["fit_bias"] = "yes"
    (old / BASE_NAME).write_text(json.dumps(info))
    with pytest.raises(WideError, match=r"field 'extra.fit_bias' is the string 'yes'; it must be true or false"):
        load(old, device="cpu")


def test_a_dial_above_the_module_bound_is_refused_before_loading(tmp_path, tokenizer):
    wm = routed(max_module_sparsity=0.3, sparsity_unit="flops")
    save_wide(wm, tmp_path / "ckpt", "tiny")
    missing = str(tmp_path / "no-model")  # refused before the base model is looked up
    with pytest.raises(WideError) as e:
        load(tmp_path / "ckpt", model=missing, sparsity=0.5)
    assert str(e.value) == (f"wide.load: sparsity 0.5 cannot be reached under the max_module_sparsity of "
                            f"{str(tmp_path / 'ckpt')!r} 0.3: the routed compute skipped (flops unit) is a weighted "
                            f"mean of the module rates, so it is at most 0.3; give sparsity 0.3 or less")
    with pytest.raises(WideError, match="under the max_module_sparsity .* 0.3: the groups sparsity"):
        load(tmp_path / "ckpt", model=missing, sparsity=0.31, sparsity_unit="groups")
    with pytest.raises(WideError, match=r"^sparsity 0.5 cannot be reached under the routers' max_module_sparsity 0.3"):
        dial(wm, 0.5, tokenizer)
    with pytest.raises(WideError, match="not found"):  # at the bound: past this check, to the missing model
        load(tmp_path / "ckpt", model=missing, sparsity=0.3)


def test_a_dial_replaces_the_fitted_shift_so_calibrated_false_with_a_dial_is_refused(fitted, tokenizer, long_text):
    """The dial's result does not depend on whether the stored shift was applied first (shifts replace each
    other; the stored curve starts the fit either way), so calibrated=False cannot change a dialed model:
    wide.load refuses the pair instead of ignoring calibrated=False."""
    path = fitted[0]
    stored = json.loads((path / CALIBRATION_NAME).read_text())
    on = load(path, device="cpu")
    off = load(path, device="cpu", calibrated=False)
    off.calibration = stored  # its curve, as the dial of a calibrated model starts from
    assert on.router_shifts is not None and off.router_shifts is None
    a = dial(on, 0.25, tokenizer, text=str(long_text))
    b = dial(off, 0.25, tokenizer, text=str(long_text))
    assert a["module_shifts"] == b["module_shifts"] and a["realized"] == b["realized"]
    with pytest.raises(WideError) as e:
        load(path, model=str(path / "no-model"), calibrated=False, sparsity=0.25)
    assert str(e.value) == ("wide.load: calibrated=False and sparsity=0.25 exclude each other: the dial replaces the "
                            "fitted shift whether or not it was applied; give sparsity= for a dialed model or "
                            "calibrated=False for the routers as trained")
