"""Input checks found by a fresh-user test: a non-empty -o without --resume / --overwrite, --warmup-steps above
--steps, a bad value in a checkpoint's wide_config.json (the error names the file), and prune-static's summary
with --attn-sparsity / --ffn-sparsity."""

import json

import pytest

from wide.cli import main
from wide.errors import WideError
from wide.training import CalibrationArgs


def run(args, capsys):
    rc = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


def one_line_error(rc, err, cmd, *words):
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"wide {cmd}: error: "), lines[0]
    for w in words:
        assert w in lines[0], lines[0]


def calibrate_args(model_dir, text_file, out, *extra):
    return ["calibrate", "--model", model_dir, "--text", text_file, "-o", out, "--steps", "1", "--batch-size", "1",
            "--seq-len", "32", "--ffn-group-size", "32", "--device", "cpu", *extra]


def test_calibrate_non_empty_output_needs_resume_or_overwrite(tmp_path, model_dir, text_file, capsys):
    out = tmp_path / "run"
    out.mkdir()  # an existing empty directory is fine
    rc, _, err = run(calibrate_args(model_dir, text_file, out), capsys)
    assert rc == 0, err
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    assert "routers.safetensors" in before and "train_state.pt" in before

    rc, _, err = run(calibrate_args(model_dir, text_file, out, "--seed", "1"), capsys)
    one_line_error(rc, err, "calibrate", repr(str(out)), "exists and is not empty", "--resume", "--overwrite")
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before  # nothing written

    rc, _, err = run(calibrate_args(model_dir, text_file, out, "--resume", "--overwrite"), capsys)
    one_line_error(rc, err, "calibrate", "--resume and --overwrite exclude each other")

    rc, _, err = run(calibrate_args(model_dir, text_file, out, "--seed", "1", "--overwrite"), capsys)
    assert rc == 0, err
    assert (out / "routers.safetensors").read_bytes() != before["routers.safetensors"]  # a new run (other seed)
    assert [json.loads(ln)["step"] for ln in (out / "train_log.jsonl").read_text().splitlines()] == [1]
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no temporary files left behind

    (out / "adapter").mkdir()  # a stage-2 output: stage 1 would leave the adapter next to its new routers
    rc, _, err = run(calibrate_args(model_dir, text_file, out, "--overwrite"), capsys)
    one_line_error(rc, err, "calibrate", "LoRA adapter", "give another -o")


def test_lora_non_empty_output_needs_resume_or_overwrite(tmp_path, model_dir, text_file, capsys):
    pytest.importorskip("peft")
    s1 = tmp_path / "s1"
    rc, _, err = run(calibrate_args(model_dir, text_file, s1), capsys)
    assert rc == 0, err
    out = tmp_path / "s2"
    out.mkdir()
    (out / "notes.txt").write_text("someone else's file\n")
    lora = ["lora", "--model", model_dir, "--text", text_file, "--wide", s1, "-o", out, "--steps", "1",
            "--batch-size", "1", "--seq-len", "32", "--device", "cpu"]
    rc, _, err = run(lora, capsys)
    one_line_error(rc, err, "lora", repr(str(out)), "exists and is not empty", "--resume", "--overwrite")
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
    rc, _, err = run([*lora[:8], s1, *lora[9:]], capsys)  # -o = --wide: that message, not "not empty"
    one_line_error(rc, err, "lora", "must differ from the stage-1 checkpoint")
    rc, _, err = run([*lora, "--overwrite"], capsys)
    assert rc == 0, err
    assert (out / "adapter").is_dir() and (out / "notes.txt").is_file()


def test_warmup_longer_than_steps_is_rejected(tmp_path, text_file, capsys):
    # the CLI: before any model loads (--model points nowhere)
    rc, _, err = run(["calibrate", "--model", tmp_path / "no-model", "--text", text_file, "-o", tmp_path / "o",
                      "--steps", "10", "--warmup-steps", "11", "--device", "cpu"], capsys)
    one_line_error(rc, err, "calibrate", "--warmup-steps 11 must be <= --steps 10")
    assert not (tmp_path / "o").exists()
    # the Python API validates the same way; warm-up over all steps is allowed
    with pytest.raises(WideError, match=r"--warmup-steps 4 must be <= --steps 3"):
        CalibrationArgs(steps=3, warmup_steps=4).validate()
    CalibrationArgs(steps=3, warmup_steps=3).validate()
    CalibrationArgs(steps=3, warmup_steps=0).validate()


@pytest.mark.parametrize("field,value,words", [
    ("ffn_group_size", 256, "FFN group size G=256 does not divide the intermediate size 128"),
    ("attn_group_size", 24, "attention group size G=24 must be a multiple of head_dim=16"),
    ("target_sparsity", 1.5, "S=1.5 is outside [0, 1)"),
])
def test_bad_config_value_names_the_file(tmp_path, model_dir, text_file, capsys, field, value, words):
    import wide

    d = tmp_path / "ckpt"
    rc, _, err = run(calibrate_args(model_dir, text_file, d), capsys)
    assert rc == 0, err
    path = d / "wide_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), field: value}))
    rc, _, err = run(["eval-ppl", "--wide", d, "--model", model_dir, "--text", text_file, "--ctx", "64",
                      "--device", "cpu"], capsys)
    one_line_error(rc, err, "eval-ppl", str(path), words)
    with pytest.raises(WideError, match="wide_config.json") as e:
        wide.load(d, model=model_dir, device="cpu")
    assert str(path) in str(e.value) and words in str(e.value)


def test_prune_static_summary_shows_the_sparsities_used(tmp_path, model_dir, text_file, capsys):
    out = tmp_path / "static"
    rc, stdout, err = run(["prune-static", "--model", model_dir, "--text", text_file, "-S", "0.1", "-o", out,
                           "--attn-sparsity", "0.5", "--ffn-sparsity", "0.25", "--ffn-group-size", "16",
                           "--calib-blocks", "2", "--seq-len", "32", "--device", "cpu"], capsys)
    assert rc == 0, err
    line = next(ln for ln in stdout.splitlines() if ln.startswith("static pruning of"))
    assert "(--attn-sparsity 0.5 --ffn-sparsity 0.25)" in line and "S=0.1" not in line
    assert "removed attention 0.500" in line and "FFN 0.250" in line and "overall 0.375" in line
    rc, stdout, err = run(["prune-static", "--model", model_dir, "--text", text_file, "-S", "0.5", "-o",
                           tmp_path / "s50", "--ffn-group-size", "16", "--calib-blocks", "2", "--seq-len", "32",
                           "--device", "cpu"], capsys)
    assert rc == 0, err
    assert "(S=0.5): removed attention" in stdout and "overall 0.500" in stdout
