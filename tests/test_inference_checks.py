"""Bad input at the inference boundary: ``Engine``, its ``prefill`` / ``decode`` / ``new_cache``, ``generate`` and
``wide generate`` refuse it in one line (before any weight loads where the CLI can tell); plus the small helpers
of generation (EOS ids, streaming, the path name).  CPU, on the PyTorch reference path."""

from __future__ import annotations

import types

import pytest
import torch

from wide import WideConfig, WideError
from wide.model import WideModel
from wide_testutil import tiny_model, tiny_tokenizer


@pytest.fixture
def reference_path(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")


@pytest.fixture
def engine(reference_path):
    from wide.inference import Engine

    torch.manual_seed(0)
    return Engine(WideModel(tiny_model(), WideConfig(ffn_group_size=32), init_keep=0.5).eval())


def _prefilled(eng, B=2, T=3, max_len=6):
    cache = eng.new_cache(B, max_len)
    eng.prefill(torch.randint(2, 100, (B, T), generator=torch.Generator().manual_seed(1)), None, cache)
    return cache


# --- Engine ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("args,kw,msg", [
    (("x",), {}, "Engine needs a WideModel \\(wide.load\\) or a Hugging Face causal LM; got str"),
    ((3,), {}, "got int"), ((torch.nn.Linear(2, 2),), {}, "got Linear"),
    ((None,), {"ops": "sparse"}, "ops='sparse' is not one of routed, dense"),
    ((None,), {"kaxis": "fast"}, "kaxis='fast' is not one of kernel, auto, dense"),
    ((None,), {"naxis": "fast"}, "naxis='fast'"), ((None,), {"attn": "flash"}, "attn='flash'"),
])
def test_engine_refuses_bad_arguments(args, kw, msg):
    from wide.inference import Engine

    with pytest.raises(WideError, match=msg):
        Engine(*(a if a is not None else tiny_model() for a in args), **kw)


def test_prefill_refuses_bad_input(engine):
    eng, vocab = engine, engine.embed.num_embeddings
    ids = torch.randint(2, 128, (2, 5), generator=torch.Generator().manual_seed(7))
    for bad_ids, cache, msg in [
        (torch.zeros(1, 0, dtype=torch.long), (1, 4), "empty prompt"),
        (torch.ones(1, 6, dtype=torch.long), (1, 4), "prompt of 6 tokens is longer than the KV cache \\(4 tokens\\)"),
        (ids, (1, 5), "batch of 2 prompts does not fit a KV cache of 1 rows"),
        (torch.full((1, 3), vocab), (1, 4), f"ids from {vocab} to {vocab}; the model's vocabulary is 0..{vocab - 1}"),
        (torch.full((1, 3), -1), (1, 4), "vocabulary"), (ids.float(), (2, 5), "integer"),
        (ids[0], (2, 5), "input_ids must be an integer tensor \\[B, T\\]"),
    ]:
        with pytest.raises(WideError, match=msg):
            eng.prefill(bad_ids, None, eng.new_cache(*cache))
    ones = torch.ones_like(ids)
    for m in (torch.tensor([[1, 1, 1, 0, 0], [1] * 5]), torch.tensor([[0, 1, 0, 1, 1], [1] * 5]),
              torch.tensor([[0] * 5, [1] * 5]), ones * 2):  # right-padded, holes, no real token, values 0/1/2
        for call in (lambda: eng.prefill(ids, m, eng.new_cache(2, 5)), lambda: eng.measure_activity(ids, m)):
            with pytest.raises(WideError, match="left-padded"):
                call()
    with pytest.raises(WideError, match="attention_mask \\(2, 4\\) on cpu must match input_ids \\(2, 5\\)"):
        eng.prefill(ids, ones[:, :4], eng.new_cache(2, 5))
    for bad in (ids[0], torch.zeros(1, 0, dtype=torch.long), ids[None]):
        with pytest.raises(WideError, match="input_ids|empty"):
            eng.measure_activity(bad)


