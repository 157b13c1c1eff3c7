"""benchmarks/modelnet_legacy.py (the old examples/modelnet.py table): ModelNet10 under rotations, on a tiny slice of the shared
data (skipped where ``<data dir>/ModelNet10`` or torch_cluster is absent).

Nothing is written next to the data: every run folder lives under tmp_path, and
the data folder's listing is compared before and after.
"""
from __future__ import annotations

import importlib
import runpy
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


@pytest.fixture(scope="module")
def modelnet(monkeypatch_module):
    pytest.importorskip("torch_cluster")
    monkeypatch_module.syspath_prepend(str(BENCHMARKS))
    torch.set_num_threads(1)
    return importlib.import_module("modelnet_legacy")


@pytest.fixture(scope="module")
def data_root(modelnet):
    from qsv_pyg.experiments.units import default_data_dir
    root = default_data_dir()
    if not (root / "ModelNet10").is_dir() or not list((root / "ModelNet10").glob("*.npz")):
        pytest.skip(f"no ModelNet10 npz under {root}")
    return root


def _listing(folder: Path):
    return sorted((str(p.relative_to(folder)), p.stat().st_size, p.stat().st_mtime_ns)
                  for p in folder.rglob("*"))


TINY = ["--models", "QSV-geometric,GAT xyz", "--protocols", "aligned",
        "--max-train", "200", "--max-test", "100", "--points", "128", "--epochs", "5",
        "--batch-size", "16", "--no-progress"]


@pytest.fixture(scope="module")
def tiny_run(modelnet, data_root, tmp_path_factory):
    """Two rows trained on aligned shapes (200 shapes of 128 points, 5 epochs),
    tested aligned, z and SO3 (in this process: --jobs 1)."""
    out = tmp_path_factory.mktemp("modelnet")
    before = _listing(data_root / "ModelNet10")
    rows = modelnet.main(["--data-dir", str(data_root), "--out-root", str(out), *TINY])
    assert _listing(data_root / "ModelNet10") == before
    return out, rows


def _acc(rows, row, column):
    return rows[row]["columns"][column][0]


def test_tiny_run_learns_and_geometric_qsv_is_invariant(tiny_run):
    out, rows = tiny_run
    assert list(rows) == ["QSV-geometric", "GAT xyz"]
    for row in rows:  # 10 classes: chance 0.1 (the largest class holds ~22 %)
        assert _acc(rows, row, "aligned/aligned") > 0.2, row
    geo = [_acc(rows, "QSV-geometric", c) for c in ("aligned/aligned", "aligned/z",
                                                     "aligned/SO3")]
    # The same 100 test shapes, rotated: the frames are recomputed from the rotated
    # points and (with the tie-break) match the rotated aligned frames, so the
    # predictions agree up to float rounding; one shape in 100 of slack.
    assert max(geo) - min(geo) <= 0.01, geo
    for name in ("table.md", "table.csv", "table.json", "accuracy.png",
                 "published_modelnet40.md"):
        assert (out / name).is_file(), name
    unit = out / "ModelNet10" / "qsv-geometric" / "aligned" / "seed0"
    log = (unit / "log.jsonl").read_text().splitlines()
    assert len(log) == 5
    import json
    metrics = json.loads((unit / "metrics.json").read_text())
    assert set(metrics["test"]) == {"aligned", "z", "so3"}
    assert metrics["params"] > 0 and metrics["time_per_epoch"] > 0 and metrics["cpu"]
    assert "torch_cluster" in metrics["versions"]


def test_rerun_reuses_units_and_report_only_rebuilds(modelnet, data_root, tiny_run,
                                                    monkeypatch, capsys):
    out, rows = tiny_run

    def no_training(*args, **kwargs):
        raise AssertionError("a finished unit was trained again")

    monkeypatch.setattr(modelnet, "train_unit", no_training)
    again = modelnet.main(["--data-dir", str(data_root), "--out-root", str(out), *TINY])
    assert again == rows
    for name in ("table.md", "accuracy.png"):
        (out / name).unlink()
    capsys.readouterr()
    modelnet.main(["--out-root", str(out), "--report-only"])
    assert "| QSV-geometric |" in (out / "table.md").read_text()
    assert (out / "accuracy.png").stat().st_size > 0
    assert "ModelNet40" in capsys.readouterr().out


