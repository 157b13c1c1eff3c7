"""qsv_pyg.experiments.citation_table (the citation table: Planetoid under gat.py's
protocol) and examples/citation.py (the short example), at a tiny size.

The training tests need the shared Planetoid files (``<data dir>/Planetoid/Cora/raw``,
the data folder being ``$QSV_DATA_DIR`` or ``units.FALLBACK_DATA_DIR``) and skip
cleanly where they are absent. Nothing is written into the data root: the dataset
is processed in a copy under ``tmp_path`` (asserted by listing the shared folder
before and after).
"""
from __future__ import annotations

import importlib
import json
import pickle
import runpy
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "citation.py"
ROWS = "GATConv,QSVConv recipe"
EPOCHS = 20


@pytest.fixture(scope="module")
def citation():
    return importlib.import_module("qsv_pyg.experiments.citation_table")


def data_root() -> Path:
    from qsv_pyg.experiments.units import default_data_dir
    return default_data_dir()


def cora_or_skip() -> Path:
    root = data_root()
    if not (root / "Planetoid" / "Cora" / "raw").is_dir():
        pytest.skip(f"no Planetoid Cora files under {root} (set QSV_DATA_DIR)")
    return root


def listing(folder: Path):
    return sorted((str(p.relative_to(folder)), p.stat().st_size, p.stat().st_mtime_ns)
                  for p in folder.rglob("*"))


def argv(root: Path, tmp: Path, *extra: str):
    return ["--data-dir", str(root), "--cache-root", str(tmp / "cache"),
            "--out-root", str(tmp / "out"), "--models", ROWS, "--seeds", "1",
            "--epochs", str(EPOCHS), "--no-progress", *extra]


@pytest.fixture(scope="module")
def trained(citation, tmp_path_factory):
    """One tiny run (GATConv and the QSVConv recipe, 1 seed, 20 epochs)."""
    root = cora_or_skip()
    torch.set_num_threads(1)
    tmp = tmp_path_factory.mktemp("citation")
    before = listing(root / "Planetoid")
    rows = citation.main(argv(root, tmp))
    return {"root": root, "tmp": tmp, "rows": rows, "before": before,
            "units": citation.compare.read_units(tmp / "out" / "Cora")}


