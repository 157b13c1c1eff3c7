"""qsv_pyg.experiments.modelnet_table at a tiny size, on a synthetic
ModelNet-style npz (two separable classes): a unit trains to its CPU budget,
a rerun reuses it, the report builds, damaged run files are named and skipped."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from qsv_pyg.experiments import modelnet_data as D
from qsv_pyg.experiments import modelnet_table as M
from qsv_pyg.experiments import modelnet_train as T

ROOT = Path(__file__).resolve().parents[1]


def _write_npz(folder: Path, shapes=48, points=40, seed=0) -> Path:
    """Class 0: elongated clouds; class 1: flat discs (rotation-invariant cue)."""
    g = np.random.default_rng(seed)
    data = {}
    for split, count in (("train", shapes), ("test", shapes // 2)):
        y = np.arange(count) % 2
        pos = g.normal(size=(count, points, 3))
        pos[y == 0] *= [2.0, 0.4, 0.4]
        pos[y == 1] *= [1.0, 1.0, 0.1]
        data[f"pos_{split}"], data[f"y_{split}"] = pos.astype(np.float32), y
    data["classes"] = np.array(["long", "flat"])
    (folder / "Toy").mkdir(parents=True)
    path = folder / "Toy" / "toy.npz"
    np.savez(path, **data)
    return path


def _args(data_root, out_root, *extra):
    return ["--data-dir", str(data_root), "--dataset", "Toy", "--out-root", str(out_root),
            "--points", "24", "--batch-size", "8", "--lr", "0.01", "--no-progress",
            *extra]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("mt")
    _write_npz(root / "data")
    out = root / "out"
    rows = M.main(_args(root / "data", out, "--rows", "qsv-geometric", "--protocols",
                        "aligned", "--seeds", "1", "--budget-cpu-s", "3"))
    return root, out, rows


def test_stratified_split_holds_out_a_tenth_of_every_class():
    y = torch.tensor([0] * 50 + [1] * 30 + [2] * 20)
    tr, va = D.stratified_split(y)
    assert sorted(torch.bincount(y[va]).tolist()) == [2, 3, 5]
    assert set(tr.tolist()).isdisjoint(va.tolist())
    assert len(tr) + len(va) == 100
    tr2, va2 = D.stratified_split(y)
    assert torch.equal(va, va2)


def test_unit_trains_to_its_budget_and_annealed(tiny):
    root, out, rows = tiny
    folder = out / "Toy" / "qsv-geometric" / "aligned" / "seed0"
    metrics = json.loads((folder / "metrics.json").read_text())
    config = json.loads((folder / "config.json").read_text())
    log = [json.loads(line) for line in (folder / "log.jsonl").read_text().splitlines()]
    assert config["budget_cpu_s"] == 3 and config["n_val"] == 4 and config["n_train"] == 44
    assert metrics["cpu_seconds_train"] >= 3.0
    assert metrics["cpu_seconds_train"] < 3.0 + 2 * metrics["cpu_seconds_per_epoch"]
    assert len(log) == metrics["epochs_run"] >= 2
    assert metrics["epochs_run"] - 1 < metrics["epochs_trained"] <= metrics["epochs_run"]
    assert log[-1]["progress"] > 0.7  # the cosine reached (nearly) its end
    assert log[-1]["lr"] < 0.01 * 0.2
    assert set(metrics["test"]) == {"aligned", "z", "so3"}
    # invariant model: the three test protocols agree
    assert len(set(metrics["test"].values())) == 1
    assert 0.0 <= metrics["val"] <= 1.0
    # per-class results: the confusion matrices count every shape and give the accuracies
    assert sum(map(sum, metrics["val_confusion"])) == config["n_val"]
    for protocol in ("aligned", "z", "so3"):
        matrix = metrics["test_confusion"][protocol]
        assert sum(map(sum, matrix)) == config["n_test"]
        assert sum(matrix[c][c] for c in range(2)) / config["n_test"] == \
            pytest.approx(metrics["test"][protocol])
        per = [matrix[c][c] / sum(matrix[c]) for c in range(2)]
        assert metrics["test_per_class"][protocol] == pytest.approx(per)
        assert metrics["test_balanced"][protocol] == pytest.approx(sum(per) / 2)
    assert 0.0 <= metrics["val_balanced"] <= 1.0
    assert metrics["classes"] == ["long", "flat"]


def test_confusion_class_accuracy_and_balanced_weights():
    y = torch.tensor([0, 0, 0, 0, 1, 1, 2])
    pred = torch.tensor([0, 0, 1, 0, 1, 0, 2])
    matrix = D.confusion(pred, y, 4)
    assert matrix == [[3, 1, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 0]]
    per, balanced = D.class_accuracy(matrix)
    assert per[:3] == [0.75, 0.5, 1.0] and per[3] != per[3]  # NaN: no shapes of class 3
    assert balanced == pytest.approx((0.75 + 0.5 + 1.0) / 3)
    w = D.class_weights(y, 4)
    # n / (C n_c): every present class carries the same total weight, an absent one none
    assert torch.allclose(w, torch.tensor([7 / 16, 7 / 8, 7 / 4, 0.0]))
    totals = w[y].view(-1).double()
    assert torch.allclose(torch.stack([totals[y == c].sum() for c in range(3)]),
                          torch.full((3,), 7 / 4, dtype=torch.float64))


def test_class_weighted_row_records_its_weighting_and_trains(tmp_path):
    """The class-weighting lever: only ``class_weights`` (and the row) differ from
    the wide row; the unit records it and trains with it (an unknown weighting is
    refused)."""
    torch.set_num_threads(1)
    name = "QSV-geometric wide balanced augmented"
    assert M.ROWS[name] == M.ROWS["QSV-geometric wide augmented"]
    assert M.ROWS[name][1] == M.ROWS["QSV-geometric wide augmented long"][1]
    assert M.CLASS_WEIGHTED == {name: "balanced"} and name in M.AUGMENTED
    assert name not in M.LONG_ROWS and name in M.select_rows("augmented")
    _write_npz(tmp_path / "data", shapes=24)
    out = tmp_path / "out"
    rows = f"{M.slug(name)},qsv-geometric-wide-augmented"
    M.main(_args(tmp_path / "data", out, "--rows", rows, "--seeds", "1", "--budget-cpu-s", "1"))
    unit = out / "Toy" / M.slug(name) / "so3" / "seed0"
    cfg = json.loads((unit / "config.json").read_text())
    assert cfg["class_weights"] == "balanced" and cfg["augment"] == "resample+scale"
    plain = json.loads((out / "Toy" / "qsv-geometric-wide-augmented" / "so3" / "seed0" /
                        "config.json").read_text())
    assert {k: v for k, v in cfg.items() if k != "row"} == \
        {k: v for k, v in plain.items() if k != "row"} | {"class_weights": "balanced"}
    metrics = json.loads((unit / "metrics.json").read_text())
    assert set(metrics["test_balanced"]) == {"so3"}
    table = (out / "table.md").read_text()
    assert "val SO3 balanced" in table
    with pytest.raises(ValueError, match="unknown class weighting"):
        T.train_unit({**cfg, "class_weights": "inverse"}, str(tmp_path / "data" / "Toy" /
                                                            "toy.npz"), lambda _: None)


def test_rerun_reuses_finished_units_and_report_files(tiny, capsys):
    root, out, _ = tiny
    metrics = out / "Toy" / "qsv-geometric" / "aligned" / "seed0" / "metrics.json"
    before = metrics.stat().st_mtime_ns
    M.main(_args(root / "data", out, "--rows", "qsv-geometric", "--protocols", "aligned",
                 "--seeds", "1", "--budget-cpu-s", "3"))
    assert metrics.stat().st_mtime_ns == before
    for name in ("table.md", "table.csv", "results.json", "accuracy.png",
                 "published_modelnet40.md"):
        assert (out / name).stat().st_size > 0
    text = (out / "table.md").read_text()
    assert "QSV-geometric" in text and "CPU-s/epoch" in text and "epochs" in text
    assert "NOT ModelNet10" in (out / "published_modelnet40.md").read_text()
    # per-class results: one line per row and protocol column, the classes by name
    lines = (out / "per_class.md").read_text().splitlines()
    assert "| model | train/test | seeds | long | flat |" in lines
    unit = json.loads(metrics.read_text())
    per = unit["test_per_class"]["z"]
    assert f"| QSV-geometric | aligned/z | 1 | {100 * per[0]:.1f} " \
        f"({100 * unit['val_per_class'][0]:.1f}) | " in "\n".join(lines)


def test_damaged_metrics_are_named_and_skipped(tiny, tmp_path, capsys):
    root, out, _ = tiny
    import shutil
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    good = copy / "Toy" / "qsv-geometric" / "aligned" / "seed0"
    bad = copy / "Toy" / "vn-dgcnn" / "aligned" / "seed0"
    shutil.copytree(good, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["row"] = "VN-DGCNN"
    (bad / "config.json").write_text(json.dumps(cfg))
    (bad / "metrics.json").write_text('{"params": 3, "test": ')  # torn
    rows = M.main(_args(root / "data", copy, "--report-only"))
    err = capsys.readouterr().err
    assert str(bad / "metrics.json") in err and "left out" in err
    assert list(rows) == ["QSV-geometric"]


def test_bad_inputs_exit_2_with_one_line(tmp_path, capsys):
    for argv in (["--points", "2000"], ["--budget-cpu-s", "0"], ["--rows", "nope"],
                 ["--protocols", "z"]):
        with pytest.raises(SystemExit) as info:
            M.main(["--data-dir", str(tmp_path), "--out-root", str(tmp_path / "o"),
                    *argv])
        assert info.value.code == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error:") and "\n" not in err


def test_so3_training_of_the_controls_runs(tmp_path):
    """The SO3/SO3 protocol (fresh rotations every epoch) for the VN and DGCNN rows."""
    torch.set_num_threads(1)
    _write_npz(tmp_path / "data", shapes=24)
    out = tmp_path / "out"
    rows = M.main(_args(tmp_path / "data", out, "--rows", "VN-DGCNN,dgcnn", "--protocols",
                        "so3", "--seeds", "1", "--budget-cpu-s", "0.5"))
    assert list(rows) == ["VN-DGCNN", "DGCNN"]
    for row in ("vn-dgcnn", "dgcnn"):
        metrics = json.loads((out / "Toy" / row / "so3" / "seed0" / "metrics.json").read_text())
        assert set(metrics["test"]) == {"so3"} and metrics["steps"] >= 1


def test_every_row_builds_and_controls_match_qsv_parameters():
    target = T.target_params(10)
    for name in M.ROW_NAMES:
        if M.ROWS[name][0] == "pointnet2":
            continue  # needs torch_cluster only to run, not to build
        n = sum(p.numel() for p in M.build_model(name, 10).parameters())
        if M.ROWS[name][0] != "qsv":
            assert abs(n - target) <= 0.05 * target, (name, n, target)
    # rows that do not set the width run at the table's (the committed runs' width),
    # the wide rows at the model's default since the width lever
    from qsv_pyg.nn.models import QSVGeometric
    assert T.TABLE_WIDTH == 64 and M.build_model("QSV-geometric", 10).hidden_channels == 64
    assert target == sum(p.numel() for p in M.build_model("QSV-geometric", 10).parameters())
    assert M.build_model("QSV-geometric wide augmented long", 10).hidden_channels == \
        QSVGeometric(10).hidden_channels == 2 * T.TABLE_WIDTH
    # rows that do not name edge_message keep it off (the model's default became
    # "target" after the edge-message lever), the lever's row sets it
    assert M.build_model("QSV-geometric wide augmented long", 10).edge_message is False
    assert M.build_model("QSV-geometric wide target messages augmented long",
                         10).edge_message == "target" == QSVGeometric(10).edge_message
    ablations = [n for n in M.ROW_NAMES if M.ROWS[n][4]]
    # the defaults at the ablation budget, then one ablation per switch
    assert ablations[0] == M.ABLATION_REFERENCE and M.ROWS[ablations[0]][1] == {}
    assert len(ablations) == 6 and all(M.ROWS[n][1] for n in ablations[1:])


def test_committed_run_files_rebuild_their_models():
    """Every committed unit's config.json rebuilds a model with the parameter count
    its metrics.json recorded: a changed default cannot silently change what a
    committed row means."""
    root = Path(__file__).resolve().parents[1] / "docs" / "results" / "modelnet_table"
    units = sorted(root.glob("*/*/*/seed*/metrics.json"))
    if not units:
        pytest.skip("no committed run files")
    checked = {}
    for metrics in units:
        cfg = json.loads((metrics.parent / "config.json").read_text())
        key = (cfg["family"], json.dumps(cfg["model_kwargs"], sort_keys=True),
               cfg["num_classes"])
        if key not in checked:
            model = T.model_of(cfg["family"], cfg["model_kwargs"], cfg["num_classes"])
            checked[key] = sum(p.numel() for p in model.parameters())
        assert checked[key] == json.loads(metrics.read_text())["params"], metrics


def test_precomputed_geometry_gives_the_models_own_logits():
    """encode() + forward() (the transforms' graph and frames, float64) feed
    QSVGeometric what it would compute itself."""
    torch.manual_seed(0)
    from qsv_pyg.nn.models import QSVGeometric
    model = QSVGeometric(4, k=6).eval()
    g = torch.Generator().manual_seed(0)
    pos = torch.randn(3, 20, 3, generator=g, dtype=torch.float64) * torch.tensor(
        [1.0, 0.5, 0.2], dtype=torch.float64)
    y = torch.zeros(3, dtype=torch.long)
    idx = torch.arange(3)
    with torch.no_grad():
        given = D.forward(model, D.encode(model, pos, y), idx)
        own = D.forward(model, {"pos": pos.float(), "y": y}, idx)
    assert torch.allclose(given, own, atol=1e-5), (given - own).abs().max()


def test_augment_shapes_rescales_resamples_and_stays_on_the_unit_sphere():
    g = torch.Generator().manual_seed(0)
    full = D.unit_sphere(torch.randn(5, 64, 3, dtype=torch.float64, generator=g))
    a = D.augment_shapes(full, 24, torch.Generator().manual_seed(1))
    b = D.augment_shapes(full, 24, torch.Generator().manual_seed(1))
    c = D.augment_shapes(full, 24, torch.Generator().manual_seed(2))
    assert a.shape == (5, 24, 3) and torch.equal(a, b) and not torch.equal(a, c)
    assert a.norm(dim=2).amax(1).le(1 + 1e-12).all()
    lo, hi = D.SCALE_RANGE
    # all points drawn: the scaling is anisotropic and inside the range (the per-axis
    # spreads' ratios to the original's lie within hi/lo of one another)
    spread_a = D.augment_shapes(full, 64, torch.Generator().manual_seed(3)).std(1)
    ratio = spread_a / full.std(1)
    r = ratio / ratio.amin(1, keepdim=True)
    assert r.le(hi / lo + 1e-9).all() and r.gt(1.01).any()
    # "resample": the same points' subsets, proportions kept (no scaling)
    kept = D.augment_shapes(full, 24, torch.Generator().manual_seed(4), "resample")
    assert kept.shape == (5, 24, 3)
    dist = torch.cdist(kept, full)  # every drawn point is one of the shape's own
    assert dist.amin(2).le(1e-6).all()
    assert torch.equal(D.augment_shapes(full, 64, torch.Generator().manual_seed(5),
                                        "resample").sort(1).values.sum(1),
                       full.sort(1).values.sum(1))
    with pytest.raises(ValueError, match="unknown augmentation"):
        D.augment_shapes(full, 24, g, "mixup")


def test_augmented_rows_record_their_augmentation_and_train(tmp_path):
    """An augmented row: ``augment`` in its config.json, fresh draws every epoch,
    and its test rows like any other's; the others' configs have no such key."""
    torch.set_num_threads(1)
    _write_npz(tmp_path / "data", shapes=24)
    out = tmp_path / "out"
    rows = M.main(_args(tmp_path / "data", out, "--rows", "augmented", "--protocols",
                        "so3", "--seeds", "1", "--budget-cpu-s", "1"))
    assert set(rows) <= set(M.AUGMENTED) and "QSV-geometric augmented" in rows
    cfg = json.loads((out / "Toy" / "qsv-geometric-augmented" / "so3" / "seed0" /
                      "config.json").read_text())
    assert cfg["augment"] == "resample+scale" and cfg["augment"] in D.AUGMENTATIONS
    metrics = json.loads((out / "Toy" / "qsv-geometric-augmented" / "so3" / "seed0" /
                          "metrics.json").read_text())
    assert set(metrics["test"]) == {"so3"} and metrics["steps"] >= 1
    # --rows augmented: not the long and longer rows
    assert set(rows) == set(M.AUGMENTED) - set(M.LONG_ROWS) - set(M.LONGER_ROWS)
    assert set(M.AUGMENTED) == {n for n in M.ROW_NAMES if n.endswith((" augmented",
                                                                       " resampled"))} | \
        set(M.LONG_ROWS) | set(M.LONGER_ROWS)
    assert {n for n, a in M.AUGMENTED.items() if a == "resample"} == \
        {"QSV-geometric wide target messages resampled long", "QSV-geometric wide resampled",
         "QSV-geometric wide target messages resampled longer"}
    assert M.ROWS["QSV-geometric wide resampled"] == M.ROWS["QSV-geometric wide augmented"]
    assert all(M.ROWS[n][2] == ("so3",) for n in M.AUGMENTED)
    with pytest.raises(ValueError, match="unknown augmentation"):
        T.train_unit({**cfg, "augment": "mixup"}, str(tmp_path / "data" / "Toy" / "toy.npz"),
                     lambda _r: None)


def test_long_row_trains_to_the_long_budget_with_the_augmentation(tmp_path):
    """``--rows long``: the recommended recipe (augmented SO3 training) at
    ``--long-budget-cpu-s``, whatever ``--budget-cpu-s`` says; its own row in the report."""
    torch.set_num_threads(1)
    _write_npz(tmp_path / "data", shapes=24)
    out = tmp_path / "out"
    assert set(M.LONG_ROWS) == {"QSV-geometric augmented long", "DGCNN augmented long",
                                "PointNet++ augmented long",
                                "QSV-geometric wide augmented long",
                                "QSV-geometric wide target messages augmented long",
                                "QSV-geometric wide target messages resampled long",
                                "VN-DGCNN augmented long"}
    rows = M.main(_args(tmp_path / "data", out, "--rows", "qsv-geometric-augmented-long",
                        "--seeds", "1", "--budget-cpu-s", "100", "--long-budget-cpu-s", "1"))
    assert set(rows) == {"QSV-geometric augmented long"}
    assert M.select_rows("long") == list(M.LONG_ROWS)
    # the controls at the long budget are the augmented controls again (equal CPU time)
    for name in ("DGCNN augmented long", "PointNet++ augmented long"):
        assert M.ROWS[name][:3] == M.ROWS[name[:-len(" long")]][:3]
    unit = out / "Toy" / "qsv-geometric-augmented-long" / "so3" / "seed0"
    cfg = json.loads((unit / "config.json").read_text())
    assert cfg["budget_cpu_s"] == 1 and cfg["augment"] == "resample+scale"
    assert json.loads((unit / "metrics.json").read_text())["cpu_seconds_train"] < 50
    assert M.ROWS["QSV-geometric augmented long"][:4] == ("qsv", {}, ("so3",), 3)
    # the width lever: only the width differs from the long row (same recipe, budget)
    wide = M.ROWS["QSV-geometric wide augmented long"]
    assert wide[1] == {"hidden_channels": 2 * T.TABLE_WIDTH}
    assert wide[2:4] == (("so3",), 3) and "QSV-geometric wide augmented long" in M.AUGMENTED
    # the edge-message lever: only edge_message differs from the wide row
    name = "QSV-geometric wide target messages augmented long"
    lever = M.ROWS[name]
    assert lever[1] == {**wide[1], "edge_message": "target"}
    assert lever[2:4] == wide[2:4] and name in M.AUGMENTED
    # the proportions lever: only the augmentation differs from the edge-message row
    kept = "QSV-geometric wide target messages resampled long"
    assert M.ROWS[kept] == lever and M.AUGMENTED[kept] == "resample"
    assert M.AUGMENTED[name] == "resample+scale"
    with pytest.raises(SystemExit):
        M.main(_args(tmp_path / "data", out, "--rows", "long", "--long-budget-cpu-s", "0"))


def test_longer_row_is_the_wide_row_at_the_longer_budget(tmp_path):
    """``--rows longer``: the wide row's model and recipe at ``--longer-budget-cpu-s``
    (default twice the long budget), whatever the other budgets say."""
    torch.set_num_threads(1)
    _write_npz(tmp_path / "data", shapes=24)
    out = tmp_path / "out"
    assert M.LONGER_ROWS == ("QSV-geometric wide augmented longer",
                             "QSV-geometric wide target messages resampled longer")
    assert M.ROWS["QSV-geometric wide target messages resampled longer"] == \
        M.ROWS["QSV-geometric wide target messages resampled long"]
    assert M.AUGMENTED["QSV-geometric wide target messages resampled longer"] == "resample"
    assert M.LONGER_BUDGET_CPU_S == 2 * M.LONG_BUDGET_CPU_S
    assert M.select_rows("longer") == list(M.LONGER_ROWS)
    assert not set(M.LONGER_ROWS) & set(M.LONG_ROWS)
    longer = M.ROWS["QSV-geometric wide augmented longer"]
    assert longer == M.ROWS["QSV-geometric wide augmented long"]
    assert M.AUGMENTED["QSV-geometric wide augmented longer"] == "resample+scale"
    args = M.parse_args(["--data-dir", str(tmp_path / "data"), "--dataset", "Toy",
                         "--rows", "longer", "--out-root", str(out)])
    assert args.longer_budget_cpu_s == M.LONGER_BUDGET_CPU_S
    rows = M.main(_args(tmp_path / "data", out, "--rows", "longer", "--seeds", "1",
                        "--budget-cpu-s", "100", "--long-budget-cpu-s", "100",
                        "--longer-budget-cpu-s", "1"))
    assert set(rows) == set(M.LONGER_ROWS)
    unit = out / "Toy" / "qsv-geometric-wide-augmented-longer" / "so3" / "seed0"
    cfg = json.loads((unit / "config.json").read_text())
    assert cfg["budget_cpu_s"] == 1 and cfg["augment"] == "resample+scale"
    assert cfg["model_kwargs"] == {"hidden_channels": 2 * T.TABLE_WIDTH}
    with pytest.raises(SystemExit):
        M.main(_args(tmp_path / "data", out, "--rows", "longer", "--longer-budget-cpu-s",
                     "-1"))


def test_budget_curves_group_one_recipe_across_budgets(tmp_path):
    """The budget figure's data: SO3-trained units of one recipe (only the budget
    differs) at two budgets or more; another width, augmentation or protocol is
    another recipe, and a recipe at one budget has no curve."""
    from qsv_pyg.experiments import modelnet_report as R

    def unit(row, budget, seed, test, val, kw=None, augment="resample+scale", train="so3"):
        cfg = {"row": row, "family": "qsv", "model_kwargs": kw or {}, "train": train,
               "seed": seed, "budget_cpu_s": budget, "lr": 1e-3, "points": 512,
               "batch_size": 32, "n_train": 10, "npz": "a.npz", "num_classes": 10}
        if augment:
            cfg["augment"] = augment
        return {"config": cfg, "metrics": {"params": 100 if not kw else 400,
                                           "test": {"so3": test}, "val": val}}

    units = [unit("a", 1500.0, 0, 0.80, 0.82), unit("a", 1500.0, 1, 0.82, 0.84),
             unit("a long", 3600.0, 0, 0.85, 0.87),
             unit("wide", 3600.0, 0, 0.87, 0.88, {"hidden_channels": 128}),
             unit("wide longer", 7200.0, 0, 0.89, 0.90, {"hidden_channels": 128}),
             unit("plain", 3600.0, 0, 0.5, 0.5, augment=None),  # one budget: no curve
             unit("aligned", 7200.0, 0, 0.9, 0.9, train="aligned")]
    units[-1]["metrics"]["test"] = {"aligned": 0.9}
    curves = R.budget_curves(units)
    assert [c["rows"] for c in curves] == [["a", "a long"], ["wide", "wide longer"]]
    assert curves[0]["label"] == "QSV-geometric 100 params augmented"
    assert curves[0]["budgets"] == {1500.0: {"test": [0.80, 0.82], "val": [0.82, 0.84],
                                             "seeds": [0, 1]},
                                    3600.0: {"test": [0.85], "val": [0.87], "seeds": [0]}}
    assert list(curves[1]["budgets"]) == [3600.0, 7200.0]
    R.plot_budget(tmp_path / "budget.png", curves, "t")
    assert (tmp_path / "budget.png").stat().st_size > 0


class _Stop(Exception):
    pass


def test_an_interrupted_unit_resumes_where_its_last_epoch_ended(tmp_path):
    """Killed in epoch 2 and run again, an augmented SO3 unit continues with
    epoch 2 as the uninterrupted unit trains it (the same shapes, rotations,
    scalings, batches and dropout: the generators, RNGs, model and optimiser
    come back), on the CPU clock where the checkpoint left it."""
    from qsv_pyg.experiments.units import UnitCheckpoint
    torch.set_num_threads(1)
    path = _write_npz(tmp_path / "data", shapes=32)
    cfg = {"row": "QSV-geometric augmented", "family": "qsv", "model_kwargs": {},
           "train": "so3", "tests": ["so3"], "seed": 0, "dataset": "Toy", "npz": "toy.npz",
           "num_classes": 2, "max_train": None, "max_test": None, "points": 24,
           "batch_size": 8, "lr": 0.01, "budget_cpu_s": 1e7, "threads": 1,
           "augment": "resample+scale"}

    def run(folder, stop_at, resume=False):
        records = []

        def log(record):
            records.append(record)
            if record["epoch"] == stop_at:
                raise _Stop

        ckpt = UnitCheckpoint.resume(folder) if resume else UnitCheckpoint(folder)
        with pytest.raises(_Stop):
            T.train_unit(cfg, str(path), log, checkpoint=ckpt)
        return records, ckpt

    whole, _ = run(tmp_path / "a", 3)
    cut, _ = run(tmp_path / "b", 2)  # epoch 2 logged, not saved: the checkpoint has epoch 1
    rest, ckpt = run(tmp_path / "b", 3, resume=True)
    assert ckpt.state["epoch"] == 1 and [r["epoch"] for r in rest] == [2, 3]
    for a, b in zip(whole[1:], rest):
        assert a["shapes"] == b["shapes"]
        assert b["train_loss"] == pytest.approx(a["train_loss"], rel=1e-6, abs=1e-9)
        assert b["train_acc"] == a["train_acc"]
    assert rest[0]["used_cpu_seconds"] > ckpt.state["used_cpu_seconds"]
    assert rest[0]["train_loss"] != pytest.approx(cut[0]["train_loss"], rel=1e-3)  # not epoch 1


def test_voting_reuses_kept_weights_and_pairs_one_draw_with_the_units_own(tmp_path, capsys):
    """A finished unit keeps its final weights (model.pt); --vote N evaluates them
    without training: its one-draw accuracies are the unit's own metrics (the same
    weights, subsample and rotations), the voted ones a mean over N fresh draws;
    voting.md and results.json report them; a rerun reuses votes.json; a unit
    without weights is counted, not fatal."""
    torch.set_num_threads(1)
    _write_npz(tmp_path / "data", points=40)
    out = tmp_path / "out"
    common = ("--rows", "qsv-geometric", "--protocols", "so3", "--seeds", "2",
              "--budget-cpu-s", "1")
    M.main(_args(tmp_path / "data", out, *common))
    units = [out / "Toy" / "qsv-geometric" / "so3" / f"seed{s}" for s in (0, 1)]
    for unit in units:
        assert (unit / "model.pt").is_file() and not (unit / "checkpoint.pt").exists()
    (units[1] / "model.pt").unlink()  # a unit trained before the weights were kept
    capsys.readouterr()
    M.main(_args(tmp_path / "data", out, *common, "--vote", "3"))
    assert "1 without a readable model.pt" in capsys.readouterr().err
    assert not (units[1] / "votes.json").exists()
    votes = json.loads((units[0] / "votes.json").read_text())
    metrics = json.loads((units[0] / "metrics.json").read_text())
    assert votes["votes"] == 3 and votes["weights"]["final"] is True
    assert votes["val"]["single"] == pytest.approx(metrics["val"])
    # every test protocol, whatever the training: an SO3-trained unit's weights on
    # the aligned and z-rotated shapes too (the same fixed rotations as the table's)
    assert set(votes["test"]) == {"aligned", "z", "so3"}
    assert votes["test"]["so3"]["single"] == pytest.approx(metrics["test"]["so3"])
    for acc in (votes["val"]["voted"], *(v["voted"] for v in votes["test"].values())):
        assert 0.0 <= acc <= 1.0
    # QSV-geometric is invariant: the three protocols' draws give the same answers
    # (up to float32 ties, none at this size)
    assert votes["test"]["aligned"] == votes["test"]["z"] == votes["test"]["so3"]
    text = (out / "voting.md").read_text()
    assert "| QSV-geometric | SO3 | 3 | 1 | final |" in text
    assert "test SO3/aligned voted" in text and "test SO3/z gain" in text
    gain = 100 * (votes["test"]["so3"]["voted"] - votes["test"]["so3"]["single"])
    assert f"| {gain:+.1f} |" in text
    assert json.loads((out / "results.json").read_text())["voting"][0]["votes"] == 3
    before = (units[0] / "votes.json").stat().st_mtime_ns
    (units[1] / "model.pt").write_bytes(b"torn")  # damaged weights: named, left out
    capsys.readouterr()
    M.main(_args(tmp_path / "data", out, *common, "--vote", "3"))
    err = capsys.readouterr().err
    assert f"{units[1] / 'model.pt'}: cannot read it" in err and "1 without a readable model.pt" in err
    assert (units[0] / "votes.json").stat().st_mtime_ns == before  # reused
    assert not (units[1] / "votes.json").exists()
    # a votes.json from before the other protocols were voted is recomputed
    old = dict(votes, test={"so3": votes["test"]["so3"]})
    (units[0] / "votes.json").write_text(json.dumps(old))
    M.main(_args(tmp_path / "data", out, *common, "--vote", "3"))
    again = json.loads((units[0] / "votes.json").read_text())
    assert again.pop("eval_cpu_seconds") > 0 and set(again["test"]) == set(votes["test"])
    assert again == {k: v for k, v in votes.items() if k != "eval_cpu_seconds"}
    with pytest.raises(SystemExit) as info:
        M.main(_args(tmp_path / "data", out, *common, "--vote", "0"))
    assert info.value.code == 2


def test_voted_probabilities_average_fresh_draws_of_every_shape():
    from qsv_pyg.nn.models import QSVGeometric
    torch.manual_seed(0)
    model = QSVGeometric(3, hidden_channels=16, k=4).eval()
    full = D.unit_sphere(torch.randn(5, 30, 3, dtype=torch.float64))
    y = torch.tensor([0, 1, 2, 0, 1])
    one = D.voted_probabilities(model, full, y, None, 12, 1, seed=7)
    again = D.voted_probabilities(model, full, y, None, 12, 1, seed=7)
    assert torch.equal(one, again)  # the draws are seeded
    four = D.voted_probabilities(model, full, y, None, 12, 4, seed=7)
    assert four.shape == (5, 3) and torch.allclose(four.sum(-1), torch.ones(5))
    # the first of the four draws is the one-draw result; the mean differs from it
    g = torch.Generator().manual_seed(7)
    draws = [D.augment_shapes(full, 12, g, "resample") for _ in range(4)]
    mean = sum(D.probabilities(model, D.encode(model, d, y)) for d in draws) / 4
    assert torch.allclose(four, mean) and torch.allclose(one, D.probabilities(
        model, D.encode(model, draws[0], y)))
    with pytest.raises(ValueError, match="votes"):
        D.voted_probabilities(model, full, y, None, 12, 0, seed=7)
