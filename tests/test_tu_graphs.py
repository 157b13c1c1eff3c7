"""qsv_pyg.experiments.tu_table (the fair-comparison TU table, Errica et al. 2020)
and examples/tu_graphs.py (the short example) at a tiny size, on MUTAG and IMDB-BINARY from the shared data folder (skipped where it is
absent). Nothing is written into the shared folder: the caches and run folders
are temporary directories."""
from __future__ import annotations

import importlib
import json
import os
import runpy
import shutil
import statistics
import time
from pathlib import Path

import numpy as np
import pytest

from qsv_pyg.experiments import tu_data, tu_models

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "tu_graphs.py"
#: $QSV_DATA_DIR, else shared/data beside the checkout (units.default_data_dir).
DATA_ROOT = Path(os.environ.get("QSV_DATA_DIR")
                 or Path(__file__).resolve().parents[2] / "shared" / "data")
TU = DATA_ROOT / "TUDataset"

pytestmark = [
    pytest.mark.skipif(not (TU / "MUTAG" / "raw").is_dir(),
                       reason=f"no TU data at {TU / 'MUTAG' / 'raw'}"),
    pytest.mark.usefixtures("one_thread"),
]

#: The tiny MUTAG table: 2 of the 10 folds, 15 epochs, three rows.
TINY = ["--dataset", "MUTAG", "--folds", "10", "--max-folds", "2", "--epochs", "15",
        "--patience", "15", "--models", "QSV,GIN,MLP", "--no-progress"]


def listing(root: Path) -> list:
    """Every path under ``root`` with its size and modification time."""
    if not root.is_dir():
        return []
    return sorted((str(p.relative_to(root)), p.stat().st_size, p.stat().st_mtime_ns)
                  for p in root.rglob("*"))


@pytest.fixture(scope="module")
def tu():
    return importlib.import_module("qsv_pyg.experiments.tu_table")


