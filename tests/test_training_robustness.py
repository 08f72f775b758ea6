"""Training runs that go wrong: diverging settings, --overwrite over an earlier state, a truncated log line on
--resume, huge seeds, interrupts (Ctrl-C, SIGTERM), a finished run resumed, --lora-r above the model's widths, another
base model on --resume, and a full disk."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import wide.train.loop as T
from wide.config import WideConfig
from wide.errors import WideError
from wide.model import WideModel
from wide.train.loop import SEED_MAX, STATE_NAME, CalibrationArgs, calibrate, stream_rows
from wide_testutil import calibrate_args, error_after_loading, interrupt_at, one_line_error, tiny_model
from wide_testutil import run_cli as run

NOWHERE = "no-such-model"  # the refusals below come before any model is looked up
DEMO = ["--device", "cpu", "--batch-size", "1", "--seq-len", "32", "--ctx", "32", "--eval-tokens", "64",
        "--ffn-group-size", "32"]


def blocks(n=12, t=16):
    return torch.randint(0, 128, (n, t), generator=torch.Generator().manual_seed(3))


def _state_step(out) -> int:
    return int(T.read_meta(out)["step"])


# --- option checks, before any model loads, leaving no output folder ---------------------------------
BAD_OPTIONS = [
    (["--lr", "inf"], ["--lr inf", "at most 1"]),
    (["--lr", "1e30"], ["--lr 1e+30", "at most 1"]),
    (["--lr", "nan"], ["--lr nan", "> 0"]),
    (["--alpha", "inf"], ["--alpha inf", "must be >= 0 and finite"]),
    (["--tau-start", "inf"], ["--tau-start inf", "is outside [0.001, 1000]"]),
    (["--tau-end", "1e-30"], ["--tau-end 1e-30", "[0.001, 1000]"]),
    (["--tau-start", "1e6"], ["--tau-start 1000000.0", "[0.001, 1000]"]),
    (["--seed", str(10 ** 16)], [f"--seed {10 ** 16}", f"from 0 to {SEED_MAX}"]),
    (["--seed", "-1"], ["--seed -1", f"from 0 to {SEED_MAX}"]),
]


@pytest.mark.parametrize("extra,words", BAD_OPTIONS, ids=[" ".join(e) for e, _ in BAD_OPTIONS])
def test_bad_training_options_refused_before_loading(tmp_path, text_file, capsys, extra, words):
    out = tmp_path / "run"
    rc, _, err = run(calibrate_args(tmp_path / NOWHERE, text_file, out, *extra), capsys)
    one_line_error(rc, err, "calibrate", *words)
    assert not out.exists()  # an early refusal leaves no (empty) output folder


UNREACHABLE = [
    ("groups", "global", "the groups sparsity (Eq. 6 / Eq. 22) is a mean of the module rates, so it is at most 0.3"),
    ("groups", "uniform", "the groups sparsity (Eq. 6 / Eq. 22) is a mean of the module rates, so it is at most 0.3"),
    ("flops", "global", "the routed compute skipped (flops unit) is a weighted mean of the module rates, so it is at "
                        "most 0.3"),
]


@pytest.mark.parametrize("unit,mode,why", UNREACHABLE, ids=[f"{u}-{m}" for u, m, _ in UNREACHABLE])
def test_a_target_above_the_module_bound_is_refused_before_loading(tmp_path, text_file, capsys, unit, mode, why):
    out = tmp_path / "run"
    flags = ["-S", "0.5", "--max-module-sparsity", "0.3", "--sparsity-unit", unit, "--mode", mode]
    words = ["-S/--sparsity 0.5 cannot be reached under --max-module-sparsity 0.3", why,
             "give -S/--sparsity 0.3 or less, or --max-module-sparsity 0.5 or more"]
    rc, _, err = run(calibrate_args(tmp_path / NOWHERE, text_file, out, *flags), capsys)
    one_line_error(rc, err, "calibrate", *words)
    rc, _, err = run(["demo", "--model", tmp_path / NOWHERE, "--text", text_file, "-o", out, *DEMO, *flags], capsys)
    one_line_error(rc, err, "demo", *words)
    assert not out.exists()
    # at the bound it is reachable (every module at 0.3): the next refusal is the missing model's
    rc, _, err = run(calibrate_args(tmp_path / NOWHERE, text_file, out, "-S", "0.3", "--max-module-sparsity", "0.3"),
                     capsys)
    assert rc == 2 and NOWHERE in err and "cannot be reached" not in err, err
    # the Python API: the config's pair, before anything is written
    wm = WideModel(tiny_model(), WideConfig(ffn_group_size=32, target_sparsity=0.5, max_module_sparsity=0.3,
                                            sparsity_unit=unit, sparsity_mode=mode))
    with pytest.raises(WideError) as e:
        calibrate(wm, blocks(), CalibrationArgs(steps=1), out, "tiny", progress=False)
    assert str(e.value).startswith("target_sparsity 0.5 cannot be reached under max_module_sparsity 0.3: ")
    assert why in str(e.value) and not out.exists()


def test_lora_bound_below_the_stage1_target_is_refused_before_loading(tmp_path, text_file, capsys):
    pytest.importorskip("peft")
    from wide.checkpoint import save_wide

    stage1 = tmp_path / "s1"
    save_wide(WideModel(tiny_model(), WideConfig(ffn_group_size=32, target_sparsity=0.5)), stage1,
              str(tmp_path / NOWHERE))
    out = tmp_path / "s2"
    lora = ["lora", "--wide", stage1, "--text", text_file, "-o", out, "--device", "cpu"]
    rc, _, err = run([*lora, "--max-module-sparsity", "0.4"], capsys)
    one_line_error(rc, err, "lora", "the stage-1 checkpoint's -S 0.5 cannot be reached under --max-module-sparsity "
                   "0.4", "give --max-module-sparsity 0.5 or more (stage 2 keeps stage 1's -S)")
    assert not out.exists()
    rc, _, err = run([*lora, "--max-module-sparsity", "0.5"], capsys)  # reachable: the next refusal is the model's
    assert rc == 2 and NOWHERE in err and "cannot be reached" not in err, err


def test_seed_range_and_stream_rows_at_its_ends():
    with pytest.raises(WideError, match="--seed"):
        CalibrationArgs(seed=SEED_MAX + 1).validate()
    CalibrationArgs(seed=SEED_MAX).validate()
    b = blocks(5, 4)
    assert stream_rows(b, [0, 7, 10 ** 6], SEED_MAX).shape == (3, 4)  # no overflow at the largest seed
    with pytest.raises(WideError, match=r"--tau-end 1e-05 is outside \[0.001, 1000\]"):
        calibrate(WideModel(tiny_model(), WideConfig(ffn_group_size=32, tau_end=1e-5)), blocks(),
                  CalibrationArgs(steps=1), "unused", "tiny", progress=False)
    WideConfig(tau_end=1e-5)  # a saved config outside the training range still loads (inference ignores tau)


# --- a non-finite step stops the run, keeping the last good state --------------------------------------
def _nan_sparsity_from(monkeypatch, call: int) -> None:
    """Make the sparsity loss NaN from its ``call``-th call on (one call per step with --grad-accum 1)."""
    real, calls = T.sparsity_loss, []

    def fake(*a, **k):
        calls.append(1)
        sp = real(*a, **k)
        return sp * float("nan") if len(calls) >= call else sp

    monkeypatch.setattr(T, "sparsity_loss", fake)


def test_divergence_stops_with_one_line_and_keeps_the_last_good_state(tmp_path, model_dir, text_file, capsys,
                                                                      monkeypatch):
    out = tmp_path / "run"
    _nan_sparsity_from(monkeypatch, 3)
    rc, _, err = run(calibrate_args(model_dir, text_file, out, "--steps", "4", "--save-every", "2"), capsys)
    error_after_loading(rc, err, "calibrate", "training diverged at step 3 of 4", "sparsity_loss nan",
                   f"the last good state (step 2) is kept in {str(out)!r}", "lower --lr")
    assert _state_step(out) == 2
    assert all(torch.isfinite(t).all() for t in load_file(str(out / "routers.safetensors")).values())
    assert json.loads((out / "base_model.json").read_text())["extra"]["step"] == 2
    logged = [json.loads(ln) for ln in (out / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == [1, 2]  # the diverged step is not logged


def test_divergence_before_the_first_save_leaves_no_folder(tmp_path, model_dir, text_file, capsys, monkeypatch):
    out = tmp_path / "run"
    _nan_sparsity_from(monkeypatch, 1)
    rc, _, err = run(calibrate_args(model_dir, text_file, out, "--steps", "2"), capsys)
    error_after_loading(rc, err, "calibrate", "training diverged at step 1 of 2", "nothing was saved")
    assert not out.exists()


def test_non_finite_parameters_after_a_step_are_caught(tmp_path, monkeypatch):
    """A step whose optimizer update leaves NaN in a trained parameter stops before that step's save."""
    wm = WideModel(tiny_model(), WideConfig(ffn_group_size=32))
    real_step = torch.optim.AdamW.step

    def bad_step(self, *a, **k):  # the 3rd update writes a NaN into the routers
        r = real_step(self, *a, **k)
        if self.state[self.param_groups[0]["params"][0]]["step"] == 3:
            with torch.no_grad():
                self.param_groups[0]["params"][0].view(-1)[0] = float("nan")
        return r

    monkeypatch.setattr(torch.optim.AdamW, "step", bad_step)
    with pytest.raises(WideError, match="diverged at step 3 of 4: .*non-finite trained parameters"):
        calibrate(wm, blocks(), CalibrationArgs(steps=4, batch_size=2, save_every=1), tmp_path, "tiny",
                  progress=False)
    assert _state_step(tmp_path) == 2