def test_decode_refuses_bad_tokens_batch_device_valid_and_cache(engine):
    from wide.inference import StaticKVCache

    eng, vocab = engine, engine.embed.num_embeddings
    cache, ok = _prefilled(eng), torch.tensor([5, 6])
    for toks, msg in [
        (ok.float(), "int64 tensor \\[B\\].*got torch.float32 \\[2\\]"), (ok.to(torch.int32), "got torch.int32"),
        (ok.view(2, 1), "int64 tensor \\[B\\].*\\[2, 1\\]"), ([5, 6], "got list"),
        (torch.tensor([5, 6, 7]), "3 tokens for a KV cache of 2 rows"), (torch.tensor([5]), "1 token for a KV cache"),
        (torch.tensor([5, vocab]), f"ids from 5 to {vocab}; the model's vocabulary is 0..{vocab - 1}"),
        (torch.tensor([-1, 6]), "ids from -1 to 6"),
        (ok.to("meta"), "tokens are on meta, the engine's model is on cpu"),
    ]:
        with pytest.raises(WideError, match=msg):
            eng.decode(toks, cache)
    for valid, msg in [(torch.ones(2), "valid must be a bool tensor \\[2\\].*float32"),
                       (torch.ones(3, dtype=torch.bool), "valid must be a bool tensor \\[2\\]"), ("yes", "got str")]:
        with pytest.raises(WideError, match=msg):
            eng.decode(ok, cache, valid=valid)
    with pytest.raises(WideError, match="cache must be a StaticKVCache"):
        eng.decode(ok, object())
    d = eng.dims
    for other in (StaticKVCache(d.num_layers, 2, d.num_kv_heads, d.head_dim, 6, torch.float64, "cpu"),
                  StaticKVCache(d.num_layers + 1, 2, d.num_kv_heads, d.head_dim, 6, torch.float32, "cpu")):
        for call in (lambda: eng.decode(ok, other), lambda: eng.prefill(ok.view(2, 1), None, other)):
            with pytest.raises(WideError, match="does not fit this model"):
                call()
    assert cache.lengths.tolist() == [3, 3]  # nothing was written by a refused step
    eng.decode(ok, cache, valid=torch.tensor([True, False]))
    assert cache.lengths.tolist() == [4, 4]


def test_decode_refuses_a_full_cache(engine):
    cache = _prefilled(engine, B=2, T=3, max_len=4)
    engine.decode(torch.tensor([5, 6]), cache)  # fills the last slot
    with pytest.raises(WideError, match="KV cache is full \\(row 0 holds 4 tokens of 4\\); no slot is left"):
        engine.decode(torch.tensor([5, 6]), cache)
    cache.lengths[0] = 1  # one full row is enough
    with pytest.raises(WideError, match="row 1 holds 4 tokens of 4"):
        engine.decode(torch.tensor([5, 6]), cache)


def test_decode_reads_no_value_off_the_cpu(engine, monkeypatch):
    """Off the CPU the value checks would be a host sync per step (impossible under CUDA-graph capture): decode only
    checks metadata there.  Meta tensors stand in for GPU ones (reading a value raises); the step stops after the
    checks."""
    engine.device = torch.device("meta")
    cache = engine.new_cache(2, 4)
    cache.lengths = torch.full((2,), 4, dtype=torch.int64, device="meta")  # "full", out of range: never read

    class Reached(Exception):
        pass

    monkeypatch.setattr(engine, "_forward", lambda *a: (_ for _ in ()).throw(Reached()))
    with pytest.raises(Reached):
        engine.decode(torch.zeros(2, dtype=torch.int64, device="meta"), cache,
                      valid=torch.ones(2, dtype=torch.bool, device="meta"))
    with pytest.raises(WideError, match="int64"):
        engine.decode(torch.zeros(2, dtype=torch.int32, device="meta"), cache)


