"""Input checks found by a fresh-user test: a non-empty -o without --resume / --overwrite, --warmup-steps above
--steps, a bad value in a checkpoint's wide_config.json (the error names the file), and prune-static's summary
with --attn-sparsity / --ffn-sparsity. A second round: --device checked first by every command, a resume on
other data or another --seq-len refused, --json / -o targets checked before any work, `wide demo` keeping a
non-empty -o unless --overwrite, `wide eval` defaulting to the offline zero-shot tasks, a corrupt
train_state.pt in one clear line, help texts, and peft's missing-config warning silenced."""

import importlib.util
import json

import pytest

from wide.cli import main
from wide.errors import WideError
from wide.train.loop import CalibrationArgs
from wide_testutil import calibrate_args, error_after_loading, one_line_error
from wide_testutil import run_cli as run


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
    split = ["--attn-sparsity", "0.5", "--ffn-sparsity", "0.25", "--ffn-group-size", "16", "--calib-blocks", "2",
             "--seq-len", "32", "--device", "cpu"]
    # an -S that is not the two fractions' mean is refused, not silently dropped (fresh user, session 15)
    rc, _, err = run(["prune-static", "--model", model_dir, "--text", text_file, "-S", "0.1", "-o", out, *split],
                     capsys)
    one_line_error(rc, err, "prune-static", "-S 0.1 conflicts with --attn-sparsity 0.5 --ffn-sparsity 0.25 (their "
                   "mean, the overall S, is 0.375): give -S alone, or the two fractions")
    assert not out.exists()
    rc, _, err = run(["prune-static", "--model", model_dir, "--text", text_file, "-o", out], capsys)
    one_line_error(rc, err, "prune-static", "give the target sparsity -S (or the two fractions --attn-sparsity and "
                   "--ffn-sparsity)")
    # a bad group size is named before a missing -S, for the attention size as for the FFN one (session 21)
    for opt, val, words in (("--attn-group-size", "7", "static attention group size G=7 must be a multiple of"),
                            ("--ffn-group-size", "24", "24")):
        rc, _, err = run(["prune-static", "--model", model_dir, "--text", text_file, "-o", out, opt, val], capsys)
        one_line_error(rc, err, "prune-static", words)
        assert "-S" not in err and not out.exists()
    # a --seq-len past the model's context is refused from the config, before the weights (fresh user, session 21)
    rc, _, err = run(["prune-static", "--model", model_dir, "--text", text_file, "-o", out, "-S", "0.5",
                      "--seq-len", "10000000"], capsys)
    one_line_error(rc, err, "prune-static", "--seq-len 10000000 is longer than the model's context of")
    assert not out.exists()
    rc, stdout, err = run(["prune-static", "--model", model_dir, "--text", text_file, "-o", out, *split], capsys)
    assert rc == 0, err
    line = next(ln for ln in stdout.splitlines() if ln.startswith("static pruning of"))
    assert "(--attn-sparsity 0.5 --ffn-sparsity 0.25)" in line and "S=" not in line
    assert "removed attention 0.500" in line and "FFN 0.250" in line and "overall 0.375" in line
    assert "warning" not in err
    # fractions whole groups cannot reach are said on stderr, with what was removed (fresh user, session 21)
    small = ["--attn-sparsity", "0.1", "--ffn-sparsity", "0.02", *split[4:]]
    rc, stdout, err = run(["prune-static", "--model", model_dir, "--text", text_file, "-o", tmp_path / "few",
                           *small], capsys)
    assert rc == 0, err
    assert "removed attention 0.000" in stdout and "FFN 0.000" in stdout
    warn = [ln for ln in err.splitlines() if ln.startswith("warning:")]
    assert len(warn) == 1, err  # one line, naming each fraction that differs
    assert ("warning: only whole groups are removed, so the sparsity removed differs from the one asked: attention "
            "0.000 (asked 0.1), FFN 0.000 (asked 0.02), overall 0.000 (asked 0.06); each layer has") in warn[0]
    assert "and keeps at least one of each" in warn[0]
    rc, stdout, err = run(["prune-static", "--model", model_dir, "--text", text_file, "-S", "0.5", "-o",
                           tmp_path / "s50", "--ffn-group-size", "16", "--calib-blocks", "2", "--seq-len", "32",
                           "--device", "cpu"], capsys)
    assert rc == 0, err
    assert "(S=0.5): removed attention" in stdout and "overall 0.500" in stdout and "warning" not in err


# --- second fresh-user round: --device, resume data, output paths, demo overwrite, eval default, help texts ---
NOWHERE = "no-model"  # a --model that does not exist: any error seen comes before the model loads

