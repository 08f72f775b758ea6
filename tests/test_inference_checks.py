"""Fresh-user input checks of the inference engine: ``Engine.decode`` / ``Engine.new_cache`` arguments, the
truthful ``path`` of generation, and ``wide generate`` refusing bad sizes before the weights load.  CPU only
(the PyTorch reference path: fast)."""

from __future__ import annotations

import types

import pytest
import torch

from wide import WideConfig, WideError
from wide.model import WideModel
from wide_testutil import tiny_model, tiny_tokenizer


@pytest.fixture
def reference_path(monkeypatch):
    """Kernels fall back to their PyTorch references (fast on CPU)."""
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


def test_decode_refuses_bad_tokens_batch_device_valid_and_cache(engine):
    eng = engine
    vocab = eng.embed.num_embeddings
    cache = _prefilled(eng)
    ok = torch.tensor([5, 6])
    bad = [
        (ok.float(), "int64 tensor \\[B\\].*got torch.float32 \\[2\\]"),
        (ok.to(torch.int32), "int64 tensor \\[B\\].*got torch.int32"),
        (ok.view(2, 1), "int64 tensor \\[B\\].*\\[2, 1\\]"),
        ([5, 6], "int64 tensor \\[B\\].*got list"),
        (torch.tensor([5, 6, 7]), "3 tokens for a KV cache of 2 rows"),
        (torch.tensor([5]), "1 token for a KV cache of 2 rows"),
        (torch.tensor([5, vocab]), f"ids from 5 to {vocab}; the model's vocabulary is 0..{vocab - 1}"),
        (torch.tensor([-1, 6]), "ids from -1 to 6"),
        (ok.to("meta"), "tokens are on meta, the engine's model is on cpu"),
    ]
    for toks, msg in bad:
        with pytest.raises(WideError, match=msg):
            eng.decode(toks, cache)
    for valid, msg in [(torch.ones(2), "valid must be a bool tensor \\[2\\].*float32"),
                       (torch.ones(3, dtype=torch.bool), "valid must be a bool tensor \\[2\\]"),
                       ("yes", "got str")]:
        with pytest.raises(WideError, match=msg):
            eng.decode(ok, cache, valid=valid)
    with pytest.raises(WideError, match="cache must be a StaticKVCache"):
        eng.decode(ok, object())
    from wide.inference import StaticKVCache

    d = eng.dims
    for other in (StaticKVCache(d.num_layers, 2, d.num_kv_heads, d.head_dim, 6, torch.float64, "cpu"),
                  StaticKVCache(d.num_layers + 1, 2, d.num_kv_heads, d.head_dim, 6, torch.float32, "cpu")):
        with pytest.raises(WideError, match="does not fit this model"):
            eng.decode(ok, other)
        with pytest.raises(WideError, match="does not fit this model"):
            eng.prefill(ok.view(2, 1), None, other)
    assert cache.lengths.tolist() == [3, 3]  # nothing was written by a refused step
    eng.decode(ok, cache, valid=torch.tensor([True, False]))
    assert cache.lengths.tolist() == [4, 4]


def test_decode_refuses_a_full_cache(engine):
    eng = engine
    cache = _prefilled(eng, B=2, T=3, max_len=4)
    eng.decode(torch.tensor([5, 6]), cache)  # fills the last slot
    with pytest.raises(WideError, match="KV cache is full \\(row 0 holds 4 tokens of 4\\); no slot is left"):
        eng.decode(torch.tensor([5, 6]), cache)
    assert cache.lengths.tolist() == [4, 4]
    cache.lengths[0] = 1  # one full row is enough
    with pytest.raises(WideError, match="row 1 holds 4 tokens of 4"):
        eng.decode(torch.tensor([5, 6]), cache)