@pytest.mark.parametrize("kw,msg", [
    (dict(batch=0, max_len=4), "batch=0 must be >= 1"), (dict(batch=1, max_len=-3), "max_len=-3 must be >= 1"),
    (dict(batch=1, max_len=2.5), "max_len=2.5 must be an int >= 1"), (dict(batch=True, max_len=4), "batch=True must"),
    (dict(batch="2", max_len=4), "batch='2' must be an int >= 1"),
    (dict(batch=1, max_len=10 ** 7), f"a KV cache of {10 ** 7} tokens exceeds the model's context of 256 tokens "
                                     "\\(max_position_embeddings\\)"),
])
def test_new_cache_refuses_bad_sizes(engine, kw, msg):
    import numpy as np

    with pytest.raises(WideError, match=msg):
        engine.new_cache(**kw)
    c = engine.new_cache(np.int64(2), 256)
    assert c.batch == 2 and c.max_len == 256 and c.lengths.tolist() == [0, 0]


def test_new_cache_refuses_the_sliding_window_and_the_memory(engine, monkeypatch, reference_path):
    from wide.inference import Engine

    eng = Engine(tiny_model("mistral", sliding_window=8))
    assert eng.new_cache(1, 8).max_len == 8
    with pytest.raises(WideError, match="exceeds the model's sliding attention window \\(8\\)"):
        eng.new_cache(1, 9)
    import wide.memory

    monkeypatch.setattr(wide.memory, "available_memory", lambda device: (10 * 2**20, "a test's 10 MiB"))
    d = engine.dims
    row = 2 * d.num_layers * d.num_kv_heads * 64 * d.head_dim * engine.dtype.itemsize  # one row of 64 tokens
    engine.new_cache(4, 64)
    rows = 10 * 2**20 // row + 1
    with pytest.raises(WideError, match=f"a KV cache of {rows} x 64 tokens needs .* GiB on cpu, more than the "
                                        "0.01 GiB available \\(a test's 10 MiB\\)"):
        engine.new_cache(rows, 64)


# --- generate ----------------------------------------------------------------------------------------------------
class _Untokenizable:
    """A tokenizer whose encoding fails as the fast tokenizers do on a lone surrogate."""

    pad_token_id, eos_token_id = 0, 1

    def __call__(self, *a, **k):
        raise TypeError("TextEncodeInput must be Union[TextInputSequence, Tuple[InputSequence, InputSequence]]")


@pytest.mark.parametrize("prompts,kw,msg", [
    (["w1"], dict(max_new_tokens="3"), "max_new_tokens='3' must be an int >= 1"),
    (["w1"], dict(max_new_tokens=2.5), "max_new_tokens=2.5 must be"), (["w1"], dict(max_new_tokens=True), "=True"),
    (["w1"], dict(sampling=0.7), "sampling=0.7 must be a wide.inference.Sampling"),
    (["w1"], dict(sampling={"temperature": 0.7}), "sampling=\\{'temperature': 0.7\\} must be a"),
    (["w1"], dict(max_len="10"), "max_len='10' must be an int >= 1"), (["w1"], dict(max_len=True), "max_len=True"),
    (["w1"], dict(on_token=5), "on_token=5 must be callable"),
    (["w1"], dict(graphs=True), "CUDA-graph decode needs a CUDA GPU and the model on it; this run is on cpu"),
    (5, {}, "prompts must be a string, a token tensor, or a list of them; got int"),
    (["w1", 7], {}, "prompt 1 is a int: a prompt is a string, a 1-D token tensor or a list of int token ids"),
    ([[1, 2.5]], {}, "prompt 0 is a list"), (["w1", ""], {}, "empty prompt \\(prompt 1 is empty\\)"),
    ("   ", {}, "empty prompt \\(prompt 0 is only whitespace\\)"), ([], {}, "no prompt given"),
    ([torch.tensor([3, 4]), torch.tensor([5], device="meta")], {}, "mixed devices"),
    (torch.tensor([[0, 0, 5], [4, 3, 7]]), {}, "shape \\(2, 3\\): a prompt is one 1-D token tensor"),
    (torch.tensor([5.7, 3.2]), {}, "prompt 0 is a float32 tensor; token ids are integers"),
    (torch.tensor([True, False]), {}, "prompt 0 is a bool tensor"), ([[2 ** 70]], {}, "holds a token id beyond int64"),
    (["w1 w2 w3 w4 w5"], dict(max_len=4), "prompt of 5 tokens is longer than the KV cache \\(4 tokens\\)"),
    (["w1 w2 w3"], dict(max_new_tokens=5, max_len=4), "prompt of 3 tokens \\+ 5 new does not fit the KV cache"),
    (["w1 w2"], dict(max_new_tokens=100000), "exceeds the model's context of 256 tokens"),
])
def test_generate_refuses_bad_arguments(engine, prompts, kw, msg):
    from wide.inference import generate

    with pytest.raises(WideError, match=msg):
        generate(engine, tiny_tokenizer(), prompts, **{"max_new_tokens": 2, **kw})