DEVICE_COMMANDS = {
    "info": [],
    "calibrate": ["-o", "{tmp}/o"],
    "lora": ["--wide", "{tmp}/w", "-o", "{tmp}/o"],
    "eval-ppl": [],
    "eval": [],
    "prune-static": ["-S", "0.5", "-o", "{tmp}/o"],
    "demo": ["-o", "{tmp}/o"],
    "generate": ["--prompt", "hi"],
}


@pytest.mark.parametrize("cmd", list(DEVICE_COMMANDS))
@pytest.mark.parametrize("device,cuda,words", [
    ("tpu", 0, ["--device 'tpu'", "use cpu, cuda or cuda:N"]),
    ("cuda", 0, ["--device cuda: no CUDA GPU on this machine (use --device cpu)"]),
    ("cuda:0", 0, ["--device cuda:0: no CUDA GPU on this machine"]),
    ("cuda:2", 2, ["--device cuda:2: this machine has 2 CUDA GPU(s): use cuda:0 to cuda:1 or cpu"]),
])
def test_device_is_checked_first_by_every_command(tmp_path, capsys, monkeypatch, cmd, device, cuda, words):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: cuda)
    extra = [a.format(tmp=tmp_path) for a in DEVICE_COMMANDS[cmd]]
    rc, _, err = run([cmd, "--model", tmp_path / NOWHERE, "--device", device, *extra], capsys)
    one_line_error(rc, err, cmd, *words)
    assert not (tmp_path / "o").exists()


def test_check_device_accepts_cpu_and_present_gpus(monkeypatch):
    import torch

    from wide.model import check_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    for dev in (None, "cpu", "cuda", "cuda:0", "cuda:1"):
        check_device(dev)
    for dev in ("CPU", "cuda:", "cuda:x", "mps", "cuda:0,1"):
        with pytest.raises(WideError, match="use cpu, cuda or cuda:N"):
            check_device(dev)


def test_resume_refuses_other_seq_len_or_text_and_says_where_it_resumes(tmp_path, model_dir, text_file, capsys):
    import torch

    out = tmp_path / "run"
    rc, _, err = run(calibrate_args(model_dir, text_file, out), capsys)
    assert rc == 0, err
    rc, stdout, err = run(calibrate_args(model_dir, text_file, out, "--resume"), capsys)
    assert rc == 0, err
    assert (f"the run in {out} is already complete: step 1 of 1 done (state in {out / 'train_state.pt'}); "
            f"nothing to train") in stdout.splitlines()  # a finished run: --resume says so, rewrites nothing

    args = calibrate_args(model_dir, text_file, out, "--resume")
    args[args.index("--seq-len") + 1] = "16"
    rc, _, err = run(args, capsys)
    one_line_error(rc, err, "calibrate", "written with other settings", "--seq-len: saved 32, now 16")  # unloaded
    assert "the saved run used" not in err  # the tokens differ because of --seq-len, not the text: no --text hint
    other = tmp_path / "other.txt"
    other.write_text(text_file.read_text()[::-1])
    rc, _, err = run(calibrate_args(model_dir, other, out, "--resume"), capsys)
    error_after_loading(rc, err, "calibrate", "written with other settings", "data.tokens_sha256: saved '")
    assert "data.seq_len" not in err

    # a state saved before the data entry existed still resumes (the entry is not compared)
    path = out / "train_state.pt"
    st = torch.load(path, weights_only=True)
    del st["meta"]["data"]
    torch.save(st, path)
    rc, stdout, err = run(calibrate_args(model_dir, other, out, "--resume"), capsys)
    assert rc == 0, err
    assert "already complete: step 1 of 1" in stdout


@pytest.mark.parametrize("content,reason", [
    (b"\x00" * 64, "unreadable: truncated or not a torch file"),
    (None, "unreadable: truncated or not a torch file"),  # a real state cut in half
    ("list", "not a wide training state"),
])
def test_corrupt_train_state_is_one_clear_line_before_loading(tmp_path, text_file, capsys, content, reason):
    import torch

    out = tmp_path / "run"
    out.mkdir()
    path = out / "train_state.pt"
    if content is None:
        torch.save({"step": 1, "model": {"w": torch.zeros(4096)}, "optimizer": {}, "meta": {}}, path)
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    elif content == "list":
        torch.save([1, 2], path)
    else:
        path.write_bytes(content)
    rc, _, err = run(calibrate_args(tmp_path / NOWHERE, text_file, out, "--resume"), capsys)
    one_line_error(rc, err, "calibrate", f"corrupt training state {path} ({reason}",
                   "); delete it or rerun without --resume")


