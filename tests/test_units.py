"""qsv_pyg.experiments.units: the example tables' run folders (lock, reuse),
the dataset cache keyed on the source, the reading of damaged units and the
worker pool that stops at the first failure. No dataset needed."""
from __future__ import annotations

import json
import os
import pickle
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from qsv_pyg.experiments import units
from qsv_pyg.training.run_lock import RunLock


def _one_line_exit_2(capsys, call, *args, **kwargs) -> str:
    with pytest.raises(SystemExit) as info:
        call(*args, **kwargs)
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


# ------------------------------------------------------------------ the lock
def test_a_unit_trained_by_a_live_process_is_left_alone(tmp_path, capsys):
    folder = tmp_path / "out" / "Cora" / "gatconv" / "seed0"
    folder.mkdir(parents=True)
    config = {"row": "GATConv", "seed": 0}
    # What a live run has written so far: its config and two epochs.
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "log.jsonl").write_text('{"epoch": 1}\n{"epoch": 2}\n')
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    calls = []
    with RunLock(folder):
        err = _one_line_exit_2(capsys, units.run_unit, folder, config,
                               lambda log: calls.append(1) or {"test_acc": 1.0})
    assert calls == []  # nothing trained
    assert f"pid {os.getpid()}" in err and "--out-root" in err and str(folder) in err
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    # Once the holder is gone, the unit is restarted (its old log replaced).
    metrics = units.run_unit(folder, config,
                             lambda log: (log({"epoch": 1}), {"test_acc": 1.0})[1])
    assert metrics == {"test_acc": 1.0}
    assert (folder / "log.jsonl").read_text() == '{"epoch": 1}\n'
    assert not (folder / "run.lock").exists()


class _Interrupted(Exception):
    pass


def test_a_resumable_unit_continues_from_its_checkpoint(tmp_path, capsys):
    """The second run gets the saved state, the log cut back to its epoch (a
    line logged after the last save is dropped); the finished unit keeps no
    checkpoint; a damaged checkpoint is named and the unit starts again."""
    import torch
    folder = tmp_path / "unit"
    config = {"row": "X", "seed": 0}

    def first(log, checkpoint):
        assert checkpoint.state is None
        log({"epoch": 1})
        checkpoint.save({"epoch": 1, "w": torch.arange(3.0)})
        log({"epoch": 2})  # then killed before epoch 2's save
        raise _Interrupted

    with pytest.raises(_Interrupted):
        units.run_unit(folder, config, first, resumable=True)
    assert (folder / units.UNIT_CHECKPOINT).exists() and not (folder / "run.lock").exists()

    def second(log, checkpoint):
        assert checkpoint.state["epoch"] == 1
        assert torch.equal(checkpoint.state["w"], torch.arange(3.0))
        assert (folder / "log.jsonl").read_text() == '{"epoch": 1}\n'
        log({"epoch": 2})
        return {"test_acc": 1.0}

    assert units.run_unit(folder, config, second, resumable=True) == {"test_acc": 1.0}
    assert not (folder / units.UNIT_CHECKPOINT).exists()
    assert (folder / "log.jsonl").read_text() == '{"epoch": 1}\n{"epoch": 2}\n'
    # a finished unit is reused; a damaged checkpoint of an unfinished one restarts it
    assert units.run_unit(folder, config, first, resumable=True) == {"test_acc": 1.0}
    (folder / "metrics.json").unlink()
    (folder / units.UNIT_CHECKPOINT).write_bytes(b"not a zip")
    capsys.readouterr()

    def fresh(log, checkpoint):
        assert checkpoint.state is None and not (folder / "log.jsonl").exists()
        return {"test_acc": 0.5}

    assert units.run_unit(folder, config, fresh, resumable=True) == {"test_acc": 0.5}
    err = capsys.readouterr().err
    assert "cannot resume" in err and units.UNIT_CHECKPOINT in err and "starts again" in err
    with pytest.raises(ValueError, match="epoch"):
        units.UnitCheckpoint(folder).save({"w": 1})
    # a checkpoint without the config.json it was saved under is not resumed
    (folder / "metrics.json").unlink()
    units.UnitCheckpoint(folder).save({"epoch": 1, "w": torch.arange(3.0)})
    (folder / "config.json").unlink()
    assert units.run_unit(folder, config, fresh, resumable=True) == {"test_acc": 0.5}
    assert units.finished_unit(folder, config) == {"test_acc": 0.5}  # config.json rewritten
    assert not (folder / units.UNIT_CHECKPOINT).exists()