def test_generate_refuses_other_engines_and_untokenizable_text(engine):
    from wide.inference import Sampling, generate

    with pytest.raises(WideError, match="engine must be a wide.inference.Engine .* got WideModel"):
        generate(WideModel(tiny_model(), WideConfig(ffn_group_size=32)), None, [[5, 6]], 2)
    with pytest.raises(WideError, match="prompt 0 cannot be tokenized \\(TextEncodeInput"):
        generate(engine, _Untokenizable(), "\ud800abc", 2)
    with pytest.raises(WideError, match="text prompts need a tokenizer"):
        generate(engine, None, "w1", 2)
    assert generate(engine, None, torch.tensor([[5, 6, 7]]), 2).tokens == generate(engine, None, [[5, 6, 7]], 2,
                                                                                    sampling=Sampling()).tokens


def test_generation_path_names_what_runs(reference_path):
    from wide.inference import Engine, generate
    from wide.inference.generation import path_of

    for ops, fast, graphs, want in [("routed", True, True, "kernels+cuda-graphs"), ("routed", True, False, "kernels"),
                                    ("routed", False, False, "reference"), ("dense", True, True,
                                                                            "dense+kernels+cuda-graphs"),
                                    ("dense", True, False, "dense+kernels"), ("dense", False, False, "dense")]:
        assert path_of(types.SimpleNamespace(ops=ops, fast=fast), graphs) == want
    for ops, want in (("dense", "dense"), ("routed", "reference")):
        assert generate(Engine(tiny_model(), ops=ops), tiny_tokenizer(), ["w1 w2"], max_new_tokens=2).path == want


def test_eos_is_the_union_of_the_tokenizer_and_the_model(engine):
    """SmolLM2-Instruct's GGUF tokenizer says EOS = <|im_start|> (1), its generation config <|im_end|> (2): a chat
    reply stops at either; generation stops at the generation config's EOS."""
    from wide.inference import generate
    from wide.inference.generation import eos_ids

    ns = types.SimpleNamespace
    model = ns(config=ns(eos_token_id=2), generation_config=ns(eos_token_id=[2, 7]))
    assert eos_ids(model, ns(eos_token_id=1)) == {1, 2, 7} and eos_ids(model) == {2, 7}
    assert eos_ids(ns(config=ns(eos_token_id=None))) == set()
    free = generate(engine, None, [[5, 6, 7]], 6, stop_at_eos=False).tokens[0]
    engine.base.config.eos_token_id, engine.base.generation_config.eos_token_id = None, free[2]
    tok = ns(eos_token_id=None, pad_token_id=0, decode=lambda ids, **k: "")
    assert generate(engine, tok, [[5, 6, 7]], 6).tokens[0] == free[:free.index(free[2]) + 1]