def test_json_target_is_checked_before_any_work(tmp_path, text_file, capsys):
    afile = tmp_path / "afile"
    afile.write_text("x")
    for target, words in ((tmp_path, [repr(str(tmp_path)), "is a directory; give a file path"]),
                          (afile / "r.json", [repr(str(afile / "r.json")), repr(str(afile)), "is a file, not a "
                                                                                             "directory"])):
        rc, _, err = run(["eval-ppl", "--model", tmp_path / NOWHERE, "--text", text_file, "--device", "cpu",
                          "--json", target], capsys)
        one_line_error(rc, err, "eval-ppl", "--json", *words)
    if importlib.util.find_spec("lm_eval") is not None:
        rc, _, err = run(["eval", "--model", tmp_path / NOWHERE, "--device", "cpu", "--json", tmp_path], capsys)
        one_line_error(rc, err, "eval", "--json", "is a directory; give a file path")


def test_json_into_a_new_directory_is_fine(tmp_path, model_dir, text_file, capsys):
    target = tmp_path / "new" / "sub" / "r.json"
    rc, _, err = run(["eval-ppl", "--model", model_dir, "--text", text_file, "--device", "cpu", "--ctx", "32",
                      "--max-tokens", "64", "--json", target], capsys)
    assert rc == 0, err
    assert "dense" in json.loads(target.read_text())


@pytest.mark.parametrize("cmd", ["calibrate", "prune-static", "demo"])  # lora: the same _check_output
@pytest.mark.parametrize("below", [False, True])
def test_output_dir_that_is_a_file(tmp_path, text_file, capsys, cmd, below):
    afile = tmp_path / "afile"
    afile.write_text("x")
    out = afile / "sub" if below else afile
    args = {"calibrate": calibrate_args(tmp_path / NOWHERE, text_file, out),
            "prune-static": ["prune-static", "--model", tmp_path / NOWHERE, "-S", "0.5", "-o", out],
            "demo": ["demo", "--model", tmp_path / NOWHERE, "-o", out]}[cmd]
    rc, _, err = run(args, capsys)
    if below:
        one_line_error(rc, err, cmd, f"-o {str(out)!r}: {str(afile)!r} is a file, not a directory")
    else:
        one_line_error(rc, err, cmd, f"-o {str(out)!r} is a file; give a directory")
    assert afile.read_text() == "x"


@pytest.mark.parametrize("cmd", ["calibrate", "demo"])
def test_output_dir_where_nothing_can_be_created(tmp_path, text_file, capsys, cmd):
    """/proc takes no new entries (even for root): one line before any model loads (the model path does not
    exist, so loading it would be a different error)."""
    out = "/proc/wide-out"
    args = {"calibrate": calibrate_args(tmp_path / NOWHERE, text_file, out),
            "demo": ["demo", "--model", tmp_path / NOWHERE, "-o", out]}[cmd]
    rc, _, err = run(args, capsys)
    one_line_error(rc, err, cmd, f"-o {out!r}: nothing can be written in '/proc'")


def test_demo_keeps_a_non_empty_output_unless_overwrite(tmp_path, model_dir, text_file, capsys):
    from pathlib import Path

    out = tmp_path / "demo"
    out.mkdir()
    (out / "routers.safetensors").write_text("an earlier checkpoint")
    demo = ["demo", "--model", model_dir, "--text", text_file, "-o", out, "--device", "cpu", "--steps", "1",
            "--batch-size", "1", "--seq-len", "32", "--ctx", "32", "--eval-tokens", "64", "--ffn-group-size", "32"]
    rc, _, err = run(demo, capsys)
    one_line_error(rc, err, "demo", repr(str(out)), "exists and is not empty", "use --overwrite to write over it: the files this "
                   "command writes are replaced, any others are left as they are")
    assert "--resume" not in err  # demo has none
    assert (out / "routers.safetensors").read_text() == "an earlier checkpoint"
    rc, _, err = run([*demo, "--overwrite"], capsys)
    assert rc == 0, err
    assert (out / "demo_result.json").is_file() and (out / "routers.safetensors").read_bytes()[:1] != b"a"
    # `make demo` passes --overwrite, so running it twice works
    makefile = (Path(__file__).resolve().parents[1] / "Makefile").read_text()
    demo_line = next(ln for ln in makefile.splitlines() if "bin/wide demo" in ln)
    assert "--overwrite" in demo_line


def test_prune_static_non_empty_output_needs_overwrite(tmp_path, text_file, capsys):
    out = tmp_path / "static"
    out.mkdir()
    (out / "x").write_text("x")
    rc, _, err = run(["prune-static", "--model", tmp_path / NOWHERE, "-S", "0.5", "-o", out], capsys)
    one_line_error(rc, err, "prune-static", repr(str(out)), "exists and is not empty (use --overwrite")


def test_eval_default_tasks_are_the_offline_zero_shot_ones():
    from wide.cli import build_parser

    assert build_parser().parse_args(["eval"]).tasks == "zeroshot"
    if __import__("importlib").util.find_spec("lm_eval") is not None:
        from wide.eval.lm_eval import ZEROSHOT_TASKS, resolve_tasks

        assert resolve_tasks("zeroshot") == list(ZEROSHOT_TASKS) and "wide_wikitext" not in ZEROSHOT_TASKS
        assert resolve_tasks("all") == [*ZEROSHOT_TASKS, "wide_wikitext"]