@pytest.fixture(scope="module", autouse=True)
def default_data_root(tu):
    """The table's default --data-dir is DATA_ROOT ($QSV_DATA_DIR)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("QSV_DATA_DIR", str(DATA_ROOT))
        yield


@pytest.fixture(scope="module", autouse=True)
def shared_folder_untouched():
    before = listing(TU)
    yield
    assert listing(TU) == before, "the tests wrote into the shared data folder"


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tu-cache")


@pytest.fixture(scope="module")
def mutag(tu, tmp_path_factory, cache):
    """The tiny MUTAG table, trained once for the module: (out root, table, seconds)."""
    out = tmp_path_factory.mktemp("tu-out")
    start = time.perf_counter()
    text = tu.main(TINY + ["--out-root", str(out), "--cache-root", str(cache)])
    return out, text, time.perf_counter() - start


def args(out: Path, cache: Path) -> list:
    return TINY + ["--out-root", str(out), "--cache-root", str(cache)]


def units_by_model(out: Path, tu) -> dict:
    units: dict = {}
    for config, metrics in tu.compare.read_units(out):
        units.setdefault(config["model"], []).append((config, metrics))
    return units


# ------------------------------------------------------------------ learning
def test_mutag_rows_learn_above_chance_quickly(tu, mutag):
    out, text, seconds = mutag
    units = units_by_model(out, tu)
    assert set(units) == {"QSV", "GIN", tu_models.BASELINE}
    for model, group in units.items():
        assert sorted(c["fold"] for c, _ in group) == [0, 1]
        mean = statistics.fmean(m["test_acc"] for _, m in group)
        # MUTAG's majority class is 66.5%; 15 epochs on 2 folds (19 test graphs each).
        assert mean >= 0.6, (model, mean)
    qsv = statistics.fmean(m["test_acc"] for _, m in units["QSV"])
    assert qsv > 0.5
    assert seconds < 60, f"the tiny MUTAG table took {seconds:.0f} s"
    assert "| QSV |" in text and "(2/10 folds)" in text


def test_unit_files(tu, mutag):
    out, _, _ = mutag
    folder = out / "MUTAG" / "qsv" / "fold0"
    config = json.loads((folder / "config.json").read_text())
    metrics = json.loads((folder / "metrics.json").read_text())
    log = [json.loads(line) for line in (folder / "log.jsonl").read_text().splitlines()]
    assert config["dataset"] == "MUTAG" and config["model"] == "QSV" and config["fold"] == 0
    assert config["hp"]["qsv_options"] == tu.QSV_OPTIONS
    assert len(log) == metrics["epochs_run"]
    assert {"epoch", "train_loss", "val_acc", "test_acc", "seconds"} <= set(log[0])
    best = log[metrics["selected_epoch"] - 1]
    assert best["val_acc"] == metrics["val_acc"] == max(r["val_acc"] for r in log)
    assert best["test_acc"] == metrics["test_acc"]
    for key in ("params", "time_per_epoch", "ms_per_epoch", "cpu", "versions"):
        assert key in metrics
    assert metrics["qsv_paths"] and all(p.startswith("attend_shared") for p in metrics["qsv_paths"])
    # The tables: overall, costs and per dataset.
    for stem in ("table", "costs", "MUTAG/table"):
        for suffix in (".md", ".csv", ".json"):
            assert (out / f"{stem}{suffix}").is_file()
    table = json.loads((out / "table.json").read_text())
    assert any(row["model"].startswith("GIN-0 [Xu") for row in table["rows"])


def test_early_stopping_selects_the_last_best_validation_epoch(tu, tmp_path, cache):
    out = tmp_path / "out"
    tu.main(["--dataset", "MUTAG", "--max-folds", "1", "--epochs", "40", "--patience", "3",
             "--models", "MLP", "--no-progress", "--out-root", str(out),
             "--cache-root", str(cache)])
    folder = out / "MUTAG" / "mlp-sum" / "fold0"
    metrics = json.loads((folder / "metrics.json").read_text())
    vals = [json.loads(line)["val_acc"] for line in (folder / "log.jsonl").read_text().splitlines()]
    best = max(vals)
    selected = len(vals) - vals[::-1].index(best)  # the last epoch of the best accuracy
    assert metrics["selected_epoch"] == selected and metrics["val_acc"] == best
    assert metrics["epochs_run"] == len(vals) == min(40, selected + 3)
    assert metrics["stopped_early"] == (len(vals) < 40)


# -------------------------------------------------------------------- splits
def test_splits_stratified_disjoint_covering_and_reused(tu, mutag):
    out, _, _ = mutag
    saved = json.loads((out / "MUTAG" / "splits.json").read_text())
    labels = np.asarray(tu.prepare_dataset("MUTAG", DATA_ROOT, out.parent / "c2",
                                           tu.NODE_ATTRIBUTES)["labels"])
    n, k = len(labels), saved["folds"]
    assert saved["num_graphs"] == n == 188 and k == 10
    counts = np.bincount(labels)
    tests = []
    for fold in saved["splits"]:
        train, val, test = (np.asarray(fold[p]) for p in ("train", "val", "test"))
        assert not set(train) & set(val) and not set(train) & set(test) \
            and not set(val) & set(test)
        assert sorted(np.concatenate([train, val, test]).tolist()) == list(range(n))
        for c, total in enumerate(counts):
            assert abs(int((labels[test] == c).sum()) - total / k) <= 1
            rest = int((labels[np.concatenate([train, val])] == c).sum())
            assert abs(int((labels[val] == c).sum()) - 0.1 * rest) <= 1
        tests.append(test)
    assert sorted(np.concatenate(tests).tolist()) == list(range(n))  # every graph tested once
    # Seeded: the same splits again; and the saved file is what a rerun reads.
    assert tu_data.make_splits(labels.tolist(), 10) == [
        {p: f[p] for p in ("train", "val", "test")} for f in saved["splits"]]
    spec = {"name": "MUTAG", "num_graphs": n, "labels": labels.tolist()}
    assert tu.load_or_make_splits(out / "MUTAG" / "splits.json", spec, 10) == \
        tu_data.make_splits(labels.tolist(), 10)


def test_splits_of_other_folds_are_refused(tu, mutag, cache, capsys):
    out, _, _ = mutag
    with pytest.raises(SystemExit) as exit_info:
        tu.main(["--dataset", "MUTAG", "--folds", "5", "--max-folds", "1", "--epochs", "1",
                 "--models", "MLP", "--no-progress", "--out-root", str(out),
                 "--cache-root", str(cache)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "10-fold" in err[0] and "splits.json" in err[0]


def test_stratified_folds_on_many_classes(tu):
    labels = [c for c in range(6) for _ in range(100)]  # ENZYMES' 6 x 100
    splits = tu_data.make_splits(labels, 10)
    y = np.asarray(labels)
    for fold in splits:
        assert np.bincount(y[fold["test"]], minlength=6).tolist() == [10] * 6
        assert np.bincount(y[fold["val"]], minlength=6).tolist() == [9] * 6


def test_attributes_standardised_on_the_training_graphs_only(tu):
    import torch
    from torch_geometric.data import Data
    graphs = [Data(x=torch.tensor([[float(10 * i), 1.0, 0.0], [float(10 * i + 2), 0.0, 1.0]]),
                   edge_index=torch.empty(2, 0, dtype=torch.long)) for i in range(4)]
    out = tu.standardised(graphs, [0, 1], 1)
    train = torch.cat([out[i].x[:, 0] for i in (0, 1)])
    assert abs(float(train.mean())) < 1e-6 and abs(float(train.std()) - 1) < 1e-6
    assert all(torch.equal(o.x[:, 1:], g.x[:, 1:]) for o, g in zip(out, graphs))  # labels kept
    assert float(graphs[3].x[0, 0]) == 30.0  # the originals are not modified
    assert tu.standardised(graphs, [0, 1], 0) is graphs


# -------------------------------------------------------------- reuse/resume
def test_rerun_trains_nothing_and_report_only_rebuilds_the_table(tu, mutag, cache,
                                                                 monkeypatch):
    out, text, _ = mutag
    before = listing(out)

    def no_training(*args, **kwargs):
        raise AssertionError("a finished unit was trained again")

    monkeypatch.setattr(tu, "train_unit", no_training)
    again = tu.main(args(out, cache))
    assert again == text
    assert tu.main(["--report-only", "--out-root", str(out)]) == text
    units = [p for p in before if p[0].endswith(("metrics.json", "log.jsonl", "config.json"))]
    assert units and all(p in listing(out) for p in units)  # untouched run files


def test_unfinished_unit_is_restarted(tu, tmp_path, cache):
    out = tmp_path / "out"
    run = ["--dataset", "MUTAG", "--max-folds", "1", "--epochs", "2", "--patience", "2",
           "--models", "MLP", "--no-progress", "--out-root", str(out),
           "--cache-root", str(cache)]
    tu.main(run)
    folder = out / "MUTAG" / "mlp-sum" / "fold0"
    first = json.loads((folder / "metrics.json").read_text())
    (folder / "metrics.json").unlink()  # as if interrupted before its end
    tu.main(run)
    second = json.loads((folder / "metrics.json").read_text())
    assert len((folder / "log.jsonl").read_text().splitlines()) == second["epochs_run"]
    assert second["test_acc"] == first["test_acc"]  # seeded: the same training


def test_worker_processes_give_the_same_units(tu, tmp_path, cache):
    """--jobs 2 trains in spawned workers; the units match an in-process run."""
    results = []
    for jobs in ("1", "2"):
        out = tmp_path / f"jobs{jobs}"
        tu.main(["--dataset", "MUTAG", "--max-folds", "1", "--epochs", "2", "--patience",
                 "2", "--models", "QSV,MLP", "--jobs", jobs, "--no-progress",
                 "--out-root", str(out), "--cache-root", str(cache)])
        results.append({(c["model"], c["fold"]): (m["selected_epoch"], m["val_acc"],
                                                  m["test_acc"], m["params"])
                        for c, m in tu.compare.read_units(out)})
    assert len(results[0]) == 2 and results[0] == results[1]


def test_unit_order_keeps_folds_whole(tu):
    order = tu.unit_order(["MUTAG", "NCI1"], 2, ["QSV", "GIN"])
    assert order == [("MUTAG", 0, "QSV"), ("MUTAG", 0, "GIN"), ("MUTAG", 1, "QSV"),
                     ("MUTAG", 1, "GIN"), ("NCI1", 0, "QSV"), ("NCI1", 0, "GIN"),
                     ("NCI1", 1, "QSV"), ("NCI1", 1, "GIN")]


# --------------------------------------------------------- one-hot degrees
@pytest.mark.skipif(not (TU / "IMDB-BINARY" / "raw").is_dir(), reason="no IMDB-BINARY")
def test_imdb_binary_gets_one_hot_degrees(tu, tmp_path, cache):
    from torch_geometric.utils import degree
    spec = tu.prepare_dataset("IMDB-BINARY", DATA_ROOT, cache, tu.NODE_ATTRIBUTES)
    assert spec["max_degree"] is not None and spec["num_features"] == spec["max_degree"] + 1
    graphs = tu.load_graphs(spec)
    assert len(graphs) == spec["num_graphs"] == 1000
    for graph in graphs[:50]:
        x = graph.x
        assert x.shape == (graph.num_nodes, spec["num_features"])
        assert set(x.unique().tolist()) <= {0.0, 1.0} and bool((x.sum(1) == 1).all())
        deg = degree(graph.edge_index[0], graph.num_nodes).long()
        assert bool((x.argmax(1) == deg).all())
    out = tmp_path / "out"
    text = tu.main(["--dataset", "IMDB-BINARY", "--max-folds", "1", "--epochs", "2",
                    "--patience", "2", "--models", "QSV,MLP", "--no-progress",
                    "--out-root", str(out), "--cache-root", str(cache)])
    config = json.loads((out / "IMDB-BINARY" / "qsv" / "fold0" / "config.json").read_text())
    assert config["features"].startswith("one-hot degree")
    assert "IMDB-BINARY" in text and "71.2 ± 3.9" in text  # Errica's GIN beside ours


@pytest.mark.skipif(not (TU / "ENZYMES" / "raw").is_dir(), reason="no ENZYMES")
def test_enzymes_gets_its_18_attributes(tu, cache):
    spec = tu.prepare_dataset("ENZYMES", DATA_ROOT, cache, tu.NODE_ATTRIBUTES)
    assert (spec["num_features"], spec["num_attributes"], spec["num_classes"]) == (21, 18, 6)
    assert "18 continuous node attributes" in spec["features"]
    plain = tu.prepare_dataset("ENZYMES", DATA_ROOT, cache, ())
    assert (plain["num_features"], plain["num_attributes"]) == (3, 0)


# ----------------------------------------------------------------- bad input
@pytest.mark.parametrize("argv, needle", [
    (["--dataset", "NO-SUCH-SET"], "NO-SUCH-SET"),
    (["--dataset", "MUTAG", "--data-dir", "/nonexistent/data"], "/nonexistent/data"),
    (["--dataset", "MUTAG", "--models", "XYZ"], "XYZ"),
    (["--dataset", "MUTAG", "--max-folds", "11"], "--max-folds"),
    (["--dataset", "MUTAG", "--jobs", "0"], "--jobs"),
])
def test_bad_input_exits_2_with_one_line(tu, tmp_path, cache, capsys, argv, needle):
    with pytest.raises(SystemExit) as exit_info:
        tu.main(argv + ["--out-root", str(tmp_path / "out"), "--cache-root", str(cache),
                        "--no-progress"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").rglob("*.json"))


def test_changed_settings_are_refused_not_mixed(tu, mutag, cache, capsys):
    out, _, _ = mutag
    changed = [a if a != "15" else "16" for a in args(out, cache)]  # --epochs 16 --patience 16
    with pytest.raises(SystemExit) as exit_info:
        tu.main(changed)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "different configuration" in err[0]


def test_report_only_without_units_exits_2(tu, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        tu.main(["--report-only", "--out-root", str(tmp_path)])
    assert exit_info.value.code == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def _exit_2(tu, capsys, argv) -> str:
    with pytest.raises(SystemExit) as exit_info:
        tu.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


@pytest.mark.parametrize("folds, needle", [
    ("189", "more than the 188 graphs of MUTAG"),
    ("64", "more than the 63 graphs of MUTAG's smallest class"),
])
def test_more_folds_than_graphs_of_a_class_exits_2(tu, tmp_path, cache, capsys, folds,
                                                   needle):
    """Folds beyond the smallest class (or the set) would leave test folds without
    that class or empty; an empty one scored 0.0 into the table's mean."""
    err = _exit_2(tu, capsys, ["--dataset", "MUTAG", "--folds", folds, "--max-folds", "1",
                               "--epochs", "1", "--models", "MLP", "--no-progress",
                               "--out-root", str(tmp_path / "out"),
                               "--cache-root", str(cache)])
    assert needle in err and "--folds" in err
    assert not (tmp_path / "out").exists()