def test_stream_delta_holds_back_a_split_character():
    """The decoded prefixes of two rocket emoji over six tokens: U+FFFD until a character completes."""
    from wide.inference.generation import stream_delta

    shown, printed = "", []
    for text in ["\ufffd", "\ufffd", "\U0001F680", "\U0001F680\ufffd", "\U0001F680\ufffd", "\U0001F680\U0001F680"]:
        delta, shown = stream_delta(shown, text)
        printed.append(delta)
    assert printed == ["", "", "\U0001F680", "", "", "\U0001F680"] and stream_delta("ab", "abc") == ("c", "abc")


# --- wide generate -----------------------------------------------------------------------------------------------
@pytest.fixture
def no_weights(monkeypatch):
    """Loading any weights (the base model's or a WIDE checkpoint's) fails the test."""
    import transformers

    import wide.checkpoint

    def boom(*a, **k):
        raise AssertionError("weights were loaded before the size check")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", boom)
    monkeypatch.setattr(wide.checkpoint, "load", boom)


def _generate(capsys, *argv):
    from wide.cli import main

    rc = main(["generate", "--device", "cpu", *map(str, argv)])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("argv,msg", [  # the tiny model has 256 tokens of context; "w1 w2 w3 w4" is 4 tokens
    (["--prompt", "w1", "--max-new-tokens", "300"],
     "a KV cache of 301 tokens (prompt of 1 token + --max-new-tokens 300) exceeds the model's context of 256"),
    (["--prompt", "w1 w2 w3 w4", "--max-new-tokens", "253"],
     "a KV cache of 257 tokens (prompt of 4 tokens + --max-new-tokens 253) exceeds the model's context of 256"),
    (["--prompt", "w1", "--max-cache-len", "1000"],
     "a KV cache of 1000 tokens (--max-cache-len 1000) exceeds the model's context of 256 tokens"),
    (["--prompt", "w1 w2 w3 w4", "--max-cache-len", "3", "--max-new-tokens", "1"],
     "prompt of 4 tokens is longer than the KV cache (--max-cache-len 3)"),
    (["--prompt", "w1 w2 w3 w4", "--max-cache-len", "6", "--max-new-tokens", "3"],
     "prompt of 4 tokens + --max-new-tokens 3 does not fit the KV cache (--max-cache-len 6); use --max-cache-len >= 7"),
    (["--prompt", "w1", "--chat"], "--chat: this tokenizer has no chat template"),
    (["--prompt", "  "], "empty prompt: every --prompt needs some text"),
])
def test_cli_generate_checks_sizes_before_loading(model_dir, capsys, no_weights, argv, msg):
    rc, _, err = _generate(capsys, "--model", model_dir, *argv)
    assert rc == 2 and err.strip().splitlines()[-1].startswith(f"wide generate: error: {msg}"), err


@pytest.mark.parametrize("argv,msg", [
    (["--max-new-tokens", "5", "--max-cache-len", "3"], "a prompt of at least 1 token + --max-new-tokens 5 does not "
     "fit the KV cache (--max-cache-len 3); use --max-cache-len >= 5 + the prompt's tokens (known once the tokenizer "
     "has read it) or fewer new tokens"),
    (["--max-new-tokens", "0"], "--max-new-tokens 0 must be >= 1"), (["--max-cache-len", "0"], "--max-cache-len 0"),
    (["--top-p", "0.9"], "--top-p only applies when sampling: add --temperature T > 0"),
    (["--temperature", "-0.5"], "--temperature -0.5 must be a finite number >= 0"),
])
def test_cli_generate_checks_options_before_reading_the_config(model_dir, capsys, monkeypatch, argv, msg):
    import transformers

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained",
                        lambda *a, **k: (_ for _ in ()).throw(AssertionError("config read")))
    rc, _, err = _generate(capsys, "--model", model_dir, "--prompt", "w1", *argv)
    assert rc == 2 and err.strip().splitlines()[-1].startswith(f"wide generate: error: {msg}"), err