def test_decode_reads_no_value_off_the_cpu(engine, monkeypatch):
    """On a GPU the value checks (ids in range, a free slot) would be a host sync per step, impossible under
    CUDA-graph capture: off the CPU decode only checks metadata.  Meta tensors stand in for GPU ones (reading a
    value of one raises), and the step stops right after the checks."""
    eng = engine
    eng.device = torch.device("meta")
    cache = eng.new_cache(2, 4)
    cache.lengths = torch.full((2,), 4, dtype=torch.int64, device="meta")  # "full", out-of-range: not read

    class Reached(Exception):
        pass

    def embed(tokens):  # the first op of the step
        raise Reached

    monkeypatch.setattr(eng, "embed", embed)
    with pytest.raises(Reached):
        eng.decode(torch.zeros(2, dtype=torch.int64, device="meta"), cache,
                   valid=torch.ones(2, dtype=torch.bool, device="meta"))
    with pytest.raises(WideError, match="int64"):  # the metadata checks still run
        eng.decode(torch.zeros(2, dtype=torch.int32, device="meta"), cache)


def test_new_cache_refuses_bad_sizes(engine):
    import numpy as np

    for kw, msg in [(dict(batch=0, max_len=4), "batch=0 must be >= 1"),
                    (dict(batch=1, max_len=-3), "max_len=-3 must be >= 1"),
                    (dict(batch=1, max_len=2.5), "max_len=2.5 must be an int >= 1"),
                    (dict(batch=True, max_len=4), "batch=True must be an int >= 1"),
                    (dict(batch="2", max_len=4), "batch='2' must be an int >= 1")]:
        with pytest.raises(WideError, match=msg):
            engine.new_cache(**kw)
    c = engine.new_cache(np.int64(2), 5)
    assert c.batch == 2 and c.max_len == 5 and c.lengths.tolist() == [0, 0]


def test_new_cache_refuses_a_cache_beyond_the_context(engine):
    ctx = engine.base.config.max_position_embeddings
    assert engine.new_cache(1, ctx).max_len == ctx
    with pytest.raises(WideError, match=f"a KV cache of {10 ** 7} tokens exceeds the model's context of {ctx} "
                                        "tokens \\(max_position_embeddings\\)"):
        engine.new_cache(1, 10 ** 7)  # refused before ~230 GB are asked of the allocator


def test_engine_and_generate_refuse_misused_arguments(engine):
    from wide.inference import Engine, Sampling, generate

    for bad in ["x", 3, torch.nn.Linear(2, 2)]:
        with pytest.raises(WideError, match=f"Engine needs a WideModel \\(wide.load\\) or a Hugging Face causal "
                                            f"LM; got {type(bad).__name__}"):
            Engine(bad)
    tok = tiny_tokenizer()
    for args, kw, msg in [
        ((["w1"], "3"), {}, "max_new_tokens='3' must be an int >= 1"),
        ((["w1"], 2.5), {}, "max_new_tokens=2.5 must be an int >= 1"),
        ((["w1"], True), {}, "max_new_tokens=True must be an int >= 1"),
        ((["w1"], 2), {"sampling": 0.7}, "sampling=0.7 must be a wide.inference.Sampling"),
        ((["w1"], 2), {"sampling": {"temperature": 0.7}}, "sampling=\\{'temperature': 0.7\\} must be a"),
        ((5, 2), {}, "prompts must be a string, a token tensor, or a list of them; got int"),
        ((["w1", 7], 2), {}, "prompt 1 is a int: a prompt is a string, a 1-D token tensor or a list of int token ids"),
        (([[1, 2.5]], 2), {}, "prompt 0 is a list"),
    ]:
        with pytest.raises(WideError, match=msg):
            generate(engine, tok, *args, **kw)
    assert generate(engine, tok, [[5, 6]], 2, sampling=Sampling(), graphs=False).tokens[0]  # the good forms run


def test_new_cache_refuses_a_cache_beyond_the_sliding_window(reference_path):
    from wide.inference import Engine

    eng = Engine(tiny_model("mistral", sliding_window=8))
    assert eng.new_cache(1, 8).max_len == 8
    with pytest.raises(WideError, match="exceeds the model's sliding attention window \\(8\\)"):
        eng.new_cache(1, 9)


def test_generation_path_names_what_runs(reference_path):
    from wide.inference import Engine, generate
    from wide.inference.generation import path_of

    for ops, kernels, graphs, want in [("routed", True, True, "kernels+cuda-graphs"), ("routed", True, False, "kernels"),
                                       ("routed", False, False, "reference"),
                                       ("dense", True, True, "dense+kernels+cuda-graphs"),
                                       ("dense", True, False, "dense+kernels"), ("dense", False, False, "dense")]:
        assert path_of(types.SimpleNamespace(ops=ops, uses_kernels=kernels), graphs) == want
    base = tiny_model()
    for ops, want in (("dense", "dense"), ("routed", "reference")):
        res = generate(Engine(base, ops=ops), tiny_tokenizer(), ["w1 w2"], max_new_tokens=2)
        assert res.path == want