def test_splits_with_an_empty_part_are_refused_before_they_are_saved(tu, tmp_path,
                                                                     capsys):
    """2 graphs per class in 2 folds: no graph is left for validation (10% of 1)."""
    spec = {"name": "TINY", "num_graphs": 4, "labels": [0, 0, 1, 1]}
    path = tmp_path / "TINY" / "splits.json"
    with pytest.raises(SystemExit) as exit_info:
        tu.load_or_make_splits(path, spec, 2)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "val part would be empty" in err[0] and "--folds 2" in err[0]
    assert not path.exists()


def test_another_data_root_with_the_same_cache_gets_its_own_data(tu, tmp_path, cache):
    """The cache is keyed on the raw files' content: MUTAG with flipped graph labels
    under another data root is not served the first root's copy."""
    for name in ("a", "b"):
        shutil.copytree(TU / "MUTAG" / "raw", tmp_path / name / "TUDataset" / "MUTAG" / "raw")
    labels = tmp_path / "b" / "TUDataset" / "MUTAG" / "raw" / "MUTAG_graph_labels.txt"
    flipped = [str(-int(v)) for v in labels.read_text().split()]
    labels.write_text("\n".join(flipped) + "\n")
    spec_a = tu.prepare_dataset("MUTAG", tmp_path / "a", tmp_path / "cache", ())
    spec_b = tu.prepare_dataset("MUTAG", tmp_path / "b", tmp_path / "cache", ())
    assert spec_b["labels"] == [1 - y for y in spec_a["labels"]]
    assert spec_a["cache"] != spec_b["cache"]
    assert [int(g.y) for g in tu.load_graphs(spec_b)] == spec_b["labels"]


