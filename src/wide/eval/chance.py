"""Zero-shot accuracy above chance: a model that guesses scores the chance level of a task, the mean over its
documents of ``1 / number of choices``, so at a small model size the raw accuracy and its retention (accuracy over
dense accuracy) hide how much of the dense model's margin over guessing is kept. Per task this module gives the
chance level, ``acc - chance`` and ``(acc - chance) / (dense - chance)``, marks the tasks where dense is at or below
chance (there the ratio means nothing), and the averages with and without BoolQ."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from wide.errors import WideError
from wide.eval.tasks import PAPER_METRIC

#: the result key of BoolQ, the task left out of ``avg_acc_without_boolq``
BOOLQ = "boolq"
#: our task name (``wide_arc_easy``) of each result key (``arc_easy``)
TASK_OF_KEY = {key: task for task, (key, _) in PAPER_METRIC.items()}


def chance_level(n_choices: Iterable[int]) -> float:
    """The accuracy of a uniform guess over documents with ``n_choices[i]`` answer choices each: the mean of
    ``1 / n_choices[i]``. Raises WideError for no document or a count below 1."""
    counts = list(n_choices)
    if not counts:
        raise WideError("no document to compute a chance level from")
    bad = [n for n in counts if int(n) != n or n < 1]
    if bad:
        raise WideError(f"number of choices {bad[0]!r} is not a whole number >= 1")
    return sum(1.0 / n for n in counts) / len(counts)


def chance_from_samples(samples: Mapping[str, list[dict]]) -> dict[str, dict]:
    """Chance levels from lm-eval's logged samples (``simple_evaluate(log_samples=True)["samples"]``: per task a list
    of ``{"doc_id", "arguments": [one request per choice], ...}``): ``{key: {"task", "chance", "docs"}}`` for the
    accuracy tasks of :data:`PAPER_METRIC` found there, over exactly the documents scored."""
    out = {}
    for task, (key, _) in PAPER_METRIC.items():
        rows = samples.get(task)
        if rows:
            docs = {int(s["doc_id"]): len(s["arguments"]) for s in rows}
            out[key] = {"task": task, "chance": chance_level(docs.values()), "docs": len(docs)}
    return out


def task_chance_levels(tasks: str | list[str] = "zeroshot", limit: int | float | None = None) -> dict[str, dict]:
    """Chance levels from the offline task data (:mod:`wide.eval.tasks`), with lm-eval's own ``doc_to_choice`` on
    the documents it evaluates (the test split where there is one), the first ``limit`` of them (a fraction: that
    share, rounded up, as lm-eval takes them): ``{key: {"task", "chance", "docs"}}`` for the accuracy tasks among
    ``tasks`` (:func:`wide.eval.lm_eval.resolve_tasks` names). Needs lm-eval; WideError for unknown tasks, a bad
    ``limit`` or missing task data."""
    import math

    from wide.eval.lm_eval import resolve_tasks, task_manager

    if limit is not None and not (isinstance(limit, (int, float)) and limit > 0):
        raise WideError(f"limit {limit!r} must be a positive number of documents (or a fraction)")
    names = [t for t in resolve_tasks(tasks) if t in PAPER_METRIC]
    loaded = task_manager().load(names)["tasks"]
    out = {}
    for task in names:
        obj = loaded[task]
        docs = list(obj.eval_docs)
        if limit is not None:
            docs = docs[:int(math.ceil(len(docs) * limit)) if limit < 1 else int(limit)]
        key = PAPER_METRIC[task][0]
        out[key] = {"task": task, "chance": chance_level(len(obj.doc_to_choice(d)) for d in docs), "docs": len(docs)}
    return out


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def above_chance(acc: Mapping[str, float], chance: Mapping[str, float],
                 dense: Mapping[str, float] | None = None) -> dict:
    """Above-chance view of the accuracies ``acc`` (result key -> accuracy, e.g. ``{"arc_easy": 0.47}``) given the
    chance level of each (``chance``, same keys) and, when known, the dense model's accuracies ``dense``. Only the
    keys in ``acc`` and ``chance`` count (and in ``dense`` for what needs it). Returns

    * ``chance``, ``acc_minus_chance``: per task; ``chance_avg``: their mean;
    * ``avg_acc`` and ``avg_acc_without_boolq``: the raw mean accuracy with and without BoolQ;
    * with ``dense``: ``above_chance`` per task, ``(acc - chance) / (dense - chance)``, None where dense is at or
      below chance; those tasks in ``dense_below_chance``; ``retention`` = ``avg_acc`` / dense's (and
      ``retention_without_boolq``); ``avg_above_chance``, the above-chance ratio of the average over the tasks
      where dense is above chance, ``(mean acc - mean chance) / (mean dense - mean chance)``, and the tasks it
      covers in ``avg_above_chance_tasks``. Without ``dense`` these are None or empty.
    """
    keys = [k for k in TASK_OF_KEY if k in acc and k in chance]
    out = {"chance": {k: chance[k] for k in keys}, "acc_minus_chance": {k: acc[k] - chance[k] for k in keys},
           "chance_avg": _mean([chance[k] for k in keys]), "avg_acc": _mean([acc[k] for k in keys]),
           "avg_acc_without_boolq": _mean([acc[k] for k in keys if k != BOOLQ]),
           "above_chance": {}, "dense_below_chance": [], "retention": None, "retention_without_boolq": None,
           "avg_above_chance": None, "avg_above_chance_tasks": []}
    if dense is None:
        return out
    both = [k for k in keys if k in dense]
    for k in both:
        margin = dense[k] - chance[k]
        out["above_chance"][k] = (acc[k] - chance[k]) / margin if margin > 0 else None
    out["dense_below_chance"] = [k for k in both if dense[k] <= chance[k]]
    for name, ks in (("retention", both), ("retention_without_boolq", [k for k in both if k != BOOLQ])):
        d = _mean([dense[k] for k in ks])
        out[name] = _mean([acc[k] for k in ks]) / d if d else None
    above = [k for k in both if dense[k] > chance[k]]
    if above:
        c = _mean([chance[k] for k in above])
        out["avg_above_chance"] = (_mean([acc[k] for k in above]) - c) / (_mean([dense[k] for k in above]) - c)
        out["avg_above_chance_tasks"] = above
    return out
