"""Fault campaign (issue 14), command line: user errors exit 2 with one line.

Items covered: 3 (``reproduce.py --train-args`` may not override a row's model
or a flag the table controls), 4 (QSV flags the quaternion source ignores are
refused), 9/11 (bad values and unusable out-dirs exit 2 with one line, not a
traceback; ``--debug`` shows the traceback), 15 (``--download-url``).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest


from tiny_cifar import TINY_QSV, write_tiny_cifar10  # noqa: E402

from qsv_pyg.experiments.cli import main as reproduce_main  # noqa: E402
from qsv_pyg.training.cli import main  # noqa: E402
from qsv_pyg.training.config import resume_overridable  # noqa: E402

# The tiny QSV model without repulsion_k: quat_source="features" has no field to repel.
assert TINY_QSV[-1].startswith("repulsion_k=")
SMALL_QSV = TINY_QSV[:-2]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("data")
    write_tiny_cifar10(root, 32, 16)
    return root


def train_args(data_dir: Path, out: Path, *extra: str, model=("--model", "resnet20")) -> list:
    return [*model, "--data-dir", str(data_dir), "--out-dir", str(out), "--epochs", "1",
            "--batch-size", "16", "--device", "cpu", "--no-progress", *extra]


def one_line_error(capsys, *needles: str) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in lines[0], err
    return lines[0]


# ------------------------------------------------------------------ item 3: reproduce.py


@pytest.mark.parametrize("flags, named", [
    ("--model resnet20", "--model"),
    ("--model=attention-gat --warmup-epochs 0", "--model"),
    ("--quat-source features", "--quat-source"),
    ("--no-field-per-head", "--field-per-head"),
    ("--config paper-resnet20", "--config"),
])
def test_reproduce_refuses_train_args_the_table_controls(data_dir, tmp_path, capsys, flags,
                                                         named):
    argv = ["--table", "controls", "--rows", "qsv", "--data-dir", str(data_dir), "--out-root",
            str(tmp_path), "--budget-minutes", "0.01", "--epochs", "1", "--batch-size", "8",
            "--device", "cpu", "--no-progress", "--launcher", "in-process",
            "--model-overrides", json.dumps({"shell_sizes": [16, 4], "widths": [8, 8],
                                             "heads": 2, "k_cross": 4, "k_inner": 3,
                                             "within_rounds": 1}),
            f"--train-args={flags}"]
    assert reproduce_main(argv) == 2
    err = capsys.readouterr().err
    assert "may not contain" in err and named in err, err
    assert not (tmp_path / "controls").exists()  # nothing was trained


# ------------------------------------------------------------------ item 4: ignored QSV flags


@pytest.mark.parametrize("extra, named", [
    (["--quat-source", "features", "--frozen-field"], "--frozen-field"),
    (["--quat-source", "features", "--no-field-per-head"], "--field-per-head"),
    (["--quat-source", "features", "--repulsion-weight", "0.1"], "--repulsion-weight"),
])
def test_qsv_flags_the_quaternion_source_ignores_are_refused(data_dir, tmp_path, capsys, extra,
                                                             named):
    out = tmp_path / "run"
    assert main(train_args(data_dir, out, *extra, model=SMALL_QSV)) == 2
    one_line_error(capsys, named, "features")
    assert not out.exists()


def test_quat_source_features_alone_still_trains(data_dir, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(train_args(data_dir, out, "--quat-source", "features", model=SMALL_QSV)) == 0
    assert json.loads((out / "metrics.json").read_text())["model"] == "qsv"


# ------------------------------------------------------------------ item 11: bad values


@pytest.mark.parametrize("extra, needle", [
    (["--model-arg", "heads=0"], "heads"),
    (["--model-arg", "mlp_ratio=Infinity"], "mlp_ratio"),
    (["--model-arg", "mlp_ratio=NaN"], "mlp_ratio"),
    (["--seed", "99999999999999999999"], "--seed"),
    (["--model-arg", "widths=[16,\"x\"]"], "widths"),
])
def test_bad_values_exit_2_with_one_line(data_dir, tmp_path, capsys, extra, needle):
    out = tmp_path / "run"
    assert main(train_args(data_dir, out, *extra, model=SMALL_QSV)) == 2
    one_line_error(capsys, needle)


# ------------------------------------------------------------------ item 9: environment errors


def test_out_dir_under_a_file_exits_2_and_debug_shows_the_traceback(data_dir, tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    out = blocker / "run"
    assert main(train_args(data_dir, out)) == 2
    one_line_error(capsys, str(blocker))
    assert main(train_args(data_dir, out, "--debug")) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and err.rstrip().splitlines()[-1].startswith("error: ")


def test_out_dir_that_is_a_file_exits_2(data_dir, tmp_path, capsys):
    out = tmp_path / "file"
    out.write_text("not a folder")
    assert main(train_args(data_dir, out)) == 2
    one_line_error(capsys, str(out))
    assert out.read_text() == "not a folder"


def test_unreadable_config_on_resume_exits_2(tmp_path, capsys):
    (tmp_path / "checkpoint.pt").write_bytes(b"PK\x03\x04 not really a zip")
    assert main(["--resume", "--out-dir", str(tmp_path), "--no-progress"]) == 2
    one_line_error(capsys, "checkpoint")


# ------------------------------------------------------------------ item 15: --download-url


def test_download_url_is_a_flag_and_a_resume_override(data_dir, tmp_path, capsys):
    out = tmp_path / "run"
    url = "file:///nowhere/cifar-10-python.tar.gz"
    assert main(train_args(data_dir, out, "--download-url", url)) == 0
    saved = json.loads((out / "config.json").read_text())
    assert saved["download_url"] == url
    assert "download_url" in resume_overridable()
    # The data is already on disk: nothing is fetched, and a resume may name another copy.
    assert main(["--resume", "--out-dir", str(out), "--no-progress",
                 "--download-url", "https://example.invalid/c.tar.gz"]) == 0