def test_a_unit_of_a_live_run_is_not_trained_twice(tu, tmp_path, cache, capsys):
    """A second process on the same --out-root exits 2 naming the holder of the
    unit's lock and leaves the live unit's files alone."""
    from qsv_pyg.training.run_lock import RunLock
    out = tmp_path / "out"
    run = ["--dataset", "MUTAG", "--max-folds", "1", "--epochs", "2", "--patience", "2",
           "--models", "MLP", "--no-progress", "--out-root", str(out),
           "--cache-root", str(cache)]
    tu.main(run)
    folder = out / "MUTAG" / "mlp-sum" / "fold0"
    (folder / "metrics.json").unlink()  # as if the live run were still training it
    (folder / "log.jsonl").write_text('{"epoch": 1}\n')
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    with RunLock(folder):
        err = _exit_2(tu, capsys, run)
        assert f"pid {os.getpid()}" in err and str(folder) in err
        assert {p.name: p.read_bytes() for p in folder.iterdir() if p.name != "run.lock"} \
            == before


@pytest.mark.parametrize("out, cache_root, report_only, needles", [
    ("file/out", None, False, ("--out-root", "file")),     # --out-root under a file
    ("out", "file", False, ("--cache-root", "is a file")),  # --cache-root a file
    ("file", None, True, ("--out-root", "is a file")),
])
def test_unusable_out_root_and_cache_root_exit_2(tu, tmp_path, cache, capsys, out,
                                                 cache_root, report_only, needles):
    (tmp_path / "file").write_text("not a folder")
    argv = ["--dataset", "MUTAG", "--max-folds", "1", "--epochs", "1", "--models", "MLP",
            "--no-progress", "--out-root", str(tmp_path / out),
            "--cache-root", str(tmp_path / cache_root if cache_root else cache)]
    err = _exit_2(tu, capsys, argv + (["--report-only"] if report_only else []))
    assert all(needle in err for needle in needles), err


