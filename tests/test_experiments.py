"""Table runner and report on a tiny CIFAR-10 layout (CPU, a few seconds per run).

The runs train for one epoch on 40 random images: the point is the bookkeeping
(run folders, reuse, resume, configuration checks, report files, errors), not
accuracy.
"""
from __future__ import annotations

import csv
import json
import os
import threading
import time
from pathlib import Path

import pytest

from qsv_pyg.experiments import ABLATIONS, CONTROLS, PaperValue, get_table
from qsv_pyg.experiments.tables import FIELD, STUDY
from qsv_pyg.experiments import runner
from qsv_pyg.experiments.report import REPORT_FILES
from qsv_pyg.experiments.cli import main
from qsv_pyg.experiments.runner import ExperimentError, RunSettings, plan_runs, run_dir, run_table
from qsv_pyg.experiments.tables import Row, Table
from qsv_pyg.models.zoo import model_overrides_for

from tiny_cifar import write_tiny_cifar10  # noqa: E402


# Graph models small enough for an epoch to take well under a second.
TINY = {"shell_sizes": [16, 4], "widths": [8, 8], "heads": 2, "k_cross": 4, "k_inner": 3,
        "within_rounds": 1, "repulsion_k": 3}

@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("data")
    write_tiny_cifar10(root, 40, 20)
    return root


def args(table: str, data_dir: Path, root: Path, *extra: str, budget: str = "1",
         overrides=TINY, train_args: str = "--warmup-epochs 0") -> list:
    return ["--table", table, "--data-dir", str(data_dir), "--out-root", str(root),
            "--budget-minutes", budget, "--seeds", "0", "--epochs", "1", "--batch-size", "8",
            "--device", "cpu", "--no-progress", "--model-overrides", json.dumps(overrides),
            "--train-args", train_args, *extra]


def assert_report(folder: Path, labels) -> dict:
    for name in REPORT_FILES:
        assert (folder / name).is_file() and (folder / name).stat().st_size > 0, name
    md = (folder / "table.md").read_text()
    for label in labels:
        assert label.replace("|", "\\|") in md
    with open(folder / "table.csv", newline="") as f:
        assert [r["label"] for r in csv.DictReader(f)] == list(labels)
    results = json.loads((folder / "results.json").read_text())
    assert [r["label"] for r in results["rows"]] == list(labels)
    return results


# --------------------------------------------------------------------------- tables


def test_tables_define_the_paper_rows():
    # The paper's matched attention is scaled-dot-product attention: TransformerConv.
    assert CONTROLS.slugs == ["qsv", "attention-transformer", "attention-gat",
                              "attention-gatv2", "lattice", "resnet20"]
    assert CONTROLS.row("attention-transformer").paper.acc == 87.3
    assert CONTROLS.row("attention-gat").paper.empty
    assert len(ABLATIONS.rows) == 9 and ABLATIONS.reference == "full"
    assert ABLATIONS.row("both-off").flags() == ["--routing", "uniform",
                                                 "--transport", "identity"]
    assert ABLATIONS.row("beta-frozen5").flags() == ["--beta-init", "5.0", "--frozen-beta"]
    assert ABLATIONS.row("frozen-field").flags() == ["--frozen-field"]
    # Paper values live in their own field, with their own formatting.
    assert CONTROLS.row("qsv").paper == PaperValue(acc=85.9)
    assert CONTROLS.row("resnet20").paper.text() == "≈93.2"
    assert ABLATIONS.row("transport-identity").paper.text() == "≈81.7"
    assert ABLATIONS.row("routing-uniform").paper.text() == "≈85.7"
    assert ABLATIONS.row("both-off").paper.text() == "64.1"
    assert STUDY.slugs == ["qsv", "attention-transformer", "attention-gat", "lattice",
                           "resnet20", "transport-identity", "routing-uniform", "both-off"]
    assert FIELD.row("field-lr5").flags() == ["--field-lr-scale", "5.0"]
    with pytest.raises(KeyError, match="rows: full"):
        ABLATIONS.select(["nope"])
    with pytest.raises(KeyError, match="controls"):
        get_table("nope")


