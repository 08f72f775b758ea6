"""Option types of the ``wide bench`` commands (comma-separated lists checked when parsed, one clear error each) and
``--report-only``."""

from __future__ import annotations

import argparse
import math
import re


def _items(s: str, what: str, example: str) -> list[str]:
    items = [v.strip() for v in str(s).split(",")]
    if not any(items):
        raise argparse.ArgumentTypeError(f"empty list; give one or more comma-separated {what}, e.g. {example}")
    if not all(items):
        raise argparse.ArgumentTypeError(f"{s!r} has an empty item; give comma-separated {what}, e.g. {example}")
    return items


def _number(v: str, conv, what: str):
    try:
        return conv(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{v!r} is not {what}") from None


def int_list(lo: int = 1):
    """Comma-separated integers >= ``lo``."""
    def parse(s):
        out = [_number(v, int, f"an integer (comma-separated integers >= {lo})")
               for v in _items(s, f"integers >= {lo}", f"{lo},{lo * 2}")]
        low = [x for x in out if x < lo]
        if low:
            raise argparse.ArgumentTypeError(f"{low[0]} is below {lo} (comma-separated integers >= {lo})")
        return out
    return parse


def group_list(s):
    """Comma-separated FFN group sizes: powers of two from 16 to 2048, as :class:`wide.WideConfig` requires."""
    out = int_list(16)(s)
    bad = [g for g in out if g & (g - 1) or g > 2048]
    if bad:
        raise argparse.ArgumentTypeError(f"group size {bad[0]} is not a power of two from 16 to 2048 (16, 32, 64, ...)")
    return out


def sparsity_list(s):
    """Comma-separated sparsities in [0, 1)."""
    what = "a number (comma-separated sparsities in [0, 1))"
    out = [_number(v, float, what) for v in _items(s, "sparsities in [0, 1)", "0,0.5")]
    for x in out:
        if not (math.isfinite(x) and 0.0 <= x < 1.0):
            raise argparse.ArgumentTypeError(f"sparsity {x} is outside [0, 1)")
    return out


def choice_list(*choices: str):
    """Comma-separated names from ``choices``."""
    def parse(s):
        out = _items(s, "names from " + ", ".join(choices), ",".join(choices[:2]))
        bad = [v for v in out if v not in choices]
        if bad:
            raise argparse.ArgumentTypeError(f"{', '.join(map(repr, bad))} not allowed; choose from "
                                             f"{', '.join(choices)}")
        return out
    return parse


def int_at_least(lo: int):
    """One integer >= ``lo``."""
    def parse(v):
        x = _number(v, int, f"an integer (an integer >= {lo})")
        if x < lo:
            raise argparse.ArgumentTypeError(f"{x} is below {lo}")
        return x
    return parse


def float_above(lo: float):
    """One finite number > ``lo``."""
    def parse(v):
        x = _number(v, float, f"a number (a number > {lo:g})")
        if not (math.isfinite(x) and x > lo):
            raise argparse.ArgumentTypeError(f"{x:g} must be a finite number > {lo:g}")
        return x
    return parse


def report_only(path: str, write_report, out_dir: str, tag: str) -> int:
    """``--report-only``: rebuild the table and plot of ``tag`` in ``out_dir`` from the records at ``path``; raises
    WideError for a missing or unreadable file, or one that is not this benchmark's list of records (then nothing in
    ``out_dir`` is written: the report is built in a temporary folder and moved in whole)."""
    import importlib.util
    import json
    import os
    import shutil
    import tempfile

    from wide.errors import WideError

    if not os.path.isfile(path):
        raise WideError(f"--report-only: no results at {path}; --out-dir and --tag choose the file of an earlier run")
    try:
        with open(path) as f:
            recs = json.load(f)
    except (OSError, ValueError) as e:
        raise WideError(f"--report-only: {path} is not a readable JSON file ({e})") from None
    if not isinstance(recs, list) or not all(isinstance(r, dict) for r in recs):
        raise WideError(f"--report-only: {path} holds a {type(recs).__name__}, not a list of JSON records")
    if not recs:
        raise WideError(f"--report-only: {path} holds no records")
    with tempfile.TemporaryDirectory(dir=out_dir or ".") as tmp:
        try:
            write_report(recs, tmp, tag)
        except KeyError as e:
            raise WideError(f"--report-only: a record of {path} lacks the field {e}; the file is not this "
                            "benchmark's output") from None
        except (TypeError, ValueError, ZeroDivisionError) as e:
            raise WideError(f"--report-only: a record of {path} holds a value of the wrong type or out of range "
                            f"({type(e).__name__}: {e}); the file is not this benchmark's output") from None
        names = sorted(os.listdir(tmp))
        for name in names:
            shutil.move(os.path.join(tmp, name), os.path.join(out_dir, name))
    plot = "" if importlib.util.find_spec("matplotlib") else " (no plot: matplotlib is not installed)"
    print(f"rebuilt {', '.join(names)} in {out_dir} from {path}{plot}", flush=True)
    return 0


def file_stem(s: str) -> str:
    """A result file stem: letters, digits, ``.``, ``_`` and ``-`` (no path); an empty one is left to the command
    line's empty-value check."""
    if s and not re.fullmatch(r"[A-Za-z0-9_.-]+", s) or s in (".", ".."):
        raise argparse.ArgumentTypeError(f"{s!r} is not a file stem; use letters, digits, '.', '_' and '-'")
    return s


def command_line(name: str, args) -> str:
    """The benchmark's command as run, for its records: the kernel backend variables that were set, then
    ``wide bench <name>`` and its options."""
    import os

    env = [f"{v}={os.environ[v]}" for v in ("WIDE_GEMM_BACKEND", "WIDE_ATTN_BACKEND") if os.environ.get(v)]
    return " ".join([*env, "wide", "bench", name, *getattr(args, "argv", [])[2:]])


def gpu_tag() -> str:
    """Result file stem of the current GPU: its model in lower case (``h200``, ``h100``, ``a100``), else the letters
    and digits of its name joined by ``_``."""
    import re

    import torch

    name = torch.cuda.get_device_name()
    m = re.search(r"\b([A-Z]\d{2,4}[A-Za-z]?)\b", name.replace("NVIDIA", ""))
    return m.group(1).lower() if m else "_".join(re.findall(r"[a-z0-9]+", name.lower()))


def provenance(name: str, args) -> dict:
    """What every record of ``wide bench <name>`` carries about its run: :func:`run_provenance` of
    :func:`command_line`."""
    return run_provenance(command_line(name, args))


def source_commit() -> tuple[str | None, str | None]:
    """``(short hash, commit date)`` of the source tree that runs: from git in a checkout, else from ``wide/COMMIT``,
    which ``git archive`` fills in (``export-subst``: a tree carried to another machine as an archive still names
    its commit); ``(None, None)`` when neither knows."""
    import os
    import subprocess

    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the wide package folder

    def git(*a: str) -> str:
        try:
            return subprocess.run(["git", *a], capture_output=True, text=True, cwd=here).stdout.strip()
        except OSError:  # no git on this machine
            return ""

    commit = git("rev-parse", "--short", "HEAD")
    if commit:
        return commit, git("show", "-s", "--format=%cs", "HEAD") or None
    try:
        with open(os.path.join(here, "COMMIT")) as f:
            words = f.read().split()
    except OSError:
        return None, None
    return (words[0], words[1] if len(words) > 1 else None) if words and "$" not in words[0] else (None, None)


def run_provenance(command: str) -> dict:
    """What every benchmark record carries about its run: ``commit`` (short hash, :func:`source_commit`; "unknown"
    where it knows none), ``date`` (the commit's, else today), ``run_date`` (UTC, seconds) and ``command``."""
    import datetime

    commit, date = source_commit()
    return dict(commit=commit or "unknown", date=date or datetime.date.today().isoformat(),
                run_date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                command=command)


def doc_summary(doc: str) -> str:
    """The first paragraph of a script's docstring as one line: its ``--help`` description."""
    return " ".join(doc.split("\n\n")[0].split())


def require_sm90(parser):
    """The built CuTe module on the current GPU; without one, one line from ``parser`` and exit code 2."""
    import torch

    from wide.kernels import sm90

    m = sm90.module(torch.device("cuda")) if torch.cuda.is_available() else None
    if m is None:
        parser.exit(2, f"{parser.prog}: the CuTe kernels need an sm_90 GPU and a working build\n")
    return m