def test_report_only_names_damaged_units_and_leaves_them_out(tu, mutag, tmp_path, capsys):
    out, _, _ = mutag
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    lacking = copy / "MUTAG" / "qsv" / "fold1" / "metrics.json"
    metrics = json.loads(lacking.read_text())
    del metrics["test_acc"]
    lacking.write_text(json.dumps(metrics))
    listed = copy / "MUTAG" / "gin" / "fold0" / "metrics.json"
    listed.write_text(json.dumps([metrics]))
    capsys.readouterr()
    text = tu.main(["--report-only", "--out-root", str(copy)])
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2, err
    joined = "\n".join(err)
    assert str(lacking) in joined and "'test_acc'" in joined
    assert str(listed) in joined and "not a JSON object" in joined
    table = json.loads((copy / "MUTAG" / "table.json").read_text())
    folds = {row["model"]: row["folds"] for row in table["rows"]}
    assert folds == {"QSV": "1/10", "GIN": "1/10", tu_models.BASELINE: "2/10"}
    assert "| QSV |" in text


def test_bench_tu_times_rows_side_by_side(tu, cache, tmp_path, capsys):
    """benchmarks/bench_tu.py: the table's rows (GAT as the anchor, added when not
    asked for) on MUTAG, one JSON, summarised by summarize.py."""
    import json
    from conftest import load_benchmark
    bench_tu = load_benchmark("bench_tu")
    summarize = load_benchmark("summarize")
    out = tmp_path / "bench_tu.json"
    payload = bench_tu.main(["--datasets", "MUTAG", "--rows", "QSV", "--quick",
                             "--data-dir", str(DATA_ROOT), "--cache-root", str(cache),
                             "--out", str(out)])
    rows = payload["rows"]
    assert [r["row"] for r in rows] == ["GAT", "QSV"] and rows[0]["vs_gat"] == 1.0
    assert all(r["epoch_ms"] > 0 and r["parameters"] > 0 and r["train_graphs"] > 100
               for r in rows)
    # QSV and its parameter-matched control: within 10% of each other (as the table).
    assert abs(rows[0]["parameters"] - rows[1]["parameters"]) < 0.1 * rows[1]["parameters"]
    capsys.readouterr()
    summarize.main([str(out)])
    assert "| MUTAG | QSV |" in capsys.readouterr().out
    assert json.loads(out.read_text())["rows"] == rows