def _subparser(*names):
    from wide.cli import build_parser

    p = build_parser()
    for n in names:
        p = next(a for a in p._actions if a.__class__.__name__ == "_SubParsersAction").choices[n]
    return p


@pytest.mark.parametrize("cmd,defaults", [
    ("lora", {"lora_dropout": "0.1"}),
    ("prune-static", {"ffn_group_size": "128", "seq_len": "2048", "batch_size": "4", "calib_blocks": "32"}),
    ("generate", {"max_new_tokens": "64"}),
    ("demo", {}),
])
def test_every_option_has_help(cmd, defaults):
    p = _subparser(cmd)
    missing = [a.option_strings for a in p._actions if a.option_strings and not a.help]
    assert not missing, missing
    helps = {a.dest: a.help for a in p._actions}
    for dest, default in defaults.items():
        assert f"default: {default})" in helps[dest], (dest, helps[dest])


def test_bench_e2e_help_texts():
    pytest.importorskip("wide.bench.e2e")
    helps = {a.dest: a.help for a in _subparser("bench", "e2e")._actions}
    assert "issue" not in helps["runs"] and "default: 50" in helps["runs"]
    assert "--text spec of wide calibrate" in helps["smollm2_text"] and "--data" not in helps["smollm2_text"]


def test_lora_save_silences_only_peft_missing_config_warning(tmp_path):
    pytest.importorskip("peft")
    import warnings

    from wide.config import WideConfig
    from wide.lora import attach_lora, peft_model, save_adapter
    from wide.model import WideModel
    from wide_testutil import tiny_model

    wm = WideModel(tiny_model(), WideConfig(ffn_group_size=32))
    attach_lora(wm)
    pm = peft_model(wm)
    pm.peft_config["default"].base_model_name_or_path = str(tmp_path / "gguf-package")  # no config.json there
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        pm.save_pretrained(str(tmp_path / "plain"))  # peft's own save warns ...
        assert any("Could not find a config file" in str(w.message) for w in seen)
        seen.clear()
        save_adapter(wm, tmp_path / "adapter")  # ... ours does not
        warnings.warn("another warning", UserWarning)  # and other warnings still show
    assert [str(w.message) for w in seen] == ["another warning"]
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()


def test_bench_e2e_trace_points_parse_and_reject():
    pytest.importorskip("wide.bench.e2e")
    p = _subparser("bench", "e2e")
    a = p.parse_args(["--trace-points", "prefill:1:2048,decode:4:2048", "--trace-sparsity", "0,0.5"])
    assert a.trace_points == [("prefill", 1, 2048), ("decode", 4, 2048)] and a.trace_sparsity == [0.0, 0.5]
    assert p.parse_args([]).trace_points == [("prefill", 1, 16384), ("decode", 1, 2048)]
    for bad in ("prefill:1", "train:1:2048", "decode:0:2048", "decode:x:2048", ""):
        with pytest.raises(SystemExit):
            p.parse_args(["--trace-points", bad])


@pytest.mark.parametrize("bench", ["e2e", "kernels"])
@pytest.mark.parametrize("opt,bad,msg", [
    ("--sparsity", "0.5,1.5", "sparsity 1.5 is outside [0, 1)"), ("--sparsity", "nan", "sparsity nan is outside"),
    ("--sparsity", "0.5,x", "'x' is not a number"), ("--G", "1.5", "'1.5' is not an integer"),
    ("--G", "8", "8 is below 16"), ("--G", "128,100", "group size 100 is not a power of two"),
    ("--sparsity", ",", "empty list"), ("--G", "64,,128", "'64,,128' has an empty item"),
    ("--sparsity", "0.5,", "'0.5,' has an empty item"), ("--time-budget", "-5", "-5 must be a finite number > 0"),
])
def test_bench_list_options_rejected_with_one_clear_error(bench, opt, bad, msg, capsys):
    pytest.importorskip(f"wide.bench.{bench}")
    with pytest.raises(SystemExit):
        _subparser("bench", bench).parse_args([opt, bad])
    err = capsys.readouterr().err
    assert msg in err and "_floats" not in err and "_ints" not in err, err


def test_bench_e2e_choice_and_count_options(capsys):
    pytest.importorskip("wide.bench.e2e")
    p = _subparser("bench", "e2e")
    a = p.parse_args(["--split", "uniform", "--models", "llama8b", "--trace-sparsity", "0", "--runs", "7"])
    assert a.split == ["uniform"] and a.models == ["llama8b"] and a.trace_sparsity == [0.0] and a.runs == 7
    for opt, bad, msg in (("--split", "foo", "'foo' not allowed; choose from paper, uniform"),
                          ("--models", "gpt2", "choose from llama8b, smollm2"), ("--batch", "0", "0 is below 1"),
                          ("--runs", "2", "2 is below 5"), ("--trace-sparsity", "-0.1", "outside [0, 1)"),
                          ("--max-prefill-tokens", "0", "0 is below 1"), ("--max-kv-gb", "-1", "-1 must be a finite"),
                          ("--max-kv-gb", "inf", "inf must be a finite")):
        with pytest.raises(SystemExit):
            p.parse_args([opt, bad])
        assert msg in capsys.readouterr().err


