"""Trainers stop when their launcher dies (issue 23, item 13).

Trainers launched by ``reproduce.py`` are tied to it (``PR_SET_PDEATHSIG`` on
Linux, else a watching thread): a SIGKILL of the launcher stops them at their
next step with a checkpoint (a real process tree, every wait bounded); a real
``qsv-train`` whose launcher is already gone stops at once; without a launcher
the tie is inert.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from qsv_pyg.training.parent_death import PARENT_PID_ENV, stop_with_parent

from .conftest import REPO, SUBPROCESS_ENV, train_args


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