# ------------------------------------- --source-logit and --edge-attr (issue 29)
#: One fold of three epochs: every row with its '+source' / '+edge' twins.
VARIANTS = ["--dataset", "MUTAG", "--max-folds", "1", "--epochs", "3", "--patience", "3",
            "--source-logit", "--edge-attr", "--no-progress"]


@pytest.fixture(scope="module")
def variants(tu, tmp_path_factory, cache):
    out = tmp_path_factory.mktemp("tu-variants")
    text = tu.main(VARIANTS + ["--out-root", str(out), "--cache-root", str(cache)])
    return out, text


def test_source_and_edge_rows_train_and_report(tu, variants):
    out, text = variants
    units = units_by_model(out, tu)
    edge_rows = {"QSV +edge", "QSV +source +edge", "GAT +edge", "GATv2 +edge",
                 "Transformer +edge", "GIN +edge"}
    assert set(units) == set(tu.ROWS) | edge_rows  # the MLP baseline has no '+edge' twin
    configs = {model: group[0][0] for model, group in units.items()}
    metrics = {model: group[0][1] for model, group in units.items()}
    # QSV +source: the QSV row's options plus source_logit, nothing else changed.
    assert configs[tu.SOURCE]["hp"]["qsv_options"] == {**tu.QSV_OPTIONS, "source_logit": True}
    assert configs["QSV"]["hp"]["qsv_options"] == tu.QSV_OPTIONS
    strip = lambda c: {k: v for k, v in c.items() if k not in ("model", "hp")}  # noqa: E731
    assert strip(configs[tu.SOURCE]) == strip(configs["QSV"])  # same fold, split, data
    assert {k: v for k, v in configs[tu.SOURCE]["hp"].items() if k != "qsv_options"} == \
        {k: v for k, v in configs["QSV"]["hp"].items() if k != "qsv_options"}
    # The per-source term adds a [C, heads] map per layer: more parameters.
    assert metrics[tu.SOURCE]["params"] > metrics["QSV"]["params"]
    # '+edge' units record their edge features; node-only units have no such keys.
    for model, config in configs.items():
        if model in edge_rows:
            assert config["edge_dim"] == 4 and "edge labels (4)" in config["edge_features"]
        else:
            assert "edge_dim" not in config and "edge_features" not in config
    for model in edge_rows:  # the QSV kernel stays on the operator with edge features
        if model.startswith("QSV"):
            assert all(p.startswith("attend_shared") for p in metrics[model]["qsv_paths"])
    # Folders of their own; the tables show the twins beside their rows.
    assert (out / "MUTAG" / "qsv-source" / "fold0" / "metrics.json").is_file()
    assert (out / "MUTAG" / "qsv-source-edge" / "fold0" / "metrics.json").is_file()
    assert (out / "MUTAG" / "gin-edge" / "fold0" / "metrics.json").is_file()
    lines = [line.split("|")[1].strip() for line in text.splitlines() if line.startswith("| ")]
    assert lines.index("GAT +edge") == lines.index("GAT") + 1
    assert lines.index("QSV +source") < lines.index("GAT")
    assert "edge labels (4)" in text
    paired = json.loads((out / "paired.json").read_text())["rows"]
    pairs = {(r["row"], r["against"]): r["MUTAG"] for r in paired}
    assert {("QSV +source", "QSV"), ("GAT +edge", "GAT"), ("GIN +edge", "GIN"),
            ("QSV +source +edge", "QSV +edge"), ("QSV +source +edge", "QSV +source")} \
        <= set(pairs)
    a, b = metrics[tu.SOURCE]["test_acc"], metrics["QSV"]["test_acc"]
    assert pairs[("QSV +source", "QSV")].startswith(f"{100 * (a - b):+.1f} ± 0.0")
    assert pairs[("QSV +source", "QSV")].endswith("of 1)")
    assert "+edge" in (out / "MUTAG" / "table.md").read_text()