def test_geometric_qsv_logits_are_rotation_invariant(modelnet, data_root):
    """Direct check: a QSV-geometric classifier's logits on 24 test shapes and on
    randomly rotated copies of them (graphs and frames recomputed after rotation)."""
    arrays = modelnet.load_arrays(next((data_root / "ModelNet10").glob("*.npz")), 256)
    pos = modelnet.normalise(arrays["pos_test"][::38], 256, 0)
    y = torch.from_numpy(arrays["y_test"][::38])
    g = torch.Generator().manual_seed(5)
    torch.manual_seed(0)
    model = modelnet.build_model("QSV-geometric", 10, 16).eval()
    idx = torch.arange(len(y))
    with torch.no_grad():
        aligned = model(modelnet.make_batch(modelnet.encode(pos, y, 16), idx, "geometric"))
        for protocol in ("z", "so3"):
            rot = modelnet.rotations(protocol, len(y), g)
            rotated = model(modelnet.make_batch(
                modelnet.encode(modelnet.rotate(pos, rot), y, 16), idx, "geometric"))
            assert (rotated - aligned).abs().max() < 1e-4, protocol
    # ... and the logits do depend on the shape (the check is not vacuous).
    assert (aligned - aligned.mean(0)).abs().max() > 1e-2


def test_encoding_matches_point_clouds_and_tie_break_fixes_planar_frames(modelnet,
                                                                         data_root):
    from qsv_pyg.geometry import matrix_to_quaternion
    from qsv_pyg.quaternion import hamilton_product
    # examples/point_clouds.py, run by path (its encode() is the reference).
    encode = runpy.run_path(str(ROOT / "examples" / "point_clouds.py"),
                            run_name="point_clouds")["encode"]
    arrays = modelnet.load_arrays(next((data_root / "ModelNet10").glob("*.npz")), 512)
    pos = modelnet.normalise(arrays["pos_test"][::90], 512, 0)  # 11 shapes
    y = torch.from_numpy(arrays["y_test"][::90])
    plain = modelnet.encode(pos, y, 16, frames="pca")
    ref = encode(pos[3], int(y[3]), 16)
    nbr = plain["nbr"][3].long().reshape(-1)
    assert torch.equal(torch.stack([nbr, torch.arange(512).repeat_interleave(16)]),
                       ref.edge_index)
    for key in ("x_xyz", "x_local", "quat"):
        assert torch.allclose(plain[key][3].double(), ref[key], atol=1e-5), key
    # Frames after a rotation vs the rotated frames of the aligned shapes: the
    # quaternions agree up to sign where the frames are consistent.
    g = torch.Generator().manual_seed(1)
    rot = modelnet.rotations("so3", len(y), g)
    changed = {}
    for frames in ("pca", "pca+centroid"):
        a = modelnet.encode(pos, y, 16, frames=frames)
        b = modelnet.encode(modelnet.rotate(pos, rot), y, 16, frames=frames)
        q_rot = matrix_to_quaternion(rot.float())[:, None, :].expand_as(a["quat"])
        expected = hamilton_product(q_rot, a["quat"])
        agree = (expected * b["quat"]).sum(-1).abs()
        changed[frames] = float((agree < 0.9998).double().mean())  # > ~2 degrees
        # The local inputs are invariant wherever the frames are.
        ok = agree >= 0.9998
        assert torch.allclose(a["x_local"][ok], b["x_local"][ok], atol=1e-4)
    assert changed["pca+centroid"] <= 1e-3 < changed["pca"], changed


def _fails(modelnet, capsys, argv, needle):
    with pytest.raises(SystemExit) as exc:
        modelnet.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err, err


def test_bad_inputs_exit_2_with_one_line(modelnet, tmp_path, capsys):
    out = ["--out-root", str(tmp_path / "out"), "--small", "--no-progress"]
    _fails(modelnet, capsys, ["--data-dir", str(tmp_path), *out], "no folder")
    fake = tmp_path / "Fake"
    fake.mkdir()
    _fails(modelnet, capsys, ["--data-dir", str(tmp_path), "--dataset", "Fake", *out],
           "no .npz")
    rng = np.random.default_rng(0)
    np.savez(fake / "fake.npz", pos_train=rng.normal(size=(6, 200, 3)).astype("f4"),
             y_train=np.arange(6) % 3, pos_test=rng.normal(size=(3, 200, 3)).astype("f4"))
    _fails(modelnet, capsys, ["--data-dir", str(tmp_path), "--dataset", "Fake", *out],
           "y_test")
    np.savez(fake / "fake.npz", pos_train=rng.normal(size=(6, 200, 3)).astype("f4"),
             y_train=np.arange(5) % 3, pos_test=rng.normal(size=(3, 200, 3)).astype("f4"),
             y_test=np.arange(3))
    _fails(modelnet, capsys, ["--data-dir", str(tmp_path), "--dataset", "Fake", *out],
           "y_train")
    _fails(modelnet, capsys, ["--data-dir", str(tmp_path), "--dataset", "Fake",
                              "--models", "NoSuchModel", *out], "NoSuchModel")
    assert not (tmp_path / "out").exists()


