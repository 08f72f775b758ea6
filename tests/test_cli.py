"""The CLI end to end on a tiny local checkpoint, and every bad input: one line, exit 2, nothing written."""

import json

import pytest

from wide.cli import main


def run(args, capsys):
    rc = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


def test_info(model_dir, capsys):
    rc, out, _ = run(["info", "--model", model_dir, "--ffn-group-size", "32"], capsys)
    assert rc == 0
    assert "layers             2" in out and "head_dim           16" in out
    assert "legal FFN G        [16, 32, 64, 128]" in out and "router params" in out


def test_calibrate_then_eval(tmp_path, model_dir, text_file, capsys):
    out_dir = tmp_path / "ckpt"
    rc, out, err = run(["calibrate", "--model", model_dir, "--text", text_file, "-o", out_dir, "--steps", "3",
                        "--batch-size", "2", "--seq-len", "32", "--ffn-group-size", "32", "--device", "cpu"], capsys)
    assert rc == 0, err
    assert (out_dir / "routers.safetensors").is_file() and (out_dir / "wide_config.json").is_file()
    res = tmp_path / "res.json"
    rc, out, err = run(["eval-ppl", "--wide", out_dir, "--model", model_dir, "--text", text_file, "--ctx", "64",
                        "--layers", "--json", res, "--device", "cpu"], capsys)
    assert rc == 0, err
    r = json.loads(res.read_text())
    assert r["dense"]["ppl"] > 1 and r["wide"]["ppl"] > 1
    assert 0 <= r["wide"]["realized_sparsity"] <= 1 and len(r["wide"]["per_layer"]) == 2
    assert "ppl ratio wide/dense" in out and "layer  attn_sparsity" in out
    # resume after completion is a no-op that still succeeds
    rc, _, err = run(["calibrate", "--model", model_dir, "--text", text_file, "-o", out_dir, "--steps", "3",
                      "--batch-size", "2", "--seq-len", "32", "--ffn-group-size", "32", "--device", "cpu", "--resume"], capsys)
    assert rc == 0, err


BAD = [
    (["--model", "/does/not/exist"], "model '/does/not/exist' not found"),
    (["-S", "1.5"], "S=1.5 is outside [0, 1)"),
    (["-S", "-0.1"], "S=-0.1 is outside [0, 1)"),
    (["--alpha", "-1"], "alpha=-1.0 must be >= 0"),
    (["--ffn-group-size", "48"], "FFN group size G=48 must be a power of two"),
    (["--ffn-group-size", "256"], "G=256 does not divide the intermediate size 128"),
    (["--attn-group-size", "24"], "G=24 must be a multiple of head_dim=16"),
    (["--text", "EMPTY"], "is empty"),
    (["--text", "SHORT"], "short.txt' has 4 tokens (with an end-of-text token after each document), "
                          "shorter than one sequence of 32"),  # names the file
    (["--text", "/no/such/file.txt"], "text '/no/such/file.txt' not found"),
    (["--resume"], "--resume: no train_state.pt"),
    (["-o", "AFILE"], "is a file; give a directory"),
    (["-o", ""], "-o '' is empty; give a directory"),  # once wrote into the current directory
]


@pytest.mark.parametrize("extra,msg", BAD, ids=[m for _, m in BAD])
def test_bad_input_calibrate(tmp_path, model_dir, text_file, capsys, extra, msg):
    (tmp_path / "empty.txt").write_text("\n")
    (tmp_path / "short.txt").write_text("w1 w2 w3")
    (tmp_path / "afile").write_text("not a directory\n")
    extra = [{"EMPTY": tmp_path / "empty.txt", "SHORT": tmp_path / "short.txt", "AFILE": tmp_path / "afile"}.get(a, a)
             for a in extra]
    args = ["calibrate", "--model", model_dir, "--text", text_file, "-o", tmp_path / "out", "--steps", "1",
            "--seq-len", "32", "--ffn-group-size", "32", "--device", "cpu", *extra]
    rc, out, err = run(args, capsys)
    assert rc == 2
    assert msg in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_unsupported_architecture(tmp_path, capsys):
    from transformers import GPT2Config, GPT2LMHeadModel

    d = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50)).save_pretrained(d)
    rc, _, err = run(["info", "--model", d], capsys)
    assert rc == 2 and "unsupported architecture GPT2LMHeadModel" in err