def test_edge_rows_read_the_edge_features(tu, cache):
    """Every '+edge' model's output depends on batch.edge_attr; the node-only
    models' does not; the controls' widths are matched to QSV +edge's parameters
    and GIN +edge is GINEConv."""
    from torch_geometric.data import Batch
    from torch_geometric.nn import GINEConv
    spec = tu.prepare_dataset("MUTAG", DATA_ROOT, cache, [])
    assert spec["edge_dim"] == 4
    graphs = tu.load_graphs(spec)
    batch = Batch.from_data_list(graphs[:8])
    other = batch.clone()
    other.edge_attr = batch.edge_attr.flip(0)  # other bond labels on the same edges
    hp = tu.hyperparameters()
    target = tu.count_parameters(tu_models.qsv_gnn(spec["num_features"], hp, 4))
    for row in tu.candidate_rows(source_logit=True, edge_attr=True):
        torch = tu.torch
        torch.manual_seed(0)
        model = tu.build_model(row, spec["num_features"], 2, tu.hyperparameters(row=row), 4)
        model.eval()
        with torch.no_grad():
            changed = not torch.allclose(model(batch), model(other))
        assert changed == row.endswith(" +edge"), row
        if row in ("GAT +edge", "GATv2 +edge", "Transformer +edge", "GIN +edge"):
            assert abs(tu.count_parameters(model.gnn) - target) < 0.1 * target, row
    gine = tu.build_model("GIN +edge", spec["num_features"], 2, hp, 4).gnn
    assert isinstance(gine, tu_models.GINE) and all(isinstance(c, GINEConv) for c in gine.convs)
    with pytest.raises(ValueError, match="edge_dim"):
        tu.build_model("GAT +edge", spec["num_features"], 2, hp, None)


