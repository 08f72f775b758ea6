"""The CLI end to end on a tiny local checkpoint: what each command prints and writes, --resume / --overwrite,
help texts, warnings and interrupts. Every refusal of bad input is in test_cli_bad_input.py."""

import argparse
import json
import re
from pathlib import Path

import pytest
import torch

from wide.cli import build_parser, main
from wide_testutil import calibrate_args, tiny_llama_config
from wide_testutil import run_cli as run

MAKEFILE = Path(__file__).resolve().parents[1] / "Makefile"


@pytest.mark.parametrize("per_layer,flags,count", [
    ([{"layer": 0, "attn": 0.0, "ffn": 0.3}, {"layer": 1, "attn": 1.0, "ffn": None}],
     ["  attn never pruned", "  attn pruned away"], "pruned away (>= 0.99): 1; never pruned (<= 0.01): 1"),
    ([{"layer": 0, "attn": 0.5, "ffn": 0.995}, {"layer": 1, "attn": 0.011, "ffn": 0.989}],
     ["  ffn pruned away", ""], "pruned away (>= 0.99): 1; never pruned (<= 0.01): 0"),
])
def test_layer_table_flags(per_layer, flags, count):
    """Modules at >= 0.99 / <= 0.01 sparsity are flagged on their row and counted on the last line."""
    from wide.eval.perplexity import format_layer_table

    lines = format_layer_table({"per_layer": per_layer}).splitlines()
    assert [line[len("    0          0.000         0.300"):] for line in lines[1:-1]] == flags
    assert lines[-1] == f"modules {count}"


def _subparser(*names):
    p = build_parser()
    for n in names:
        p = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction)).choices[n]
    return p


def _fake_memory(monkeypatch, available: int) -> None:
    import wide.memory as M

    monkeypatch.setattr(M, "available_memory", lambda device: (available, "MemAvailable of this machine"))


# --- info ----------------------------------------------------------------------------------------------------------
def test_info(model_dir, capsys):
    rc, out, err = run(["info", "--model", model_dir, "--ffn-group-size", "32"], capsys)
    assert rc == 0, err
    assert "layers             2" in out and "head_dim           16" in out and "max context        256" in out
    assert "legal FFN G        [16, 32, 64, 128]" in out and "router params" in out
    nxt = next(ln for ln in out.splitlines() if ln.startswith("next step"))
    cmd = nxt.split("next step", 1)[1].split("(")[0].split()
    assert cmd[:2] == ["wide", "calibrate"] and "--ffn-group-size" in cmd
    parsed = build_parser().parse_args(cmd[1:])  # a command that parses
    if not torch.cuda.is_available():  # sized to finish on a CPU, as the demo is there
        assert (parsed.steps, parsed.batch_size, parsed.seq_len) == (80, 4, 256) and "no GPU here" in nxt, nxt


def test_info_help_shows_only_its_options(capsys):
    with pytest.raises(SystemExit) as e:
        main(["info", "--help"])
    assert e.value.code == 0
    shown = set(re.findall(r"(?<![\w-])--[a-z][\w-]*", capsys.readouterr().out))
    assert shown == {"--help", "--model", "--attn-group-size", "--ffn-group-size", "--rank", "--routed", "--method",
                     "--skipgpt-rank"}, shown  # no --sparsity, --alpha, --tau-*, --mode, --device