def test_eval_bad_checkpoints(tmp_path, model_dir, text_file, capsys):
    rc, _, err = run(["eval-ppl", "--wide", tmp_path / "none", "--model", model_dir, "--text", text_file], capsys)
    assert rc == 2 and "not found" in err
    d = tmp_path / "ckpt"
    run(["calibrate", "--model", model_dir, "--text", text_file, "-o", d, "--steps", "1", "--batch-size", "1",
         "--seq-len", "32", "--ffn-group-size", "32", "--device", "cpu"], capsys)
    (d / "routers.safetensors").write_bytes(b"junk")
    rc, _, err = run(["eval-ppl", "--wide", d, "--model", model_dir, "--text", text_file, "--json", tmp_path / "r.json"], capsys)
    assert rc == 2 and "corrupt checkpoint file" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "r.json").exists()


def test_help_for_every_subcommand(capsys):
    for cmd in ["info", "calibrate", "eval-ppl", "demo"]:
        with pytest.raises(SystemExit) as e:
            main([cmd, "--help"])
        assert e.value.code == 0
        assert "usage: wide " + cmd in capsys.readouterr().out


def _one_line_error(rc, err, cmd, msg):
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"wide {cmd}: error: ") and msg in lines[0], lines[0]


@pytest.mark.parametrize("extra,msg", [
    (["--attn-group-size", "0"], "attention group size G=0 must be a positive multiple of head_dim"),
    (["--attn-group-size", "-64"], "attention group size G=-64 must be a positive multiple of head_dim"),
    (["--ffn-group-size", "0"], "FFN group size G=0 must be a power of two >= 16"),
    (["--ffn-group-size", "-32"], "FFN group size G=-32 must be a power of two >= 16"),
])
def test_info_non_positive_group_size(model_dir, capsys, extra, msg):
    rc, _, err = run(["info", "--model", model_dir, *extra], capsys)
    _one_line_error(rc, err, "info", msg)


@pytest.mark.parametrize("field,value,words", [
    ("ffn_group_size", "abc", "an integer"), ("ffn_group_size", 32.0, "an integer"),
    ("target_sparsity", "0.5", "a number"), ("router_rank", None, "an integer"),
])
def test_eval_ppl_config_of_wrong_type(tmp_path, model_dir, text_file, capsys, field, value, words):
    """A checkpoint whose wide_config.json holds a wrong type: one line naming field, value and type."""
    d = tmp_path / "ckpt"
    rc, _, err = run(["calibrate", "--model", model_dir, "--text", text_file, "-o", d, "--steps", "1", "--batch-size",
                      "1", "--seq-len", "32", "--ffn-group-size", "32", "--device", "cpu"], capsys)
    assert rc == 0, err
    cfg = json.loads((d / "wide_config.json").read_text())
    (d / "wide_config.json").write_text(json.dumps({**cfg, field: value}))
    res = tmp_path / "r.json"
    rc, _, err = run(["eval-ppl", "--wide", d, "--model", model_dir, "--text", text_file, "--json", res], capsys)
    _one_line_error(rc, err, "eval-ppl", f"{field}={value!r}")
    assert "wide_config.json" in err and f"must be {words}" in err
    assert not res.exists()


# Bad counts fail before the model loads: with --model pointing nowhere, the message is still about the count.
EARLY = [
    ("eval-ppl", ["--batch-size", "0"], "--batch-size 0 must be >= 1"),
    ("eval-ppl", ["--batch-size", "-2"], "--batch-size -2 must be >= 1"),
    ("eval-ppl", ["--max-tokens", "0"], "--max-tokens 0 must be >= 2"),
    ("eval-ppl", ["--max-tokens", "-5"], "--max-tokens -5 must be >= 2"),
    ("eval-ppl", ["--max-tokens", "1"], "--max-tokens 1 must be >= 2"),  # a window needs 2 tokens
    ("eval-ppl", ["--ctx", "0"], "--ctx 0 must be >= 2"),
    ("eval-ppl", ["--ctx", "-1"], "--ctx -1 must be >= 2"),
    ("calibrate", ["-o", "OUT", "--max-blocks", "0", "--seq-len", "64"], "--max-blocks 0 must be >= 1"),
    ("calibrate", ["-o", "OUT", "--max-blocks", "-1"], "--max-blocks -1 must be >= 1"),
    ("calibrate", ["-o", "OUT", "--seq-len", "1"], "--seq-len 1 must be >= 2"),
    ("demo", ["-o", "OUT", "--steps", "0"], "--steps 0 must be >= 1"),
    ("demo", ["-o", "OUT", "--steps", "-3"], "--steps -3 must be >= 1"),
    ("demo", ["-o", "OUT", "--seq-len", "0"], "--seq-len 0 must be >= 2"),
    ("demo", ["-o", "OUT", "--ctx", "0"], "--ctx 0 must be >= 2"),
    ("demo", ["-o", "OUT", "--eval-tokens", "0"], "--eval-tokens 0 must be >= 2"),
    ("demo", ["-o", "OUT", "--eval-tokens", "1"], "--eval-tokens 1 must be >= 2"),
]


