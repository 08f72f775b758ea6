"""Fourth fresh-user round of input checks: a WIDE checkpoint path that is a file, router weights that do not fit,
an interrupted checkpoint's warning as one line, truncated model files, non-string JSONL text, file modes of
adapters and pruned models, `wide demo` --max-blocks / --text, `wide info --method skipgpt`, eval-ppl's memory check,
and refusals that now come before the weights load (prune-static group sizes, eval-ppl text shorter than --ctx)."""

import json

import pytest

from wide.checkpoint import ROUTERS_NAME, load, save_wide
from wide.config import WideConfig
from wide.errors import WideError
from wide.model import WideModel
from wide_testutil import one_line_error, tiny_model
from wide_testutil import run_cli as run


def no_weights(monkeypatch):
    """Make any read of base-model weights fail the test."""
    import transformers

    def refuse(*a, **k):
        raise AssertionError("base-model weights were read before the check")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)


def saved(tmp_path, extra=None, **cfg):
    wm = WideModel(tiny_model(), WideConfig(ffn_group_size=32, **cfg))
    return save_wide(wm, tmp_path / "ckpt", model_ref="tiny", extra=extra)


# --- a checkpoint path that is a file -------------------------------------------------------------------------
def test_wide_path_that_is_a_file(tmp_path, text_file, capsys, monkeypatch):
    no_weights(monkeypatch)
    rc, _, err = run(["eval-ppl", "--wide", text_file, "--text", text_file, "--device", "cpu"], capsys)
    one_line_error(rc, err, "eval-ppl", f"WIDE checkpoint '{text_file}' is a file, but a checkpoint directory is "
                   "expected", "wide_config.json")
    assert "not found" not in err
    ckpt = saved(tmp_path)
    rc, _, err = run(["eval-ppl", "--wide", ckpt / ROUTERS_NAME, "--text", text_file, "--device", "cpu"], capsys)
    one_line_error(rc, err, "eval-ppl", "is a file, but a checkpoint directory is expected",
                   f"routers.safetensors is one of its files: give its folder '{ckpt}'")
    rc, _, err = run(["lora", "--wide", text_file, "--text", text_file, "-o", tmp_path / "o", "--device", "cpu"],
                     capsys)
    if rc == 2 and "peft" in err:
        pytest.skip("peft is not installed")
    one_line_error(rc, err, "lora", f"stage-1 checkpoint '{text_file}' is a file, but a checkpoint directory is "
                   "expected")


# --- router weights that do not fit ---------------------------------------------------------------------------
def test_router_shapes_match_the_model():
    from wide.model import router_shapes

    for cfg in (WideConfig(ffn_group_size=32), WideConfig(ffn_group_size=16, routed="ffn", router_rank=4),
                WideConfig(method="skipgpt", routed="attn")):
        wm = WideModel(tiny_model(), cfg)
        assert router_shapes(wm.dims, cfg) == {k: tuple(v.shape) for k, v in wm.router_state_dict().items()}


@pytest.mark.parametrize("with_dims", [True, False])
def test_router_key_mismatch_names_the_keys_and_the_likely_cause(tmp_path, monkeypatch, with_dims):
    """routers.safetensors of a routed=both run next to a wide_config.json saying routed=ffn: the message counts
    and names the unexpected keys and says the checkpoint was likely made for another model or config; with the
    dims recorded in base_model.json this is found before any base model loads."""
    import re

    import wide.checkpoint as C

    path = saved(tmp_path)
    cfg = json.loads((path / "wide_config.json").read_text())
    cfg["routed"] = "ffn"
    (path / "wide_config.json").write_text(json.dumps(cfg))
    if with_dims:
        monkeypatch.setattr(C, "load_base_model", lambda *a, **k: (_ for _ in ()).throw(AssertionError("loaded")))
    else:
        info = json.loads((path / "base_model.json").read_text())
        del info["dims"]
        (path / "base_model.json").write_text(json.dumps(info))
    with pytest.raises(WideError) as e:
        load(path, model=None if with_dims else tiny_model())
    msg = str(e.value)
    assert msg.startswith(f"{path / ROUTERS_NAME}: router weights do not match the model: "), msg
    assert re.search(r"0 missing, 8 unexpected \(attn\.0\.w1\.bias, attn\.0\.w1\.weight, attn\.0\.w2\.bias, "
                     r"\.\.\.\), of the 8 it needs", msg), msg
    assert "likely made for another model or another WIDE config" in msg