# --- wide generate ------------------------------------------------------------------------------------------


@pytest.fixture
def no_weights(monkeypatch):
    """Loading any weights (the base model's or a WIDE checkpoint) fails the test."""
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


def test_cli_generate_checks_sizes_before_loading(model_dir, tmp_path, capsys, monkeypatch, no_weights):
    m = ["--model", model_dir]
    cases = [  # the tiny model: 256 tokens of context (max_position_embeddings); "w1 w2 w3 w4" is 4 tokens
        (m + ["--prompt", "w1", "--max-new-tokens", "300"],
         "a KV cache of 301 tokens (prompt of 1 token + --max-new-tokens 300) exceeds the model's context of 256"),
        (m + ["--prompt", "w1 w2 w3 w4", "--max-new-tokens", "253"],
         "a KV cache of 257 tokens (prompt of 4 tokens + --max-new-tokens 253) exceeds the model's context of 256"),
        (m + ["--prompt", "w1", "--max-cache-len", "1000"],
         "a KV cache of 1000 tokens (--max-cache-len 1000) exceeds the model's context of 256 tokens"),
        (m + ["--prompt", "w1 w2 w3 w4", "--max-cache-len", "3", "--max-new-tokens", "1"],
         "prompt of 4 tokens is longer than the KV cache (--max-cache-len 3)"),
        (m + ["--prompt", "w1 w2 w3 w4", "--max-cache-len", "6", "--max-new-tokens", "3"],
         "prompt of 4 tokens + --max-new-tokens 3 does not fit the KV cache (--max-cache-len 6); use "
         "--max-cache-len >= 7"),
        (m + ["--prompt", "w1", "--chat"], "--chat: this tokenizer has no chat template"),
    ]
    for argv, msg in cases:
        rc, _, err = _generate(capsys, *argv)
        last = err.strip().splitlines()[-1]
        assert rc == 2 and last.startswith(f"wide generate: error: {msg}"), (argv, err)
    # sizes that need no model are refused before even the config is read
    import transformers

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained",
                        lambda *a, **k: (_ for _ in ()).throw(AssertionError("config read")))
    for argv, msg in [(["--max-new-tokens", "5", "--max-cache-len", "3"],
                       "a prompt of at least 1 token + --max-new-tokens 5 does not fit the KV cache "
                       "(--max-cache-len 3); use --max-cache-len >= 5 + the prompt's tokens (known once the "
                       "tokenizer has read it) or fewer new tokens"),  # not a bound that fails again later
                      (["--max-new-tokens", "0"], "--max-new-tokens 0 must be >= 1"),
                      (["--max-cache-len", "0"], "--max-cache-len 0 must be >= 1")]:
        rc, _, err = _generate(capsys, *m, "--prompt", "w1", *argv)
        assert rc == 2 and err.strip().splitlines()[-1].startswith(f"wide generate: error: {msg}"), (argv, err)


def test_cli_generate_checks_the_sliding_window_before_loading(tmp_path, capsys, no_weights):
    d = tmp_path / "mistral"
    tiny_model("mistral", sliding_window=16).save_pretrained(d)
    tiny_tokenizer().save_pretrained(d)
    rc, _, err = _generate(capsys, "--model", d, "--prompt", "w1 w2", "--max-new-tokens", "15")
    assert rc == 2 and "a KV cache of 17 tokens (prompt of 2 tokens + --max-new-tokens 15) exceeds the model's " \
                      "sliding attention window (16)" in err.strip().splitlines()[-1], err