@pytest.mark.parametrize("bench", ["e2e", "kernels"])
def test_bench_report_only_missing_or_bad_file_is_one_line(bench, tmp_path, capsys):
    pytest.importorskip(f"wide.bench.{bench}")
    from wide.cli import main

    assert main(["bench", bench, "--report-only", "--out-dir", str(tmp_path / "none"), "--tag", "x"]) == 2
    err = capsys.readouterr().err
    assert "no results at" in err and "--tag" in err and "Traceback" not in err
    assert not (tmp_path / "none").exists()  # nothing created for a report of nothing
    (tmp_path / f"{bench}_y.json").write_text("{not json")
    assert main(["bench", bench, "--report-only", "--out-dir", str(tmp_path), "--tag", "y"]) == 2
    assert "is not a readable JSON file" in capsys.readouterr().err


def test_library_load_checks_the_device(monkeypatch, tmp_path):
    """``wide.load`` / ``load_base_model`` with a GPU device on a machine without one: a WideError naming it (the
    same check as the CLI's ``--device``), before any file is read."""
    import torch

    import wide
    from wide.model import load_base_model

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(WideError, match=r"device cuda: no CUDA GPU on this machine \(use device='cpu'\)"):
        load_base_model(str(tmp_path / "nowhere"), device="cuda")
    with pytest.raises(WideError, match="device 'tpu': use cpu, cuda or cuda:N"):
        load_base_model(str(tmp_path / "nowhere"), device="tpu")
    with pytest.raises(WideError, match="no CUDA GPU"):
        wide.load(tmp_path, model=str(tmp_path / "nowhere"), device=torch.device("cuda"))


def test_bench_kernels_counts_rejected(capsys):
    pytest.importorskip("wide.bench.kernels")
    p = _subparser("bench", "kernels")
    assert p.parse_args(["--tokens", "4096", "--decode-batch", "4"]).tokens == 4096
    for opt, bad, msg in (("--tokens", "-1", "-1 is below 1"), ("--decode-batch", "0", "0 is below 1"),
                          ("--M", "1,2,", "has an empty item")):
        with pytest.raises(SystemExit):
            p.parse_args([opt, bad])
        assert msg in capsys.readouterr().err


# --- third fresh-user round: training memory, eval-ppl --ctx / --max-tokens, run_quality's text paths, wide info,
# one-line usage errors ----------------------------------------------------------------------------------------
def _fake_memory(monkeypatch, available: int) -> None:
    import wide.memory as M

    monkeypatch.setattr(M, "available_memory", lambda device: (available, "MemAvailable of this machine"))


def _tiny_train_memory(model_dir):
    from wide.config import WideConfig
    from wide.memory import train_memory_of
    from wide.model import WideModel, load_base_model

    model, _, _ = load_base_model(str(model_dir), device="cpu")  # as the CLI loads it (SDPA attention)
    return train_memory_of(WideModel(model, WideConfig(ffn_group_size=32)), "cpu")


def test_calibrate_refuses_a_batch_too_large_for_memory(tmp_path, model_dir, text_file, capsys, monkeypatch):
    """Default options used to be OOM-killed without a word on a 24 GB CPU machine: now one line before the first
    step names the estimate, the memory available and a --batch-size / --grad-accum split that fits."""
    from wide.memory import GIB, HEADROOM

    mem = _tiny_train_memory(model_dir)
    avail = int(mem.estimate(3, 32, False) / HEADROOM)  # 2 sequences of 32 tokens fit, 4 do not
    _fake_memory(monkeypatch, avail)
    out = tmp_path / "o"
    args = [*calibrate_args(model_dir, text_file, out), "--batch-size", "8"]
    rc, _, err = run(args, capsys)
    error_after_loading(rc, err, "calibrate", "one micro-batch of --batch-size 8 x --seq-len 32 tokens needs about "
                        f"{mem.estimate(8, 32, False) / GIB:.1f} GiB", f"{avail / GIB:.1f} GiB is available",
                        "use --batch-size 2 --grad-accum 4 (about", "the same 8 sequences per step",
                        "--no-memory-check")
    assert not out.exists()  # refused before anything was written
    rc, _, err = run([*args, "--batch-size", "2", "--grad-accum", "4"], capsys)  # the suggestion runs
    assert rc == 0, err
    rc, _, err = run([*args, "--no-memory-check", "--overwrite"], capsys)  # and the check can be skipped
    assert rc == 0, err