# --- calibrate, eval-ppl, --resume, --overwrite ------------------------------------------------------------------
def test_calibrate_then_eval(tmp_path, model_dir, text_file, capsys):
    out_dir = tmp_path / "ckpt"
    args = calibrate_args(model_dir, text_file, out_dir, "--steps", "3", "--batch-size", "2")
    rc, out, err = run(args, capsys)
    assert rc == 0, err
    assert (out_dir / "routers.safetensors").is_file() and (out_dir / "wide_config.json").is_file()
    assert re.search(r"^done in \d+s: lm_loss [\d.]+, attn sparsity [\d.]+, ffn sparsity [\d.]+$", out, re.M), out
    res = tmp_path / "new" / "sub" / "res.json"  # its folders are made
    rc, out, err = run(["eval-ppl", "--wide", out_dir, "--model", model_dir, "--text", text_file, "--ctx", "64",
                        "--layers", "--json", res, "--device", "cpu"], capsys)
    assert rc == 0, err
    r = json.loads(res.read_text())
    assert r["dense"]["ppl"] > 1 and r["wide"]["ppl"] > 1
    assert 0 <= r["wide"]["realized_sparsity"] <= 1 and len(r["wide"]["per_layer"]) == 2
    assert "ppl ratio wide/dense" in out and "layer  attn_sparsity" in out
    values = [x for row in r["wide"]["per_layer"] for x in (row["attn"], row["ffn"]) if x is not None]
    assert (f"modules pruned away (>= 0.99): {sum(x >= 0.99 for x in values)}; never pruned (<= 0.01): "
            f"{sum(x <= 0.01 for x in values)}") in out.splitlines()
    rc, out, err = run([*args, "--resume"], capsys)  # a finished run: --resume says so and rewrites nothing
    assert rc == 0, err
    assert (f"the run in {out_dir} is already complete: step 3 of 3 done (state in {out_dir / 'train_state.dcp'}); "
            f"nothing to train") in out.splitlines()


def test_overwrite_starts_a_new_run(tmp_path, model_dir, text_file, capsys):
    out = tmp_path / "run"
    out.mkdir()  # an existing empty directory is fine
    assert run(calibrate_args(model_dir, text_file, out), capsys)[0] == 0
    before = (out / "routers.safetensors").read_bytes()
    rc, _, err = run(calibrate_args(model_dir, text_file, out, "--seed", "1", "--overwrite"), capsys)
    assert rc == 0, err
    assert (out / "routers.safetensors").read_bytes() != before  # a new run (other seed)
    assert [json.loads(ln)["step"] for ln in (out / "train_log.jsonl").read_text().splitlines()] == [1]
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no temporary files left behind


def test_lora_overwrite_keeps_other_files(tmp_path, model_dir, text_file, capsys):
    pytest.importorskip("peft")
    s1 = tmp_path / "s1"
    assert run(calibrate_args(model_dir, text_file, s1), capsys)[0] == 0
    out = tmp_path / "s2"
    out.mkdir()
    (out / "notes.txt").write_text("someone else's file\n")
    rc, _, err = run(["lora", "--model", model_dir, "--text", text_file, "--wide", s1, "-o", out, "--steps", "1",
                      "--batch-size", "1", "--seq-len", "32", "--device", "cpu", "--overwrite"], capsys)
    assert rc == 0, err
    assert (out / "adapter").is_dir() and (out / "notes.txt").is_file()


def test_calibrate_notes_a_text_with_fewer_sequences_than_the_batch(tmp_path, model_dir, text_file, capsys):
    from transformers import AutoTokenizer

    from wide.data import load_texts, pack

    n = pack(load_texts(str(text_file)), AutoTokenizer.from_pretrained(model_dir), 32).shape[0]
    rc, stdout, err = run([*calibrate_args(model_dir, text_file, tmp_path / "o"), "--batch-size", str(n + 1)], capsys)
    assert rc == 0, err
    assert (f"note: the text gives {n} sequences of 32 tokens, fewer than the global batch of {n + 1}: every step "
            "repeats some of them") in stdout
    rc, stdout, err = run([*calibrate_args(model_dir, text_file, tmp_path / "p"), "--batch-size", str(n)], capsys)
    assert rc == 0 and "note: the text gives" not in stdout, err  # a batch of every sequence repeats none