def test_cli_generate_wide_checks_the_context_before_loading(tmp_path, model_dir, capsys, monkeypatch):
    """--wide: the sizes are checked against the base config (wide.checkpoint.load's ``check`` hook) before any
    base weight is read, whatever the base (a Hugging Face directory here; the bundled GGUF the same way)."""
    import transformers

    from wide.checkpoint import save_wide
    from wide.model import load_base_model

    base, _, src = load_base_model(str(model_dir), device="cpu")
    ckpt = save_wide(WideModel(base, WideConfig(ffn_group_size=32)), tmp_path / "ckpt", src.ref)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        lambda *a, **k: (_ for _ in ()).throw(AssertionError("base weights loaded")))
    rc, _, err = _generate(capsys, "--wide", ckpt, "--prompt", "w1", "--max-cache-len", "300")
    assert rc == 2 and err.strip().splitlines()[-1] == ("wide generate: error: a KV cache of 300 tokens "
                                                        "(--max-cache-len 300) exceeds the model's context of 256 "
                                                        "tokens (max_position_embeddings)"), err


def test_cli_generate_one_cpu_line_and_a_truthful_path(model_dir, capsys, reference_path):
    rc, out, err = _generate(capsys, "--model", model_dir, "--prompt", "w1 w2", "--max-new-tokens", "2")
    assert rc == 0, err
    why = "no CUDA device" if not torch.cuda.is_available() else "--device cpu"  # a GPU machine asked for the CPU
    about = [ln for ln in err.splitlines() if "fall" in ln or "reference" in ln or "CPU" in ln or "CUDA" in ln]
    assert about == [f"wide generate: {why}: the engine falls back to the reference path on the CPU (the "
                     "PyTorch reference of every kernel); no CUDA graphs, slow"], err
    assert out.strip().splitlines()[-1].endswith("| path: reference")
    rc, out, err = _generate(capsys, "--model", model_dir, "--prompt", "w1 w2", "--max-new-tokens", "2",
                             "--dense-ops")
    assert rc == 0, err
    about = [ln for ln in err.splitlines() if "fall" in ln or "reference" in ln or "CPU" in ln or "CUDA" in ln]
    assert about == [f"wide generate: {why}: the engine runs dense PyTorch ops on the CPU; no CUDA graphs, "
                     "slow"], err
    assert out.strip().splitlines()[-1].endswith("| path: dense")


def test_cli_generate_one_token_has_no_tpot(model_dir, capsys, reference_path):
    rc, out, err = _generate(capsys, "--model", model_dir, "--prompt", "w1 w2", "--max-new-tokens", "1")
    assert rc == 0, err
    last = out.strip().splitlines()[-1]
    assert "| TPOT n/a (no decode step) |" in last and "(1 token, batch 1)" in last, last


