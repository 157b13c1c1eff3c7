"""``reproduce.py --report-only`` on damaged or hand-edited run files (issue 23, item 7).

A ``config.json`` or ``metrics.json`` that is damaged or holds a value of the
wrong type (``"epochs": "two"``, a JSON list, ``"test_acc": "high"``, ``[]``,
``NaN``) makes its run *invalid*: a warning names the file and the field, the
run is left out of the means and its row counts it; never a traceback. A damaged
``runner.json`` or ``log.jsonl`` is worked around. ``results.json`` is strict
JSON (no bare ``NaN``), and ``table.md`` shows no "nan".
"""
from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from qsv_pyg.experiments import ABLATIONS
from qsv_pyg.experiments.cli import main as reproduce_main
from qsv_pyg.experiments.report import collect, format_markdown
from qsv_pyg.experiments.runner import run_dir


GOOD_METRICS = {"test_acc": 0.70, "best_test_acc": 0.71, "train_acc": 0.8, "steps": 1000,
                "stopped_early": True, "epochs": 3, "epochs_planned": 10, "params": 1000,
                "seconds": 60.0, "cpu": "CPU A"}
GOOD_CONFIG = {"time_budget": 30.0, "epochs": 10, "batch_size": 8, "lr": 1e-3}


def write_run(root: Path, slug: str, seed: int, metrics, config) -> Path:
    folder = run_dir(root, "ablations", slug, seed)
    folder.mkdir(parents=True)
    for name, value in (("metrics.json", metrics), ("config.json", config)):
        text = value if isinstance(value, str) else json.dumps(value)
        (folder / name).write_text(text)
    return folder


def table_cells(md: str) -> str:
    """The table lines of a table.md (the warnings may quote a NaN; the cells may not)."""
    return "\n".join(line for line in md.splitlines() if line.startswith("|")).lower()


def strict_load(path: Path):
    """``json.loads`` that refuses NaN/Infinity, as strict JSON readers do."""
    def refuse(constant):
        raise ValueError(f"not strict JSON: {constant}")
    return json.loads(path.read_text(), parse_constant=refuse)


# (file, text of that file, what the warning names)
DAMAGED = [
    ("config.json", json.dumps(dict(GOOD_CONFIG, epochs="two")), "config.json: epochs is 'two'"),
    ("config.json", json.dumps(dict(GOOD_CONFIG, epochs=[1, 2])),
     "config.json: epochs is a JSON list"),
    ("config.json", "[1, 2]", "config.json: holds a JSON list"),
    ("config.json", '{"epochs": 10', "config.json: not valid JSON"),
    ("metrics.json", json.dumps(dict(GOOD_METRICS, test_acc="high")),
     "metrics.json: test_acc is 'high'"),
    ("metrics.json", json.dumps(dict(GOOD_METRICS, test_acc=[])),
     "metrics.json: test_acc is a JSON list"),
    ("metrics.json", "[]", "metrics.json: holds a JSON list"),
    ("metrics.json", json.dumps(dict(GOOD_METRICS, test_acc=float("nan"))),
     "metrics.json: test_acc is NaN"),
    ("metrics.json", json.dumps(dict(GOOD_METRICS, seconds=float("inf"))),
     "metrics.json: seconds is Infinity"),
    ("metrics.json", json.dumps(dict(GOOD_METRICS, steps="many")),
     "metrics.json: steps is 'many'"),
    ("metrics.json", json.dumps(dict(GOOD_METRICS, budget_evals=[{"minutes": "x"}])),
     "metrics.json: budget_evals"),
    ("metrics.json", '{"test_acc": 0.7', "metrics.json: not valid JSON"),
]


@pytest.mark.parametrize("name, text, named", DAMAGED, ids=[d[2] for d in DAMAGED])
def test_report_only_marks_a_damaged_run_invalid_without_a_traceback(tmp_path, capsys, name,
                                                                       text, named):
    write_run(tmp_path, "full", 0, GOOD_METRICS, GOOD_CONFIG)
    bad = write_run(tmp_path, "full", 1, dict(GOOD_METRICS, test_acc=0.60), GOOD_CONFIG)
    (bad / name).write_text(text)
    rc = reproduce_main(["--table", "ablations", "--out-root", str(tmp_path), "--report-only",
                         "--rows", "full"])
    err = capsys.readouterr().err
    assert rc == 0, err
    assert "Traceback" not in err
    # The warning names the run, the file and the field; once on stderr, once in table.md.
    warning = [line for line in err.splitlines() if line.startswith("warning: ")]
    assert len(warning) == 1 and "full/seed1: invalid run" in warning[0] and named in warning[0]
    folder = tmp_path / "ablations"
    md = (folder / "table.md").read_text()
    assert named in md and "nan" not in table_cells(md)
    assert "| Full kernel | qsv | 1,000 | 1 (+1 invalid) | 70.00 |" in md
    results = strict_load(folder / "results.json")
    m = results["rows"][0]["measured"]
    # The invalid run (test acc 60 where readable) is left out of the mean.
    assert m["n"] == 1 and m["n_invalid"] == 1 and m["test_acc_mean"] == pytest.approx(70.0)
    assert [r["status"] for r in m["runs"]] == ["done", "invalid"]
    assert any(named in p for p in m["runs"][1]["problems"])
    with open(folder / "table.csv", newline="") as f:
        row = next(csv.DictReader(f))
    assert row["n_seeds"] == "1" and row["n_invalid"] == "1"


