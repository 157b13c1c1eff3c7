"""Accuracy-against-budget report (qsv_pyg.experiments.budget_curve)."""
import csv

import pytest

from qsv_pyg.experiments.budget_curve import budget_points, format_budget_markdown, \
    write_budget_curves


def _run(evals, final, stopped=True, budget=30.0, seed=0):
    return {"seed": seed, "test_acc": final, "stopped_early": stopped,
            "settings": {"time_budget": budget},
            "budget_evals": [{"minutes": m, "test_acc": a} for m, a in evals]}


def _summary():
    return {"rows": [
        {"slug": "qsv", "label": "QSV", "paper": {"acc": 85.9},
         "measured": {"runs": [_run([(5, 0.40), (10, 0.50)], 60.0),
                               _run([(5, 0.42), (10, 0.52)], 62.0, seed=1)]}},
        {"slug": "t", "label": "T", "paper": {"acc": None},
         "measured": {"runs": [_run([(5, 0.45)], 55.0, stopped=False)]}},
        {"slug": "none", "label": "no marks", "paper": {"acc": None},
         "measured": {"runs": [_run([], 50.0)]}},
    ]}


def test_points_per_row_and_mark():
    curves = budget_points(_summary())
    assert [c["slug"] for c in curves] == ["qsv", "t"]  # rows without marks left out
    assert curves[0]["points"] == {5.0: [40.0, 42.0], 10.0: [50.0, 52.0], 30.0: [60.0, 62.0]}
    # Each seed keeps its own curve (the figure draws one line per seed).
    assert curves[0]["per_seed"] == {0: {5.0: 40.0, 10.0: 50.0, 30.0: 60.0},
                                     1: {5.0: 42.0, 10.0: 52.0, 30.0: 62.0}}
    # A run that ended before its budget contributes its marks only.
    assert curves[1]["points"] == {5.0: [45.0]}
    assert curves[1]["per_seed"] == {0: {5.0: 45.0}}


def test_markdown_has_mean_std_and_gaps():
    text = format_budget_markdown(budget_points(_summary()))
    assert "| 5 min | 10 min | 30 min | Paper |" in text
    assert "| QSV | 41.00 ± 1.41 | 51.00 ± 1.41 | 61.00 ± 1.41 | 85.9 |" in text
    assert "| T | 45.00 | — | — | — |" in text


def test_write_files(tmp_path):
    pytest.importorskip("matplotlib")
    paths = write_budget_curves(_summary(), tmp_path)
    assert set(paths) == {"budget_curve.md", "budget_curve.csv", "budget_curve.png"}
    rows = list(csv.DictReader(open(paths["budget_curve.csv"])))
    assert rows[0]["slug"] == "qsv" and rows[0]["test_acc_mean_pct"] == "41.0"
    assert paths["budget_curve.png"].stat().st_size > 1000
    assert write_budget_curves({"rows": []}, tmp_path / "empty") == {}


def test_a_failed_figure_write_keeps_the_previous_files(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    paths = write_budget_curves(_summary(), tmp_path)
    before = {name: p.read_bytes() for name, p in paths.items()}

    def broken_savefig(self, f, **kwargs):
        f.write(b"half a png")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Figure, "savefig", broken_savefig)
    with pytest.raises(OSError, match="No space left"):
        write_budget_curves(_summary(), tmp_path)
    assert paths["budget_curve.png"].read_bytes() == before["budget_curve.png"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(before)  # no temp files
