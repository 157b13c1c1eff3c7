"""Faults of the run folder (issue 14, items 1, 5, 7, 9 and 13).

Each test reproduces one hole the fault campaign found: two runs in one
``--out-dir``, a torn ``config.json``, bit rot in ``checkpoint.pt``, an
unusable out-dir found only after data loading, and stale temporary files.
"""
from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from qsv_pyg.training import run_files
from qsv_pyg.training.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from qsv_pyg.training.cli import main
from qsv_pyg.training.run_files import RunFolderError
from qsv_pyg.training.run_lock import RunLock

from tiny_cifar import write_tiny_cifar10  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("data")
    write_tiny_cifar10(root)
    return root


def args(data_dir, out, *extra, epochs=1):
    return ["--model", "resnet20", "--data-dir", str(data_dir),
            "--out-dir", str(out), "--epochs", str(epochs), "--batch-size", "16",
            "--device", "cpu", "--no-progress", "--warmup-epochs", "0", *extra]


def exit_2(argv, capsys, *needles):
    """Run the CLI, expect exit 2 and a one-line error holding every needle."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, err
    return err


# --------------------------------------------------------------------------- 1. the lock


HOLDER = textwrap.dedent("""
    import fcntl, os, sys, time
    fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.write(fd, f"{os.getpid()}\\n".encode())
    print("locked", flush=True)
    time.sleep(60)
