"""``--resume`` takes every option not on the command line from the saved run (kept with its training state), so
``wide calibrate -o DIR --resume`` alone continues it exactly; an option given that differs from the saved run is
still refused with a one-line error (before the model loads when it is one of the run options), and a state saved
without options resumes as before."""

import json

import pytest
import torch
from safetensors.torch import load_file

from wide.train.loop import META_NAME, STATE_NAME
from wide_testutil import calibrate_args, error_after_loading, interrupt_at, one_line_error
from wide_testutil import run_cli as run

SAVED = "resuming with the saved settings: "


def _records(out):
    """The log without its timing."""
    return [{k: v for k, v in json.loads(ln).items() if k != "tokens_per_s"}
            for ln in (out / "train_log.jsonl").read_text().splitlines()]


def _saved_line(stdout):
    lines = [ln for ln in stdout.splitlines() if ln.startswith(SAVED)]
    assert len(lines) == 1, stdout
    return lines[0]


# every value differs from its default, -S 0.3 included (its default is 0.5)
RUN = ["--steps", "4", "--save-every", "2", "--batch-size", "2", "--grad-accum", "2", "-S", "0.3", "--seed", "5",
       "--lr", "0.01", "--tau-start", "2", "--rank", "8", "--warmup-steps", "1"]


def test_resume_with_only_the_output_continues_the_saved_run_exactly(tmp_path, model_dir, text_file, capsys,
                                                                      monkeypatch):
    a, b = tmp_path / "a", tmp_path / "b"
    rc, _, err = run(calibrate_args(model_dir, text_file, a, *RUN), capsys)
    assert rc == 0, err
    interrupt_at(monkeypatch, 6)  # in step 3 (2 micro-batches a step); the state of step 2 is saved
    rc, _, err = run(calibrate_args(model_dir, text_file, b, *RUN), capsys)
    assert rc == 130 and "add --resume to continue" in err, err
    monkeypatch.undo()
    monkeypatch.chdir(tmp_path / "tiny-llama")  # another folder: the saved paths are absolute

    rc, stdout, err = run(["calibrate", "-o", b, "--resume"], capsys)
    assert rc == 0, err
    line = _saved_line(stdout)
    for words in (f"--model {model_dir}", f"--text {text_file}", "--steps 4", "--batch-size 2", "--grad-accum 2",
                  "--sparsity 0.3", "--seed 5", "--lr 0.01", "--tau-start 2.0", "--rank 8", "--warmup-steps 1",
                  "--seq-len 32", "--ffn-group-size 32", "--device cpu", "--save-every 2"):
        assert words in line, line
    assert "--alpha" not in line and "--output" not in line  # the same as the default: not named
    assert "resuming from step 2 of 4" in stdout
    assert _records(b) == _records(a) and [r["step"] for r in _records(b)] == [1, 2, 3, 4]
    ra, rb = load_file(a / "routers.safetensors"), load_file(b / "routers.safetensors")
    assert ra.keys() == rb.keys() and all(torch.equal(ra[k], rb[k]) for k in ra)


def test_resume_refuses_an_option_given_that_differs_from_the_saved_run(tmp_path, model_dir, text_file, capsys):
    out = tmp_path / "run"
    rc, _, err = run(calibrate_args(model_dir, text_file, out, *RUN), capsys)
    assert rc == 0, err
    # -S 0.5 is the default: given on the command line it still counts, and differs from the saved 0.3
    # refused before the model loads (one line, nothing else printed), naming the flags
    rc, stdout, err = run(["calibrate", "-o", out, "--resume", "-S", "0.5", "--seed", "9"], capsys)
    one_line_error(rc, err, "calibrate", f"--resume: the run in {str(out)!r} was written with other settings: "
                   "--sparsity: saved 0.3, now 0.5; --seed: saved 5, now 9 (to continue it, drop the options that "
                   "differ and the saved run's own are reused; or start over with --overwrite)")
    assert stdout == ""
    # a setting outside the options (here the text's tokens) is still refused by the check after loading
    other = tmp_path / "other.txt"
    other.write_text(text_file.read_text()[::-1])
    rc, stdout, err = run(["calibrate", "-o", out, "--resume", "--text", other], capsys)
    error_after_loading(rc, err, "calibrate", "--resume", "written with other settings", "data.tokens_sha256: saved",
                        "(to continue it, drop the options that differ and the saved run's own are reused; or "
                        "start over with --overwrite)")
    assert "--text" not in _saved_line(stdout) and "--steps 4" in _saved_line(stdout)
    # an option that may change on resume (not part of the resume key) is still accepted when given
    rc, stdout, err = run(["calibrate", "-o", out, "--resume", "--save-every", "7"], capsys)
    assert rc == 0, err
    assert "already complete: step 4 of 4" in stdout and "--save-every" not in _saved_line(stdout)