def test_edge_attr_on_a_set_without_edge_labels(tu, tmp_path, cache, capsys):
    """Alone: exit 2 with one line naming it. Beside MUTAG: its '+edge' rows are
    skipped with a line on stderr, MUTAG's are trained."""
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_info:
        tu.main(["--dataset", "IMDB-BINARY", "--edge-attr", "--max-folds", "1",
                 "--epochs", "1", "--models", "GIN +edge", "--no-progress",
                 "--out-root", str(out), "--cache-root", str(cache)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "IMDB-BINARY" in err[0] and "no edge labels" in err[0], err
    assert not any(out.rglob("metrics.json"))
    tu.main(["--dataset", "MUTAG,IMDB-BINARY", "--edge-attr", "--max-folds", "1",
             "--epochs", "1", "--patience", "1", "--models", "GIN +edge", "--no-progress",
             "--out-root", str(out), "--cache-root", str(cache)])
    err = capsys.readouterr().err
    assert "IMDB-BINARY has no edge labels" in err and "skipped" in err
    assert {c["dataset"] for c, _ in tu.compare.read_units(out)} == {"MUTAG"}
    assert (out / "MUTAG" / "gin-edge" / "fold0" / "metrics.json").is_file()


def test_edge_and_node_only_units_never_mix(tu, variants, cache, monkeypatch):
    """A node-only run in the '+edge' run's folder reuses the node-only units and
    trains nothing; '+edge' units are never taken for node-only ones (own folders,
    own config keys) and a node-only config never matches a '+edge' folder."""
    out, _ = variants
    trained = []
    monkeypatch.setattr(tu, "train_unit", lambda *a, **kw: trained.append(a[3]))
    tu.main(["--dataset", "MUTAG", "--max-folds", "1", "--epochs", "3", "--patience", "3",
             "--source-logit", "--no-progress", "--out-root", str(out),
             "--cache-root", str(cache)])
    assert trained == []
    node = json.loads((out / "MUTAG" / "gat" / "fold0" / "config.json").read_text())
    edge = json.loads((out / "MUTAG" / "gat-edge" / "fold0" / "config.json").read_text())
    assert tu.compare.finished_unit(out / "MUTAG" / "gat" / "fold0", node) is not None
    with pytest.raises(SystemExit):  # a node-only config is refused in a '+edge' folder
        tu.compare.finished_unit(out / "MUTAG" / "gat-edge" / "fold0", node)
    assert {k for k in edge if edge.get(k) != node.get(k)} == {"model", "edge_dim",
                                                               "edge_features"}


# ------------------------------------------------------- examples/tu_graphs.py
def test_example_trains_one_fold(cache, capsys):
    """examples/tu_graphs.py, the short example, run by path: one MUTAG fold."""
    main = runpy.run_path(str(EXAMPLE), run_name="example")["main"]
    best = main(["--data-dir", str(DATA_ROOT), "--cache-root", str(cache), "--epochs", "5"])
    assert 1 <= best["epoch"] <= 5 and 0.0 <= best["test_acc"] <= 1.0
    assert "MUTAG fold 0: test accuracy" in capsys.readouterr().out


def test_example_names_the_table_for_table_flags(capsys):
    main = runpy.run_path(str(EXAMPLE), run_name="example")["main"]
    with pytest.raises(SystemExit) as exit_info:
        main(["--report-only", "--out-root", "x"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "python -m qsv_pyg.experiments.tu_table --report-only" in err[0]
