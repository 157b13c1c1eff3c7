"""Reliability round 2 (issue 23), training side: items 4, 6, 12 and 13.

* 4: a checkpoint written before an option existed resumes with the option's old
  behaviour where it is known, otherwise at the value given now (accepted, not
  refused as a change) or today's default, and says which options it lacked;
* 6: a disk that fills at a later checkpoint, where torch's zip writer turns the
  failed write into a ``RuntimeError``, exits 2 with one line and keeps the
  previous checkpoint;
* 12: ``--download`` stops at a size cap (an endless server no longer fills the
  data root), and ``--no-progress`` hides the download bar;
* 13: trainers launched by ``reproduce.py`` stop when it is killed with SIGKILL
  (a real process tree, bounded by timeouts).

Servers listen on 127.0.0.1 only; every loop and wait is bounded.
"""
from __future__ import annotations

import errno
import http.server
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ for tiny_cifar

from tiny_cifar import write_tiny_cifar10  # noqa: E402

from qsv_pyg.data import DataError, download_cifar  # noqa: E402
from qsv_pyg.data import cifar  # noqa: E402
from qsv_pyg.data.download import fetch  # noqa: E402
from qsv_pyg.training import run_files  # noqa: E402
from qsv_pyg.training.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402
from qsv_pyg.training.cli import as_user_error, main  # noqa: E402
from qsv_pyg.training.config import TrainConfig  # noqa: E402
from qsv_pyg.training.parent_death import PARENT_PID_ENV, stop_with_parent  # noqa: E402
from qsv_pyg.training.resume import (config_for_resume, load_for_resume,  # noqa: E402
                                     unrecorded_fields)
from qsv_pyg.training.run_files import RunFolderError  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
SUBPROCESS_ENV = {**os.environ, "PYTHONPATH": str(REPO)}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("data")
    write_tiny_cifar10(root, 64, 32)
    return root


def train_args(data_dir: Path, out: Path, *extra: str, epochs: int = 1) -> list:
    return ["--model", "resnet20", "--data-dir", str(data_dir), "--out-dir", str(out),
            "--epochs", str(epochs), "--batch-size", "16", "--device", "cpu", "--no-progress",
            "--warmup-epochs", "0", *extra]


def one_line_error(capsys, *needles: str) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err, err
    for needle in needles:
        assert needle in lines[0], err
    return lines[0]


# ====================================================================== item 4: old checkpoints


@pytest.fixture(scope="module")
def stopped_run(data_dir, tmp_path_factory) -> Path:
    """A 1-epoch run stopped (time budget) before its first step: a cheap checkpoint."""
    out = tmp_path_factory.mktemp("stopped") / "run"
    assert main(train_args(data_dir, out, "--time-budget", "1e-9")) == 0
    return out


def older_checkpoint(src: Path, dst: Path, *without: str) -> Path:
    """``src``'s checkpoint in a new folder, its configuration lacking the fields ``without``."""
    state = load_checkpoint(src / "checkpoint.pt")
    for name in without:
        del state["config"][name]
    save_checkpoint(dst / "checkpoint.pt", state)
    return dst


def test_explicit_value_of_a_field_the_checkpoint_lacks_is_accepted(stopped_run, tmp_path,
                                                                    capsys):
    """Used to be refused as "cannot change --label-smoothing 0.1 -> 0.0"."""
    out = older_checkpoint(stopped_run, tmp_path / "run", "label_smoothing")
    assert main(["--resume", str(out), "--no-progress", "--label-smoothing", "0.0",
                 "--time-budget", "60"]) == 0, capsys.readouterr().err
    state = load_checkpoint(out / "checkpoint.pt")
    assert state["config"]["label_smoothing"] == 0.0  # now recorded
    assert json.loads((out / "config.json").read_text())["label_smoothing"] == 0.0
    assert json.loads((out / "metrics.json").read_text())["epochs"] == 1


def test_a_field_the_checkpoint_lacks_resumes_at_todays_default_and_says_so(
        stopped_run, tmp_path, caplog):
    out = older_checkpoint(stopped_run, tmp_path / "run", "label_smoothing")
    with caplog.at_level("WARNING", logger="qsv_pyg.training.resume"):
        cfg = config_for_resume(out / "checkpoint.pt", {})
    assert cfg.label_smoothing == TrainConfig().label_smoothing
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1, messages
    assert "--label-smoothing 0.1 (today's default)" in messages[0]
    assert "give --label-smoothing if the run trained with another value" in messages[0]


