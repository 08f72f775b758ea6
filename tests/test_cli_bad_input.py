"""Every bad input a user can give the ``wide`` command line, in one table: the arguments, what the one error line
says, and (where it matters) what must not have been read yet. Each case must end with exit code 2, exactly one
line ``wide <command>: error: ...`` on stderr (the last line when the model loaded first: its progress bars may
come before), no traceback, and nothing written under the test's folder.

Placeholders in the arguments and messages: ``{model}`` a tiny Llama folder, ``{text}`` a text file, ``{nowhere}``
a model path that does not exist (so a refusal shows it came before any loading), ``{out}`` a new output folder,
``{full}`` a folder holding a file, ``{afile}`` a file, ``{short}`` / ``{emptytxt}`` too short / empty texts,
``{ckpt}`` a saved WIDE checkpoint of the tiny model, ``{run}`` a one-step ``wide calibrate`` output, ``{blank}``
an empty argument. ``loads=True`` marks the cases that load the tiny model's weights before refusing;
``before="weights"`` / ``"tokenizer"`` makes reading those fail the test.
"""

from __future__ import annotations

import importlib.util
import json
import shutil

import pytest
import torch

from wide.cli import main
from wide_testutil import calibrate_args, tiny_llama_config, tiny_model

HAS_LM_EVAL, HAS_PEFT = (importlib.util.find_spec(m) is not None for m in ("lm_eval", "peft"))
CAL = "calibrate --model {model} --text {text} -o {out} --steps 1 --seq-len 32 --ffn-group-size 32 --device cpu"
NOWHERE_CAL = "calibrate --model {nowhere} --text {text} -o {out} --steps 1 --device cpu"
LORA = "lora --wide {ckpt} --model {model} --text {text} -o {out} --steps 1 --batch-size 1 --seq-len 32 --device cpu"
PPL = "eval-ppl --model {model} --text {text} --ctx 32 --device cpu"
PRUNE = "prune-static --model {model} --text {text} -o {out} --seq-len 32 --calib-blocks 2 --device cpu"
DEMO = ("demo --model {model} --text {text} -o {out} --device cpu --steps 1 --seq-len 32 --ctx 32 --eval-tokens 64 "
        "--ffn-group-size 32")


class Ctx:
    """The files a case refers to (made when its arguments name them) and the changes it makes first."""

    def __init__(self, tmp, model, text, monkeypatch, capsys):
        self.tmp, self.mp, self.capsys = tmp, monkeypatch, capsys
        self.fixed = {"tmp": tmp, "model": model, "text": text, "nowhere": tmp / "no-model", "out": tmp / "out",
                      "afile": tmp / "afile", "full": tmp / "full", "short": tmp / "short.txt",
                      "emptytxt": tmp / "empty.txt", "blank": ""}
        (tmp / "afile").write_text("x")
        (tmp / "full").mkdir()
        (tmp / "full" / "x").write_text("someone else's file\n")
        (tmp / "short.txt").write_text("w1 w2 w3")
        (tmp / "empty.txt").write_text("\n")
        self.made: dict = {}

    def __getitem__(self, key):  # str.format_map: the files named, made on first use
        if key in self.fixed:
            return self.fixed[key]
        if key not in self.made:
            self.made[key] = getattr(self, f"_make_{key}")()
        return self.made[key]

    def fmt(self, s: str) -> str:
        return s.format_map(self)

    def _make_ckpt(self):
        from wide.checkpoint import save_wide
        from wide.config import WideConfig
        from wide.model import WideModel

        return save_wide(WideModel(tiny_model(), WideConfig(ffn_group_size=32)), self.tmp / "ckpt",
                         model_ref=str(self.fixed["model"]))

    def _make_run(self):
        out = self.tmp / "run"
        assert main([str(a) for a in calibrate_args(self.fixed["model"], self.fixed["text"], out)]) == 0
        self.capsys.readouterr()
        return out

    def _make_gpt2(self):
        from transformers import GPT2Config, GPT2LMHeadModel

        GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50)).save_pretrained(self.tmp / "gpt2")
        return self.tmp / "gpt2"

    def _make_stk(self):  # a model folder without tokenizer files
        tiny_model().save_pretrained(self.tmp / "stk")
        return self.tmp / "stk"

    def _make_gguf(self):  # a small whole GGUF file
        gguf = pytest.importorskip("gguf")
        import numpy as np

        w = gguf.GGUFWriter(str(self.tmp / "whole.gguf"), "llama")
        for add, v in ((w.add_block_count, 1), (w.add_context_length, 64), (w.add_embedding_length, 8),
                       (w.add_feed_forward_length, 16), (w.add_head_count, 2), (w.add_head_count_kv, 1)):
            add(v)
        w.add_tensor("token_embd.weight", np.zeros((16, 8), dtype=np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return self.tmp / "whole.gguf"

    # --- changes a case makes before it runs ---------------------------------------------------------------
    def edit_json(self, path, **fields):
        path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))

    def cuda(self, n: int):
        self.mp.setattr(torch.cuda, "is_available", lambda: n > 0)
        self.mp.setattr(torch.cuda, "device_count", lambda: n)

    def memory(self, available: int):
        import wide.memory as M

        self.mp.setattr(M, "available_memory", lambda device: (available, "MemAvailable of this machine"))

    def missing(self, module: str):
        real = importlib.util.find_spec
        self.mp.setattr(importlib.util, "find_spec", lambda name, *a: None if name == module else real(name, *a))

    def train_state(self):  # a training state whose description is not JSON
        (self.tmp / "full" / "train_state.dcp").mkdir()
        (self.tmp / "full" / "train_state.dcp" / ".metadata").write_bytes(b"")
        (self.tmp / "full" / "train_state.dcp" / "train_state.json").write_text("{not json")

    def os_error(self, owner, name: str, path, error: OSError):
        """``owner.name(...)`` raises ``error`` for ``path`` (the first argument, or the object it is called on),
        as an unreadable file does for a user that is not root."""
        real = getattr(owner, name)
        def fails(first, *a, **k):
            if str(first) == str(path):
                raise error
            return real(first, *a, **k)
        self.mp.setattr(owner, name, fails)

    def cut(self, path, keep: int):
        data = path.read_bytes()[:keep]
        path.write_bytes(data)
        return len(data)


def tiny_train_memory():
    from wide.config import WideConfig
    from wide.memory import train_memory_from_config

    return train_memory_from_config(tiny_llama_config(), WideConfig(ffn_group_size=32), "cpu")