# --- an interrupted checkpoint ----------------------------------------------------------------------------------
def test_interrupted_checkpoint_warning_is_one_line(tmp_path, model_dir, text_file, capsys):
    path = saved(tmp_path, extra={"stage": "router", "step": 2, "steps": 4})
    rc, _, err = run(["eval-ppl", "--wide", path, "--model", model_dir, "--text", text_file, "--ctx", "32",
                      "--max-tokens", "64", "--device", "cpu"], capsys)
    assert rc == 0, err
    assert "UserWarning" not in err and "warnings.warn" not in err and "checkpoint.py" not in err, err
    lines = [ln for ln in err.splitlines() if "warning" in ln]
    assert lines == [f"wide eval-ppl: warning: WIDE checkpoint '{path}' is an intermediate save (step 2 of 4) of "
                     f"an interrupted wide calibrate run; to finish it, run wide calibrate again with the same "
                     f"options, -o '{path}' and --resume"], err
    from wide.errors import WideWarning

    with pytest.warns(WideWarning, match="intermediate save"):  # the library still warns (a UserWarning)
        load(path, model=tiny_model())


# --- truncated model files ------------------------------------------------------------------------------------
def test_truncated_safetensors_in_a_model_directory(model_dir, text_file, capsys):
    """A Hugging Face directory whose model.safetensors was cut short: one line naming the file (was safetensors'
    'incomplete metadata, file not fully covered' traceback)."""
    f = model_dir / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    rc, _, err = run(["eval-ppl", "--model", model_dir, "--text", text_file, "--ctx", "32", "--device", "cpu"],
                     capsys)
    one_line_error(rc, err, "eval-ppl", f"model weights file '{f}' is truncated or corrupt ({len(data) // 2:,} bytes")