def test_what_the_logit_shift_is_fitted_on_is_said_one_way(tmp_path, model_dir, text_file, capsys):
    """A one-document text holds nothing out: the note says so after the checks, and the calibration line names
    the training text, not held-out tokens; a .jsonl of many documents holds a tenth out and says so."""
    from wide.calibrate import heldout_split
    from wide.cli.train import ONE_DOCUMENT

    rc, stdout, err = run(calibrate_args(model_dir, text_file, tmp_path / "one"), capsys)
    assert rc == 0, err
    lines = stdout.splitlines()
    assert ONE_DOCUMENT in lines and lines.index(ONE_DOCUMENT) > 0, stdout  # after "calibrating ...", not first
    fit = [ln for ln in lines if ln.startswith("calibrated routing to S=0.5")]
    assert len(fit) == 1 and " tokens of the training text (one document: nothing held out)" in fit[0], stdout
    assert "held-out tokens" not in stdout
    rec = json.loads((tmp_path / "one" / "calibration.json").read_text())
    assert rec["heldout"]["held_out"] is False
    docs = [" ".join(f"w{(7 * i + j) % 120}" for j in range(60)) for i in range(30)]
    n_held = len(heldout_split(docs)[1])
    assert 0 < n_held < len(docs)
    jsonl = tmp_path / "docs.JSONL"  # JSON lines in any case of the suffix
    jsonl.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    rc, stdout, err = run(calibrate_args(model_dir, jsonl, tmp_path / "many"), capsys)
    assert rc == 0, err
    assert "note: the text is one document" not in stdout
    rec = json.loads((tmp_path / "many" / "calibration.json").read_text())
    # the held-out documents, 60 words each, in windows of --seq-len 32
    assert rec["heldout"]["held_out"] is True and rec["heldout"]["tokens"] == 60 * n_held // 32 * 32
    assert f"on {rec['heldout']['tokens']:,} held-out tokens" in stdout, stdout


def test_memory_suggestion_runs_and_the_check_can_be_skipped(tmp_path, model_dir, text_file, capsys, monkeypatch):
    """The split the memory refusal suggests (test_cli_bad_input) fits; --no-memory-check skips the check."""
    from wide.config import WideConfig
    from wide.memory import HEADROOM, train_memory_from_config

    mem = train_memory_from_config(tiny_llama_config(), WideConfig(ffn_group_size=32), "cpu")
    _fake_memory(monkeypatch, int(mem.estimate(3, 32, False) / HEADROOM))  # 2 sequences of 32 tokens fit, 4 not
    args = [*calibrate_args(model_dir, text_file, tmp_path / "o"), "--batch-size", "8"]
    rc, _, err = run([*args, "--batch-size", "2", "--grad-accum", "4"], capsys)
    assert rc == 0, err
    rc, _, err = run([*args, "--no-memory-check", "--overwrite"], capsys)
    assert rc == 0, err


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
    (tmp_path / "o" / "train_state.dcp").mkdir(parents=True)  # a saved state: its description and metadata
    (tmp_path / "o" / "train_state.dcp" / "train_state.json").write_text("{}")
    (tmp_path / "o" / "train_state.dcp" / ".metadata").write_bytes(b"")
    rc, _, err = run(argv, capsys)
    assert rc == 130
    assert err.strip() == (f"wide calibrate: interrupted; the last state saved (every --save-every 5 steps) is in "
                           f"{str(tmp_path / 'o')!r}: add --resume to continue from it")


@pytest.mark.parametrize("ours", [True, False])
def test_value_errors_of_ours_are_one_line_others_propagate(capsys, monkeypatch, ours):
    """WideError and the kernels' KernelArgumentError (ValueErrors defined in wide) are bad input: one line, exit
    2; a ValueError from a library is a bug and keeps its traceback."""
    import wide.cli as cli
    from wide.kernels import KernelArgumentError

    def fail(args):
        raise (KernelArgumentError if ours else ValueError)("tile 3 must be a multiple of 16")

    monkeypatch.setattr(cli.evaluate, "cmd_info", fail)
    if not ours:
        with pytest.raises(ValueError, match="tile 3"):
            main(["info"])
        return
    assert main(["info"]) == 2
    assert capsys.readouterr().err == "wide info: error: tile 3 must be a multiple of 16\n"