def test_calibrate_names_a_too_short_text_before_the_memory_check(tmp_path, model_dir, capsys, monkeypatch):
    """A few words of --text with a batch that does not fit: the text is what to fix first, so it is named."""
    _fake_memory(monkeypatch, 2 ** 20)
    short = tmp_path / "short.txt"
    short.write_text("a few words")
    out = tmp_path / "o"
    rc, _, err = run([*calibrate_args(model_dir, short, out), "--batch-size", "8"], capsys)
    error_after_loading(rc, err, "calibrate", "text", "short.txt' has", "shorter than one sequence of 32")
    assert "needs about" not in err and not out.exists()


def test_calibrate_notes_a_text_with_fewer_sequences_than_the_batch(tmp_path, model_dir, text_file, capsys):
    from transformers import AutoTokenizer

    from wide.data import load_texts, pack

    tok = AutoTokenizer.from_pretrained(model_dir)
    n = pack(load_texts(str(text_file)), tok, 32).shape[0]  # sequences of 32 tokens in the text
    out = tmp_path / "o"
    rc, stdout, err = run([*calibrate_args(model_dir, text_file, out), "--batch-size", str(n + 1)], capsys)
    assert rc == 0, err
    assert (f"note: the text gives {n} sequences of 32 tokens, fewer than the global batch of {n + 1}: every step "
            "repeats some of them") in stdout
    rc, stdout, err = run([*calibrate_args(model_dir, text_file, tmp_path / "p"), "--batch-size", str(n)], capsys)
    assert rc == 0, err
    assert "note: the text gives" not in stdout  # a batch of every sequence repeats none


def test_demo_checks_memory_before_its_dense_evaluation(tmp_path, model_dir, text_file, capsys, monkeypatch):
    _fake_memory(monkeypatch, 2 ** 20)
    out = tmp_path / "demo"
    rc, stdout, err = run(["demo", "--model", model_dir, "--text", text_file, "-o", out, "--device", "cpu",
                           "--steps", "1", "--seq-len", "32", "--ctx", "32", "--eval-tokens", "64",
                           "--ffn-group-size", "32"], capsys)
    error_after_loading(rc, err, "demo", "--batch-size 4 x --seq-len 32 tokens needs about", "--no-memory-check")
    assert "[2/5]" not in stdout and not out.exists()


def test_prune_static_checks_memory_before_the_weights_load(tmp_path, model_dir, text_file, capsys, monkeypatch):
    """The weights and one scoring pass must fit, checked from the config (fresh user, session 21: prune-static had
    no memory check); the message names --batch-size / --seq-len, and --no-memory-check skips it."""
    _fake_memory(monkeypatch, 2 ** 20)
    out = tmp_path / "static"
    args = ["prune-static", "--model", model_dir, "--text", text_file, "-o", out, "-S", "0.5", "--device", "cpu",
            "--ffn-group-size", "16", "--calib-blocks", "2", "--seq-len", "32", "--batch-size", "2"]
    rc, stdout, err = run(args, capsys)
    one_line_error(rc, err, "prune-static", "a forward pass of 2 sequences (--batch-size) x 32 tokens (--seq-len) "
                   "needs about", "for scoring the groups", "--no-memory-check")
    assert "windows" not in err and "perplexity" not in err and not out.exists()
    rc, stdout, err = run([*args, "--no-memory-check"], capsys)
    assert rc == 0 and "overall 0.500" in stdout, err
    # the batch is sized on the sequences that exist: --batch-size 64 with 2 blocks is a batch of 2 (fresh user,
    # session 22: it was refused on 64 sequences), and the message says so when even that does not fit
    rc, _, err = run([*args[:-2], "--batch-size", "64", "-o", tmp_path / "b64"], capsys)
    one_line_error(rc, err, "prune-static", "a forward pass of all 2 sequences of the text (--batch-size 64 is "
                   "capped at the number of sequences) x 32 tokens (--seq-len)")


def test_make_demo_settings_fit_in_memory():
    """`make demo` (CPU defaults: 4 x 256 tokens on the bundled SmolLM2-135M) must pass the check on a 24 GB
    machine: its estimate fits in 8 GiB with the headroom."""
    from pathlib import Path

    from wide.cli import build_parser
    from wide.cli.common import hf_config as _hf_config
    from wide.cli.demo import demo_settings
    from wide.memory import GIB, HEADROOM, estimate_train_memory
    from wide.model import dims_of

    makefile = (Path(__file__).resolve().parents[1] / "Makefile").read_text()
    line = next(ln for ln in makefile.splitlines() if "bin/wide demo" in ln)
    argv = line.split("bin/wide ", 1)[1].split("#")[0].split()
    args = build_parser().parse_args(argv)
    seq_len = demo_settings(args, gpu=False)["seq_len"]
    try:
        _, hf = _hf_config(args.model)
    except WideError as e:
        pytest.skip(f"bundled model not installed: {e}")
    est = estimate_train_memory(dims_of(hf), hf.vocab_size, args.batch_size, seq_len,
                                grad_checkpoint=bool(getattr(args, "grad_checkpoint", False)),
                                extra_layer_values=1000, trainable_params=10**6)  # routers: a generous bound
    assert args.memory_check and est <= HEADROOM * 8 * GIB, est / GIB