def eval_need(batch: int) -> int:
    """Bytes the memory check estimates for evaluating the tiny model, ``batch`` windows of 32 tokens."""
    from wide.memory import config_param_count, estimate_eval_memory
    from wide.model import dims_of

    cfg = tiny_llama_config()
    return sum(estimate_eval_memory(dims_of(cfg), cfg.vocab_size, config_param_count(cfg), batch, 32))


def gib(n: float) -> str:
    return f"{n / 2 ** 30:.1f} GiB"


def case(argv: str, *words, setup=None, loads=False, before=None, needs=None, id=None):
    """One row: ``argv`` (split on spaces, then formatted), the words of the error line (strings formatted like
    ``argv``, or ``f(ctx)`` giving a list), ``setup(ctx)`` run first."""
    marks = [pytest.mark.skipif(needs == "lm_eval" and not HAS_LM_EVAL, reason="needs lm-eval"),
             pytest.mark.skipif(needs == "peft" and not HAS_PEFT, reason="needs peft")]
    return pytest.param(argv, words, setup, loads, before, marks=marks, id=id or argv.split()[0] + ": " + (
        words[0] if words and isinstance(words[0], str) else argv))


HEADROOM = 0.9  # wide.memory.HEADROOM: the memory cases size what is available from it
DEVICE_COMMANDS = {"info": "", "calibrate": "-o {out}", "lora": "--wide {tmp}/w -o {out}", "eval-ppl": "",
                   "eval": "", "prune-static": "-S 0.5 -o {out}", "demo": "-o {out}", "generate": "--prompt hi"}
DEVICES = [("tpu", 0, ["--device 'tpu'", "use cpu, cuda or cuda:N"]),
           ("cuda", 0, ["--device cuda: no CUDA GPU on this machine (use --device cpu)"]),
           ("cuda:0", 0, ["--device cuda:0: no CUDA GPU on this machine"]),
           ("cuda:2", 2, ["--device cuda:2: this machine has 2 CUDA GPU(s): use cuda:0 to cuda:1 or cpu"])]
CONFIG_DIMS = [({"num_attention_heads": 0}, "num_attention_heads=0 must be a positive integer"),
               ({"hidden_size": "64"}, "hidden_size='64' must be a positive integer"),
               ({"num_hidden_layers": -1}, "num_hidden_layers=-1 must be a positive integer"),
               ({"head_dim": None, "num_attention_heads": 3},
                "hidden_size=64 is not a multiple of num_attention_heads=3"),
               ({"num_key_value_heads": 3}, "num_attention_heads=4 is not a multiple of num_key_value_heads=3")]
BENCH_LISTS = [("--sparsity", "0.5,1.5", "sparsity 1.5 is outside [0, 1)"), ("--sparsity", "nan", "sparsity nan is"),
               ("--sparsity", "0.5,x", "'x' is not a number"), ("--G", "1.5", "'1.5' is not an integer"),
               ("--G", "8", "8 is below 16"), ("--G", "128,100", "group size 100 is not a power of two"),
               ("--sparsity", ",", "empty list"), ("--G", "64,,128", "'64,,128' has an empty item"),
               ("--sparsity", "0.5,", "'0.5,' has an empty item; give comma-separated sparsities in [0, 1), "
                "e.g. 0,0.5"),
               ("--G", ",", "integers >= 16, e.g. 16,32"), ("--time-budget", "-5", "-5 must be a finite number > 0"),
               ("--tag", "../x", "'../x' is not a file stem; use letters, digits"), ("--tag", "..", "not a file stem")]