# --- --overwrite removes an earlier run's training state, and only that ---------------------------------------
def test_overwrite_removes_a_stale_state(tmp_path, model_dir, text_file, capsys):
    out = tmp_path / "run"
    rc, _, err = run(calibrate_args(model_dir, text_file, out), capsys)
    assert rc == 0, err
    dcp = out / ".train_state.dcp.old"  # what a crash during a save leaves (a newer step than ours)
    dcp.mkdir()
    (dcp / ".metadata").write_bytes(b"x")
    (dcp / "train_state.json").write_text(json.dumps({"step": 99, "key": {}, "world_size": 2}))
    (out / "notes.txt").write_text("mine\n")
    (out / "mydata").mkdir()
    rc, _, err = run(calibrate_args(model_dir, text_file, out, "--overwrite", "--steps", "2", "--seed", "1"), capsys)
    assert rc == 0, err
    rc, stdout, err = run(calibrate_args(model_dir, text_file, out, "--resume", "--steps", "2", "--seed", "1"), capsys)
    assert rc == 0, err
    assert "already complete: step 2 of 2" in stdout
    assert not dcp.exists() and (out / "notes.txt").read_text() == "mine\n" and (out / "mydata").is_dir()


@pytest.mark.parametrize("command", ["calibrate", "demo"])
def test_overwrite_interrupted_before_its_first_save_leaves_no_file_of_the_earlier_run(
        tmp_path, model_dir, text_file, capsys, monkeypatch, command):
    """--overwrite over a finished checkpoint removes all of its files when training starts, so an interrupt before
    the new run's first save leaves a folder that mixes no two runs, and says the earlier checkpoint is gone."""
    out = tmp_path / "run"

    def args(*extra):
        if command == "calibrate":
            return calibrate_args(model_dir, text_file, out, *extra)
        return ["demo", "--model", model_dir, "--text", text_file, "-o", out, *DEMO, "--steps", "1", *extra]

    rc, _, err = run(args(), capsys)
    assert rc == 0, err
    earlier = sorted(p.name for p in out.iterdir())
    expected = {"calibrate": ["base_model.json", "calibration.json", "routers.safetensors", STATE_NAME,
                              "train_log.jsonl", "wide_config.json"],
                "demo": ["base_model.json", "demo_result.json", "routers.safetensors", STATE_NAME,
                         "train_log.jsonl", "wide_config.json"]}[command]
    assert earlier == sorted(expected)
    (out / ".routers.safetensors.x1y2").write_bytes(b"half")  # what a killed atomic write leaves
    (out / "notes.txt").write_text("mine\n")
    interrupt_at(monkeypatch, 2)
    rc, stdout, err = run(args("--overwrite", "--steps", "4", "--save-every", "3"), capsys)
    assert rc == 130, err
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]  # no file of the earlier run, no log of this one
    assert (out / "notes.txt").read_text() == "mine\n"
    removed = ", ".join(sorted([*earlier, ".routers.safetensors.x1y2"]))
    assert f"removed the earlier run's files from {out}: {removed}" in stdout
    lines = err.strip().splitlines()
    assert lines[-2] == (f"wide {command}: --overwrite removed the earlier checkpoint in {str(out)!r} ({removed}) "
                         f"when training started; the new run was interrupted before its first save"), err
    assert lines[-1].startswith(f"wide {command}: interrupted"), err
    if command == "calibrate":
        assert lines[-1].endswith("nothing was saved yet (the first save is at step 3), so there is nothing to "
                                  "resume"), err


