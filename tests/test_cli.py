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
    (["--text", "SHORT"], "shorter than one sequence of 32"),
    (["--text", "/no/such/file.txt"], "text '/no/such/file.txt' not found"),
    (["--resume"], "--resume: no train_state.pt"),
]


@pytest.mark.parametrize("extra,msg", BAD, ids=[m for _, m in BAD])
def test_bad_input_calibrate(tmp_path, model_dir, text_file, capsys, extra, msg):
    (tmp_path / "empty.txt").write_text("\n")
    (tmp_path / "short.txt").write_text("w1 w2 w3")
    extra = [{"EMPTY": tmp_path / "empty.txt", "SHORT": tmp_path / "short.txt"}.get(a, a) for a in extra]
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