def test_a_field_with_known_old_behaviour_resumes_with_it(stopped_run, tmp_path, caplog):
    out = older_checkpoint(stopped_run, tmp_path / "run", "field_lr_scale")
    assert unrecorded_fields(load_checkpoint(out / "checkpoint.pt")["config"]) == ()
    with caplog.at_level("WARNING", logger="qsv_pyg.training.resume"):
        cfg = config_for_resume(out / "checkpoint.pt", {})
    assert cfg.field_lr_scale == 1.0  # the behaviour before the option (default now 20)
    assert "--field-lr-scale 1.0 (its behaviour before the option existed)" in caplog.text
    # The old behaviour is known, so changing it changes the run: refused, saying why.
    from qsv_pyg.training.config import ConfigError
    with pytest.raises(ConfigError, match=r"--field-lr-scale 1.0 -> 20.0 \(the checkpoint "
                                          "predates the option"):
        config_for_resume(out / "checkpoint.pt", {"field_lr_scale": 20.0})


def test_load_for_resume_accepts_the_value_given_for_a_missing_field(stopped_run, tmp_path):
    out = older_checkpoint(stopped_run, tmp_path / "run", "label_smoothing")
    cfg = config_for_resume(out / "checkpoint.pt", {"label_smoothing": 0.0})
    state = load_for_resume(out / "checkpoint.pt", cfg, world_size=1)
    assert state["epoch"] == 0
    # A field the checkpoint records is still checked.
    with pytest.raises(Exception, match="differs from the checkpoint's in \\['lr'\\]"):
        load_for_resume(out / "checkpoint.pt", cfg.replace(lr=0.5), world_size=1)


# ====================================================================== item 6: a later full disk


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


# ====================================================================== item 12: --download


class _Server:
    """A loopback HTTP server; ``mode`` chooses what GET answers."""

    def __init__(self, mode: str, size: int = 0, bound: int = 64 << 20):
        outer = self
        self.sent = 0

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                self.send_response(200)
                if mode == "announces-too-much":
                    self.send_header("Content-Length", str(10**12))
                elif mode == "small":
                    self.send_header("Content-Length", str(size))
                self.end_headers()
                total = size if mode == "small" else bound  # "endless", up to a bound
                chunk = b"\0" * (64 << 10)
                try:
                    while outer.sent < total:
                        n = min(len(chunk), total - outer.sent)
                        self.wfile.write(chunk[:n])
                        outer.sent += n
                except (BrokenPipeError, ConnectionResetError):
                    pass

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/cifar-10-python.tar.gz"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


def test_endless_download_stops_at_the_cap(tmp_path):
    with _Server("endless") as server:
        start = time.monotonic()
        with pytest.raises(DataError, match=r"stopped: it sent more than 1,048,576 bytes"):
            fetch(server.url, tmp_path / "a.tar.gz", "0" * 32, progress=False, timeout=10,
                  max_bytes=1 << 20)
        assert time.monotonic() - start < 60
    assert server.sent < 32 << 20  # it did not read the bound
    assert not any(tmp_path.iterdir())  # no partial file


def test_download_cifar_caps_a_repacked_archive_at_the_documented_margin(tmp_path,
                                                                         monkeypatch):
    spec = cifar._SPECS["cifar10"]
    assert spec.download_cap(spec.md5) == 170_498_071  # the official archive: its size
    assert spec.download_cap("0" * 32) == int(cifar.DOWNLOAD_SIZE_MARGIN * 170_498_071)
    monkeypatch.setattr(cifar, "DOWNLOAD_SIZE_MARGIN", 0.002)  # ~340 kB: a quick test
    with _Server("endless") as server:
        with pytest.raises(DataError, match="stopped"):
            download_cifar("cifar10", tmp_path, url=server.url, md5="0" * 32, progress=False)
    assert server.sent < 32 << 20
    assert not any(tmp_path.iterdir())


def test_download_announcing_more_than_the_official_archive_exits_2(tmp_path, capsys,
                                                                    monkeypatch):
    monkeypatch.delenv("QSV_DATA_DIR", raising=False)
    (tmp_path / "data").mkdir()
    with _Server("announces-too-much", bound=8 << 20) as server:
        assert main(train_args(tmp_path / "data", tmp_path / "run", "--download-url",
                               server.url)) == 2
    one_line_error(capsys, "announced 1,000,000,000,000 bytes",
                   "more than the 170,498,071 bytes accepted for cifar-10-python.tar.gz")
    assert not any((tmp_path / "data").iterdir())


@pytest.mark.parametrize("flag", ["--no-progress", "--progress"])
def test_no_progress_hides_the_download_bar(tmp_path, capsys, monkeypatch, flag):
    monkeypatch.delenv("QSV_DATA_DIR", raising=False)
    (tmp_path / "data").mkdir()
    with _Server("small", size=300_000) as server:
        argv = train_args(tmp_path / "data", tmp_path / "run", "--download-url", server.url)
        assert main([*argv, flag]) == 2  # not the official archive: md5 mismatch
    err = capsys.readouterr().err
    assert "checksum mismatch" in err
    assert ("%|" in err) == (flag == "--progress"), err  # tqdm's bar


# ====================================================================== item 13: parent death


