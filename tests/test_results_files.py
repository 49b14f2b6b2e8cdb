"""The committed benchmark results: run files, results.json and the generated RESULTS.md agree with each other."""

import json
import math
from pathlib import Path

import pytest

from benchmarks import render_results as rr

RUN_FILES = sorted(rr.RUNS_DIR.glob("*.json"))


def test_there_are_runs():
    assert RUN_FILES, f"no run files under {rr.RUNS_DIR}"


@pytest.mark.parametrize("path", RUN_FILES, ids=lambda p: p.name)
def test_run_file_parses_and_has_the_required_keys(path):
    doc = json.loads(path.read_text())
    rr.check_run(doc, path.name)
    assert path.name == rr.run_file_name(doc)
    assert doc["results"], f"{path.name} has no results"


def test_run_numbers_are_unique_and_ordered_by_date():
    runs = rr.load_runs()
    assert [doc["run"] for doc in runs] == sorted({doc["run"] for doc in runs})
    assert [doc["date"] for doc in runs] == sorted(doc["date"] for doc in runs)


def test_results_json_holds_the_newest_value_of_each_metric():
    """Every entry of results.json is what the newest run that measured the metric recorded."""
    runs = rr.load_runs()
    latest = rr.load_latest()
    assert latest
    names = [row["name"] for row in latest]
    assert len(names) == len(set(names)), "a metric appears twice in results.json"
    for row in latest:
        assert set(row) == {"name", "value", "unit", "target", "commit", "date"}, row
        measured = rr.history(row["name"], runs)
        assert measured, f"`{row['name']}` is in results.json but in no run file"
        doc, newest = measured[-1]
        assert (doc["commit"], doc["date"]) == (row["commit"], row["date"]), row["name"]
        assert math.isclose(newest["value"], row["value"], rel_tol=1e-9), row["name"]
        assert (newest["unit"], newest["target"]) == (row["unit"], row["target"]), row["name"]


def test_results_md_is_generated_from_the_committed_files():
    expected = rr.render(rr.load_latest(), rr.load_runs())
    assert rr.RESULTS_MD.read_text() == expected, "stale: run `python benchmarks/render_results.py`"


def test_headline_rows_name_their_run():
    text = rr.render(rr.load_latest(), rr.load_runs())
    headline = text.split("## Headline")[1].split("## Run-to-run spread")[0]
    rows = [line for line in headline.splitlines() if line.startswith("| `")]
    assert len(rows) == len(rr.HEADLINE)
    for row in rows:
        run = row.rstrip(" |").rsplit("| ", 1)[1]
        assert run.split()[0].isdigit(), row


def test_check_run_names_the_problem():
    good = {"run": 1, "date": "2026-01-02", "commit": "abc1234", "gpu": "G", "command": "c", "tests": "t",
            "note": "", "results": [{"name": "m", "value": 1.0, "unit": "x", "target": None}]}
    rr.check_run(good)
    with pytest.raises(ValueError, match="missing key `gpu`"):
        rr.check_run({k: v for k, v in good.items() if k != "gpu"})
    with pytest.raises(ValueError, match="non-numeric"):
        rr.check_run({**good, "results": [{"name": "m", "value": "1.0", "unit": "x", "target": None}]})
    with pytest.raises(ValueError, match="appears twice"):
        rr.check_run({**good, "results": good["results"] * 2})
    with pytest.raises(ValueError, match="YYYY-MM-DD"):
        rr.check_run({**good, "date": "3 Dec 2026"})


def test_merge_latest_replaces_measured_metrics_in_place_and_appends_new_ones():
    old = [{"name": "a", "value": 1}, {"name": "b", "value": 2}, {"name": "c", "value": 3}]
    new = [{"name": "d", "value": 40}, {"name": "b", "value": 20}]
    assert rr.merge_latest(old, new) == [{"name": "a", "value": 1}, {"name": "b", "value": 20},
                                         {"name": "c", "value": 3}, {"name": "d", "value": 40}]


def test_next_run_number_follows_the_highest(tmp_path: Path):
    assert rr.next_run_number(tmp_path) == 1
    (tmp_path / "2026-01-02_run07_abc.json").write_text("{}")
    (tmp_path / "2026-01-01_run03_def.json").write_text("{}")
    assert rr.next_run_number(tmp_path) == 8


@pytest.mark.parametrize("target, value, expected", [
    (">= 3.0", 3.125, "met"), (">= 3.0", 2.9, "not met"), ("< 0.05", 0.038, "met"), ("0", 0.0, "met"),
    (">= 0.60 (best path: hadamard)", 0.59, "not met"), ("chunk=none", 1.0, ""), (None, 1.0, ""),
])
def test_status_of_a_target(target, value, expected):
    assert rr.status(value, target) == expected