@pytest.mark.parametrize("wide", [False, True])
def test_eval_ppl_ctx_longer_than_the_model_context(tmp_path, model_dir, text_file, capsys, wide, monkeypatch):
    """The tiny model's max_position_embeddings is 256: --ctx 512 fails in one line naming both, before the
    tokenizer and any weight is read (no loading progress on stderr)."""
    import transformers

    args = ["eval-ppl", "--model", model_dir, "--text", text_file, "--ctx", "512", "--device", "cpu"]
    if wide:
        ckpt = tmp_path / "ckpt"
        rc, _, err = run(calibrate_args(model_dir, text_file, ckpt), capsys)
        assert rc == 0, err
        args += ["--wide", ckpt]

    def not_yet(*a, **k):
        raise AssertionError("the tokenizer or the weights were read before the --ctx check")

    with monkeypatch.context() as m:
        m.setattr(transformers.AutoTokenizer, "from_pretrained", not_yet)
        m.setattr(transformers.AutoModelForCausalLM, "from_pretrained", not_yet)
        rc, _, err = run(args, capsys)
    one_line_error(rc, err, "eval-ppl", "--ctx 512 is longer than the model's context of 256 tokens",
                   "max_position_embeddings", "use --ctx 256 or less")
    rc, stdout, err = run([*args[:-4], "--ctx", "256", "--device", "cpu"], capsys)  # the limit itself is fine
    assert rc == 0, err
    assert "windows of 256 tokens" in stdout


@pytest.mark.parametrize("ctx,max_tokens,line,tokens", [
    (64, 100, "1 window of 64 tokens (64 tokens)", 63),  # at most --max-tokens: 64 of the first 100
    (64, 200, "3 windows of 64 tokens (192 tokens)", 189),
    (256, 40, "1 window of 40 tokens (40 tokens; --max-tokens 40 is below --ctx 256)", 39),  # not a full window
    (256, None, "4 windows of 256 tokens (1,024 tokens)", 1020),
])
def test_eval_ppl_max_tokens_is_an_upper_bound(tmp_path, model_dir, text_file, capsys, ctx, max_tokens, line, tokens):
    target = tmp_path / "r.json"
    args = ["eval-ppl", "--model", model_dir, "--text", text_file, "--ctx", ctx, "--device", "cpu", "--json", target]
    rc, stdout, err = run([*args, *([] if max_tokens is None else ["--max-tokens", max_tokens])], capsys)
    assert rc == 0, err
    assert line in stdout.splitlines()
    r = json.loads(target.read_text())["dense"]
    assert r["tokens"] == tokens and r["ctx"] == min(ctx, max_tokens or ctx)  # tokens predicted: width - 1 each