def test_a_state_saved_without_options_resumes_as_before(tmp_path, model_dir, text_file, capsys):
    out = tmp_path / "run"
    args = calibrate_args(model_dir, text_file, out, "--steps", "2", "--seed", "3")
    rc, _, err = run(args, capsys)
    assert rc == 0, err
    meta = json.loads((out / STATE_NAME / META_NAME).read_text())
    assert meta["options"]["seed"] == 3 and "output" not in meta["options"]
    del meta["options"]  # a state saved from Python, without a command line
    (out / STATE_NAME / META_NAME).write_text(json.dumps(meta))
    rc, stdout, err = run([*args, "--resume"], capsys)
    assert rc == 0, err
    assert "already complete: step 2 of 2" in stdout and SAVED not in stdout
    rc, stdout, err = run([*calibrate_args(model_dir, text_file, out, "--steps", "2"), "--resume"], capsys)
    error_after_loading(rc, err, "calibrate", "written with other settings", "train.seed: saved 3, now 0",
                        "now 0 (to continue it, give the saved values; or start over with --overwrite)")


def test_lora_resume_takes_the_stage1_directory_and_lora_options(tmp_path, model_dir, text_file, capsys):
    pytest.importorskip("peft")
    stage1, out = tmp_path / "s1", tmp_path / "s2"
    rc, _, err = run(calibrate_args(model_dir, text_file, stage1), capsys)
    assert rc == 0, err
    rc, _, err = run(["lora", "-o", out, "--text", text_file, "--steps", "2"], capsys)
    one_line_error(rc, err, "lora", "--wide is required", "--resume")
    assert not out.exists()
    rc, _, err = run(["lora", "--wide", stage1, "--text", text_file, "-o", out, "--steps", "2", "--batch-size", "1",
                      "--seq-len", "32", "--lora-r", "2", "--freeze-router", "--device", "cpu"], capsys)
    assert rc == 0, err
    rc, stdout, err = run(["lora", "-o", out, "--resume"], capsys)
    assert rc == 0, err
    line = _saved_line(stdout)
    for words in (f"--wide {stage1}", "--lora-r 2", "--freeze-router", "--steps 2", "--seq-len 32"):
        assert words in line, line
    assert "--model" not in line  # not given: the stage-1 checkpoint's base model, as before
    assert "already complete: step 2 of 2" in stdout
    rc, stdout, err = run(["lora", "-o", out, "--resume", "--lora-r", "4"], capsys)
    one_line_error(rc, err, "lora", "written with other settings", "--lora-r: saved 2, now 4")  # before loading
    assert stdout == ""


def test_an_interrupted_demo_is_finished_by_calibrate_resume_alone(tmp_path, model_dir, text_file, capsys,
                                                                    monkeypatch):
    demo = ["--model", model_dir, "--text", text_file, "--device", "cpu", "--steps", "4", "--save-every", "2",
            "--batch-size", "1", "--seq-len", "32", "--ctx", "32", "--eval-tokens", "64", "--ffn-group-size", "32",
            "--lr", "0.02", "--seed", "4"]
    a, b = tmp_path / "a", tmp_path / "b"
    rc, _, err = run(["demo", "-o", a, *demo], capsys)
    assert rc == 0, err
    interrupt_at(monkeypatch, 3)  # in step 3; the state of step 2 is saved
    rc, _, err = run(["demo", "-o", b, *demo], capsys)
    assert rc == 130, err
    last = err.strip().splitlines()[-1]  # after the progress bars
    assert last.startswith("wide demo: interrupted; ") and f"`wide calibrate -o {b} --resume` finishes it" in last, err
    monkeypatch.undo()

    rc, stdout, err = run(["calibrate", "-o", b, "--resume"], capsys)
    assert rc == 0, err
    line = _saved_line(stdout)
    for words in (f"--model {model_dir}", f"--text {text_file}", "--steps 4", "--seq-len 32", "--lr 0.02",
                  "--seed 4", "--batch-size 1", "--ffn-group-size 32"):
        assert words in line, line
    assert "resuming from step 2 of 4" in stdout
    assert _records(b) == _records(a) and [r["step"] for r in _records(b)] == [1, 2, 3, 4]
    ra, rb = load_file(a / "routers.safetensors"), load_file(b / "routers.safetensors")
    assert ra.keys() == rb.keys() and all(torch.equal(ra[k], rb[k]) for k in ra)


def test_a_demo_interrupted_after_calibration_points_to_eval_ppl(tmp_path, model_dir, text_file, capsys,
                                                                 monkeypatch):
    # interrupted in the WIDE evaluation ([4/5]): the calibration is complete, so the hint is eval-ppl (no --resume,
    # which would only say there is nothing to train), and that command evaluates the saved routers
    import wide.eval.perplexity as E

    out = tmp_path / "d"
    real, calls = E.perplexity, []

    def second_call_interrupted(*a, **k):  # the dense evaluation runs, the WIDE one is interrupted
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(E, "perplexity", second_call_interrupted)
    rc, _, err = run(["demo", "-o", out, "--model", model_dir, "--text", text_file, "--device", "cpu", "--steps", "2",
                      "--batch-size", "1", "--seq-len", "32", "--ctx", "32", "--eval-tokens", "64",
                      "--ffn-group-size", "32"], capsys)
    assert rc == 130, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("wide demo: interrupted; the calibration was complete") and "--resume" not in last, last
    assert f"`wide eval-ppl --wide {out}` evaluates it" in last, last
    monkeypatch.undo()
    rc, stdout, err = run(["eval-ppl", "--wide", out, "--text", text_file, "--device", "cpu", "--ctx", "32",
                           "--max-tokens", "64"], capsys)
    assert rc == 0, err
    assert "ppl" in stdout.lower()
