import json

import pytest
import torch

from wide.data import load_texts, pack, ppl_windows, split_default
from wide.errors import WideError
from wide_testutil import needs_bundled_text


def test_pack_keeps_eos(tokenizer):
    blocks = pack(["w1 w2 w3", "w4 w5"], tokenizer, seq_len=3)
    eos = tokenizer.eos_token_id
    ids = [tokenizer.convert_tokens_to_ids(w) for w in ["w1", "w2", "w3"]] + [eos] + \
          [tokenizer.convert_tokens_to_ids(w) for w in ["w4", "w5"]]
    assert blocks.tolist() == [ids[:3], ids[3:6]]  # tail of 1 token (EOS) dropped
    assert blocks.dtype == torch.long


def test_pack_too_short(tokenizer):
    with pytest.raises(WideError, match=r"^text has 3 tokens \(with an end-of-text token after each document\), "
                                        r"shorter than one sequence of 64"):
        pack(["w1 w2"], tokenizer, seq_len=64)
    with pytest.raises(WideError, match="^text 'notes/a.txt' has 3 tokens .*, shorter than one sequence of 64"):
        pack(["w1 w2"], tokenizer, seq_len=64, source="notes/a.txt")


def test_windows_too_short(tokenizer):
    with pytest.raises(WideError, match="^text has 2 tokens, shorter than one window of --ctx 2048"):
        ppl_windows(["w1 w2"], tokenizer, ctx=2048)
    with pytest.raises(WideError, match="^text 'b.jsonl' has 2 tokens, shorter than one window of --ctx 2048"):
        ppl_windows(["w1 w2"], tokenizer, ctx=2048, source="b.jsonl")


def test_text_formats(tmp_path):
    (tmp_path / "a.txt").write_text("hello world\n")
    assert load_texts(str(tmp_path / "a.txt")) == ["hello world\n"]
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "one"}) + "\n\n" + json.dumps({"text": "two"}) + "\n")
    assert load_texts(str(tmp_path / "b.jsonl")) == ["one", "two"]
    (tmp_path / "c.jsonl").write_text('{"body": "x"}\n')
    with pytest.raises(WideError, match="line 1 is not a JSON object with a 'text' field"):
        load_texts(str(tmp_path / "c.jsonl"))
    (tmp_path / "d.jsonl").write_text(json.dumps({"text": "one"}) + "\nplain words\n")
    with pytest.raises(WideError, match=r"d.jsonl: line 2 is not valid JSON \(Expecting value at column 1\); each "
                                        r"line must be a JSON object with a 'text' field"):
        load_texts(str(tmp_path / "d.jsonl"))
    (tmp_path / "e.txt").write_text("  \n")
    with pytest.raises(WideError, match="is empty"):
        load_texts(str(tmp_path / "e.txt"))
    with pytest.raises(WideError, match="not found"):
        load_texts(str(tmp_path / "missing.txt"))


def test_jsonl_suffix_in_any_case_and_structured_files_refused(tmp_path):
    (tmp_path / "b.JSONL").write_text(json.dumps({"text": "one"}) + "\n" + json.dumps({"text": "two"}) + "\n")
    assert load_texts(str(tmp_path / "b.JSONL")) == ["one", "two"]  # JSON lines, not one document of JSON
    (tmp_path / "notes.md").write_text('{"text": "kept as written"}\n')
    assert load_texts(str(tmp_path / "notes.md")) == ['{"text": "kept as written"}\n']  # any other name: plain text
    for name in ("data.json", "data.JSON", "data.csv", "data.tsv", "data.parquet", "data.ndjson"):
        path = tmp_path / name
        path.write_text('[{"text": "one"}]\n' if "json" in name.lower() else "text\none\n")
        with pytest.raises(WideError) as e:
            load_texts(str(path))
        suffix = name[name.index("."):]
        assert str(e.value) == (f"text {str(path)!r}: {suffix} files are not read as text; give a plain-text file "
                                "(one document), a .jsonl file with a 'text' field per line, a datasets saved "
                                "folder, or 'boolq-passages'")
    with pytest.raises(WideError, match=r"^text 123 \(type int\) is not a path: give a plain-text file \(one "
                                        r"document\)"):
        load_texts(123)


def test_saved_dataset_folder(tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"text": ["a b", "c d"]}).save_to_disk(str(tmp_path / "ds"))
    assert load_texts(str(tmp_path / "ds")) == ["a b", "c d"]


def test_saved_dataset_text_must_be_strings(tmp_path):
    """A text column of numbers or with a missing value is refused (not read as "1" / "None"), naming the row."""
    datasets = pytest.importorskip("datasets")
    for name, rows, what in (("ints", [1, 2], "row 0 of column 'text' is a number (1)"),
                             ("none", ["a b", None], "row 1 of column 'text' is null"),
                             ("bools", [True], "row 0 of column 'text' is a boolean (True)")):
        datasets.Dataset.from_dict({"text": rows}).save_to_disk(str(tmp_path / name))
        with pytest.raises(WideError) as e:
            load_texts(str(tmp_path / name))
        assert str(e.value) == f"saved dataset {str(tmp_path / name)!r}: {what}; it must be a string"


def test_encodings(tmp_path):
    """A .jsonl with a UTF-8 byte-order mark is read; text that is not UTF-8 is refused, .jsonl as .txt, naming
    the first bad byte; line ends are read as Path.read_text reads them (CR LF and CR become LF)."""
    (tmp_path / "bom.jsonl").write_bytes(b"\xef\xbb\xbf" + json.dumps({"text": "one"}).encode() + b"\r\n"
                                         + json.dumps({"text": "two"}).encode() + b"\r\n")
    assert load_texts(str(tmp_path / "bom.jsonl")) == ["one", "two"]
    for name in ("bin.jsonl", "bin.txt", "bin.JSONL"):
        (tmp_path / name).write_bytes(b'{"text": "caf\xe9"}\n')
        with pytest.raises(WideError) as e:
            load_texts(str(tmp_path / name))
        assert str(e.value) == (f"text file {str(tmp_path / name)!r} is not UTF-8 (byte 0xe9 at offset 13 cannot "
                                "be decoded): save it as UTF-8")
    raw = "a\r\nb\rc\n\u00e9\u4e2d"
    (tmp_path / "crlf.txt").write_bytes(raw.encode())
    assert load_texts(str(tmp_path / "crlf.txt")) == [(tmp_path / "crlf.txt").read_text(encoding="utf-8")]
    assert load_texts(str(tmp_path / "crlf.txt")) == ["a\nb\nc\n\u00e9\u4e2d"]


def test_unreadable_text_names_the_os_error(tmp_path, monkeypatch):
    """A text that cannot be read: one WideError naming the file and the OS reason (monkeypatched: as root a
    permission bit does not stop a read)."""
    path = tmp_path / "locked.txt"
    path.write_text("w1 w2")
    real = type(path).read_bytes
    for err in (PermissionError(13, "Permission denied"), IsADirectoryError(21, "Is a directory")):
        monkeypatch.setattr(type(path), "read_bytes", lambda self, e=err: (_ for _ in ()).throw(e)
                            if self == path else real(self))
        with pytest.raises(WideError) as e:
            load_texts(str(path))
        assert str(e.value) == f"cannot read text {str(path)!r}: {err.strerror}"


@needs_bundled_text
def test_default_text_split_is_disjoint_and_deterministic():
    calib, evals = load_texts(None, "calib"), load_texts(None, "eval")
    assert len(calib) > 1000 and len(evals) > 300
    assert not set(calib) & set(evals)
    assert split_default(calib + evals) == split_default(calib + evals)