# --- eval-ppl --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("ctx,max_tokens,line,tokens", [
    (64, 100, "1 window of 64 tokens (64 tokens)", 63),  # at most --max-tokens: 64 of the first 100
    (64, 200, "3 windows of 64 tokens (192 tokens)", 189),
    (256, 40, "1 window of 40 tokens (40 tokens; --max-tokens 40 is below --ctx 256)", 39),  # not a full window
    (256, None, "4 windows of 256 tokens (1,024 tokens)", 1020),  # --ctx at the model's context
])
def test_eval_ppl_max_tokens_is_an_upper_bound(tmp_path, model_dir, text_file, capsys, ctx, max_tokens, line, tokens):
    target = tmp_path / "r.json"
    args = ["eval-ppl", "--model", model_dir, "--text", text_file, "--ctx", ctx, "--device", "cpu", "--json", target]
    rc, stdout, err = run([*args, *([] if max_tokens is None else ["--max-tokens", max_tokens])], capsys)
    assert rc == 0, err
    assert line in stdout.splitlines()
    r = json.loads(target.read_text())["dense"]
    assert r["tokens"] == tokens and r["ctx"] == min(ctx, max_tokens or ctx)  # tokens predicted: width - 1 each


def test_interrupted_checkpoint_warning_is_one_line(tmp_path, model_dir, text_file, capsys):
    from wide.checkpoint import load, save_wide
    from wide.config import WideConfig
    from wide.errors import WideWarning
    from wide.model import WideModel
    from wide_testutil import tiny_model

    wm = WideModel(tiny_model(), WideConfig(ffn_group_size=32))
    path = save_wide(wm, tmp_path / "ckpt", model_ref="tiny", extra={"stage": "router", "step": 2, "steps": 4})
    rc, out, err = run(["eval-ppl", "--wide", path, "--model", model_dir, "--text", text_file, "--ctx", "32",
                        "--max-tokens", "64", "--device", "cpu", "--no-memory-check"], capsys)
    assert rc == 0, err
    assert "UserWarning" not in err and "warnings.warn" not in err and "checkpoint.py" not in err, err
    assert [ln for ln in err.splitlines() if "warning" in ln] == [
        f"wide eval-ppl: warning: WIDE checkpoint '{path}' is an intermediate save (step 2 of 4) of an interrupted "
        f"wide calibrate run; to finish it, run wide calibrate again with the same options, -o '{path}' and --resume"]
    assert "dense  ppl" in out
    with pytest.warns(WideWarning, match="intermediate save"):  # the library still warns
        load(path, model=tiny_model())


# --- demo ------------------------------------------------------------------------------------------------------
def test_demo_every_stage_ends_with_its_result(tmp_path, model_dir, text_file, capsys):
    out = tmp_path / "demo"
    out.mkdir()
    (out / "routers.safetensors").write_text("an earlier checkpoint")  # replaced with --overwrite
    rc, stdout, err = run(["demo", "--model", model_dir, "--text", text_file, "-o", out, "--device", "cpu", "--steps",
                           "1", "--batch-size", "1", "--seq-len", "32", "--ctx", "32", "--eval-tokens", "64",
                           "--ffn-group-size", "32", "--max-blocks", "3", "--overwrite"], capsys)
    assert rc == 0, err
    lines = stdout.splitlines()
    stages = [i for i, ln in enumerate(lines) if re.match(r"\[\d/5\]", ln)] + [len(lines)]
    assert len(stages) == 6, stdout
    last = [lines[end - 1] for end in stages[1:]]  # the line that closes each stage
    assert re.match(r" +2 layers, hidden 64, .* router parameters$", last[0]), last
    assert re.match(r" +dense ppl [\d.]+$", last[1]), last
    assert re.match(r" +done in \d+s: lm_loss [\d.]+, attn sparsity [\d.]+, ffn sparsity [\d.]+$", last[2]), last
    assert re.match(r"ppl ratio wide/dense: [\d.]+$", last[3]), last
    assert re.match(rf"done in \d+s; results in {re.escape(str(out / 'demo_result.json'))}$", last[4]), last
    assert "(3 calibration sequences)" in lines[stages[2]]  # --max-blocks
    assert f"tokens of {text_file} (the calibration text too, not held-out)" in lines[stages[1]]
    assert (out / "demo_result.json").is_file() and (out / "routers.safetensors").read_bytes()[:1] != b"a"
    demo_line = next(ln for ln in MAKEFILE.read_text().splitlines() if "bin/wide demo" in ln)
    assert "--overwrite" in demo_line  # `make demo` runs again