def test_trains_above_chance_and_leaves_the_shared_folder_alone(trained):
    # Cora: 7 classes; the largest holds 30% of the test nodes.
    acc = {config["row"]: metrics["test_acc"] for config, metrics in trained["units"]}
    assert set(acc) == {"GATConv", "QSVConv recipe"}
    assert acc["GATConv"] > 0.5 and acc["QSVConv recipe"] > 0.5, acc
    assert listing(trained["root"] / "Planetoid") == trained["before"]
    # The copy was processed in the cache (keyed on the raw files' content), not in
    # the shared folder.
    copies = list((trained["tmp"] / "cache").glob("Cora-*"))
    assert len(copies) == 1 and (copies[0] / "Cora" / "processed").is_dir()
    out = trained["tmp"] / "out" / "Cora"
    for stem in ("table.md", "table.csv", "table.json"):
        assert (out / stem).is_file()
    unit = out / "gatconv" / "seed0"
    log = [json.loads(line) for line in (unit / "log.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in log] == list(range(1, EPOCHS + 1))
    assert set(log[0]) >= {"epoch", "loss", "val_acc", "test_acc", "seconds"}
    metrics = json.loads((unit / "metrics.json").read_text())
    best = max(log, key=lambda r: (r["val_acc"], -r["epoch"]))  # first best epoch
    assert metrics["best_epoch"] == best["epoch"] and metrics["test_acc"] == best["test_acc"]
    assert metrics["params"] == 92_373  # gat.py's network on Cora
    assert metrics["ms_per_epoch"] > 0 and metrics["cpu"] and metrics["torch"]
    rows = {r["row"]: r for r in trained["rows"]}
    assert rows["GATConv"]["published"] == "83.0 ± 0.7"
    assert rows["GATConv"]["ms/epoch vs GATConv"] == "1.00×"
    assert rows["QSVConv recipe"]["published"] == "–"


def test_rerun_reuses_units_and_report_only_rebuilds_the_table(citation, trained,
                                                               monkeypatch, capsys):
    out = trained["tmp"] / "out"
    table = (out / "Cora" / "table.md").read_text()
    logs = {p: p.stat().st_mtime_ns for p in out.rglob("log.jsonl")}

    def no_training(*args, **kwargs):
        raise AssertionError("a finished unit was trained again")

    monkeypatch.setattr(citation, "train_unit", no_training)
    assert citation.main(argv(trained["root"], trained["tmp"])) == trained["rows"]
    assert {p: p.stat().st_mtime_ns for p in out.rglob("log.jsonl")} == logs
    capsys.readouterr()
    # No data needed: a data root that does not exist is never looked at.
    rows = citation.main(["--report-only", "--out-root", str(out),
                          "--data-dir", str(trained["tmp"] / "nowhere")])
    assert rows == trained["rows"]
    assert (out / "Cora" / "table.md").read_text() == table
    printed = capsys.readouterr().out
    assert "| GATConv |" in printed and "| QSVConv recipe |" in printed


def test_a_changed_config_in_an_existing_out_root_exits_2(citation, trained, capsys):
    with pytest.raises(SystemExit) as info:
        citation.main(argv(trained["root"], trained["tmp"], "--epochs", str(EPOCHS + 1)))
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "epochs" in err and "different configuration" in err


def test_unknown_dataset_exits_2(citation, tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        citation.main(["--dataset", "Coraa", "--out-root", str(tmp_path / "out"),
                       "--cache-root", str(tmp_path / "cache"), "--no-progress"])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "'Coraa'" in err and "CiteSeer" in err
    assert not (tmp_path / "out").exists()


def test_missing_data_dir_exits_2(citation, tmp_path, capsys):
    missing = tmp_path / "no-such-root"
    with pytest.raises(SystemExit) as info:
        citation.main(["--data-dir", str(missing), "--out-root", str(tmp_path / "out"),
                       "--cache-root", str(tmp_path / "cache"), "--no-progress"])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(missing / "Planetoid" / "Cora" / "raw") in err


def test_missing_raw_files_are_named(citation, tmp_path, capsys):
    root = cora_or_skip()
    raw = tmp_path / "data" / "Planetoid" / "Cora" / "raw"
    shutil.copytree(root / "Planetoid" / "Cora" / "raw", raw)
    (raw / "ind.cora.graph").unlink()
    (raw / "ind.cora.ty").unlink()
    with pytest.raises(SystemExit) as info:
        citation.main(["--data-dir", str(tmp_path / "data"), "--no-progress",
                       "--out-root", str(tmp_path / "out"),
                       "--cache-root", str(tmp_path / "cache")])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "ind.cora.graph" in err and "ind.cora.ty" in err and str(raw) in err


def test_any_planetoid_name_laid_out_the_same_way_runs(citation, tmp_path):
    """Cora's files under CiteSeer's names: the name reaches the folder, the file
    names, the out root and the published column (72.5 on CiteSeer)."""
    root = cora_or_skip()
    raw = tmp_path / "data" / "Planetoid" / "CiteSeer" / "raw"
    raw.mkdir(parents=True)
    for f in (root / "Planetoid" / "Cora" / "raw").iterdir():
        shutil.copy(f, raw / f.name.replace("ind.cora.", "ind.citeseer."))
    torch.set_num_threads(1)
    rows = citation.main(["--dataset", "citeseer", "--data-dir", str(tmp_path / "data"),
                          "--cache-root", str(tmp_path / "cache"),
                          "--out-root", str(tmp_path / "out"), "--models", "GATConv",
                          "--seeds", "1", "--epochs", "2", "--no-progress"])
    assert [r["row"] for r in rows] == ["GATConv"]
    assert rows[0]["published"] == "72.5 ± 0.7"
    assert (tmp_path / "out" / "CiteSeer" / "gatconv" / "seed0" / "metrics.json").is_file()


def _cora_copy(tmp_path: Path, name: str = "data") -> Path:
    root = cora_or_skip()
    raw = tmp_path / name / "Planetoid" / "Cora" / "raw"
    shutil.copytree(root / "Planetoid" / "Cora" / "raw", raw)
    return raw


def _one_line_exit_2(capsys, call, *args) -> str:
    with pytest.raises(SystemExit) as info:
        call(*args)
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_another_data_root_with_the_same_cache_gets_its_own_data(citation, tmp_path):
    """The cache is keyed on the raw files' content: a second --data-root holding
    other labels under the same name trains on its own labels."""
    _cora_copy(tmp_path, "a")
    raw_b = _cora_copy(tmp_path, "b")
    for suffix in ("y", "ty", "ally"):  # every label moved to the next class
        path = raw_b / f"ind.cora.{suffix}"
        with open(path, "rb") as f:
            labels = pickle.load(f, encoding="latin1")
        path.write_bytes(pickle.dumps(np.roll(labels, 1, axis=1), protocol=2))
    cache = tmp_path / "cache"
    data_a, *_ = citation.load(tmp_path / "a", "Cora", cache)
    data_b, *_ = citation.load(tmp_path / "b", "Cora", cache)
    assert torch.equal(data_b.y, (data_a.y + 1) % 7)
    assert torch.equal(citation.load(tmp_path / "a", "Cora", cache)[0].y, data_a.y)


class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # unpickling it creates the marker file
        return (open, (str(self.marker), "w"))


def test_a_crafted_raw_file_exits_2_and_runs_nothing(citation, tmp_path, capsys):
    raw = _cora_copy(tmp_path)
    marker = tmp_path / "marker"
    (raw / "ind.cora.x").write_bytes(pickle.dumps(_Payload(marker), protocol=2))
    argv = ["--data-dir", str(tmp_path / "data"), "--cache-root", str(tmp_path / "cache"),
            "--out-root", str(tmp_path / "out"), "--models", "GATConv", "--seeds", "1",
            "--epochs", "1", "--no-progress"]
    err = _one_line_exit_2(capsys, citation.main, argv)
    assert not marker.exists(), "the pickled payload ran"
    assert "ind.cora.x" in err and "refusing to load global" in err
    # A corrupt (torn) file: one line too.
    good = (cora_or_skip() / "Planetoid" / "Cora" / "raw" / "ind.cora.graph").read_bytes()
    shutil.copy(cora_or_skip() / "Planetoid" / "Cora" / "raw" / "ind.cora.x", raw)
    (raw / "ind.cora.graph").write_bytes(good[:1000])
    err = _one_line_exit_2(capsys, citation.main, argv)
    assert "ind.cora.graph" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("out, cache, extra, needles", [
    ("file/out", "c", [], ("--out-root", "file")),         # --out-root under a file
    ("out", "file", [], ("--cache-root", "is a file")),   # --cache-root a file
    ("out", "c", ["--threads", "0"], ("--threads",)),
])
def test_unusable_folders_and_threads_exit_2(citation, tmp_path, capsys, out, cache, extra,
                                             needles):
    root = cora_or_skip()
    (tmp_path / "file").write_text("not a folder")
    err = _one_line_exit_2(capsys, citation.main, [
        "--data-dir", str(root), "--models", "GATConv", "--seeds", "1", "--epochs", "1",
        "--no-progress", "--out-root", str(tmp_path / out),
        "--cache-root", str(tmp_path / cache), *extra])
    assert all(needle in err for needle in needles), err
    assert not (tmp_path / "out").exists()


def _fake_unit(root: Path, row: str, seed: int, metrics) -> Path:
    folder = root / row.lower().replace(" ", "_") / f"seed{seed}"
    folder.mkdir(parents=True)
    config = {"script": "citation.py", "row": row, "seed": seed, "epochs": 3, "threads": 1}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "metrics.json").write_text(json.dumps(metrics))
    return folder


def test_report_only_names_damaged_units_and_leaves_them_out(citation, tmp_path, capsys):
    root = tmp_path / "out" / "Cora"
    good = {"test_acc": 0.8, "params": 100, "ms_per_epoch": 2.0}
    _fake_unit(root, "GATConv", 0, good)
    lacking = _fake_unit(root, "GATConv", 1, {k: v for k, v in good.items()
                                             if k != "test_acc"})
    listed = _fake_unit(root, "QSV model", 0, [good])
    rows = citation.main(["--report-only", "--out-root", str(tmp_path / "out")])
    assert [(r["row"], r["seeds"]) for r in rows] == [("GATConv", 1)]
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2, err
    text = "\n".join(err)
    assert str(lacking / "metrics.json") in text and "'test_acc'" in text
    assert str(listed / "metrics.json") in text and "not a JSON object" in text


def test_rows(citation):
    names = [spec["name"] for spec in citation.ALL_ROWS]
    assert names[:6] == ["GATConv", "GATv2Conv", "TransformerConv", "QSVConv literal",
                         "QSVConv recipe", "QSV model"]
    assert len(citation.DIAGNOSIS) <= 8
    assert len({citation.slug(n) for n in names}) == len(names)
    assert citation.slug("QSVConv +loops -root") == "qsvconv_with-loops_no-root"
    spec = {s["name"]: s for s in citation.ALL_ROWS}
    # The literal drop-in takes exactly GATConv's arguments.
    assert citation.model_kwargs(spec["QSVConv literal"], 1433, 7) == \
        citation.model_kwargs(spec["GATConv"], 1433, 7)
    # The recipe contains docs/usage.md's options.
    assert citation.USAGE_RECIPE.items() <= spec["QSVConv recipe"]["extra"].items()
    assert spec["QSV model"]["extra"] == spec["QSVConv recipe"]["extra"]


def test_plain_init_replaces_the_near_identity_start(citation):
    spec = {s["name"]: s for s in citation.ALL_ROWS}
    row = spec["QSVConv +project init=glorot"]
    default = dict(row, init="default")
    kwargs = citation.model_kwargs(row, 20, 3)
    torch.manual_seed(0)
    near = citation.build(default, kwargs)
    torch.manual_seed(0)
    plain = citation.build(row, kwargs)
    heads = kwargs["layer1"]["heads"]
    identity = torch.tensor([1.0, 0, 0, 0]).repeat(heads)
    assert torch.equal(near.conv1.lin_quat.bias, identity)
    assert torch.equal(plain.conv1.lin_quat.bias, torch.zeros(4 * heads))
    assert torch.equal(plain.conv2.lin_quat.bias, torch.zeros(4))
    # Only the quaternion maps differ.
    assert torch.equal(near.conv1.weight, plain.conv1.weight)


def test_bench_cora_times_rows_side_by_side(tmp_path, capsys):
    """benchmarks/bench_cora.py: the citation rows' training steps, one JSON, GATConv
    as the anchor (added when not asked for), unknown rows refused."""
    root = cora_or_skip()
    bench = Path(__file__).resolve().parents[1] / "benchmarks"
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(bench))
        bench_cora = importlib.import_module("bench_cora")
        before = listing(root / "Planetoid")
        out = tmp_path / "bench_cora.json"
        payload = bench_cora.main(["--data-dir", str(root), "--rows", "QSVConv recipe",
                                   "--quick", "--cache-root", str(tmp_path / "cache"),
                                   "--out", str(out)])
        assert [r["row"] for r in payload["rows"]] == ["GATConv", "QSVConv recipe"]
        assert payload["rows"][0]["vs_gatconv"] == 1.0
        assert all(r["step_ms"] > 0 and r["parameters"] > 0 for r in payload["rows"])
        assert json.loads(out.read_text())["rows"] == payload["rows"]
        assert "| QSVConv recipe |" in capsys.readouterr().out
        assert listing(root / "Planetoid") == before
        summarize = importlib.import_module("summarize")
        summarize.main([str(out)])
        assert "| QSVConv recipe | 94,988 |" in capsys.readouterr().out
        with pytest.raises(SystemExit):
            bench_cora.main(["--data-dir", str(root), "--rows", "QSVConv nope", "--quick"])


def test_data_root_is_a_deprecated_alias_of_data_dir(citation, tmp_path, capsys):
    """--data-root still works: a DeprecationWarning and a one-line notice, then the
    same one-line error as --data-dir for a folder without the data."""
    missing = tmp_path / "no-such-root"
    with pytest.warns(DeprecationWarning, match="--data-dir"):
        with pytest.raises(SystemExit) as info:
            citation.main(["--data-root", str(missing), "--out-root", str(tmp_path / "out"),
                           "--cache-root", str(tmp_path / "cache"), "--no-progress"])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "deprecated" in err[0] and str(missing) in err[1], err


def test_data_dir_defaults_to_the_environment(citation, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("QSV_DATA_DIR", str(tmp_path / "from-env"))
    err = _one_line_exit_2(capsys, citation.main, [
        "--out-root", str(tmp_path / "out"), "--cache-root", str(tmp_path / "cache"),
        "--no-progress"])
    assert str(tmp_path / "from-env" / "Planetoid" / "Cora" / "raw") in err


def test_example_trains_one_model(tmp_path, capsys):
    """examples/citation.py, the gat.py-style example, run by path: it learns."""
    root = cora_or_skip()
    torch.set_num_threads(1)
    main = runpy.run_path(str(EXAMPLE), run_name="example")["main"]
    result = main(["--data-dir", str(root), "--cache-root", str(tmp_path / "cache"),
                   "--epochs", "20"])
    assert result["test_acc"] > 0.5, result  # 7 classes
    assert "Epoch: 020" in capsys.readouterr().out


def test_example_names_the_table_for_table_flags(capsys):
    main = runpy.run_path(str(EXAMPLE), run_name="example")["main"]
    err = _one_line_exit_2(capsys, main, ["--report-only"])
    assert "python -m qsv_pyg.experiments.citation_table --report-only" in err