CASES = [
    # --- usage errors (argparse): one line naming the command's --help -----------------------------------------
    case("calibrate -o x --steps x", "wide calibrate: error: argument --steps: invalid int value: 'x' (see wide "
         "calibrate --help)"),
    case("calibrate", "the following arguments are required: --output/-o"),
    case("eval-ppl --ctx", "argument --ctx: expected one argument (see wide eval-ppl --help)"),
    case("info --bogus", "unrecognized arguments: --bogus"),
    case("info --model {model} --sparsity 0.5", "wide info: error: unrecognized arguments: --sparsity 0.5 (see "
         "wide info --help)"),
    case("eval-ppl --sparsity x", "argument --sparsity: invalid float value: 'x'"),
    case("eval-ppl --sparsity-unit params", "argument --sparsity-unit: invalid choice: 'params'"),
    case("generate --prompt hi --sparsity-unit params", "argument --sparsity-unit: invalid choice: 'params'"),
    case("calibrate -o x --sparsity-unit params", "argument --sparsity-unit: invalid choice: 'params'"),
    case("lora -o x --sparsity-unit bytes", "argument --sparsity-unit: invalid choice: 'bytes'"),
    case("calibrate -o x --max-module-sparsity x", "argument --max-module-sparsity: invalid float value: 'x'"),
    case("eval-ppl --mode global", "unrecognized arguments: --mode global", id="no abbreviation of --model"),
    case("demo --mode x", "argument --mode: invalid choice: 'x'"),
    case("generate --prompt hi --bogus", "wide generate: error: unrecognized arguments: --bogus"),
    case("bench kernels --bogus", "wide bench kernels: error: unrecognized arguments: --bogus"),
    case("nosuch", "wide: error: argument command: invalid choice: 'nosuch'"),
    case("", "wide: error: the following arguments are required: command", id="no command"),
    case("bench", "wide bench: error: the following arguments are required: {{kernels,e2e}}"),
    *[case(f"bench {b} {opt} {bad}", f"wide bench {b}: error: argument {opt}: ", msg)
      for b in ("e2e", "kernels") for opt, bad, msg in BENCH_LISTS],
    *[case(f"bench e2e {opt} {bad}", msg) for opt, bad, msg in (
        ("--split", "foo", "'foo' not allowed; choose from paper, uniform"),
        ("--models", "gpt2", "choose from llama8b, smollm2"), ("--batch", "0", "0 is below 1"),
        ("--runs", "2", "2 is below 5"), ("--trace-sparsity", "-0.1", "outside [0, 1)"),
        ("--max-prefill-tokens", "0", "0 is below 1"), ("--max-kv-gb", "-1", "-1 must be a finite"),
        ("--max-kv-gb", "inf", "inf must be a finite"))],
    *[case(f"bench e2e --trace-points {bad}", "argument --trace-points") for bad in
      ("prefill:1", "train:1:2048", "decode:0:2048", "decode:x:2048")],
    *[case(f"bench kernels {opt} {bad}", msg) for opt, bad, msg in (
        ("--tokens", "-1", "-1 is below 1"), ("--decode-batch", "0", "0 is below 1"), ("--M", "1,2,", "empty item"),
        ("--ops", "gemm_mn,,swiglu", "e.g. gemm_mn,gemm_k"))],

    # --- --device, checked first by every command that takes it -----------------------------------------------
    *[case(f"{cmd} --model {{nowhere}} --device {dev} {extra}", *words, setup=lambda c, n=n: c.cuda(n),
           id=f"{cmd} --device {dev}") for cmd, extra in DEVICE_COMMANDS.items() for dev, n, words in DEVICES],

    # --- numbers out of range, before anything loads (--model points nowhere) --------------------------------
    *[case(f"eval-ppl --model {{nowhere}} --text {{text}} --device cpu {opt} {v}", f"{opt} {v} must be >= {low}")
      for opt, v, low in (("--batch-size", 0, 1), ("--batch-size", -2, 1), ("--max-tokens", 0, 2),
                          ("--max-tokens", -5, 2), ("--max-tokens", 1, 2), ("--ctx", 0, 2), ("--ctx", -1, 2))],
    case(NOWHERE_CAL + " --max-blocks 0 --seq-len 64", "--max-blocks 0 must be >= 1"),
    case(NOWHERE_CAL + " --fit-tokens 1", "--fit-tokens 1 must be >= 2"),
    *[case(NOWHERE_CAL + f" --max-module-sparsity {v}", f"--max-module-sparsity {v} is outside (0, 1] (1.0: no "
           "bound)") for v in ("0.0", "1.5", "-0.2", "nan")],
    *[case(f"{cmd} --model {{nowhere}} --wide {{nowhere}} --sparsity {v}", f"--sparsity {v:g} is outside [0, 1)")
      for cmd in ("eval-ppl --text {text} --device cpu", "generate --prompt hi --device cpu")
      for v in (1.0, -0.1, 2.5, float("nan"))],
    *[case(f"{cmd} --model {{nowhere}} --sparsity 0.5", "--sparsity 0.5 dials the routers of a WIDE checkpoint: "
           "give --wide") for cmd in ("eval-ppl --text {text} --device cpu", "generate --prompt hi --device cpu")],
    *[case(f"{cmd} --model {{nowhere}} --wide {{nowhere}} --sparsity-unit flops", "--sparsity-unit flops is the "
           "unit of a dialed --sparsity: give --sparsity")
      for cmd in ("eval-ppl --text {text} --device cpu", "generate --prompt hi --device cpu")],
    case("eval-ppl --model {nowhere} --wide {nowhere} --text {text} --device cpu --sparsity 0.3 --uncalibrated",
         "--uncalibrated and --sparsity 0.3 exclude each other: --sparsity fits a new logit shift"),
    case("generate --model {nowhere} --wide {nowhere} --prompt hi --device cpu --dense-ops --sparsity 0.3",
         "--dense-ops and --sparsity 0.3 exclude each other", "the routers are ignored"),
    *[case(f"generate --model {{nowhere}} --prompt hi --device cpu {opt}", words) for opt, words in (
        ("--temperature -1", "--temperature -1.0 must be a finite number >= 0"),
        ("--temperature 0.7 --top-k -1", "--top-k -1 must be an int >= 0"),
        ("--temperature 0.7 --top-p 1.5", "--top-p 1.5 must be in (0, 1]"),
        ("--temperature 0.7 --seed -1", "--seed -1 must be an integer from 0 to"))],
    case("eval-ppl --model {nowhere} --text {text} --device cpu --uncalibrated", "--uncalibrated applies to the "
         "routers of a WIDE checkpoint: give --wide"),
    case(NOWHERE_CAL + " --max-blocks -1", "--max-blocks -1 must be >= 1"),
    case(NOWHERE_CAL + " --seq-len 1", "--seq-len 1 must be >= 2"),
    case(NOWHERE_CAL + " --steps 10 --warmup-steps 11", "--warmup-steps 11 must be <= --steps 10"),
    case(NOWHERE_CAL + " --steps 10 --warmup-steps -1", "--warmup-steps -1 must be >= 0"),
    *[case(f"demo --model {{nowhere}} --text {{text}} -o {{out}} --device cpu {opt} {v}", f"{opt} {v} must be >= {low}")
      for opt, v, low in (("--steps", 0, 1), ("--steps", -3, 1), ("--seq-len", 0, 2), ("--ctx", 0, 2),
                          ("--eval-tokens", 0, 2), ("--eval-tokens", 1, 2))],
    case("prune-static --model {model} -S 0.5 -o {full} --text {text} --calib-blocks 0 --device cpu",
         "--calib-blocks 0 must be >= 1", id="prune-static: the options before the non-empty output"),

    # --- the method options -----------------------------------------------------------------------------------
    case(CAL + " --model /does/not/exist", "model '/does/not/exist' not found"),
    # named as typed (the flag), not as the WideConfig field; every count option worded "must be >= N"
    *[case(f"{cmd} {opt} {v}", f"{cmd.split()[0]}: error: {flag} {v!r} {words}") for cmd in (NOWHERE_CAL, DEMO)
      for opt, flag, v, words in (
          ("-S", "--sparsity", 1.5, "is outside [0, 1): the target fraction of the routed groups"),
          ("--sparsity", "--sparsity", -0.1, "is outside [0, 1)"), ("-S", "--sparsity", float("nan"), "is outside"),
          ("--alpha", "--alpha", -1.0, "must be >= 0 and finite"), ("--rank", "--rank", 0, "must be >= 1"),
          ("--tau-start", "--tau-start", float("inf"), "is outside [0.001, 1000]"),
          ("--steps", "--steps", 0, "must be >= 1"), ("--save-every", "--save-every", 0, "must be >= 1"),
          ("--batch-size", "--batch-size", 0, "must be >= 1"), ("--grad-accum", "--grad-accum", -1, "must be >= 1"))],
    case(CAL + " --ffn-group-size 48", "FFN group size G=48 must be a power of two"),
    case(CAL + " --ffn-group-size 256", "G=256 must be a power of two >= 16 that divides the intermediate size 128",
         "pass --ffn-group-size with one of [16, 32, 64, 128]"),
    case(CAL + " --ffn-group-size 100", "FFN group size G=100", "pass --ffn-group-size with one of [16, 32, 64, 128]",
         before="weights"),
    case(CAL + " --attn-group-size 24", "G=24 must be a positive multiple of head_dim=16",
         "pass --attn-group-size with one of"),
    case("info --model {model} --skipgpt-rank 4", "wide info: error: --skipgpt-rank 4 needs --method skipgpt"),
    case("info --model {model} --ffn-group-size 48", "FFN group size G=48 must be a power of two >= 16",
         "intermediate size 128", "--ffn-group-size with one of [16, 32, 64, 128]"),
    case("info --model {model} --method skipgpt --ffn-group-size 100", "FFN group size G=100",
         "--ffn-group-size with one of [16, 32, 64, 128]", "with --method skipgpt it sets the WIDE layout"),
    case("info --model {model} --attn-group-size 0", "attention group size G=0 must be a positive multiple of "
         "head_dim=16 that divides the attention width 64", "pass --attn-group-size with one of [16, 32, 64]"),
    case("info --model {model} --attn-group-size -64", "attention group size G=-64 must be a positive multiple",
         "one of [16, 32, 64]"),
    case(CAL + " --attn-group-size 0", "G=0 must be a positive multiple", "one of [16, 32, 64]", before="tokenizer"),
    *[case(f"{cmd} --method skipgpt --skipgpt-rank {r}", f"--skipgpt-rank {r} must be >= 1")
      for cmd in ("info --model {model}", NOWHERE_CAL) for r in (0, -2)],
    case("info --model {model} --ffn-group-size 0", "FFN group size G=0 must be a power of two >= 16"),
    case("info --model {model} --ffn-group-size -32", "FFN group size G=-32 must be a power of two >= 16"),

    # --- the model: missing, unsupported, malformed ------------------------------------------------------------
    case("info --model {gpt2}", "unsupported architecture GPT2LMHeadModel"),
    case("info --model {model}", "{model}/config.json", "must be a JSON object", "not list",
         setup=lambda c: (c["model"] / "config.json").write_text("[]"), id="info: config.json not an object"),
    *[case(cmd, "{model}/config.json", words, setup=lambda c, f=fields: c.edit_json(c["model"] / "config.json", **f),
           before="weights", id=f"{cmd.split()[0]}: {words}")
      for cmd in ("info --model {model}", CAL) for fields, words in CONFIG_DIMS],
    case("info --model {model}", "no legal FFN group size divides intermediate_size=100", "powers of two >= 16",
         "use a model whose intermediate size is a multiple of 16",
         setup=lambda c: c.edit_json(c["model"] / "config.json", intermediate_size=100)),
    case("eval-ppl --model {stk} --text {text} --ctx 16 --device cpu", "model folder '{stk}' has no tokenizer files",
         "tokenizer.json", "tokenizer.model", "vocab.json"),
    case(PPL, lambda c: [f"model weights file '{c['model'] / 'model.safetensors'}' is truncated or corrupt "
                         f"({c.made['cut']:,} bytes"],
         setup=lambda c: c.made.update(cut=c.cut(c["model"] / "model.safetensors",
                                                 (c["model"] / "model.safetensors").stat().st_size // 2)),
         id="eval-ppl: truncated model.safetensors"),
    *[case("info --model {tmp}/cut.gguf --ffn-group-size 16",
           lambda c: [f"GGUF file '{c['tmp'] / 'cut.gguf'}' is truncated or corrupt ({c.made['cut']:,} bytes;",
                      "copy or download it again"],
           setup=lambda c, k=keep: c.made.update(cut=c.cut(shutil.copy(c["gguf"], c["tmp"] / "cut.gguf"), k)),
           id=f"info: GGUF cut to {keep} bytes") for keep in (10, 100, -100)],

    *[case(cmd, "the tokenizer of '{model}' has 128 tokens (ids up to 127), but the model's vocab_size is 100",
           "use the tokenizer made for this model", before="weights",
           setup=lambda c: c.edit_json(c["model"] / "config.json", vocab_size=100), id=f"{cmd.split()[0]}: vocab")
      for cmd in (CAL, PPL, "generate --model {model} --prompt hi --device cpu")],
    case("info --model {tmp}/locked.gguf --ffn-group-size 16", "cannot read GGUF file '{tmp}/locked.gguf': "
         "Permission denied", setup=lambda c: (shutil.copy(c["gguf"], c["tmp"] / "locked.gguf"), c.os_error(
             __import__("gguf.gguf_reader").gguf_reader, "GGUFReader", c["tmp"] / "locked.gguf",
             PermissionError(13, "Permission denied"))), id="info: GGUF file not readable"),
    case(PPL, "cannot read model weights file '{model}/model.safetensors': Permission denied",
         setup=lambda c: c.os_error(__import__("safetensors"), "safe_open", c["model"] / "model.safetensors",
                                    PermissionError(13, "Permission denied")), id="eval-ppl: weights not readable"),

    # --- context lengths, refused from the config (the tiny model's context is 256 tokens) -------------------
    case(CAL + " --seq-len 512", "--seq-len 512 is longer than the model's context of 256 tokens",
         "use --seq-len 256 or less", before="tokenizer"),
    case(LORA + " --seq-len 512", "--seq-len 512 is longer than the model's context of 256 tokens",
         before="tokenizer", needs="peft"),
    case(PRUNE + " -S 0.5 --seq-len 10000000", "--seq-len 10000000 is longer than the model's context of"),
    *[case(PPL + f" --ctx 512 {w}", "--ctx 512 is longer than the model's context of 256 tokens",
           "max_position_embeddings", "use --ctx 256 or less", before="tokenizer", id=f"eval-ppl --ctx 512 {w}")
      for w in ("", "--wide {ckpt}")],

    # --- texts ------------------------------------------------------------------------------------------------
    case(CAL + " --text {emptytxt}", "is empty"),
    case(CAL + " --text {short}", "short.txt' has 4 tokens (with an end-of-text token after each document), shorter "
         "than one sequence of 32"),
    case(CAL + " --text /no/such/file.txt", "text '/no/such/file.txt' not found"),
    *[case(cmd + f" --text {{tmp}}/{name}", f"text '{{tmp}}/{name}': {name[4:]} files are not read as text; give a "
           "plain-text file (one document), a .jsonl file with a 'text' field per line", before="tokenizer",
           setup=lambda c, n=name: (c["tmp"] / n).write_text('{"text": "w1 w2"}\n'), id=f"{cmd.split()[0]}: {name}")
      for cmd in (CAL, PPL, DEMO) for name in ("data.json", "data.csv", "data.PARQUET")],
    case(DEMO + " --text {emptytxt}", "text '{emptytxt}' is empty", before="tokenizer"),
    case(DEMO + " --text {short}", "text '{short}' has 3 tokens, shorter than one window of --ctx 32",
         before="weights", id="demo: a too short text, before its first line"),
    *[case(PPL + f" --text {{short}} {w}", "text '{short}' has 3 tokens, shorter than one window of --ctx 32",
           before="weights", id=f"eval-ppl: text shorter than --ctx {w}") for w in ("", "--wide {ckpt}")],

    *[case(cmd + " --text {tmp}/bin.jsonl", "text file '{tmp}/bin.jsonl' is not UTF-8 (byte 0xff at offset 9",
           setup=lambda c: (c["tmp"] / "bin.jsonl").write_bytes(b'{"text": \xff\xfe\x00\x01}\n'),
           before="tokenizer", id=f"{cmd.split()[0]}: binary .jsonl") for cmd in (CAL, PPL)],
    # a text that cannot be read (monkeypatched: the tests may run as root), or that sits in an unreadable folder
    *[case(CAL + f" --text {path}", f"cannot read text '{path}': {err.strerror}", before="tokenizer",
           setup=lambda c, m=method, p=path, e=err: c.os_error(type(c["text"]), m, c.fmt(p), e),
           id=f"calibrate: text {method} fails: {err.strerror}") for method, path, err in (
        ("read_bytes", "{text}", PermissionError(13, "Permission denied")),
        ("read_bytes", "{text}", IsADirectoryError(21, "Is a directory")),
        ("read_bytes", "{text}", OSError(5, "Input/output error")),
        ("stat", "{tmp}/private/t.txt", PermissionError(13, "Permission denied")))],

    # --- output paths -------------------------------------------------------------------------------------------
    case(CAL + " -o {afile}", "-o '{afile}' is a file; give a directory"),
    case(CAL + " -o {blank}", "-o '' is empty; give a directory", id="calibrate: -o ''"),
    *[case(cmd.replace("{o}", o), words.replace("{o}", o)) for cmd in (
        NOWHERE_CAL.replace("{out}", "{o}"), "prune-static --model {nowhere} -S 0.5 -o {o}",
        "demo --model {nowhere} -o {o}") for o, words in (
            ("{afile}", "-o '{o}' is a file; give a directory"),
            ("{afile}/sub", "-o '{o}': '{afile}' is a file, not a directory"))],
    *[case(cmd + " -o /proc/wide-out", "-o '/proc/wide-out': nothing can be written in '/proc'")
      for cmd in ("calibrate --model {nowhere} --text {text} --device cpu", "demo --model {nowhere}")],
    case(CAL + " -o {full}", "'{full}'", "exists and is not empty", "--resume", "--overwrite"),
    case(CAL + " -o {full} --resume --overwrite", "--resume and --overwrite exclude each other"),
    case(CAL + " -o {full} --overwrite", "LoRA adapter", "give another -o",
         setup=lambda c: (c["full"] / "adapter").mkdir(), id="calibrate --overwrite over a LoRA adapter"),
    case(LORA + " -o {full}", "'{full}'", "exists and is not empty", "--resume", "--overwrite", needs="peft"),
    case(LORA + " -o {ckpt}", "must differ from the stage-1 checkpoint", needs="peft"),
    case(LORA + " --max-module-sparsity 1.5", "--max-module-sparsity 1.5 is outside (0, 1]", needs="peft",
         before="weights"),
    case(DEMO + " -o {full}", "'{full}'", "exists and is not empty", "use --overwrite to write over it: the files "
         "this command writes are replaced, any others are left as they are"),
    case("prune-static --model {nowhere} -S 0.5 -o {full}", "exists and is not empty (use --overwrite"),
    case("eval-ppl --model {nowhere} --text {text} --device cpu --json {tmp}", "--json '{tmp}' is a directory; give "
         "a file path"),
    case("eval-ppl --model {nowhere} --text {text} --device cpu --json {afile}/r.json",
         "--json '{afile}/r.json': '{afile}' is a file, not a directory"),
    case("eval --model {nowhere} --device cpu --json {tmp}", "--json", "is a directory; give a file path",
         needs="lm_eval"),

    # an output written into what the command reads: --json over the checkpoint's own base_model.json, ...
    case(PPL + " --wide {ckpt} --json {ckpt}/base_model.json", "--json '{ckpt}/base_model.json' is inside the "
         "--wide folder '{ckpt}', which this command reads: write the results elsewhere", before="tokenizer"),
    case(PPL + " --json {model}/r.json", "--json '{model}/r.json' is inside the --model folder '{model}'",
         before="tokenizer"),
    case(PPL + " --json {text}", "--json '{text}' is the --text file this command reads", before="tokenizer"),
    case(PPL + " --json {tmp}/sub/../text.txt", "--json '{tmp}/sub/../text.txt' is the --text file",
         before="tokenizer", id="eval-ppl: --json the --text file, by another path"),
    case("eval --model {model} --json {model}/config.json", "--json '{model}/config.json' is inside the --model "
         "folder", needs="lm_eval"),
    case(PRUNE.replace("{out}", "{model}") + " -S 0.5 --overwrite", "-o '{model}' is the --model folder this "
         "command reads", before="tokenizer"),
    # an empty value: refused by the parser, naming the option as typed
    *[case(f"{cmd} {opt} {{blank}}", f"wide {cmd.split(' -')[0]}: error: {opt} '' is empty; give {what}",
           id=f"{cmd.split(' -')[0]} {opt} ''") for cmd, opt, what in (
        ("eval-ppl", "--wide", "a WIDE checkpoint directory"), ("eval-ppl", "--json", "a file path"),
        ("eval-ppl", "--text", "a text file"), ("eval-ppl", "--model", "a model folder, a .gguf file"),
        ("info", "--model", "a model folder"), ("generate --prompt hi", "--wide", "a WIDE checkpoint"),
        ("calibrate", "--output", "a directory"), ("prune-static -S 0.5", "-o", "a directory"),
        ("demo", "--text", "a text file"), ("lora -o {out}", "--wide", "a WIDE checkpoint"),
        ("eval-ppl", "--device", "a value, or leave it out"), ("eval", "--dense-json", "a file path"),
        ("bench e2e", "--tag", "a value"))],
    case("eval-ppl --model= --text {text}", "wide eval-ppl: error: --model '' is empty", id="eval-ppl --model="),

    # --- --resume ----------------------------------------------------------------------------------------------
    case(CAL + " --resume", "--resume: no train_state.dcp in '{out}'"),
    case(NOWHERE_CAL.replace("{out}", "{full}") + " --resume", "corrupt training state "
         "{full}/train_state.dcp/train_state.json", setup=lambda c: c.train_state(), id="calibrate --resume: corrupt"),
    case(CAL.replace("{out}", "{run}").replace("--seq-len 32", "--seq-len 16") + " --batch-size 1 --resume",
         "written with other settings", "--seq-len: saved 32, now 16", before="tokenizer"),
    case(CAL.replace("{out}", "{run}").replace("{text}", "{full}/x") + " --batch-size 1 --resume",
         "written with other settings", "data.tokens_sha256: saved '", loads=True,
         setup=lambda c: (c["full"] / "x").write_text(c["text"].read_text()[::-1]),
         id="calibrate --resume: other text"),

    # --- checkpoints --------------------------------------------------------------------------------------------
    case(PPL + " --wide {tmp}/none", "not found"),
    case(PPL + " --wide {text}", "WIDE checkpoint '{text}' is a file, but a checkpoint directory is expected",
         "wide_config.json", before="weights"),
    case(PPL + " --wide {ckpt}/routers.safetensors", "is a file, but a checkpoint directory is expected",
         "routers.safetensors is one of its files: give its folder '{ckpt}'", before="weights"),
    case(PPL + " --wide {ckpt} --json {tmp}/r.json", "corrupt checkpoint file",
         setup=lambda c: (c["ckpt"] / "routers.safetensors").write_bytes(b"junk"), id="eval-ppl: junk routers"),
    *[case(PPL + " --wide {ckpt}", "{ckpt}/wide_config.json", *words,
           setup=lambda c, f=field, v=value: c.edit_json(c["ckpt"] / "wide_config.json", **{f: v}),
           id=f"eval-ppl: wide_config.json {field}={value!r}") for field, value, words in (
        ("ffn_group_size", "abc", ["ffn_group_size='abc'", "must be an integer"]),
        ("ffn_group_size", 32.0, ["ffn_group_size=32.0", "must be an integer"]),
        ("target_sparsity", "0.5", ["target_sparsity='0.5'", "must be a number"]),
        ("router_rank", None, ["router_rank=None", "must be an integer"]),
        ("ffn_group_size", 256, ["FFN group size G=256 does not divide the intermediate size 128"]),
        ("attn_group_size", 24, ["attention group size G=24 must be a multiple of head_dim=16"]),
        ("target_sparsity", 1.5, ["S=1.5 is outside [0, 1)"]))],
    case("lora --wide {text} --text {text} -o {out} --device cpu", "stage-1 checkpoint '{text}' is a file, but a "
         "checkpoint directory is expected", needs="peft"),

    # --- prune-static's options ------------------------------------------------------------------------------
    case(PRUNE + " -S 1.2", "wide prune-static: error: -S 1.2 is outside [0, 1)"),
    case(PRUNE, "give the target sparsity -S (or the two fractions --attn-sparsity and --ffn-sparsity)"),
    case(PRUNE + " -S 0.1 --attn-sparsity 0.5 --ffn-sparsity 0.25", "-S 0.1 conflicts with --attn-sparsity 0.5 "
         "--ffn-sparsity 0.25 (their mean, the overall S, is 0.375): give -S alone, or the two fractions"),
    case(PRUNE + " --attn-sparsity 0.5", "give both --attn-sparsity and --ffn-sparsity, or neither"),
    case(PRUNE + " --attn-sparsity 1.5 --ffn-sparsity 0.5", "--attn-sparsity 1.5 is outside [0, 1)"),
    case(PRUNE + " --attn-group-size 7", "static attention group size G=7 must be a multiple of",
         id="prune-static: the attention group size before a missing -S"),
    case(PRUNE + " --ffn-group-size 24", "FFN group size G=24", id="prune-static: the FFN group size before -S"),
    case(PRUNE + " -S 0.5 --attn-group-size 100 --ffn-group-size 32", "static attention group size G=100 must be a "
         "multiple of the GQA group 32 dividing the attention width 64", "legal: [32, 64]", before="weights"),
    case(PRUNE + " -S 0.5 --ffn-group-size 256", "FFN group size G=256 does not divide the intermediate size 128",
         "legal: [16, 32, 64, 128]", before="weights"),

    # --- memory: a batch that cannot fit, refused with a split that does ---------------------------------------
    case(CAL + " --batch-size 8", lambda c: [
        f"one micro-batch of --batch-size 8 x --seq-len 32 tokens needs about "
        f"{gib(tiny_train_memory().estimate(8, 32, False))}", f"{gib(c.made['avail'])} is available",
        "use --batch-size 2 --grad-accum 4 (about", "the same 8 sequences per step", "--no-memory-check"],
        setup=lambda c: c.memory(c.made.setdefault("avail",
                                                   int(tiny_train_memory().estimate(3, 32, False) / HEADROOM))),
        before="weights", id="calibrate: a micro-batch too large for memory"),
    *[case(CAL.replace("--seq-len 32", "--seq-len 16") + f" --batch-size {b}", *words,
           setup=lambda c, s=size: c.memory(int(tiny_train_memory().estimate(*s) / HEADROOM) + 1),
           before="weights", id=f"calibrate --batch-size {b}: {words[-1]}") for b, size, words in (
        (100000000, (4, 16, False), ["--batch-size 100000000", "use --batch-size ", "micro-batches, so choose "
                                                                                   "--grad-accum"]),
        (8, (4, 16, False), ["use --batch-size 4 --grad-accum 2", "the same 8 sequences per step"]),
        (2, (1, 4, True), ["even --batch-size 1 does not fit at --seq-len 16", "--seq-len "]))],
    case(CAL + " --batch-size 8 --text {short}", "short.txt' has", "shorter than one sequence of 32",
         setup=lambda c: c.memory(2 ** 20), id="calibrate: a too short text named before the memory"),
    case(DEMO, "--batch-size 4 x --seq-len 32 tokens needs about", "--no-memory-check",
         setup=lambda c: c.memory(2 ** 20), loads=True, id="demo: memory, before its dense evaluation"),
    case(PRUNE + " -S 0.5 --ffn-group-size 16 --batch-size 2", "a forward pass of 2 sequences (--batch-size) x 32 "
         "tokens (--seq-len) needs about", "for scoring the groups", "--no-memory-check",
         setup=lambda c: c.memory(2 ** 20), before="weights"),
    case(PRUNE + " -S 0.5 --ffn-group-size 16 --batch-size 64", "a forward pass of all 2 sequences of the text "
         "(--batch-size 64 is capped at the number of sequences) x 32 tokens (--seq-len)",
         setup=lambda c: c.memory(2 ** 20), before="weights"),
    *[case(PPL + f" --batch-size 8 {w}", lambda c: [
        f"a forward pass of 8 windows (--batch-size) x 32 tokens (--ctx) needs about {gib(eval_need(8))} for "
        f"evaluation", f"but {gib(c.made['avail'])} is available", "[8 x 32 x 128] logits",
        "use --batch-size 3 (about", "--no-memory-check"],
        setup=lambda c: c.memory(c.made.setdefault("avail", int(eval_need(3) / HEADROOM) + 1)), before="weights",
        id=f"eval-ppl: memory {w}") for w in ("", "--wide {ckpt}")],
    case(PPL + " --batch-size 1000", "a forward pass of all ", "(--batch-size 1000 is capped at the number of "
         "windows) x 32 tokens", setup=lambda c: c.memory(1)),

    # --- optional packages, lm-eval and the benchmarks ----------------------------------------------------------
    *[case(cmd, f"needs the '{module}' package", "wide[quality]", setup=lambda c, m=module: c.missing(m))
      for module, cmd in (("lm_eval", "eval --tasks wide_boolq --wide {tmp}/w --model {model}"),
                          ("lm_eval", "lm-eval"), ("peft", LORA))],
    *[case(f"eval --model {{model}} {args}", msg, needs="lm_eval") for args, msg in (
        ("--tasks mmlu", "unknown task 'mmlu'"), ("--wide /nonexistent/ckpt", "not found"),
        ("--batch-size 0", "--batch-size 0 must be >= 1"),
        ("--tasks wikitext --wikitext /nonexistent/wiki.test.raw", "WikiText-2 test file"),
        ("--limit 0", "--limit 0: give a whole number of documents per task (>= 1) or a fraction in (0, 1)"),
        ("--limit -1 --model /nonexistent/model", "--limit -1: give a whole number"))],
    case("eval --model {nowhere} --tasks all", "WikiText-2 test file wiki.test.raw not found", "--wikitext PATH",
         "WIDE_WIKITEXT", needs="lm_eval", setup=lambda c: (
             c.mp.delenv("WIDE_WIKITEXT", raising=False),
             c.mp.setattr("wide.eval.tasks.loaders.wikitext_candidates", lambda: [c["tmp"] / "wiki.test.raw"])),
         id="eval --tasks all without wiki.test.raw"),
    case("lm-eval --model wide --tasks nosuchtask", "wide lm-eval: error: Tasks not found: nosuchtask", loads=True,
         needs="lm_eval"),
    *[case(f"bench {b} --out-dir {{out}}", f"wide bench {b}: error: this benchmark times GPU code and needs a CUDA GPU",
           setup=lambda c: c.cuda(0)) for b in ("kernels", "e2e")],
    *[case(f"bench {b} --report-only --out-dir {{out}} --tag x", "no results at", "--tag") for b in ("kernels", "e2e")],
    *[case(f"bench {b} --report-only --out-dir {{afile}}", f"wide bench {b}: error: --out-dir '{{afile}}' is a file")
      for b in ("kernels", "e2e")],
    *[case(f"bench {b} --out-dir {{afile}}/sub", f"wide bench {b}: error: --out-dir '{{afile}}/sub': '{{afile}}' is a "
           "file, not a directory") for b in ("kernels", "e2e")],
    *[case(f"bench {b} --report-only --out-dir {{full}} --tag y", "is not a readable JSON file",
           setup=lambda c, b=b: (c["full"] / f"{b}_y.json").write_text("{not json")) for b in ("kernels", "e2e")],
    *[case(f"{cmd} --model {{model}}", f"{var}='{value}' is not allowed", "'triton', 'cute'", before="weights",
           setup=lambda c, var=var, value=value: c.mp.setenv(var, value))
      for cmd, var, value in (("info", "WIDE_ATTN_BACKEND", "foo"), ("eval-ppl", "WIDE_GEMM_BACKEND", "cutlass"))],
]


def _tree(root) -> dict:
    """Every path under ``root``, with each file's size and modification time."""
    return {str(p.relative_to(root)): p.is_file() and (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*")}


@pytest.mark.parametrize("argv,words,setup,loads,before", CASES)
def test_bad_input(argv, words, setup, loads, before, tmp_path, model_dir, text_file, capsys, monkeypatch):
    c = Ctx(tmp_path, model_dir, text_file, monkeypatch, capsys)
    args = [c.fmt(a) for a in argv.split(" ") if a] if argv else []
    if setup is not None:
        setup(c)
    if before is not None:
        import transformers

        def refuse(*a, **k):
            raise AssertionError(f"the {before} were read before the refusal")

        monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)
        if before == "tokenizer":
            monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", refuse)
    capsys.readouterr()
    files = _tree(tmp_path)
    try:
        rc = main(args)
    except SystemExit as e:  # a usage error
        rc = e.code
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert rc == 2 and lines and "Traceback" not in err, err
    line = lines[-1]
    assert line.startswith("wide") and ": error: " in line and (loads or len(lines) == 1), err
    assert loads or not out, out  # nothing said (a note, a first progress line) before the refusal
    for w in (words[0](c) if words and callable(words[0]) else [c.fmt(w) for w in words]):
        assert w in line, (w, line)
    assert _tree(tmp_path) == files, "something was written"


# --- the same checks through the Python API ------------------------------------------------------------------------
def test_library_checks_the_device(monkeypatch, tmp_path):
    """``check_device``, ``load_base_model`` and ``wide.load``: the CLI's --device check, before any file is read."""
    import wide
    from wide.errors import WideError
    from wide.hub import check_device, load_base_model

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    for dev in (None, "cpu", "cuda", "cuda:0", "cuda:1"):
        check_device(dev)
    for dev in ("CPU", "cuda:", "cuda:x", "mps", "cuda:0,1"):
        with pytest.raises(WideError, match="use cpu, cuda or cuda:N"):
            check_device(dev)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(WideError, match=r"device cuda: no CUDA GPU on this machine \(use device='cpu'\)"):
        load_base_model(str(tmp_path / "nowhere"), device="cuda")
    with pytest.raises(WideError, match="device 'tpu': use cpu, cuda or cuda:N"):
        load_base_model(str(tmp_path / "nowhere"), device="tpu")
    with pytest.raises(WideError, match="no CUDA GPU"):
        wide.load(tmp_path, model=str(tmp_path / "nowhere"), device=torch.device("cuda"))


def test_library_checks_warmup_and_jsonl_text(tmp_path):
    from wide.data import load_texts
    from wide.errors import WideError
    from wide.train.loop import CalibrationArgs

    with pytest.raises(WideError, match=r"--warmup-steps 4 must be <= --steps 3"):
        CalibrationArgs(steps=3, warmup_steps=4).validate()
    CalibrationArgs(steps=3, warmup_steps=3).validate()
    CalibrationArgs(steps=3, warmup_steps=0).validate()
    p = tmp_path / "t.jsonl"
    for value, words in ((5, "'text' is a number (5)"), (None, "'text' is null;"), (["a"], "'text' is a list"),
                         ({"a": 1}, "'text' is an object")):
        p.write_text(json.dumps({"text": "w1 w2"}) + "\n\n" + json.dumps({"text": value}) + "\n")
        with pytest.raises(WideError) as e:
            load_texts(str(p))
        assert "t.jsonl: line 3: " + words in str(e.value) and "it must be a string" in str(e.value)


def test_library_checks_checkpoints(tmp_path, model_dir, monkeypatch):
    """A bad wide_config.json value names the file; router weights of another config name the keys, before any
    base model loads when the checkpoint records the dims."""
    import re

    import wide
    import wide.checkpoint as CK
    from wide.checkpoint import ROUTERS_NAME, save_wide
    from wide.config import WideConfig
    from wide.errors import WideError
    from wide.model import WideModel, router_shapes

    for cfg in (WideConfig(ffn_group_size=32), WideConfig(ffn_group_size=16, routed="ffn", router_rank=4),
                WideConfig(method="skipgpt", routed="attn")):
        wm = WideModel(tiny_model(), cfg)
        assert router_shapes(wm.dims, cfg) == {k: tuple(v.shape) for k, v in wm.router_state_dict().items()}
    path = save_wide(WideModel(tiny_model(), WideConfig(ffn_group_size=32)), tmp_path / "ckpt", model_ref="tiny")
    config = path / "wide_config.json"
    good = config.read_text()
    config.write_text(json.dumps({**json.loads(good), "target_sparsity": 1.5}))
    with pytest.raises(WideError, match="S=1.5 is outside") as e:
        wide.load(path, model=str(model_dir), device="cpu")
    assert str(config) in str(e.value)
    config.write_text(json.dumps({**json.loads(good), "routed": "ffn"}))  # the routers of routed=both
    monkeypatch.setattr(CK, "load_base_model", lambda *a, **k: (_ for _ in ()).throw(AssertionError("loaded")))
    with pytest.raises(WideError) as e:  # found from the dims base_model.json records, before any base loads
        wide.load(path)
    msg = str(e.value)
    assert msg.startswith(f"{path / ROUTERS_NAME}: router weights do not match the model: "), msg
    assert re.search(r"0 missing, 8 unexpected \(attn\.0\.w1\.bias, attn\.0\.w1\.weight, attn\.0\.w2\.bias, "
                     r"\.\.\.\), of the 8 it needs", msg), msg
    assert "likely made for another model or another WIDE config" in msg


def test_library_lora_adapter_files(tmp_path):
    """The adapter gets a new file's mode (peft's safetensors writes 0600), and peft's missing-config warning
    is silenced while other warnings still show."""
    import os
    import stat
    import warnings

    pytest.importorskip("peft")
    from wide.config import WideConfig
    from wide.lora import attach_lora, peft_model, save_adapter
    from wide.model import WideModel

    wm = WideModel(tiny_model(), WideConfig(ffn_group_size=32))
    attach_lora(wm)
    peft_model(wm).peft_config["default"].base_model_name_or_path = str(tmp_path / "gguf-package")
    old = os.umask(0o022)
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            save_adapter(wm, tmp_path / "adapter")
            warnings.warn("another warning", UserWarning)
    finally:
        os.umask(old)
    assert [str(w.message) for w in seen] == ["another warning"]
    modes = {f.name: stat.S_IMODE(f.stat().st_mode) for f in (tmp_path / "adapter").iterdir()}
    assert "adapter_model.safetensors" in modes and set(modes.values()) == {0o644}, modes


def test_library_checks_the_vocabulary():
    """A tokenizer whose ids (its vocabulary, its end- / start-of-text ids) reach the config's ``vocab_size`` is
    refused before any weight loads; a vocabulary padded past the tokenizer's is fine."""
    from types import SimpleNamespace

    from wide.errors import WideError
    from wide.hub import check_vocab

    tok = SimpleNamespace(vocab_size=128, eos_token_id=1, bos_token_id=None)
    for vocab in (128, 160):
        check_vocab(SimpleNamespace(vocab_size=vocab), tok, "m")
    with pytest.raises(WideError, match=r"^the tokenizer of 'm' has 128 tokens \(ids up to 127\), but the model's "
                                        r"vocab_size is 127 \(its config\): ids from 127 up have no embedding"):
        check_vocab(SimpleNamespace(vocab_size=127), tok, "m")
    with pytest.raises(WideError, match=r"has 128 tokens \(ids up to 200\), but the model's vocab_size is 160"):
        check_vocab(SimpleNamespace(vocab_size=160), SimpleNamespace(vocab_size=128, eos_token_id=200,
                                                                     bos_token_id=0), "m")


@pytest.mark.parametrize("module,names,said", [("wide.hub", ("check_device",), "wide info: interrupted"),
                                               ("wide", ("__version__",), "wide: interrupted")])
def test_interrupt_before_the_command_runs(module, names, said, monkeypatch, capsys):
    """Ctrl-C while the command line is parsed or torch imports (the first half second): one line, exit 130."""
    import builtins

    real = builtins.__import__

    def interrupted(name, globals=None, locals=None, fromlist=(), level=0):
        if name == module and tuple(fromlist or ()) == names:
            raise KeyboardInterrupt
        return real(name, globals, locals, fromlist, level)

    with monkeypatch.context() as m:
        m.setattr(builtins, "__import__", interrupted)
        rc = main(["info", "--model", "nowhere"])
    out, err = capsys.readouterr()
    assert (rc, out, err) == (130, "", said + "\n")


def test_info_suggests_a_seq_len_within_the_context(model_dir, monkeypatch, capsys):
    """``wide info``'s next step for a model with a 128-token context: ``--seq-len 128``, which calibrate accepts
    (not the CPU run's 256 nor the GPU default 2048, which it refuses)."""
    from wide.cli import build_parser
    from wide.cli.common import fits_context
    from wide.hub import read_hf_config, resolve_model

    config = model_dir / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "max_position_embeddings": 128}))
    hf = read_hf_config(resolve_model(str(model_dir)))
    for gpu in (False, True):
        monkeypatch.setattr(torch.cuda, "is_available", lambda g=gpu: g)
        assert main(["info", "--model", str(model_dir)]) == 0
        nxt = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("next step"))
        parsed = build_parser().parse_args(nxt.split("next step", 1)[1].split("(")[0].split()[1:])
        assert parsed.seq_len == 128 and "--seq-len 128: the model's context" in nxt, nxt
        fits_context("--seq-len", parsed.seq_len)(hf)