def test_demo_reports_dense_and_wide_flops_at_one_context(tmp_path, model_dir, text_file, capsys):
    """With the automatic --seq-len (256 on a CPU) and --ctx 64, both summary lines give the FLOPs sparsity at
    T=256, the calibration length the WIDE checkpoint records."""
    rc, stdout, err = run(["demo", "--model", model_dir, "--text", text_file, "-o", tmp_path / "d", "--device", "cpu",
                           "--steps", "1", "--batch-size", "1", "--ctx", "64", "--eval-tokens", "128",
                           "--ffn-group-size", "32"], capsys)
    assert rc == 0, err
    lines = {ln.split()[0]: ln for ln in stdout.splitlines() if re.match(r"(dense|wide) +ppl ", ln)}
    assert set(lines) == {"dense", "wide"} and all("(T=256)" in ln for ln in lines.values()), stdout
    assert json.loads((tmp_path / "d" / "wide_config.json").read_text())["seq_len"] == 256


DEMO_TINY = ["--device", "cpu", "--batch-size", "1", "--seq-len", "32", "--ctx", "32", "--eval-tokens", "64",
             "--ffn-group-size", "32"]


@pytest.mark.parametrize("omp", ["3", None])
def test_demo_keeps_the_thread_count_of_omp_num_threads(tmp_path, model_dir, text_file, capsys, monkeypatch, omp):
    import os

    calls = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)  # the test's own thread count stays as it is
    if omp is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", omp)
    rc, _, err = run(["demo", "--model", model_dir, "--text", text_file, "-o", tmp_path / "d", *DEMO_TINY,
                      "--steps", "1"], capsys)
    assert rc == 0, err
    assert calls == ([] if omp is not None else [os.cpu_count() or 1])


def test_demo_saves_a_quarter_of_its_steps_so_an_interrupt_leaves_a_state(tmp_path, model_dir, text_file, capsys,
                                                                           monkeypatch):
    from wide.cli.demo import CPU, GPU, demo_settings
    from wide.train.loop import read_meta
    from wide_testutil import interrupt_at

    parsed = _subparser("demo").parse_args([])
    assert parsed.save_every is None
    assert demo_settings(parsed, gpu=False)["save_every"] == CPU["steps"] // 4 == 20
    assert demo_settings(parsed, gpu=True)["save_every"] == GPU["steps"] // 4 == 75
    assert demo_settings(_subparser("demo").parse_args(["--steps", "2"]), gpu=False)["save_every"] == 1
    assert demo_settings(_subparser("demo").parse_args(["--save-every", "7"]), gpu=False)["save_every"] == 7
    out = tmp_path / "d"
    interrupt_at(monkeypatch, 5)  # in step 5 of 8: the state of step 4 (a save every 2 steps) is there
    rc, _, err = run(["demo", "--model", model_dir, "--text", text_file, "-o", out, *DEMO_TINY, "--steps", "8"],
                     capsys)
    assert rc == 130, err
    assert f"`wide calibrate -o {out} --resume` finishes it" in err.strip().splitlines()[-1], err
    meta = read_meta(out)
    assert meta["step"] == 4 and meta["options"]["save_every"] == 2
    rc, _, err = run(["demo", "-o", out, "--save-every", "0", *DEMO_TINY], capsys)
    assert rc == 2 and "--save-every 0 must be >= 1" in err, err


def test_make_demo_settings_fit_in_memory():
    """`make demo` (CPU: 4 x 256 tokens on the bundled SmolLM2-135M) passes the memory check on a 24 GB machine:
    its estimate fits in 8 GiB with the headroom."""
    from wide.cli.common import config_from, hf_config
    from wide.cli.demo import demo_settings
    from wide.errors import WideError
    from wide.memory import GIB, HEADROOM, train_memory_from_config

    line = next(ln for ln in MAKEFILE.read_text().splitlines() if "bin/wide demo" in ln)
    args = build_parser().parse_args(line.split("bin/wide ", 1)[1].split("#")[0].split())
    try:
        _, hf = hf_config(args.model)
    except WideError as e:
        pytest.skip(f"bundled model not installed: {e}")
    mem = train_memory_from_config(hf, config_from(args), "cpu")
    est = mem.estimate(args.batch_size, demo_settings(args, gpu=False)["seq_len"], args.grad_checkpoint)
    assert args.memory_check and est <= HEADROOM * 8 * GIB, est / GIB