FAKE_TRAINER = textwrap.dedent("""
    # Stands in for qsv-train: ties itself to its launcher as qsv-train does, then
    # "trains" in short steps; SIGTERM stops it at the next step with a "checkpoint".
    import importlib.util, os, signal, sys, time
    spec = importlib.util.spec_from_file_location("parent_death", sys.argv[1])
    parent_death = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(parent_death)
    out = sys.argv[2]
    stop = []
    signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
    how = parent_death.stop_with_parent(use_prctl=sys.argv[3] == "prctl")
    with open(os.path.join(out, "started"), "w") as f:
        f.write(f"{os.getpid()} {how}")
    for step in range(1200):  # at most a minute: nothing outlives the test for long
        if stop:
            with open(os.path.join(out, "checkpoint"), "w") as f:
                f.write(str(step))
            sys.exit(130)
        time.sleep(0.05)
    with open(os.path.join(out, "ran-out"), "w") as f:
        f.write("the launcher's death went unnoticed")
""")

RUNNER = textwrap.dedent("""
    # Stands in for reproduce.py --jobs 2: the real launcher and side-by-side runner.
    import sys
    from pathlib import Path
    from qsv_pyg.experiments import launch
    from qsv_pyg.experiments.side_by_side import run_side_by_side
    fake, module, mode, root = sys.argv[1:5]
    launch.TRAINER_COMMAND = (sys.executable, fake)
    def one(k):
        out = Path(root) / f"run{k}"
        out.mkdir()
        return launch.launch_training([module, str(out), mode], out)
    print("codes", run_side_by_side(one, [0, 1], jobs=2), flush=True)
""")


def _wait_for(predicate, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return predicate()


def _gone(pid: int) -> bool:
    """Whether ``pid`` ended (a zombie that nobody reaped counts as ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return False


@pytest.mark.skipif(sys.platform == "win32", reason="SIGKILL and fork: POSIX")
@pytest.mark.parametrize("mode", ["prctl", "thread"])
def test_sigkill_of_the_runner_stops_its_trainers(tmp_path, mode):
    if mode == "prctl" and not sys.platform.startswith("linux"):
        pytest.skip("PR_SET_PDEATHSIG is Linux only")
    fake = tmp_path / "fake_trainer.py"
    fake.write_text(FAKE_TRAINER)
    module = REPO / "qsv_pyg" / "training" / "parent_death.py"
    root = tmp_path / "runs"
    root.mkdir()
    runner = subprocess.Popen([sys.executable, "-c", RUNNER, str(fake), str(module), mode,
                               str(root)], cwd=REPO, env=SUBPROCESS_ENV,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    runs = [root / "run0", root / "run1"]
    pids = []
    try:
        assert _wait_for(lambda: runner.poll() is not None
                         or all((r / "started").exists() for r in runs), 180)
        assert runner.poll() is None, runner.communicate(timeout=30)[0]
        assert all((r / "started").exists() for r in runs), "the trainers did not start"
        time.sleep(0.2)  # both are in their step loop
        for r in runs:
            pid, how = (r / "started").read_text().split()
            assert how == mode
            pids.append(int(pid))
        runner.kill()  # SIGKILL: no handler of the runner runs
        runner.wait(timeout=30)
        assert _wait_for(lambda: all((r / "checkpoint").exists() for r in runs), 30), \
            [sorted(p.name for p in r.iterdir()) for r in runs]
        assert _wait_for(lambda: all(_gone(pid) for pid in pids), 30)
        assert not any((r / "ran-out").exists() for r in runs)
    finally:
        if runner.poll() is None:
            runner.kill()
            runner.wait(timeout=30)
        for pid in pids:  # never leave a stray process behind, whatever failed
            if not _gone(pid):
                os.kill(pid, signal.SIGKILL)


def test_qsv_train_stops_when_its_launcher_is_already_gone(tmp_path, data_dir):
    """The real trainer ties itself to the pid in its environment: a launcher that
    died before the trainer started stops it at once instead of training."""
    out = tmp_path / "run"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True, timeout=60)
    env = {**SUBPROCESS_ENV, PARENT_PID_ENV: dead.stdout.strip()}
    proc = subprocess.run([sys.executable, "-m", "qsv_pyg.training.cli",
                           *train_args(data_dir, out, epochs=50)], capture_output=True,
                          text=True, timeout=300, cwd=REPO, env=env)
    assert proc.returncode == -signal.SIGTERM, proc.stderr
    assert "the launching process" in proc.stderr and "is gone" in proc.stderr
    assert not (out / "metrics.json").exists()


def test_stop_with_parent_is_inert_without_a_launcher():
    env = {"OTHER": "1"}
    assert stop_with_parent(env) is None and env == {"OTHER": "1"}
    env = {PARENT_PID_ENV: "not a pid"}
    assert stop_with_parent(env) is None
    assert env == {}  # removed: this process's own children are not tied to its parent
