"""Shared by the fault tests that train a tiny resnet20 on CPU from the command line
(test_checkpoint_compat, test_disk_full, test_download, test_parent_death).

``data_dir`` is a module-scoped fixture: each module that asks for it gets its own
tiny CIFAR-10 copy (a module that defines its own ``data_dir`` keeps it). The plain
helpers are imported with ``from .conftest import ...``.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from tiny_cifar import write_tiny_cifar10  # tests/ is on sys.path (pytest prepends it)

REPO = Path(__file__).resolve().parents[2]
#: The environment for subprocesses that import qsv_pyg from this checkout.
SUBPROCESS_ENV = {**os.environ, "PYTHONPATH": str(REPO)}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("data")
    write_tiny_cifar10(root, 64, 32)
    return root


def train_args(data_dir: Path, out: Path, *extra: str, epochs: int = 1) -> list:
    """qsv-train arguments: resnet20, batch 16, CPU, no progress bar, no warmup."""
    return ["--model", "resnet20", "--data-dir", str(data_dir), "--out-dir", str(out),
            "--epochs", str(epochs), "--batch-size", "16", "--device", "cpu", "--no-progress",
            "--warmup-epochs", "0", *extra]


def one_line_error(capsys, *needles: str) -> str:
    """The one ``error: ...`` line on stderr (no traceback), holding every needle."""
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err, err
    for needle in needles:
        assert needle in lines[0], err
    return lines[0]