def test_run_quality_checks_text_paths_before_loading(tmp_path, monkeypatch):
    """benchmarks/quality/run_quality.py used to read --calib / --wikitext only after loading the model: one
    error now names every missing path, before anything loads."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "quality" / "run_quality.py"
    spec = importlib.util.spec_from_file_location("run_quality_under_test", path)
    rq = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rq)

    def no_loading(*a, **k):
        raise AssertionError("the model loaded before the text paths were checked")

    monkeypatch.setattr(rq, "load_base_model", no_loading)
    calib, wiki = tmp_path / "calib.jsonl", tmp_path / "wiki.test.raw"
    base = ["run_quality.py", "--out", str(tmp_path / "out"), "--runs", str(tmp_path / "runs")]
    monkeypatch.setattr(sys, "argv", [*base, "--calib", str(calib), "--wikitext", str(wiki)])
    with pytest.raises(WideError) as e:
        rq.main()
    assert f"--calib {str(calib)!r} and --wikitext {str(wiki)!r} not found" in str(e.value)
    calib.write_text(json.dumps({"text": "w1 w2"}) + "\n")
    with pytest.raises(WideError, match=f"^--wikitext {str(wiki)!r} not found"):
        rq.main()
    assert not (tmp_path / "out").exists() and not (tmp_path / "runs").exists()


def test_info_help_shows_only_its_options(capsys):
    with pytest.raises(SystemExit) as e:
        main(["info", "--help"])
    assert e.value.code == 0
    import re

    out = capsys.readouterr().out
    shown = set(re.findall(r"(?<![\w-])--[a-z][\w-]*", out))
    assert shown == {"--help", "--model", "--attn-group-size", "--ffn-group-size", "--rank", "--routed", "--method",
                     "--skipgpt-rank"}, shown  # no --sparsity, --alpha, --tau-*, --mode, --device


def test_info_points_to_a_real_next_step(model_dir, capsys):
    import torch

    from wide.cli import build_parser

    rc, _, err = run(["info", "--model", model_dir, "--ffn-group-size", "48"], capsys)
    one_line_error(rc, err, "info", "FFN group size G=48 must be a power of two >= 16",
                   "intermediate size 128", "--ffn-group-size with one of [16, 32, 64, 128]")
    assert "wide info" not in err.split(": error: ", 1)[1]  # the old hint sent the user back to wide info
    rc, out, err = run(["info", "--model", model_dir, "--ffn-group-size", "32"], capsys)
    assert rc == 0, err
    assert "max context        256" in out
    nxt = next(ln for ln in out.splitlines() if ln.startswith("next step"))
    cmd = nxt.split("next step", 1)[1].split("(")[0].split()
    assert cmd[:2] == ["wide", "calibrate"] and "--ffn-group-size" in cmd
    parsed = build_parser().parse_args(cmd[1:])  # a command that parses
    if not torch.cuda.is_available():  # sized to finish on a CPU, as the demo is there
        assert (parsed.steps, parsed.batch_size, parsed.seq_len) == (80, 4, 256) and "no GPU here" in nxt, nxt
    with pytest.raises(SystemExit) as e:  # a training option: a usage error now
        main(["info", "--model", str(model_dir), "--sparsity", "0.5"])
    one_line_error(e.value.code, capsys.readouterr().err, "info", "unrecognized arguments: --sparsity 0.5",
                   "(see wide info --help)")


@pytest.mark.parametrize("argv,prog,msg", [
    (["calibrate", "-o", "x", "--steps", "x"], "wide calibrate", "argument --steps: invalid int value: 'x'"),
    (["calibrate"], "wide calibrate", "the following arguments are required: --output/-o"),
    (["eval-ppl", "--ctx"], "wide eval-ppl", "argument --ctx: expected one argument"),
    (["info", "--bogus"], "wide info", "unrecognized arguments: --bogus"),
    (["eval-ppl", "--sparsity", "0.5"], "wide eval-ppl", "unrecognized arguments: --sparsity 0.5"),
    (["demo", "--mode", "x"], "wide demo", "argument --mode: invalid choice: 'x'"),
    (["generate", "--prompt", "hi", "--bogus"], "wide generate", "unrecognized arguments: --bogus"),
    (["bench", "kernels", "--bogus"], "wide bench kernels", "unrecognized arguments: --bogus"),
    (["nosuch"], "wide", "argument command: invalid choice: 'nosuch'"),
    (["eval-ppl", "--mode", "global"], "wide eval-ppl", "unrecognized arguments: --mode global"),  # not --model
    ([], "wide", "the following arguments are required: command"),
    (["bench"], "wide bench", "the following arguments are required: {kernels,e2e}"),  # names the choices
])
def test_usage_errors_are_one_line(capsys, argv, prog, msg):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "usage:" not in err and not out, err
    assert lines[0].startswith(f"{prog}: error: {msg}") and lines[0].endswith(f" (see {prog} --help)"), lines[0]


def test_seq_len_longer_than_the_model_context(tmp_path, model_dir, text_file, capsys, monkeypatch):
    """calibrate and lora: --seq-len 512 on the tiny model (max_position_embeddings 256) fails in one line before
    any weight is read, and nothing is written."""
    import transformers

    ckpt = tmp_path / "ckpt"
    rc, _, err = run(calibrate_args(model_dir, text_file, ckpt), capsys)
    assert rc == 0, err

    def no_weights(*a, **k):
        raise AssertionError("weights were read before the --seq-len check")

    def no_tokenizer(*a, **k):  # a GGUF tokenizer takes seconds to build: the check runs on the config alone
        raise AssertionError("the tokenizer was loaded before the --seq-len check")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_weights)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", no_tokenizer)
    out = tmp_path / "long"
    args = calibrate_args(model_dir, text_file, out)
    args[args.index("--seq-len") + 1] = "512"
    rc, _, err = run(args, capsys)
    one_line_error(rc, err, "calibrate", "--seq-len 512 is longer than the model's context of 256 tokens",
                   "use --seq-len 256 or less")
    rc, _, err = run(["lora", "--wide", ckpt, "--model", model_dir, "--text", text_file, "-o", out, "--steps", "1",
                      "--batch-size", "1", "--seq-len", "512", "--device", "cpu"], capsys)
    one_line_error(rc, err, "lora", "--seq-len 512 is longer than the model's context of 256 tokens")
    assert not out.exists() or not any(out.iterdir())