def test_an_interrupt_before_the_overwrite_keeps_the_earlier_checkpoint(tmp_path, model_dir, text_file, capsys,
                                                                        monkeypatch):
    """An interrupt while the model loads, before training starts, removes nothing and says nothing of it."""
    import wide.cli.common as C

    out = tmp_path / "run"
    rc, _, err = run(calibrate_args(model_dir, text_file, out), capsys)
    assert rc == 0, err
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(C, "load", interrupted)
    rc, _, err = run(calibrate_args(model_dir, text_file, out, "--overwrite"), capsys)
    assert rc == 130 and "--overwrite removed" not in err, err
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before


def test_clear_run_removes_only_the_files_a_run_writes(tmp_path):
    for name in ["routers.safetensors", "wide_config.json", "base_model.json", "calibration.json", "train_log.jsonl",
                 "demo_result.json", ".wide_config.json.abc", "notes.txt", "routers.safetensors.bak"]:
        (tmp_path / name).write_text("x")
    for d in ["adapter", STATE_NAME, f".{STATE_NAME}.old", ".adapter.tmp", "mydata"]:
        (tmp_path / d).mkdir()
        (tmp_path / d / "f").write_text("x")
    assert T.clear_run(tmp_path) == sorted([".adapter.tmp", f".{STATE_NAME}.old", ".wide_config.json.abc", "adapter",
                                            "base_model.json", "calibration.json", "demo_result.json",
                                            "routers.safetensors", STATE_NAME, "train_log.jsonl",
                                            "wide_config.json"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mydata", "notes.txt", "routers.safetensors.bak"]
    assert T.clear_run(tmp_path) == [] and T.clear_run(tmp_path / "missing") == []


# --- an interrupted run: the hint, and a truncated last log line on --resume --------------------------
def test_interrupt_before_any_save_does_not_offer_resume(tmp_path, model_dir, text_file, capsys, monkeypatch):
    out = tmp_path / "run"
    interrupt_at(monkeypatch, 2)
    rc, _, err = run(calibrate_args(model_dir, text_file, out, "--steps", "4", "--save-every", "3"), capsys)
    assert rc == 130
    assert "--resume" not in err and "nothing was saved yet (the first save is at step 3)" in err, err
    assert not out.exists()  # nothing to resume from: no folder left behind


def test_interrupt_then_resume_over_a_truncated_log_line(tmp_path, model_dir, text_file, capsys, monkeypatch):
    out = tmp_path / "run"
    args = calibrate_args(model_dir, text_file, out, "--steps", "4", "--save-every", "2")
    interrupt_at(monkeypatch, 4)
    rc, _, err = run(args, capsys)
    assert rc == 130 and "add --resume to continue" in err, err
    monkeypatch.undo()
    log = out / "train_log.jsonl"
    with log.open("a") as f:
        f.write('{"step": 4, "lm_lo')  # a killed run's half-written last record
    rc, stdout, err = run([*args, "--resume"], capsys)
    assert rc == 0, err
    warn = [ln for ln in err.splitlines() if "warning" in ln]
    assert len(warn) == 1 and warn[0].startswith("wide calibrate: warning: "), err
    assert "train_log.jsonl: skipped 1 unreadable line(s) (line 4" in warn[0], err
    assert [json.loads(ln)["step"] for ln in log.read_text().splitlines()] == [1, 2, 3, 4]
    assert "saved WIDE checkpoint" in stdout


# --- --resume of a finished run -----------------------------------------------------------------------
def test_resume_of_a_finished_run_says_so_and_writes_nothing(tmp_path, model_dir, text_file, capsys):
    out = tmp_path / "run"
    rc, _, err = run(calibrate_args(model_dir, text_file, out), capsys)
    assert rc == 0, err
    before = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in out.iterdir() if p.is_file()}
    rc, stdout, err = run(calibrate_args(model_dir, text_file, out, "--resume"), capsys)
    assert rc == 0, err
    assert "already complete: step 1 of 1 done" in stdout and "saved" not in stdout, stdout
    assert {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in out.iterdir() if p.is_file()} == before


# --- a LoRA rank above the model's projection widths ----------------------------------------------------
def test_lora_rank_above_the_projection_widths_is_refused_before_loading(tmp_path, model_dir, text_file, capsys,
                                                                        monkeypatch):
    pytest.importorskip("peft")
    import wide.checkpoint

    s1 = tmp_path / "s1"
    rc, _, err = run(calibrate_args(model_dir, text_file, s1), capsys)
    assert rc == 0, err

    def no_load(*a, **k):
        raise AssertionError("weights loaded before the --lora-r check")

    monkeypatch.setattr(wide.checkpoint, "load", no_load)
    out = tmp_path / "s2"
    rc, _, err = run(["lora", "--model", model_dir, "--text", text_file, "--wide", s1, "-o", out, "--steps", "1",
                      "--batch-size", "1", "--seq-len", "32", "--device", "cpu", "--lora-r", "100000"], capsys)
    # tiny model: hidden 64, 2 KV heads x 16 = 32 for k_proj / v_proj, FFN 128
    one_line_error(rc, err, "lora", "--lora-r 100000 must be at most 32", "k_proj / v_proj")
    assert not out.exists()
    from wide.config import ModelDims
    from wide.lora import LoraSettings, max_lora_rank

    smol = ModelDims(num_layers=30, hidden_size=576, num_heads=9, num_kv_heads=3, head_dim=64,
                     intermediate_size=1536)
    assert max_lora_rank(smol) == (192, ["k_proj", "v_proj"])
    LoraSettings(r=192).check_dims(smol)
    with pytest.raises(WideError, match="--lora-r 193 must be at most 192"):
        LoraSettings(r=193).check_dims(smol)


def test_memory_estimate_counts_the_lora_parameters():
    """The training memory check counts every trained LoRA weight's gradient and AdamW state (12 bytes each)."""
    pytest.importorskip("peft")
    from wide.lora import LoraSettings, attach_lora, lora_named_parameters
    from wide.memory import OPTIMIZER_BYTES_PER_PARAM, train_memory_of

    counts = {}
    for r in (4, 32):
        wm = WideModel(tiny_model(), WideConfig(ffn_group_size=32))
        attach_lora(wm, LoraSettings(r=r))
        for p in wm.router_parameters():
            p.requires_grad_(False)
        lora = sum(p.numel() for _, p in lora_named_parameters(wm))
        mem = train_memory_of(wm, "cpu")
        assert mem.trainable_params == lora
        counts[r] = (lora, mem.estimate(1, 16, False))
    (l4, e4), (l32, e32) = counts[4], counts[32]
    assert e32 - e4 >= OPTIMIZER_BYTES_PER_PARAM * (l32 - l4)


# --- --resume with another base model, a full disk, SIGTERM, the data source of a resume mismatch ---------------
def _other_model_dir(tmp_path, **kw):
    from wide_testutil import tiny_tokenizer

    d = tmp_path / "other-llama"
    tiny_model(seed=1, **kw).save_pretrained(d)  # other weights (and, with kw, another shape)
    tiny_tokenizer().save_pretrained(d)
    return d


@pytest.mark.parametrize("shape", [{}, {"intermediate_size": 192}], ids=["same-shape", "other-shape"])
def test_resume_with_another_base_model_is_refused_before_loading_the_state(tmp_path, model_dir, text_file, capsys,
                                                                            monkeypatch, shape):
    out = tmp_path / "run"
    args = calibrate_args(model_dir, text_file, out, "--steps", "4", "--save-every", "2")
    interrupt_at(monkeypatch, 4)  # an unfinished run: its state at step 2
    rc, _, err = run(args, capsys)
    assert rc == 130, err
    monkeypatch.undo()
    info = json.loads((out / "base_model.json").read_text())
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    args[args.index("--model") + 1] = _other_model_dir(tmp_path, **shape)
    rc, _, err = run([*args, "--resume"], capsys)
    error_after_loading(rc, err, "calibrate", "--resume", f"trained on base model {str(model_dir)!r}",
                        info["fingerprint"], "not on the model given now", f"--model {str(model_dir)!r}")
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before


def test_lora_resume_with_another_base_model_is_refused(tmp_path, model_dir, text_file, capsys):
    pytest.importorskip("peft")
    stage1, out = tmp_path / "s1", tmp_path / "s2"
    rc, _, err = run(calibrate_args(model_dir, text_file, stage1), capsys)
    assert rc == 0, err
    lora = ["lora", "--wide", stage1, "--text", text_file, "-o", out, "--steps", "1", "--batch-size", "1",
            "--seq-len", "32", "--lora-r", "2", "--device", "cpu"]
    rc, _, err = run(lora, capsys)
    assert rc == 0, err
    # another stage-1 checkpoint made on other weights, then --resume of the first LoRA run with it
    other, stage1b = _other_model_dir(tmp_path), tmp_path / "s1b"
    rc, _, err = run(calibrate_args(other, text_file, stage1b), capsys)
    assert rc == 0, err
    args = [*lora, "--resume"]  # the same options: only the base model differs
    args[args.index("--wide") + 1] = stage1b
    rc, _, err = run(args, capsys)
    error_after_loading(rc, err, "lora", "--resume", f"trained on base model {str(model_dir)!r}",
                        "not on the model given now")


@pytest.mark.parametrize("exc", [OSError(28, "No space left on device"), RuntimeError("unexpected pos 64 vs 40")],
                         ids=["ENOSPC", "writer"])
def test_a_failed_state_write_is_one_line_and_keeps_the_last_good_state(tmp_path, model_dir, text_file, capsys,
                                                                       monkeypatch, exc):
    import torch.distributed.checkpoint as dcp

    out = tmp_path / "run"
    real, calls = dcp.save, []

    def full_disk(state, checkpoint_id, **k):
        calls.append(1)
        if len(calls) == 2:  # the second training-state save (step 2): the disk is full
            Path(checkpoint_id).mkdir(parents=True, exist_ok=True)
            (Path(checkpoint_id) / "__0_0.distcp").write_bytes(b"partial")  # what a dying writer leaves
            raise exc
        return real(state, checkpoint_id=checkpoint_id, **k)

    monkeypatch.setattr(dcp, "save", full_disk)
    rc, _, err = run(calibrate_args(model_dir, text_file, out, "--steps", "3", "--save-every", "1"), capsys)
    error_after_loading(rc, err, "calibrate", f"could not write the checkpoint to {out / STATE_NAME}",
                        "is the disk full?", "the training state of step 1 is kept", str(exc.args[-1]))
    assert _state_step(out) == 1  # the previous good state, not a partial file
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == []  # no temporary file left
    monkeypatch.undo()
    rc, _, err = run(calibrate_args(model_dir, text_file, out, "--steps", "3", "--save-every", "1", "--resume"),
                     capsys)
    assert rc == 0, err


@pytest.mark.parametrize("how", ["SIGINT", "SIGTERM"])
def test_an_interrupt_inside_the_state_write_is_reported_as_an_interrupt(tmp_path, model_dir, text_file, capsys,
                                                                          monkeypatch, how):
    """Ctrl-C or SIGTERM while DCP writes the state: DCP wraps it in a CheckpointException; the CLI still says
    "interrupted" with its exit code and the --resume hint, not a disk error, and keeps the last good state."""
    import os
    import signal

    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    out = tmp_path / "run"
    real, calls = FileSystemWriter.write_data, []

    def interrupted(self, *a, **k):
        calls.append(1)
        if len(calls) == 2:  # the second training-state save (step 2)
            if how == "SIGTERM":
                os.kill(os.getpid(), signal.SIGTERM)  # the CLI's handler raises KeyboardInterrupt here
            raise KeyboardInterrupt
        return real(self, *a, **k)

    monkeypatch.setattr(FileSystemWriter, "write_data", interrupted)
    rc, _, err = run(calibrate_args(model_dir, text_file, out, "--steps", "3", "--save-every", "1"), capsys)
    assert len(calls) == 2 and rc == (143 if how == "SIGTERM" else 130), err
    last = err.strip().splitlines()[-1]
    assert last == (f"wide calibrate: interrupted{' (SIGTERM)' if how == 'SIGTERM' else ''}; the last state saved "
                    f"(every --save-every 1 steps) is in {str(out)!r}: add --resume to continue from it"), err
    assert "disk full" not in err and "Traceback" not in err
    assert _state_step(out) == 1 and not [p.name for p in out.iterdir() if p.name.startswith(".")]
    monkeypatch.undo()
    rc, _, err = run(calibrate_args(model_dir, text_file, out, "--steps", "3", "--save-every", "1", "--resume"),
                     capsys)
    assert rc == 0, err


def test_dcp_failures_name_their_cause(tmp_path):
    """A CheckpointException is reported by its rank's exception (an interrupt of any rank first), not by DCP's
    "CheckpointException ranks:dict_keys([0])"."""
    import traceback

    from torch.distributed.checkpoint.api import CheckpointException

    def wrapped(**failures):
        return CheckpointException("write_data", {int(r[1:]): (e, traceback.StackSummary()) for r, e in
                                                  failures.items()})

    assert str(T._cause(wrapped(r0=ValueError("bad shard")))) == "bad shard"
    stop = KeyboardInterrupt()
    assert T._cause(wrapped(r0=OSError(28, "No space left on device"), r1=stop)) is stop
    wm = WideModel(tiny_model(), WideConfig(ffn_group_size=32))
    opt = torch.optim.AdamW(list(wm.router_parameters()))

    def failing(exc):
        def dcp_op(op, state, path, env):
            raise wrapped(r0=exc)
        return dcp_op

    env = T.D.current()
    for exc, raised, text in [(RuntimeError("size mismatch for attn.0.w1"), WideError,
                               f"corrupt training state {tmp_path}: size mismatch for attn.0.w1"),
                              (KeyboardInterrupt(), KeyboardInterrupt, "")]:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(T, "_dcp", failing(exc))
            with pytest.raises(raised) as info:
                T._load_state(wm, opt, {"_path": str(tmp_path)}, env)
            assert str(info.value) == text
            with pytest.raises(RuntimeError if raised is WideError else raised) as info:
                T._save_state(wm, opt, tmp_path, {}, env)
            assert str(info.value) == ("size mismatch for attn.0.w1" if raised is WideError else "")


def test_a_failed_checkpoint_write_before_any_save_leaves_no_folder(tmp_path, model_dir, text_file, capsys,
                                                                    monkeypatch):
    import wide.checkpoint as C

    out = tmp_path / "run"

    def full_disk(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(C, "atomic_save_safetensors", full_disk)
    rc, _, err = run(calibrate_args(model_dir, text_file, out), capsys)
    error_after_loading(rc, err, "calibrate", f"could not write the checkpoint to {out}", "No space left on device",
                        "nothing was saved yet")
    assert not out.exists()


def test_sigterm_is_handled_like_ctrl_c(tmp_path, model_dir, text_file):
    import os
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "run"
    # a slow step (a sleep in every micro-batch read) so that SIGTERM arrives during training, after step 2's save
    code = ("import sys, time, wide.train.loop as T\n"
            "real = T.stream_rows\n"
            "def slow(*a, **k):\n"
            "    time.sleep(0.5)\n"
            "    return real(*a, **k)\n"
            "T.stream_rows = slow\n"
            "from wide.cli import main\n"
            "sys.exit(main(sys.argv[1:]))\n")
    args = [str(a) for a in calibrate_args(model_dir, text_file, out, "--steps", "1000", "--save-every", "2")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), *sys.path])}
    p = subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=env)
    try:
        deadline = time.time() + 120
        while not T.has_train_state(out) and time.time() < deadline and p.poll() is None:
            time.sleep(0.2)
        assert T.has_train_state(out), p.communicate(timeout=30)
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 143, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("wide calibrate: interrupted (SIGTERM); the last state saved"), err
    assert "add --resume to continue from it" in last and "Traceback" not in err


def test_sigterm_handler_is_only_installed_while_a_command_runs():
    import signal

    from wide.cli import _term_as_interrupt

    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt):
        with _term_as_interrupt() as got:
            assert signal.getsignal(signal.SIGTERM) is not before
            signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)
    assert got["signal"] == signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is before


def test_resume_on_other_text_names_the_text_of_the_saved_run(tmp_path, model_dir, text_file, capsys):
    from wide_testutil import random_text

    out = tmp_path / "run"
    rc, _, err = run(calibrate_args(model_dir, text_file, out, "--steps", "2", "--save-every", "1"), capsys)
    assert rc == 0, err
    other = tmp_path / "other.txt"
    other.write_text("\n\n".join(random_text(300, seed=s + 10) for s in range(4)))
    args = calibrate_args(model_dir, other, out, "--steps", "2", "--save-every", "1", "--resume")  # only the text
    rc, _, err = run(args, capsys)
    error_after_loading(rc, err, "calibrate", "data.tokens_sha256: saved",
                        f"the saved run used --text {str(text_file.resolve())!r}")
