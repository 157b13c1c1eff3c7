"""A disk that fills at a later checkpoint (issue 23, item 6).

torch's zip writer turns the failed write into a ``RuntimeError`` ("enforce fail at
inline_container.cc"); the trainer maps it back to the OS error, exits 2 with one
line naming the file, and keeps the previous checkpoint, from which the run resumes.
Also the real error under a file-size limit (``ulimit -f``, in a subprocess).
"""
from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from qsv_pyg.training import run_files
from qsv_pyg.training.checkpoint import load_checkpoint
from qsv_pyg.training.cli import as_user_error, main
from qsv_pyg.training.run_files import RunFolderError

from .conftest import REPO, SUBPROCESS_ENV, one_line_error, train_args


class FillingDisk:
    """A file on a disk with ``room`` bytes left: then every write fails with ENOSPC."""

    def __init__(self, f, room: int):
        self._f, self._room = f, room

    def write(self, data) -> int:
        if len(data) > self._room:
            raise OSError(errno.ENOSPC, "No space left on device")
        self._room -= len(data)
        return self._f.write(data)

    def __getattr__(self, name):
        return getattr(self._f, name)


def test_disk_filling_at_a_later_checkpoint_exits_2_with_one_line(data_dir, tmp_path,
                                                                  monkeypatch, capsys):
    """torch's zip writer used to turn ENOSPC into ``RuntimeError: [enforce fail at
    inline_container.cc]``: a traceback and exit 1."""
    real_save = torch.save
    saves = {"n": 0}

    def save_on_a_filling_disk(obj, f, *a, **k):
        saves["n"] += 1
        if saves["n"] == 2:  # the checkpoint of epoch 2: 4 KiB left on the disk
            f = FillingDisk(f, 4096)
        return real_save(obj, f, *a, **k)

    monkeypatch.setattr(torch, "save", save_on_a_filling_disk)
    out = tmp_path / "run"
    assert main(train_args(data_dir, out, epochs=3)) == 2
    line = one_line_error(capsys, f"cannot write {out / 'checkpoint.pt'}",
                          "No space left on device")
    assert "inline_container" not in line
    monkeypatch.undo()
    state = load_checkpoint(out / "checkpoint.pt")  # the old checkpoint survives
    assert (state["epoch"], state["batch"]) == (1, 0)
    assert not [p for p in os.listdir(out) if p.endswith(".tmp")]
    assert [r["epoch"] for r in run_files.read_log(out / "log.jsonl")] == [1]
    assert main(["--resume", str(out), "--no-progress"]) == 0
    assert [r["epoch"] for r in run_files.read_log(out / "log.jsonl")] == [1, 2, 3]


def test_zip_writer_failure_under_a_file_size_limit_names_the_file(tmp_path):
    """The real RuntimeError of torch.save under ``ulimit -f`` (no fake file)."""
    code = textwrap.dedent("""
        import resource, sys, torch
        resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))
        from qsv_pyg.training.checkpoint import save_checkpoint
        from qsv_pyg.training.run_files import RunFolderError
        try:
            save_checkpoint(sys.argv[1], {"w": torch.zeros(100_000)})
        except RunFolderError as err:
            print(err)
    """)
    path = tmp_path / "checkpoint.pt"
    proc = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True,
                          text=True, timeout=120, cwd=REPO, env=SUBPROCESS_ENV)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stdout.strip() == (f"cannot write {path}: File too large (the file-size "
                                   "limit of this process, ulimit -f)"), proc.stdout
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("message", [
    "[enforce fail at inline_container.cc:672] . unexpected pos 768 vs 662",
    "[enforce fail at inline_container.cc:432] . PytorchStreamWriter failed writing file "
    "data/0: file write failed",
])
def test_zip_writer_errors_are_user_errors(message):
    err = RuntimeError(message)
    mapped = as_user_error(err)
    assert isinstance(mapped, RunFolderError) and "write failed" in str(mapped)
    ctx = RuntimeError(message)
    ctx.__context__ = OSError(errno.ENOSPC, "No space left on device")
    mapped = run_files.as_write_error(ctx, "/x/checkpoint.pt")
    assert str(mapped) == "cannot write /x/checkpoint.pt: No space left on device"
    assert mapped.errno == errno.ENOSPC
    assert as_user_error(RuntimeError("some bug")) is None  # a bug keeps its traceback