@pytest.mark.parametrize("cmd,extra,msg", EARLY, ids=[f"{c} {' '.join(e)}" for c, e, _ in EARLY])
def test_bad_counts_fail_before_loading(tmp_path, text_file, capsys, cmd, extra, msg):
    out = tmp_path / "out"
    extra = [out if a == "OUT" else a for a in extra]
    rc, _, err = run([cmd, "--model", tmp_path / "no-model", "--text", text_file, "--device", "cpu", *extra], capsys)
    _one_line_error(rc, err, cmd, msg)
    assert not out.exists()


def test_demo_help_and_auto_defaults(capsys):
    """Every `wide demo` option has help; --steps / --seq-len default to None and the help says 'auto'."""
    import argparse

    from wide.cli import build_parser

    p = build_parser()
    sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
    demo = sub.choices["demo"]
    missing = [a.option_strings[0] for a in demo._actions if a.option_strings and not a.help]
    assert missing == []
    args = demo.parse_args([])
    assert args.steps is None and args.seq_len is None
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "default: auto, 80 on CPU, 300 on GPU" in out and "default: auto, 256 on CPU, 2048 on GPU" in out
    # the other commands keep their fixed defaults
    cal = sub.choices["calibrate"].parse_args(["-o", "x"])
    assert cal.steps == 500 and cal.seq_len == 2048


@pytest.mark.parametrize("bench", ["kernels", "e2e"])
def test_bench_without_gpu_same_error_format(tmp_path, capsys, bench):
    import torch

    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    out = tmp_path / "bench"
    rc, _, err = run(["bench", bench, "--out-dir", out], capsys)
    _one_line_error(rc, err, "bench", f"wide bench {bench} times GPU code and needs a CUDA GPU")
    assert not out.exists()


@pytest.mark.parametrize("module,cmd", [("lm_eval", ["eval", "--tasks", "wide_boolq"]), ("lm_eval", ["lm-eval"]),
                                        ("peft", ["lora", "-o", "LORA"])])
def test_missing_quality_extra_is_one_line(tmp_path, model_dir, text_file, capsys, monkeypatch, module, cmd):
    # `make demo` installs only the core package: these commands name the missing package and the extra
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == module else real(name, *a))
    args = [str(tmp_path / "lora") if a == "LORA" else a for a in cmd]
    if cmd[0] in ("eval", "lora"):
        args += ["--wide", str(tmp_path / "ckpt"), "--model", model_dir]
    if cmd[0] == "lora":
        args += ["--text", text_file, "--device", "cpu"]
    rc, _, err = run(args, capsys)
    assert rc == 2, err
    assert f"needs the '{module}' package" in err and "wide[quality]" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "lora").exists()


def test_interrupted_training_says_how_to_resume(tmp_path, model_dir, text_file, capsys, monkeypatch):
    import wide.cli as cli

    def stop(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli.train, "cmd_calibrate", stop)
    argv = ["calibrate", "--model", model_dir, "--text", text_file, "-o", tmp_path / "o", "--save-every", "5"]
    rc, _, err = run(argv, capsys)
    assert rc == 130  # no state saved yet: --resume would fail, so it is not offered
    assert err.strip() == ("wide calibrate: interrupted; nothing was saved yet (the first save is at step 5), so "
                           "there is nothing to resume")
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "train_state.pt").write_bytes(b"")
    rc, _, err = run(argv, capsys)
    assert rc == 130
    assert err.strip() == (f"wide calibrate: interrupted; the last state saved (every --save-every 5 steps) is in "
                           f"{str(tmp_path / 'o')!r}: add --resume to continue from it")