def test_a_unit_finished_while_waiting_for_the_lock_is_not_retrained(tmp_path):
    folder = tmp_path / "unit"
    folder.mkdir()
    config = {"seed": 0}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "metrics.json").write_text(json.dumps({"test_acc": 0.5}))
    assert units.run_unit(folder, config, lambda log: pytest.fail("trained")) == \
        {"test_acc": 0.5}


def test_damaged_config_exits_2_and_damaged_metrics_retrains(tmp_path, capsys):
    folder = tmp_path / "unit"
    folder.mkdir()
    (folder / "config.json").write_text("[1, 2]")
    err = _one_line_exit_2(capsys, units.finished_unit, folder, {"seed": 0})
    assert "config.json" in err and "damaged" in err
    (folder / "config.json").write_text(json.dumps({"seed": 0}))
    (folder / "metrics.json").write_text("[1, 2]")
    assert units.finished_unit(folder, {"seed": 0}) is None


def test_a_run_folder_under_a_file_exits_2(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    err = _one_line_exit_2(capsys, units.run_unit, tmp_path / "file" / "unit", {},
                           lambda log: {})
    assert "file" in err


# ------------------------------------------------------------------ folders
def test_check_folder(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    err = _one_line_exit_2(capsys, units.check_folder, tmp_path / "file", "--out-root")
    assert "--out-root" in err and "is a file" in err
    err = _one_line_exit_2(capsys, units.check_folder, tmp_path / "file" / "a" / "b",
                           "--cache-root")
    assert "--cache-root" in err and str(tmp_path / "file") in err
    units.check_folder(tmp_path / "new" / "deeper", "--out-root")
    assert not (tmp_path / "new").exists()  # checked, not created


# ------------------------------------------------------------------ reading
def _unit(root: Path, name: str, config, metrics) -> Path:
    folder = root / name
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(config if isinstance(config, str)
                                        else json.dumps(config))
    (folder / "metrics.json").write_text(metrics if isinstance(metrics, str)
                                         else json.dumps(metrics))
    return folder


def test_read_units_names_and_leaves_out_damaged_units(tmp_path, capsys):
    good = {"row": "A", "seed": 0, "hp": {"lr": 0.1}}
    fields = {"row": str, "seed": int, "hp.lr": None}
    metrics = {"test_acc": 0.5}
    _unit(tmp_path, "a", good, metrics)
    damaged = {
        "b": (good, [1, 2]),                                  # metrics a list
        "c": (good, {"other": 1}),                            # a field missing
        "d": (good, {"test_acc": "high"}),                    # not a number
        "e": ({"row": "A", "seed": 0, "hp": {}}, metrics),    # nested field missing
        "f": ([good], metrics),                               # config a list
        "g": (good, '{"test_acc": 0.'),                       # torn JSON
    }
    for name, (config, m) in damaged.items():
        _unit(tmp_path, name, config, m)
    _unit(tmp_path, "h", {"script": "other.py"}, {})          # another script's unit
    found = units.read_units(tmp_path, fields, {"test_acc": units.NUMBER},
                             keep=lambda c: c.get("script") != "other.py")
    assert found == [(good, metrics)]
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == len(damaged), err
    assert all(line.startswith("warning: ") and "left out" in line for line in err)
    by_unit = {Path(line.split()[1].rstrip(":")).parent.name: line for line in err}
    assert set(by_unit) == set(damaged)
    assert "not a JSON object" in by_unit["b"] and "metrics.json" in by_unit["b"]
    assert "'test_acc'" in by_unit["c"] and "'test_acc'" in by_unit["d"]
    assert "'hp.lr'" in by_unit["e"] and "config.json" in by_unit["e"]
    assert "config.json" in by_unit["f"] and "not valid JSON" in by_unit["g"]


# ------------------------------------------------------------------ workers
def test_the_first_failure_cancels_the_queued_calls(tmp_path):
    """One call fails at once, eight others take a second each: with two workers
    the failure is raised before the queue has run (on today's main the pool ran
    every queued call first)."""
    markers = [tmp_path / f"done{i}" for i in range(8)]
    calls = [(["false"],)] + [(["sh", "-c", f"sleep 1 && touch {m}"],) for m in markers]
    start = time.perf_counter()
    with pytest.raises(subprocess.CalledProcessError):
        units.run_in_workers(_checked_run, calls, jobs=2)
    ran = sum(m.exists() for m in markers)
    assert ran <= 4, f"{ran} of 8 queued calls ran after the failure"
    assert time.perf_counter() - start < 30


def _checked_run(argv):
    return subprocess.run(argv, check=True)


# ------------------------------------------------------------------ the cache
def _source(root: Path, name: str, content: bytes) -> Path:
    raw = root / name / "raw"
    raw.mkdir(parents=True)
    (raw / "data.txt").write_bytes(content)
    return root / name


def test_the_dataset_cache_is_keyed_on_the_source(tmp_path):
    cache = tmp_path / "cache"
    a = _source(tmp_path / "a", "Set", b"first")
    b = _source(tmp_path / "b", "Set", b"second")
    same = _source(tmp_path / "c", "Set", b"first")
    with units.dataset_copy(a, cache, "Set") as root_a:
        (root_a / "Set" / "processed").mkdir()  # what a PyG dataset writes there
    with units.dataset_copy(b, cache, "Set") as root_b:
        assert (root_b / "Set" / "raw" / "data.txt").read_bytes() == b"second"
    assert root_a != root_b
    assert (root_a / "Set" / "raw" / "data.txt").read_bytes() == b"first"
    with units.dataset_copy(same, cache, "Set") as root_same:
        assert root_same == root_a and (root_a / "Set" / "processed").is_dir()
    # The source changed in place: a fresh copy, the old one untouched.
    (a / "raw" / "data.txt").write_bytes(b"third")
    with units.dataset_copy(a, cache, "Set") as root_changed:
        assert (root_changed / "Set" / "raw" / "data.txt").read_bytes() == b"third"
    assert root_changed not in (root_a, root_b)
    record = json.loads((root_changed / "source.json").read_text())
    assert record["source"] == str(a.resolve()) and len(record["sha256"]) == 64
    assert not list(cache.glob(".*.partial"))


def test_a_cache_root_that_is_a_file_exits_2(tmp_path, capsys):
    (tmp_path / "cache").write_text("x")
    source = _source(tmp_path, "Set", b"x")

    def enter():
        with units.dataset_copy(source, tmp_path / "cache", "Set"):
            pass

    err = _one_line_exit_2(capsys, enter)
    assert "--cache-root" in err and "is a file" in err


# ------------------------------------------------------------------ Planetoid
CORA = Path(os.environ.get("QSV_DATA_DIR")
            or Path(__file__).resolve().parents[2] / "shared" / "data") / "Planetoid" / "Cora" / "raw"


class _Payload:
    """Unpickling it creates ``marker`` (a file a crafted pickle could write)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


@pytest.mark.skipif(not CORA.is_dir(), reason=f"no Cora files at {CORA}")
def test_planetoid_raw_files_are_read_without_running_code(tmp_path):
    from qsv_pyg.data import DataError
    from qsv_pyg.data.planetoid import check_planetoid_raw
    raw = tmp_path / "raw"
    raw.mkdir()
    for f in CORA.iterdir():
        (raw / f.name).write_bytes(f.read_bytes())
    objs = check_planetoid_raw(raw, "Cora")
    assert objs["x"].shape == (140, 1433) and objs["ally"].shape == (1708, 7)
    assert len(objs["graph"]) == 2708
    marker = tmp_path / "marker"
    good_x = (raw / "ind.cora.x").read_bytes()
    (raw / "ind.cora.x").write_bytes(pickle.dumps(_Payload(marker), protocol=2))
    with pytest.raises(DataError, match=r"ind\.cora\.x.*refusing to load global"):
        check_planetoid_raw(raw, "Cora")
    assert not marker.exists()
    (raw / "ind.cora.x").write_bytes(good_x[: len(good_x) // 2])  # torn
    with pytest.raises(DataError, match=r"ind\.cora\.x"):
        check_planetoid_raw(raw, "Cora")
    (raw / "ind.cora.x").write_bytes(pickle.dumps(np.array(["a", "b"]), protocol=2))
    with pytest.raises(DataError, match="numeric"):
        check_planetoid_raw(raw, "Cora")
    (raw / "ind.cora.x").write_bytes(good_x)
    (raw / "ind.cora.graph").write_bytes(pickle.dumps({0: "abc"}, protocol=2))
    with pytest.raises(DataError, match="neighbours of node 0"):
        check_planetoid_raw(raw, "Cora")