def test_any_modelnet_style_npz_runs(modelnet, tmp_path):
    """A made-up 3-class npz in the same layout (without ``classes``) trains, both
    protocols, in two worker processes (--jobs 2)."""
    rng = np.random.default_rng(0)
    folder = tmp_path / "Blobs"
    folder.mkdir()
    np.savez(folder / "blobs.npz",
             pos_train=(rng.normal(size=(24, 80, 3)) * [1, 2, 3]).astype("f4"),
             y_train=np.arange(24) % 3,
             pos_test=(rng.normal(size=(9, 80, 3)) * [1, 2, 3]).astype("f4"),
             y_test=np.arange(9) % 3)
    rows = modelnet.main(["--data-dir", str(tmp_path), "--dataset", "Blobs",
                          "--out-root", str(tmp_path / "out"), "--models", "QSV xyz,DGCNN,"
                          "PointNet++", "--points", "64", "--epochs", "1", "--jobs", "2",
                          "--no-progress"])
    assert list(rows) == ["QSV xyz", "DGCNN", "PointNet++"]
    for row in rows.values():
        assert all(len(row["columns"][c]) == 1 for c in row["columns"])


def _blobs(folder: Path, shapes: int = 24, points: int = 80, repeat: bool = False) -> Path:
    """A made-up 3-class ModelNet-style npz; ``repeat``: the first quarter of every
    shape's points at one place."""
    rng = np.random.default_rng(0)
    folder.mkdir(parents=True)

    def pos(count):
        p = rng.normal(size=(count, points, 3)) * [1, 2, 3]
        if repeat:
            p[:, :points // 4] = p[:, :1]
        return p.astype("f4")

    np.savez(folder / "blobs.npz", pos_train=pos(shapes), y_train=np.arange(shapes) % 3,
             pos_test=pos(9), y_test=np.arange(9) % 3)
    return folder


def test_repeated_points_get_exactly_k_nearest_neighbours(modelnet, tmp_path):
    """torch_cluster.knn_graph returns k + 1 sources for a point repeated more than
    k + 1 times; the graph still has exactly k, the nearest other points (today's
    main raised "knn_graph did not return k sources per target")."""
    g = torch.Generator().manual_seed(0)
    pos = torch.randn(3, 40, 3, generator=g, dtype=torch.float64)
    pos[:, :10] = pos[:, :1]  # one point ten times
    pos[1] = torch.randn(40, 3, generator=g, dtype=torch.float64)  # one shape without
    k = 6
    shapes = modelnet.encode(pos, torch.zeros(3, dtype=torch.long), k)
    nbr = shapes["nbr"].long()
    assert nbr.shape == (3, 40, k)
    for s in range(3):
        dist = torch.cdist(pos[s], pos[s])
        dist.fill_diagonal_(float("inf"))
        assert bool((nbr[s] != torch.arange(40)[:, None]).all())  # no self
        kth = dist.sort(dim=1).values[:, k - 1]
        chosen = dist.gather(1, nbr[s])
        assert bool((chosen <= kth[:, None] + 1e-12).all())  # the k nearest
    assert torch.isfinite(shapes["quat"]).all() and torch.isfinite(shapes["x_local"]).all()
    # The whole script on such data: trains, no traceback.
    _blobs(tmp_path / "Dups", repeat=True)
    rows = modelnet.main(["--data-dir", str(tmp_path), "--dataset", "Dups",
                          "--out-root", str(tmp_path / "out"), "--models", "QSV-geometric",
                          "--protocols", "aligned", "--points", "64", "--k", "8",
                          "--epochs", "1", "--no-progress"])
    assert list(rows) == ["QSV-geometric"]


def test_a_failed_unit_cancels_the_queued_ones(modelnet, tmp_path, capfd):
    """--jobs 2: the first unit (longest first: GAT local) cannot create its
    folder; the run ends at once with exit 2 instead of training the queue first."""
    _blobs(tmp_path / "Blobs")
    out = tmp_path / "out"
    blocked = out / "Blobs" / "gat-local" / "aligned" / "seed0"
    blocked.parent.mkdir(parents=True)
    blocked.write_text("a file where the unit's folder belongs")
    with pytest.raises((SystemExit, OSError)) as exc:
        modelnet.main(["--data-dir", str(tmp_path), "--dataset", "Blobs",
                       "--out-root", str(out), "--protocols", "aligned", "--points", "64",
                       "--epochs", "1", "--jobs", "2", "--no-progress"])
    started = [p for p in (out / "Blobs").glob("*/aligned/seed0") if p.is_dir()]
    finished = [p for p in started if (p / "metrics.json").is_file()]
    # 8 units; with two workers at most the few already handed to a worker run.
    assert len(finished) <= 4 and len(started) <= 5, sorted(map(str, started))
    # ... and the failure is one line, exit 2 (printed by the worker).
    assert exc.type is SystemExit and exc.value.code == 2
    err = [line for line in capfd.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and str(blocked) in err[0], err


def test_unusable_out_root_exits_2(modelnet, tmp_path, capsys):
    _blobs(tmp_path / "Blobs")
    (tmp_path / "file").write_text("not a folder")
    for extra in ([], ["--report-only"]):
        _fails(modelnet, capsys, ["--data-dir", str(tmp_path), "--dataset", "Blobs",
                                  "--out-root", str(tmp_path / "file" / "out"),
                                  "--models", "QSV xyz", "--points", "64", "--epochs", "1",
                                  "--no-progress", *extra], "--out-root")


def test_report_only_names_damaged_units_and_leaves_them_out(modelnet, tmp_path, capsys):
    import json
    root = tmp_path / "out" / "ModelNet10"

    def unit(row, train, seed, metrics):
        folder = root / modelnet.slug(row) / train / f"seed{seed}"
        folder.mkdir(parents=True)
        cfg = {"row": row, "train": train, "seed": seed, "epochs": 1, "num_classes": 10}
        (folder / "config.json").write_text(json.dumps(cfg))
        (folder / "metrics.json").write_text(json.dumps(metrics))
        return folder / "metrics.json"

    good = {"params": 10, "time_per_epoch": 1.0, "test": {"aligned": 0.5, "z": 0.4,
                                                           "so3": 0.3}}
    unit("QSV xyz", "aligned", 0, good)
    listed = unit("QSV xyz", "aligned", 1, [good])
    lacking = unit("GAT xyz", "aligned", 0, {k: v for k, v in good.items() if k != "params"})
    wrong = unit("DGCNN", "aligned", 0, {**good, "test": {"aligned": "high"}})
    rows = modelnet.main(["--out-root", str(tmp_path / "out"), "--report-only"])
    assert list(rows) == ["QSV xyz"] and rows["QSV xyz"]["seeds"] == {0}
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3, err
    joined = "\n".join(err)
    assert str(listed) in joined and "not a JSON object" in joined
    assert str(lacking) in joined and "'params'" in joined
    assert str(wrong) in joined and "test.aligned" in joined


def test_cli_missing_folder_exits_2(tmp_path):
    pytest.importorskip("torch_cluster")
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "modelnet_legacy.py"), "--data-dir",
                           str(tmp_path), "--out-root", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1 and "no folder" in proc.stderr


def test_report_names_each_rows_epochs_when_they_differ(modelnet, tiny_run, tmp_path):
    """An equal-CPU-budget table trains rows for different epochs: the table then
    says each row's own (and has no epochs column when they agree)."""
    import json
    import shutil
    out, _ = tiny_run
    assert "| epochs |" not in (out / "table.md").read_text()
    copy = tmp_path / "copy"
    shutil.copytree(out / "ModelNet10", copy / "ModelNet10")
    for protocol in (copy / "ModelNet10" / "gat-xyz").iterdir():
        path = protocol / "seed0" / "config.json"
        cfg = json.loads(path.read_text())
        cfg["epochs"] = 7
        path.write_text(json.dumps(cfg))
    modelnet.main(["--out-root", str(copy), "--report-only"])
    lines = (copy / "table.md").read_text().splitlines()
    header = next(line for line in lines if line.startswith("| model |"))
    cells = {line.split(" | ")[0].lstrip("| "): line for line in lines if line.startswith("| ")}
    assert "| epochs |" in header
    assert "| 7 |" in cells["GAT xyz"] and "| 5 |" in cells["QSV-geometric"]