def test_model_overrides_are_translated_per_model():
    assert model_overrides_for("qsv", TINY) == TINY
    lattice = model_overrides_for("lattice", TINY)
    assert lattice["lattice_sides"] == [4, 2] and "shell_sizes" not in lattice
    gat = model_overrides_for("attention-gat", TINY)
    assert gat["qsv_widths"] == [8, 8] and "widths" not in gat and "repulsion_k" not in gat
    assert model_overrides_for("resnet20", TINY) == {}
    nested = model_overrides_for("attention-gat", dict(TINY, **{"attention-gat": {
        "widths": [4, 4]}}))
    assert nested["widths"] == [4, 4] and "qsv_widths" not in nested
    with pytest.raises(ValueError, match="unknown key"):
        model_overrides_for("qsv", {"widht": [8]})
    with pytest.raises(ValueError, match="square"):
        model_overrides_for("lattice", {"shell_sizes": [15, 4]})


# --------------------------------------------------------------------------- runs


def test_ablations_run_report_and_reuse(data_dir, tmp_path, monkeypatch, capsys):
    rows = ["full", "transport-identity", "routing-uniform"]
    # A CPU-time budget: on starved cores a wall-clock minute could end a run before its
    # first epoch (seen twice with two study runs holding both cores).
    argv = args("ablations", data_dir, tmp_path, "--rows", *rows, "--launcher", "in-process",
                train_args="--warmup-epochs 0 --budget-clock process")
    assert main(argv) == 0
    labels = [ABLATIONS.row(r).label for r in rows]
    results = assert_report(tmp_path / "ablations", labels)
    assert all(r["measured"]["n"] == 1 for r in results["rows"])
    assert results["rows"][0]["measured"]["delta"] == 0.0
    assert results["rows"][1]["paper"]["acc"] == 81.7
    assert results["settings"]["time_budget"] == 1.0
    for slug in rows:
        folder = run_dir(tmp_path, "ablations", slug, 0)
        assert json.loads((folder / "log.jsonl").read_text().splitlines()[0])["betas"]
    assert "3 trained" in capsys.readouterr().out

    # The same command again: every run is reused, nothing is launched.
    metrics = run_dir(tmp_path, "ablations", "full", 0) / "metrics.json"
    mtime = metrics.stat().st_mtime_ns

    def no_training(*a, **k):
        raise AssertionError("a finished run was trained again")

    monkeypatch.setattr(runner, "launch_training", no_training)
    assert main(argv) == 0
    assert "3 reused" in capsys.readouterr().out
    assert metrics.stat().st_mtime_ns == mtime


def test_resume_mismatch_overwrite_and_budget(data_dir, tmp_path, capsys):
    argv = args("ablations", data_dir, tmp_path, "--rows", "full", "--launcher", "in-process")
    assert main(argv) == 0
    folder = run_dir(tmp_path, "ablations", "full", 0)

    # A checkpoint without metrics (an interrupted run) is resumed, not restarted.
    os.remove(folder / "metrics.json")
    assert main(argv) == 0
    assert "1 resumed" in capsys.readouterr().out
    launches = json.loads((folder / "runner.json").read_text())["launches"]
    assert [x["action"] for x in launches] == ["train", "resume"]
    assert float(launches[-1]["argv"][launches[-1]["argv"].index("--time-budget") + 1]) <= 1.0

    # A changed setting is refused before anything runs, unless --overwrite.
    changed = args("ablations", data_dir, tmp_path, "--rows", "full", "--launcher",
                   "in-process", budget="2")
    assert main(changed) == 2
    err = capsys.readouterr().err
    assert "different configuration" in err and "time_budget" in err
    assert main(changed + ["--overwrite"]) == 0
    assert "1 trained" in capsys.readouterr().out

    # A budget that ends before the first step still yields metrics, marked as stopped.
    tiny_budget = args("ablations", data_dir, tmp_path / "b", "--rows", "full",
                       "--launcher", "in-process", budget="0.0001")
    assert main(tiny_budget) == 0
    md = (tmp_path / "b" / "ablations" / "table.md").read_text()
    assert "(budget: 1/1)" in md


