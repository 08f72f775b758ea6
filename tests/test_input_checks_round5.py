"""Round-5 input checks: malformed config.json, no legal FFN group size, missing tokenizer files, the legal FFN
sizes in calibrate's error, prune-static's option order, eval-ppl's capped batch and the pre-load training memory
check with a sane suggestion."""

from __future__ import annotations

import json

import pytest

from wide_testutil import one_line_error, tiny_llama_config
from wide_testutil import run_cli as run


def _refuse_weights(monkeypatch):
    import transformers

    def refuse(*a, **k):
        raise AssertionError("base-model weights were read before the check")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)


def _edit_config(model_dir, **fields):
    path = model_dir / "config.json"
    cfg = json.loads(path.read_text())
    cfg.update(fields)
    path.write_text(json.dumps(cfg))
    return path


def test_config_that_is_not_an_object(model_dir, capsys):
    (model_dir / "config.json").write_text("[]")
    rc, _, err = run(["info", "--model", model_dir], capsys)
    one_line_error(rc, err, "info", str(model_dir / "config.json"), "must be a JSON object", "not list")


@pytest.mark.parametrize("fields, words", [
    ({"num_attention_heads": 0}, ["num_attention_heads=0 must be a positive integer"]),
    ({"hidden_size": "64"}, ["hidden_size='64' must be a positive integer"]),
    ({"num_hidden_layers": -1}, ["num_hidden_layers=-1 must be a positive integer"]),
    ({"head_dim": None, "num_attention_heads": 3}, ["hidden_size=64 is not a multiple of num_attention_heads=3"]),
    ({"num_key_value_heads": 3}, ["num_attention_heads=4 is not a multiple of num_key_value_heads=3"]),
])
def test_config_dims_are_checked_before_transformers(model_dir, text_file, tmp_path, capsys, monkeypatch, fields,
                                                     words):
    path = _edit_config(model_dir, **fields)
    rc, _, err = run(["info", "--model", model_dir], capsys)
    one_line_error(rc, err, "info", str(path), *words)
    _refuse_weights(monkeypatch)
    rc, _, err = run(["calibrate", "--model", model_dir, "--text", text_file, "-o", tmp_path / "o", "--steps", "1",
                      "--seq-len", "16", "--device", "cpu"], capsys)
    one_line_error(rc, err, "calibrate", str(path), *words)


def test_no_legal_ffn_group_size(tmp_path, capsys):
    d = tmp_path / "odd"
    tiny_llama_config(intermediate_size=100).save_pretrained(d)
    rc, _, err = run(["info", "--model", d], capsys)
    one_line_error(rc, err, "info", "no legal FFN group size divides intermediate_size=100",
                   "powers of two >= 16", "use a model whose intermediate size is a multiple of 16")
    assert "one of []" not in err


def test_missing_tokenizer_files(tmp_path, capsys):
    from wide_testutil import tiny_model

    d = tmp_path / "stk"
    tiny_model().save_pretrained(d)
    (tmp_path / "t.txt").write_text("w1 w2 " * 200)
    capsys.readouterr()  # the save's progress bar
    rc, _, err = run(["eval-ppl", "--model", d, "--text", tmp_path / "t.txt", "--ctx", "16", "--device", "cpu"],
                     capsys)
    one_line_error(rc, err, "eval-ppl", f"model folder {str(d)!r} has no tokenizer files", "tokenizer.json",
                   "tokenizer.model", "vocab.json")


def test_calibrate_bad_ffn_group_size_lists_the_legal_ones(model_dir, text_file, tmp_path, capsys, monkeypatch):
    _refuse_weights(monkeypatch)
    rc, _, err = run(["calibrate", "--model", model_dir, "--text", text_file, "-o", tmp_path / "o",
                      "--ffn-group-size", "100", "--device", "cpu"], capsys)
    one_line_error(rc, err, "calibrate", "FFN group size G=100", "pass --ffn-group-size with one of [16, 32, 64, 128]")


def test_prune_static_checks_options_before_the_output(model_dir, text_file, tmp_path, capsys):
    out = tmp_path / "p"
    out.mkdir()
    (out / "x").write_text("old")
    rc, _, err = run(["prune-static", "--model", model_dir, "-S", "0.5", "-o", out, "--text", text_file,
                      "--calib-blocks", "0", "--device", "cpu"], capsys)
    one_line_error(rc, err, "prune-static", "--calib-blocks 0 must be >= 1")


def test_eval_ppl_memory_error_says_the_batch_is_capped(model_dir, text_file, capsys, monkeypatch):
    import wide.memory as M

    monkeypatch.setattr(M, "available_memory", lambda device: (1, "MemAvailable of this machine"))
    rc, _, err = run(["eval-ppl", "--model", model_dir, "--text", text_file, "--ctx", "32", "--batch-size", "1000",
                      "--device", "cpu"], capsys)
    one_line_error(rc, err, "eval-ppl", "a forward pass of all ", "(--batch-size 1000 is capped at the number of "
                   "windows) x 32 tokens")
    assert "windows (--batch-size)" not in err


def test_calibrate_huge_batch_fails_before_loading_with_a_sane_suggestion(model_dir, text_file, tmp_path, capsys,
                                                                          monkeypatch):
    import wide.memory as M

    mem = M.train_memory_from_config(tiny_llama_config(), __import__("wide").WideConfig(ffn_group_size=32), "cpu")
    avail = int(mem.estimate(4, 16, False) / M.HEADROOM) + 1  # 4 sequences of 16 tokens fit
    monkeypatch.setattr(M, "available_memory", lambda device: (avail, "MemAvailable of this machine"))
    _refuse_weights(monkeypatch)
    base = ["calibrate", "--model", model_dir, "--text", text_file, "-o", tmp_path / "o", "--ffn-group-size", "32",
            "--seq-len", "16", "--device", "cpu"]
    rc, _, err = run([*base, "--batch-size", "100000000"], capsys)
    one_line_error(rc, err, "calibrate", "--batch-size 100000000", "use --batch-size ",
                   "micro-batches, so choose --grad-accum")
    assert "--grad-accum 25000000" not in err and "--grad-accum 50000000" not in err
    rc, _, err = run([*base, "--batch-size", "8"], capsys)  # a sane split keeps the step's sequences
    one_line_error(rc, err, "calibrate", "use --batch-size 4 --grad-accum 2", "the same 8 sequences per step")
    monkeypatch.setattr(M, "available_memory", lambda device: (int(mem.estimate(1, 4, True) / M.HEADROOM) + 1, "x"))
    rc, _, err = run([*base, "--batch-size", "2"], capsys)
    one_line_error(rc, err, "calibrate", "even --batch-size 1 does not fit at --seq-len 16", "--seq-len ")