""")


def test_second_run_into_a_live_out_dir_exits_2_naming_the_holder(data_dir, tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(out / "run.lock")],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        exit_2(args(data_dir, out), capsys, f"pid {holder.pid}", "in use by another run")
    finally:
        holder.kill()
        holder.wait()
    assert not (out / "checkpoint.pt").exists() and not (out / "log.jsonl").exists()


def test_stale_lock_of_a_dead_process_is_taken_over(data_dir, tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    out = tmp_path / "run"
    out.mkdir()
    (out / "run.lock").write_text(dead.stdout)
    assert main(args(data_dir, out)) == 0
    assert (out / "metrics.json").is_file() and not (out / "run.lock").exists()


def test_run_lock_api(tmp_path):
    with RunLock(tmp_path) as lock:
        assert (tmp_path / "run.lock").read_text().strip() == str(os.getpid())
        with pytest.raises(RunFolderError, match=f"pid {os.getpid()}") as info:
            RunLock(tmp_path).acquire()
        assert info.value.errno == errno.EBUSY
        assert lock.path == tmp_path / "run.lock"
    assert not (tmp_path / "run.lock").exists()
    RunLock(tmp_path).acquire().release()  # free again


# --------------------------------------------------------------------------- 5. atomic files


def test_config_json_survives_a_file_size_limit_on_resume(data_dir, tmp_path):
    """``ulimit -f`` during a resume used to leave config.json truncated (invalid JSON)."""
    out = tmp_path / "run"
    assert main(args(data_dir, out)) == 0
    before = (out / "config.json").read_text()
    code = ("import resource, sys; resource.setrlimit(resource.RLIMIT_FSIZE, (512, 512)); "
            "from qsv_pyg.training.cli import main; sys.exit(main(sys.argv[1:]))")
    proc = subprocess.run([sys.executable, "-c", code, "--resume", str(out), "--no-progress"],
                          capture_output=True, text=True, timeout=300, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 2, proc.stderr
    assert "ulimit -f" in proc.stderr and "Traceback" not in proc.stderr
    assert (out / "config.json").read_text() == before
    json.loads(before)


@pytest.mark.parametrize("writer", ["json", "text", "checkpoint"])
def test_failed_write_keeps_the_previous_file_and_no_temp(tmp_path, monkeypatch, writer):
    path = tmp_path / "f"
    write = {"json": lambda v: run_files.write_json(path, {"v": v}),
             "text": lambda v: run_files.write_text(path, f"v={v}"),
             "checkpoint": lambda v: save_checkpoint(path, {"v": v})}[writer]
    write(1)
    before = path.read_bytes()
    real_fsync = os.fsync

    def full_disk(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(RunFolderError, match=f"cannot write {path}: No space left") as info:
        write(2)
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert isinstance(info.value, OSError) and info.value.errno == errno.ENOSPC
    assert path.read_bytes() == before and os.listdir(tmp_path) == ["f"]


def test_failed_log_append_leaves_whole_lines(tmp_path, monkeypatch):
    log = tmp_path / "log.jsonl"
    run_files.append_jsonl(log, {"epoch": 1})
    monkeypatch.setattr(os, "fsync", lambda fd: (_ for _ in ()).throw(
        OSError(errno.ENOSPC, "No space left on device")))
    with pytest.raises(RunFolderError, match="cannot append"):
        run_files.append_jsonl(log, {"epoch": 2})
    assert log.read_text() == '{"epoch": 1}\n'


# --------------------------------------------------------------------------- 7. checksum


def test_bit_rot_in_tensor_data_is_refused(tmp_path):
    path = tmp_path / "checkpoint.pt"
    save_checkpoint(path, {"w": torch.randn(4096)})
    data = bytearray(path.read_bytes())
    start = data.index(b"data/0") + 200  # inside the tensor's bytes
    data[start:start + 64] = bytes(b ^ 0xFF for b in data[start:start + 64])
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="checksum .* does not match"):
        load_checkpoint(path)


def test_resume_from_a_rotten_checkpoint_exits_2(data_dir, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(args(data_dir, out)) == 0
    path = out / "checkpoint.pt"
    data = bytearray(path.read_bytes())
    start = len(data) // 2
    data[start:start + 64] = bytes(b ^ 0x5A for b in data[start:start + 64])
    path.write_bytes(bytes(data))
    exit_2(["--resume", str(out), "--no-progress"], capsys, str(path))


# --------------------------------------------------------------------------- 9. unusable out-dir


@pytest.fixture
def no_data(tmp_path, monkeypatch) -> Path:
    """An empty data folder: a run that reaches data loading fails with a data error."""
    monkeypatch.delenv("QSV_DATA_DIR", raising=False)
    (tmp_path / "empty").mkdir()
    return tmp_path / "empty"


def test_out_dir_that_is_a_file_is_found_before_data_loading(no_data, tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    exit_2(args(no_data, blocker), capsys, f"--out-dir {blocker} is a file")
    exit_2(args(no_data, blocker / "sub"), capsys, f"{blocker} is a file")
    assert blocker.read_text() == "not a folder"


def test_read_only_out_dir_is_found_before_data_loading(no_data, tmp_path, capsys,
                                                        monkeypatch):
    out = tmp_path / "ro"
    out.mkdir()
    real_open = os.open

    def read_only(path, *a, **k):  # chmod cannot stop root: refuse writes in `out` instead
        if Path(path).parent == out:
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real_open(path, *a, **k)

    monkeypatch.setattr(os, "open", read_only)
    exit_2(args(no_data, out), capsys, f"cannot write into --out-dir {out}",
           "Read-only file system")


def test_full_disk_is_found_before_data_loading(no_data, tmp_path, capsys, monkeypatch):
    import shutil
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage",
                        lambda p: real(p)._replace(free=1000))
    exit_2(args(no_data, tmp_path / "runs" / "run"), capsys, "free under", "needs about")
    assert not (tmp_path / "runs").exists()  # the run created both and removed them again


def test_disk_full_at_a_checkpoint_exits_2_and_resume_realigns_the_log(data_dir, tmp_path,
                                                                       capsys, monkeypatch):
    out = tmp_path / "run"
    calls = {"n": 0}
    real_save = torch.save

    def fail_second(obj, f, *a, **k):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, f, *a, **k)

    monkeypatch.setattr(torch, "save", fail_second)
    exit_2(args(data_dir, out, epochs=2), capsys, "checkpoint.pt", "No space left on device")
    monkeypatch.setattr(torch, "save", real_save)
    assert load_checkpoint(out / "checkpoint.pt")["epoch"] == 1
    assert not [p for p in os.listdir(out) if p.endswith(".tmp")]
    assert main(["--resume", str(out), "--no-progress"]) == 0
    assert [r["epoch"] for r in run_files.read_log(out / "log.jsonl")] == [1, 2]


# --------------------------------------------------------------------------- 13. stale temps


def test_stale_temp_files_are_removed_on_start_and_on_resume(data_dir, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    stale = [out / ".checkpoint.pt.0123456789ab.tmp", out / ".config.json.tmp",
             out / ".log.jsonl.ffffffffffff.tmp"]
    keep = out / ".notes.tmp"  # not a run file: left alone
    for p in stale + [keep]:
        p.write_bytes(b"half")
    assert main(args(data_dir, out)) == 0
    assert not any(p.exists() for p in stale) and keep.exists()
    stale[0].write_bytes(b"half")
    assert main(["--resume", str(out), "--no-progress"]) == 0
    assert not stale[0].exists()


# --------------------------------------------------------------------------- log helpers


def test_truncate_log_keeps_the_checkpointed_epochs(tmp_path):
    log = tmp_path / "log.jsonl"
    log.write_text('{"epoch": 1}\n{"epoch": 2}\n{"epoch": 3}\n{"epoch": 4')  # torn last line
    run_files.truncate_log(log, keep_epochs=2)
    assert log.read_text() == '{"epoch": 1}\n{"epoch": 2}\n'
    log.write_text('{"epoch": 1}\ngarbage\n{"epoch": 2}\n')  # not a prefix: rewritten
    run_files.truncate_log(log, keep_epochs=2)
    assert log.read_text() == '{"epoch": 1}\n{"epoch": 2}\n'
    run_files.truncate_log(tmp_path / "new.jsonl", keep_epochs=0)
    assert (tmp_path / "new.jsonl").read_text() == ""