def test_controls_in_subprocesses(data_dir, tmp_path, capsys):
    # The default launcher: one fresh interpreter per run, here two side by side.
    assert main(args("controls", data_dir, tmp_path, "--rows", "qsv", "resnet20",
                     "--jobs", "2")) == 0
    assert "2 trained" in capsys.readouterr().out
    results = assert_report(tmp_path / "controls", ["QSV", "ResNet-20"])
    qsv, resnet = results["rows"]
    assert qsv["paper"]["acc"] == 85.9 and resnet["paper"]["approx"]
    assert resnet["measured"]["params"] > 100 * qsv["measured"]["params"]
    assert any("not parameter-matched" in w for w in results["warnings"])
    out = (run_dir(tmp_path, "controls", "qsv", 0) / "output.txt").read_text()
    assert "done: test acc" in out
    # Only the requested rows were run.
    assert not (tmp_path / "controls" / "lattice").exists()


def test_report_only_without_runs(tmp_path, capsys):
    assert main(["--table", "controls", "--out-root", str(tmp_path), "--report-only"]) == 0
    results = assert_report(tmp_path / "controls", [r.label for r in CONTROLS.rows])
    assert all(r["measured"]["n"] == 0 for r in results["rows"])


@pytest.mark.parametrize("extra, message", [
    (["--table", "nope"], "invalid choice"),
    (["--table", "ablations", "--rows", "nope"], "has no row"),
    (["--table", "ablations", "--budget-minutes", "0"], "must be positive"),
    (["--table", "ablations"], "--budget-minutes is required"),
    (["--table", "ablations", "--budget-minutes", "1", "--seeds", "x"], "non-negative integer"),
    (["--table", "ablations", "--budget-minutes", "1", "--model-overrides", "{bad"],
     "not valid JSON"),
    (["--table", "ablations", "--budget-minutes", "1", "--model-overrides", '{"widht": 1}'],
     "unknown key"),
    (["--table", "ablations", "--budget-minutes", "1", "--train-args", "--seed 3"],
     "may not contain --seed"),
    (["--table", "ablations", "--budget-minutes", "1", "--train-args=--bogus"],
     "unrecognized arguments"),
    (["--table", "ablations", "--budget-minutes", "1", "--epochs", "0"], "must be positive"),
    (["--table", "ablations", "--budget-minutes", "1", "--jobs", "0"], "must be positive"),
    (["--table", "ablations", "--budget-minutes", "1", "--jobs", "2", "--launcher",
      "in-process"], "needs the subprocess launcher"),
    (["--table", "ablations", "--budget-minutes", "1", "--rows", "full",
      "--model-overrides", '{"widths": [8, 8]}'], "cannot build 'qsv'"),
])
def test_bad_flags_fail_clearly(data_dir, tmp_path, capsys, extra, message):
    argv = ["--data-dir", str(data_dir), "--out-root", str(tmp_path), "--no-progress", *extra]
    assert main(argv) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "ablations").exists()  # nothing was trained


def test_missing_data_dir_is_reported(tmp_path, capsys):
    argv = ["--table", "ablations", "--budget-minutes", "1", "--data-dir",
            str(tmp_path / "none"), "--out-root", str(tmp_path)]
    assert main(argv) == 2
    assert "no such folder" in capsys.readouterr().err


# --------------------------------------------------------------------------- seed plans