def test_a_row_of_only_nan_runs_shows_n_a_and_results_json_has_no_nan(tmp_path, capsys):
    nan = dict(GOOD_METRICS, test_acc=float("nan"), best_test_acc=float("nan"))
    write_run(tmp_path, "full", 0, GOOD_METRICS, GOOD_CONFIG)
    write_run(tmp_path, "transport-identity", 0, nan, GOOD_CONFIG)
    write_run(tmp_path, "transport-identity", 1, nan, GOOD_CONFIG)
    assert reproduce_main(["--table", "ablations", "--out-root", str(tmp_path),
                           "--report-only", "--rows", "full", "transport-identity"]) == 0
    assert "Traceback" not in capsys.readouterr().err
    folder = tmp_path / "ablations"
    md = (folder / "table.md").read_text()
    assert "| Transport → identity | qsv | — | 0 (+2 invalid) | n/a | — |" in md
    assert "| Transport → identity | 0 | invalid |" in md  # the per-seed table
    assert "nan" not in table_cells(md)
    results = strict_load(folder / "results.json")
    ident = results["rows"][1]["measured"]
    assert ident["test_acc_mean"] is None and ident["n_invalid"] == 2


def test_results_json_is_strict_even_with_non_finite_settings(tmp_path):
    """Values the report passes through (model keywords) never reach it as bare NaN."""
    write_run(tmp_path, "full", 0, GOOD_METRICS,
              dict(GOOD_CONFIG, model_args={"beta_init": float("nan")}))
    assert reproduce_main(["--table", "ablations", "--out-root", str(tmp_path),
                           "--report-only", "--rows", "full"]) == 0
    results = strict_load(tmp_path / "ablations" / "results.json")
    assert results["settings"]["model_args"] == {"qsv": {"beta_init": None}}


def test_damaged_runner_record_and_log_are_worked_around(tmp_path):
    folder = write_run(tmp_path, "full", 0, GOOD_METRICS, GOOD_CONFIG)
    (folder / "runner.json").write_text('{"launches": "yes", "time_budget": "long"}')
    (folder / "log.jsonl").write_text(
        '{"epoch": 1, "betas": {"cross0": [1.0, 2.0]}}\n'
        '{"epoch": "two", "betas": {"cross0": 1.0}}\n'
        '{"epoch": 3, "betas": ["x"]}\n')
    summary = collect(ABLATIONS, tmp_path, rows=["full"])
    run = summary["rows"][0]["measured"]["runs"][0]
    assert run["status"] == "done" and run["settings"]["time_budget"] == 30.0
    assert summary["rows"][0]["_betas"] == [(0, [(1, {"cross0": [1.0, 2.0]})])]
    warnings = " ".join(summary["warnings"])
    assert "runner.json: launches is" in warnings and "runner.json: time_budget is" in warnings
    assert "log.jsonl: 2 record(s)" in warnings
    assert "Full kernel" in format_markdown(summary)


def test_older_metrics_without_epochs_still_report(tmp_path):
    """Optional fields may be missing (older trainers): not invalid, and no crash."""
    write_run(tmp_path, "full", 0, {"test_acc": 0.5}, {})
    write_run(tmp_path, "full", 1, GOOD_METRICS, GOOD_CONFIG)
    summary = collect(ABLATIONS, tmp_path, rows=["full"])
    m = summary["rows"][0]["measured"]
    assert m["n"] == 2 and m["n_invalid"] == 0 and m["epochs_done"] == [3]
    assert "| 2 | 60.00 ± 14.14 |" in format_markdown(summary)


def test_report_only_into_an_unwritable_root_exits_2_with_one_line(tmp_path, capsys):
    root = tmp_path / "file"
    root.write_text("not a folder")
    assert reproduce_main(["--table", "ablations", "--out-root", str(root),
                           "--report-only"]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: cannot write the report"), err