def test_cli_generate_checks_the_window_and_the_checkpoints_base_before_loading(tmp_path, model_dir, capsys,
                                                                               monkeypatch, no_weights):
    """The sliding window of a Mistral base; ``--wide``: the base config through ``wide.checkpoint.load``'s hook."""
    import transformers

    from wide.checkpoint import save_wide
    from wide.hub import load_base_model

    d = tmp_path / "mistral"
    tiny_model("mistral", sliding_window=16).save_pretrained(d)
    tiny_tokenizer().save_pretrained(d)
    rc, _, err = _generate(capsys, "--model", d, "--prompt", "w1 w2", "--max-new-tokens", "15")
    assert rc == 2 and "a KV cache of 17 tokens (prompt of 2 tokens + --max-new-tokens 15) exceeds the model's " \
                      "sliding attention window (16)" in err.strip().splitlines()[-1], err
    monkeypatch.undo()
    base, _, src = load_base_model(str(model_dir), device="cpu")
    ckpt = save_wide(WideModel(base, WideConfig(ffn_group_size=32)), tmp_path / "ckpt", src.ref)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        lambda *a, **k: (_ for _ in ()).throw(AssertionError("base weights loaded")))
    rc, _, err = _generate(capsys, "--wide", ckpt, "--prompt", "w1", "--max-cache-len", "300")
    assert rc == 2 and err.strip().splitlines()[-1] == ("wide generate: error: a KV cache of 300 tokens "
                                                        "(--max-cache-len 300) exceeds the model's context of 256 "
                                                        "tokens (max_position_embeddings)"), err


def test_cli_generate_refuses_another_base_model_and_a_missing_gpu(tmp_path, model_dir, capsys, reference_path):
    from wide.checkpoint import save_wide
    from wide.hub import load_base_model

    base, _, src = load_base_model(str(model_dir), device="cpu")
    ckpt = save_wide(WideModel(base, WideConfig(ffn_group_size=32)), tmp_path / "ckpt", src.ref)
    other = tmp_path / "other"
    tiny_model(seed=9).save_pretrained(other)
    tiny_tokenizer().save_pretrained(other)
    cases = [(["--wide", ckpt, "--model", other], "made for base model")]
    if not torch.cuda.is_available():
        cases.append((["--model", model_dir, "--device", "cuda"], "no CUDA GPU"))
    for argv, msg in cases:
        from wide.cli import main

        rc = main(["generate", "--prompt", "w1", "--max-new-tokens", "2", *map(str, argv)])
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 2 and msg in err[-1] and err[-1].startswith("wide generate: error:"), err


@pytest.mark.parametrize("extra,path,how", [
    ([], "reference", "falls back to the reference path on the CPU (the PyTorch reference of every kernel)"),
    (["--dense-ops"], "dense", "runs dense PyTorch ops on the CPU"),
])
def test_cli_generate_one_cpu_line_and_a_truthful_path(model_dir, capsys, reference_path, extra, path, how):
    rc, out, err = _generate(capsys, "--model", model_dir, "--prompt", "w1 w2", "--max-new-tokens", "1", *extra)
    assert rc == 0, err
    why = "no CUDA device" if not torch.cuda.is_available() else "--device cpu"
    about = [ln for ln in err.splitlines() if "fall" in ln or "reference" in ln or "CPU" in ln or "CUDA" in ln]
    assert about == [f"wide generate: {why}: the engine {how}; no CUDA graphs, slow"], err
    last = out.strip().splitlines()[-1]
    assert last.endswith(f"| path: {path}") and "| TPOT n/a (no decode step) |" in last and "(1 token, batch 1)" in last


def test_cli_cpu_notice_names_the_path_and_why(monkeypatch):
    from wide.cli.generate import _cpu_notice

    args = types.SimpleNamespace(device="cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    ns = types.SimpleNamespace
    assert _cpu_notice(ns(ops="routed", fast=False), args).startswith(
        "wide generate: --device cpu: the engine falls back to the reference path on the CPU")
    assert "routed Triton kernels in the Triton interpreter" in _cpu_notice(ns(ops="routed", fast=True), args)
    assert "dense PyTorch ops on the CPU, its few Triton kernels" in _cpu_notice(ns(ops="dense", fast=True), args)