def test_study_seed_plan_and_override(tmp_path):
    # The protocol: seed 0 for every row, seed 1 also for QSV, the matched
    # attention and both off; --seeds replaces the plan for every row.
    assert STUDY.seeds_of("qsv") == (0, 1) and STUDY.seeds_of("resnet20") == (0,)
    assert CONTROLS.seeds_of("qsv") == (0,)
    with pytest.raises(KeyError, match="has no row"):
        STUDY.seeds_of("nope")
    settings = RunSettings(budget_minutes=1.0)
    planned = [s.name for s in plan_runs(STUDY, None, tmp_path, settings,
                                         validate_models=False)]
    assert planned == ["qsv/seed0", "qsv/seed1", "attention-transformer/seed0",
                       "attention-transformer/seed1", "attention-gat/seed0", "lattice/seed0",
                       "resnet20/seed0", "transport-identity/seed0", "routing-uniform/seed0",
                       "both-off/seed0", "both-off/seed1"]
    given = plan_runs(STUDY, [2], tmp_path, settings, rows=["qsv", "resnet20"],
                      validate_models=False)
    assert [s.name for s in given] == ["qsv/seed2", "resnet20/seed2"]
    with pytest.raises(ValueError, match="extra_seeds name no row"):
        Table("t", "T", (Row("a", "A", "qsv"),), "a", extra_seeds={"b": (1,)})


# --------------------------------------------------------------------------- side by side


def _fake_launcher(fail=(), barrier=None):
    """A stand-in for launch_training: records the runs, writes metrics, exits 0 or 2.

    The first two launches wait for each other at ``barrier``; a run that succeeds
    returns only after every failed run has returned (and a moment more, so the
    runner has recorded the failure).
    """
    launched, lock, failed = [], threading.Lock(), threading.Event()

    def launch(argv, out_dir, launcher="subprocess"):
        with lock:
            launched.append(out_dir.parent.name)
            first_two = len(launched) <= 2
        if barrier is not None and first_two:
            barrier.wait()  # breaks (and fails the test) unless two runs are in flight
        if out_dir.parent.name in fail:
            failed.set()
            return 2
        if fail:
            assert failed.wait(timeout=20)
            time.sleep(0.5)
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "metrics.json").write_text(json.dumps(
            {"test_acc": 0.5, "epochs": 1, "epochs_planned": 1}))
        return 0

    return launch, launched


def test_runs_side_by_side_in_plan_order(tmp_path, monkeypatch):
    barrier = threading.Barrier(2, timeout=20)
    launch, launched = _fake_launcher(barrier=barrier)
    monkeypatch.setattr(runner, "launch_training", launch)
    rows = ["full", "transport-identity", "routing-uniform"]
    results = run_table(ABLATIONS, [0], tmp_path, RunSettings(budget_minutes=1.0), rows=rows,
                        progress=False, validate_models=False, jobs=2)
    assert not barrier.broken
    assert [r.spec.row.slug for r in results] == rows  # plan order, whatever ended first
    assert [r.status for r in results] == ["trained"] * 3
    assert sorted(launched) == sorted(rows)


def test_side_by_side_error_starts_nothing_more(tmp_path, monkeypatch):
    # The first run is rejected (exit 2) while the second is in flight: the second
    # finishes, the third never starts, and the error names the rejected run.
    barrier = threading.Barrier(2, timeout=20)
    launch, launched = _fake_launcher(fail={"full"}, barrier=barrier)
    monkeypatch.setattr(runner, "launch_training", launch)
    rows = ["full", "transport-identity", "routing-uniform"]
    with pytest.raises(ExperimentError, match="full/seed0: the trainer rejected"):
        run_table(ABLATIONS, [0], tmp_path, RunSettings(budget_minutes=1.0), rows=rows,
                  progress=False, validate_models=False, jobs=2)
    assert sorted(launched) == ["full", "transport-identity"]
    assert (run_dir(tmp_path, "ablations", "transport-identity", 0) / "metrics.json").is_file()


def test_readme_study_command_plans_the_whole_study(tmp_path):
    # The one documented command of the study (README) parses, and without --seeds it
    # plans every run of the protocol, two side by side.
    import shlex
    from qsv_pyg.experiments.cli import build_parser

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    start = readme.index("python examples/reproduce.py --table study --data-dir")
    lines = []
    for line in readme[start:].splitlines():
        lines.append(line.rstrip("\\ "))
        if not line.endswith("\\"):
            break
    argv = shlex.split(" ".join(lines))[2:]
    ns = build_parser().parse_args(argv)
    assert ns.table == "study" and ns.seeds is None and ns.jobs == 2
    assert ns.budget_minutes == 30
    assert len(plan_runs(STUDY, ns.seeds, tmp_path, RunSettings(budget_minutes=30.0),
                         validate_models=False)) == 11


