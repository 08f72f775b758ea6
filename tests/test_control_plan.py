"""``benchmarks/quality/run_control.py``'s job plan: what part ``equal`` trains and evaluates, in the order the
launcher starts them (trainings first, so the routed checkpoints are not kept waiting behind the zero-shot jobs
that need none)."""

import importlib.util
from pathlib import Path


def _run_control():
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "quality" / "run_control.py"
    spec = importlib.util.spec_from_file_location("run_control", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_equal_plans_the_trainings_first():
    rc = _run_control()
    a = rc.parser().parse_args(["--calib", "c", "--wikitext", "w", "--out", "o", "--parts", "equal",
                                "--equal-targets", "0.5", "0.25"])
    jobs = rc.plan_jobs(a)
    keys = [j["key"] for j in jobs]
    assert keys == ["wide-groups-s50", "skipgpt-groups-s50", "wide-groups-s25", "skipgpt-groups-s25", "zs-dense",
                    "zs-static-s50", "zs-wide-groups-s50", "zs-skipgpt-groups-s50", "zs-static-s25",
                    "zs-wide-groups-s25", "zs-skipgpt-groups-s25"]
    by_key = {j["key"]: j for j in jobs}
    for j in jobs:  # every zero-shot job of a routed model waits on its own training, of its method and target
        if j["kind"] == "zs" and j["method"] in ("wide", "skipgpt"):
            src = by_key[j["needs"]]
            assert (src["kind"], src["method"], src["target"], src["unit"]) == ("train", j["method"], j["target"],
                                                                                 "groups")
        elif j["kind"] == "zs":
            assert j["needs"] is None