# --- help and parsing ---------------------------------------------------------------------------------------------
def test_help_for_every_subcommand(capsys):
    for cmd in ["info", "calibrate", "lora", "eval-ppl", "eval", "prune-static", "demo", "generate"]:
        with pytest.raises(SystemExit) as e:
            main([cmd, "--help"])
        assert e.value.code == 0
        assert "usage: wide " + cmd in capsys.readouterr().out


def test_lm_eval_help_without_lm_eval_installed(capsys, monkeypatch):
    """`wide lm-eval --help` is help (exit 0) without the quality extra; only a run names the extra to install."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "lm_eval" else real(name, *a))
    for flag in ("--help", "-h"):
        with pytest.raises(SystemExit) as e:
            main(["lm-eval", "--model", "wide", flag])
        out, err = capsys.readouterr()
        assert e.value.code == 0 and out.startswith("usage: wide lm-eval") and err == "", (out, err)
        assert "--model wide --model_args pretrained=smollm2-135m,wide=CKPT --tasks wide_zeroshot" in " ".join(
            out.split())
    rc, _, err = run(["lm-eval", "--model", "wide"], capsys)
    assert rc == 2 and err.startswith("wide lm-eval: error: wide lm-eval needs the 'lm_eval' package") \
        and "pip install 'wide[quality]'" in err and len(err.splitlines()) == 1, err


@pytest.mark.parametrize("cmd,defaults", [
    ("lora", {"lora_dropout": "0.1"}),
    ("prune-static", {"ffn_group_size": "128", "seq_len": "2048", "batch_size": "4", "calib_blocks": "32"}),
    ("generate", {"max_new_tokens": "64"}),
    ("demo", {"steps": "auto, 80 on CPU, 300 on GPU", "seq_len": "auto, 256 on CPU, 2048 on GPU"}),
    ("calibrate", {"steps": "500", "seq_len": "2048"}),
])
def test_every_option_has_help(cmd, defaults):
    p = _subparser(cmd)
    assert not [a.option_strings for a in p._actions if a.option_strings and not a.help]
    helps = {a.dest: a.help for a in p._actions}
    for dest, default in defaults.items():
        assert f"default: {default})" in helps[dest], (dest, helps[dest])


def test_parsed_defaults():
    assert _subparser("demo").parse_args([]).steps is None and _subparser("demo").parse_args([]).seq_len is None
    cal = _subparser("calibrate").parse_args(["-o", "x"])
    assert cal.steps == 500 and cal.seq_len == 2048
    assert build_parser().parse_args(["eval"]).tasks == "zeroshot"


def test_bench_options_parse():
    pytest.importorskip("wide.bench.e2e")
    e2e = _subparser("bench", "e2e")
    helps = {a.dest: a.help for a in e2e._actions}
    assert "default: 50" in helps["runs"] and "--text spec of wide calibrate" in helps["smollm2_text"]
    a = e2e.parse_args(["--trace-points", "prefill:1:2048,decode:4:2048", "--trace-sparsity", "0,0.5"])
    assert a.trace_points == [("prefill", 1, 2048), ("decode", 4, 2048)] and a.trace_sparsity == [0.0, 0.5]
    assert e2e.parse_args([]).trace_points == [("prefill", 1, 16384), ("decode", 1, 2048)]
    a = e2e.parse_args(["--split", "uniform", "--models", "llama8b", "--trace-sparsity", "0", "--runs", "7"])
    assert a.split == ["uniform"] and a.models == ["llama8b"] and a.trace_sparsity == [0.0] and a.runs == 7
    k = _subparser("bench", "kernels").parse_args(["--tokens", "4096", "--decode-batch", "4"])
    assert k.tokens == 4096 and k.decode_batch == 4