def test_side_by_side_waits_for_tasks_in_flight_after_ctrl_c(monkeypatch):
    from qsv_pyg.experiments import side_by_side

    class Stopped(Exception):
        pass

    started, finished, second = [], [], threading.Event()
    real_join, ctrl_c = side_by_side._join, [KeyboardInterrupt]

    def join_then_ctrl_c(threads):
        # The main thread's first wait ends in Ctrl-C once tasks 0 and 1 are in flight.
        if ctrl_c:
            assert second.wait(timeout=20)
            raise ctrl_c.pop()
        real_join(threads)

    def task(i):
        started.append(i)
        if i == 1:
            second.set()
        time.sleep(1.0)
        finished.append(i)
        return i

    monkeypatch.setattr(side_by_side, "_join", join_then_ctrl_c)
    with pytest.raises(Stopped):
        side_by_side.run_side_by_side(task, [0, 1, 2, 3], 2, interrupted=Stopped)
    # Both tasks in flight ended before the error was raised; none started after it.
    assert sorted(started) == [0, 1] and sorted(finished) == [0, 1]
    monkeypatch.setattr(side_by_side, "_join", real_join)
    assert side_by_side.run_side_by_side(lambda i: i * i, range(5), 3) == [0, 1, 4, 9, 16]
    with pytest.raises(ValueError, match="at least 1"):
        side_by_side.run_side_by_side(lambda i: i, [1], 0)


def _fake_run(root, table, slug, seed, acc, steps, cpu=None):
    folder = run_dir(root, table, slug, seed)
    folder.mkdir(parents=True)
    metrics = {"test_acc": acc, "steps": steps, "stopped_early": True, "epochs": 3,
               "epochs_planned": 10, "params": 1000}
    if cpu:
        metrics["cpu"] = cpu
    (folder / "metrics.json").write_text(json.dumps(metrics))
    (folder / "config.json").write_text(json.dumps({"time_budget": 30.0}))


def test_report_pairs_delta_by_seed_and_flags_unequal_compute(tmp_path):
    from qsv_pyg.experiments.report import collect, format_markdown

    # The reference ran seeds 0 and 1 (seed 1 on a slower CPU: fewer steps); the
    # variant only seed 0. Δ compares the variant with the reference's seed 0 only.
    _fake_run(tmp_path, "ablations", "full", 0, 0.70, 10_000, "CPU A")
    _fake_run(tmp_path, "ablations", "full", 1, 0.60, 7_000, "CPU B")
    _fake_run(tmp_path, "ablations", "transport-identity", 0, 0.66, 11_000, "CPU A")
    summary = collect(ABLATIONS, tmp_path, rows=["full", "transport-identity"])
    full, ident = summary["rows"]
    assert full["measured"]["test_acc_mean"] == pytest.approx(65.0)
    assert ident["measured"]["delta"] == pytest.approx(-4.0)  # not 66 − 65 = +1
    assert ident["measured"]["delta_seeds"] == [0]
    warnings = " ".join(summary["warnings"])
    assert "different CPUs (CPU A; CPU B)" in warnings
    assert "full: its seeds made different numbers of optimiser steps" in warnings
    assert "transport-identity: its seeds" not in warnings
    md = format_markdown(summary)
    assert "| Transport → identity | 0 | 66.00 | −4.00 | 11,000 | CPU A |" in md
    assert "| Full kernel | 1 | 60.00 | ref | 7,000 | CPU B |" in md
    # One seed per row: no per-seed table, and equal steps raise no warning.
    summary = collect(ABLATIONS, tmp_path, rows=["transport-identity"])
    assert "Per seed" not in format_markdown(summary) and not summary["warnings"]