def _small_gguf(path):
    gguf = pytest.importorskip("gguf")
    import numpy as np

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_tensor("token_embd.weight", np.zeros((16, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("keep", [10, 100, -100])
def test_truncated_gguf_names_the_file(tmp_path, capsys, keep):
    """A GGUF cut short (in its header, its metadata or its tensor data): one line naming the file as truncated or
    corrupt (was numpy's 'cannot reshape array' or a struct.error traceback)."""
    whole = _small_gguf(tmp_path / "whole.gguf")
    rc, _, err = run(["info", "--model", whole, "--ffn-group-size", "16"], capsys)
    assert "is truncated or corrupt" not in err  # the whole file reads
    data = whole.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:keep])
    rc, _, err = run(["info", "--model", cut, "--ffn-group-size", "16"], capsys)
    one_line_error(rc, err, "info", f"GGUF file '{cut}' is truncated or corrupt ({len(data[:keep]):,} bytes;",
                   "copy or download it again")


# --- JSONL text that is not a string --------------------------------------------------------------------------
@pytest.mark.parametrize("value,words", [(5, "'text' is a number (5)"), (None, "'text' is null;"),
                                         (["a"], "'text' is a list ([\"a\"])"), ({"a": 1}, "'text' is an object")])
def test_jsonl_text_must_be_a_string(tmp_path, value, words):
    from wide.data import load_texts

    p = tmp_path / "t.jsonl"
    p.write_text(json.dumps({"text": "w1 w2"}) + "\n\n" + json.dumps({"text": value}) + "\n")
    with pytest.raises(WideError, match=r"t\.jsonl: line 3: " + words.replace("(", r"\(").replace(")", r"\)")
                       .replace("[", r"\[").replace("]", r"\]") + ".* it must be a string"):
        load_texts(str(p))


# --- file modes ------------------------------------------------------------------------------------------------
def _modes(directory):
    import stat

    return {str(f.relative_to(directory)): stat.S_IMODE(f.stat().st_mode) for f in directory.rglob("*") if f.is_file()}


def test_adapter_files_get_the_new_file_mode(tmp_path):
    """peft's save_pretrained writes adapter_model.safetensors with 0600 (safetensors does): it gets 0644 under
    umask 022 like every other file."""
    import os

    pytest.importorskip("peft")
    from wide.lora import attach_lora, save_adapter

    wm = WideModel(tiny_model(), WideConfig(ffn_group_size=32))
    attach_lora(wm)
    old = os.umask(0o022)
    try:
        save_adapter(wm, tmp_path / "adapter")
    finally:
        os.umask(old)
    modes = _modes(tmp_path / "adapter")
    assert "adapter_model.safetensors" in modes and set(modes.values()) == {0o644}, modes


def test_pruned_model_files_get_the_new_file_mode(tmp_path, model_dir, text_file, capsys):
    import os

    out = tmp_path / "pruned"
    out.mkdir()
    keep = out / "mine.txt"  # a file of the user's that the save does not write keeps its mode
    keep.write_text("x")
    keep.chmod(0o600)
    old = os.umask(0o022)
    try:
        rc, _, err = run(["prune-static", "--model", model_dir, "-S", "0.5", "-o", out, "--text", text_file,
                          "--seq-len", "32", "--calib-blocks", "2", "--ffn-group-size", "32", "--device", "cpu",
                          "--overwrite"], capsys)
    finally:
        os.umask(old)
    assert rc == 0, err
    modes = _modes(out)
    assert modes.pop("mine.txt") == 0o600
    assert "model.safetensors" in modes and set(modes.values()) == {0o644}, modes


# --- wide demo: --max-blocks and what the evaluation text is --------------------------------------------------
def test_demo_max_blocks_and_a_truthful_evaluation_text(tmp_path, model_dir, text_file, capsys):
    rc, out, err = run(["demo", "--model", model_dir, "--text", text_file, "-o", tmp_path / "demo", "--device", "cpu",
                        "--steps", "1", "--batch-size", "1", "--seq-len", "32", "--ctx", "32", "--eval-tokens", "64",
                        "--ffn-group-size", "32", "--max-blocks", "3"], capsys)
    assert rc == 0, err
    assert "(3 calibration sequences)" in out, out  # --max-blocks was ignored: all 37 sequences
    line = next(ln for ln in out.splitlines() if ln.startswith("[2/5]"))
    assert "held-out" in line and "not held-out" in line and f"tokens of {text_file} (the calibration text too" \
        in line, line


# --- wide info --method skipgpt -------------------------------------------------------------------------------
def test_info_skipgpt_bad_ffn_group_size_lists_the_legal_ones(model_dir, capsys):
    rc, _, err = run(["info", "--model", model_dir, "--method", "skipgpt", "--ffn-group-size", "100"], capsys)
    one_line_error(rc, err, "info", "FFN group size G=100", "--ffn-group-size with one of [16, 32, 64, 128]",
                   "with --method skipgpt it sets the WIDE layout")
    assert "wide info" not in err.split(": error: ", 1)[1]  # no hint pointing back to itself


# --- refusals before the weights load ---------------------------------------------------------------------------
def test_prune_static_group_size_is_checked_before_the_weights_load(tmp_path, model_dir, text_file, capsys,
                                                                     monkeypatch):
    no_weights(monkeypatch)
    base = ["prune-static", "--model", model_dir, "-S", "0.5", "-o", tmp_path / "p", "--text", text_file,
            "--seq-len", "32", "--device", "cpu"]
    rc, _, err = run([*base, "--attn-group-size", "100", "--ffn-group-size", "32"], capsys)
    one_line_error(rc, err, "prune-static", "static attention group size G=100 must be a multiple of the GQA group "
                   "32 dividing the attention width 64", "legal: [32, 64]")
    rc, _, err = run([*base, "--ffn-group-size", "256"], capsys)
    one_line_error(rc, err, "prune-static", "FFN group size G=256 does not divide the intermediate size 128",
                   "legal: [16, 32, 64, 128]")
    assert not (tmp_path / "p").exists()


@pytest.mark.parametrize("wide", [False, True])
def test_eval_ppl_text_shorter_than_ctx_is_refused_before_the_weights_load(tmp_path, model_dir, capsys,
                                                                            monkeypatch, wide):
    ckpt = saved(tmp_path)
    no_weights(monkeypatch)
    short = tmp_path / "short.txt"
    short.write_text("w1 w2 w3")
    rc, _, err = run(["eval-ppl", "--model", model_dir, "--text", short, "--ctx", "32", "--device", "cpu",
                      *(["--wide", ckpt] if wide else [])], capsys)
    one_line_error(rc, err, "eval-ppl", f"text {str(short)!r} has 3 tokens, shorter than one window of --ctx 32")


@pytest.mark.parametrize("wide", [False, True])
def test_eval_ppl_memory_check(tmp_path, model_dir, text_file, capsys, monkeypatch, wide):
    """Weights + one forward pass that do not fit: one line before the weights load with the estimate, the
    memory available and a --batch-size that fits; --no-memory-check skips it."""
    import wide.memory as M
    from wide.memory import GIB, HEADROOM, config_param_count, estimate_eval_memory
    from wide.model import dims_of
    from wide_testutil import tiny_llama_config

    cfg = tiny_llama_config()
    params = config_param_count(cfg)
    assert params == sum(p.numel() for p in tiny_model().parameters())

    def need(b):
        return sum(estimate_eval_memory(dims_of(cfg), cfg.vocab_size, params, b, 32))

    avail = int(need(3) / HEADROOM) + 1  # 3 windows per pass fit, 8 do not
    monkeypatch.setattr(M, "available_memory", lambda device: (avail, "MemAvailable of this machine"))
    ckpt = saved(tmp_path)
    args = ["eval-ppl", "--model", model_dir, "--text", text_file, "--ctx", "32", "--batch-size", "8", "--device",
            "cpu", *(["--wide", ckpt] if wide else [])]
    import transformers

    real = transformers.AutoModelForCausalLM.from_pretrained
    no_weights(monkeypatch)
    rc, _, err = run(args, capsys)
    one_line_error(rc, err, "eval-ppl", "a forward pass of 8 windows (--batch-size) x 32 tokens (--ctx) needs about "
                   f"{need(8) / GIB:.1f} GiB for evaluation", f"but {avail / GIB:.1f} GiB is available",
                   "[8 x 32 x 128] logits", "use --batch-size 3 (about", "--no-memory-check")
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", real)
    rc, out, err = run([*args, "--no-memory-check"], capsys)
    assert rc == 0, err
    assert "dense  ppl" in out