def test_cli_cpu_notice_names_the_path_and_why(monkeypatch):
    from wide.cli.generate import _cpu_notice

    args = types.SimpleNamespace(device="cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    eng = types.SimpleNamespace(ops="routed", uses_kernels=False)
    assert _cpu_notice(eng, args).startswith("wide generate: --device cpu: the engine falls back to the reference "
                                             "path on the CPU")
    eng = types.SimpleNamespace(ops="routed", uses_kernels=True)
    assert "routed Triton kernels in the Triton interpreter on the CPU" in _cpu_notice(eng, args)
    eng = types.SimpleNamespace(ops="dense", uses_kernels=True)
    assert "dense PyTorch ops on the CPU, its few Triton kernels" in _cpu_notice(eng, args)


def test_generate_refuses_prompt_tensors_it_would_misread(engine):
    """A padded [B, T] tensor used to become one prompt of B * T tokens; float / bool tensors were truncated / read
    as 0 and 1; an id beyond int64, a max_len that is not an int, an on_token that is not callable and a model in
    place of the engine raised bare Python errors."""
    from wide.inference import generate

    cases = [
        (torch.tensor([[0, 0, 5], [4, 3, 7]]), "shape \\(2, 3\\): a prompt is one 1-D token tensor"),
        (torch.tensor([5.7, 3.2]), "prompt 0 is a float32 tensor; token ids are integers"),
        (torch.tensor([True, False]), "prompt 0 is a bool tensor"),
        ([[2 ** 70]], "prompt 0 holds a token id beyond int64"),
    ]
    for prompts, msg in cases:
        with pytest.raises(WideError, match=msg):
            generate(engine, None, prompts, 2)
    for kw, msg in [({"max_len": "10"}, "max_len='10' must be an int >= 1"), ({"max_len": True}, "max_len=True"),
                    ({"on_token": 5}, "on_token=5 must be callable")]:
        with pytest.raises(WideError, match=msg):
            generate(engine, None, [[5, 6]], 2, **kw)
    with pytest.raises(WideError, match="engine must be a wide.inference.Engine .* got WideModel"):
        generate(WideModel(tiny_model(), WideConfig(ffn_group_size=32)), None, [[5, 6]], 2)
    # a [1, T] tensor is one prompt, as before
    one = generate(engine, None, torch.tensor([[5, 6, 7]]), 2).tokens
    assert one == generate(engine, None, [[5, 6, 7]], 2).tokens


def test_generate_text_prompts_name_whitespace_and_untokenizable(engine):
    from wide.inference import generate

    tok = tiny_tokenizer()
    with pytest.raises(WideError, match="empty prompt \\(prompt 0 is only whitespace\\)"):
        generate(engine, tok, "   ", 2)

    with pytest.raises(WideError, match="prompt 0 cannot be tokenized \\(TextEncodeInput"):
        generate(engine, _Untokenizable(tok), "\ud800abc", 2)


class _Untokenizable:
    """A tokenizer whose encoding fails as the fast tokenizers do on a lone surrogate."""

    def __init__(self, tok):
        self.pad_token_id, self.eos_token_id = tok.pad_token_id, tok.eos_token_id

    def __call__(self, *a, **k):
        raise TypeError("TextEncodeInput must be Union[TextInputSequence, Tuple[InputSequence, InputSequence]]")


def test_eos_is_the_union_of_the_tokenizer_and_the_model():
    """SmolLM2-Instruct's GGUF tokenizer says EOS = <|im_start|> (1), its generation config <|im_end|> (2): a chat
    reply must stop at either."""
    from wide.inference.generation import eos_ids

    model = types.SimpleNamespace(config=types.SimpleNamespace(eos_token_id=2),
                                  generation_config=types.SimpleNamespace(eos_token_id=[2, 7]))
    assert eos_ids(model, types.SimpleNamespace(eos_token_id=1)) == {1, 2, 7}
    assert eos_ids(model) == {2, 7}
    assert eos_ids(types.SimpleNamespace(config=types.SimpleNamespace(eos_token_id=None))) == set()


def test_generation_stops_at_the_generation_configs_eos(engine):
    from wide.inference import generate

    free = generate(engine, None, [[5, 6, 7]], 6, stop_at_eos=False).tokens[0]
    stop_tok = free[2]
    engine.base.config.eos_token_id = None
    engine.base.generation_config.eos_token_id = stop_tok
    tok = types.SimpleNamespace(eos_token_id=None, pad_token_id=0, decode=lambda ids, **k: "")
    got = generate(engine, tok, [[5, 6, 7]], 6).tokens[0]
    assert got == free[:free.index(stop_tok) + 1]


def test_stream_delta_holds_back_a_split_character():
    """The decoded prefixes of two rocket emoji over six tokens: U+FFFD until a character completes."""
    from wide.inference.generation import stream_delta

    shown, printed = "", []
    for text in ["\ufffd", "\ufffd", "\U0001F680", "\U0001F680\ufffd", "\U0001F680\ufffd", "\U0001F680\U0001F680"]:
        delta, shown = stream_delta(shown, text)
        printed.append(delta)
    assert "".join(printed) == "\U0001F680\U0001F680"
    assert printed == ["", "", "\U0001F680", "", "", "\U0001F680"]
    assert stream_delta("ab", "abc") == ("c", "abc")


def test_new_cache_beyond_the_available_memory_is_refused(engine, monkeypatch):
    """Linux overcommits a huge CPU allocation and kills the process while zeroing it: refuse it first."""
    import wide.memory as M

    monkeypatch.setattr(M, "available_memory", lambda device: (10 * 2**20, "a test's 10 MiB"))
    d = engine.dims
    need = 2 * d.num_layers * 4 * d.num_kv_heads * 64 * d.head_dim * engine.dtype.itemsize
    assert need < 10 * 2**20
    engine.new_cache(4, 64)  # fits
    rows = 10 * 2**20 // (2 * d.num_layers * d.num_kv_heads * 64 * d.head_dim * engine.dtype.itemsize) + 1
    with pytest.raises(WideError, match=f"a KV cache of {rows} x 64 tokens needs .* GiB on cpu, more than the "
                                        "0.01 GiB available \\(a test's 10 MiB\\)"):
        engine.new_cache(rows, 64)
