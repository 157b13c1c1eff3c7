"""Reliability round 2 (issue 23), the C++ CPU kernel's first-use build.

Items covered: 1 (a lock left by a killed build never makes a later process
wait forever: removed when provably stale, otherwise the wait is bounded by
``QSV_PYG_KERNEL_LOCK_TIMEOUT`` or a stop request, then a warning names the
lock and the layer falls back to PyTorch), 8 (the first compile says so on
stderr, once, with its time; the cache folder's name hashes the source, its
path and the Python/torch build; a failed build's warning keeps the cause:
the compiler's last lines), 9 (the trainer builds the kernel before the first
step, so a Ctrl-C during the compile stops at a step boundary and saves).

Nothing here compiles: ``torch.utils.cpp_extension.load`` is replaced by
stand-ins, or run for real with a compiler that fails at once.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import types
import warnings
from pathlib import Path

import pytest
import torch
import torch.utils.cpp_extension as cpp_extension


from tiny_cifar import TINY_QSV, write_tiny_cifar10  # noqa: E402

import qsv_pyg.nn._cpu_ext as cpu_ext  # noqa: E402
from qsv_pyg.training.checkpoint import load_checkpoint  # noqa: E402
from qsv_pyg.training.cli import main  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
LEGACY_NAME = "qsv_pyg_csr_kernel"  # the cache folder of the code before issue 23
HANG_S = 150  # an in-process test that waits this long is a hang
try:
    import fcntl
except ImportError:  # Windows
    fcntl = None
needs_flock = pytest.mark.skipif(fcntl is None, reason="needs fcntl.flock")


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """A fresh module state, an empty extensions folder, the kernel enabled, and
    a watchdog: a wait without a limit fails the test instead of hanging it."""
    monkeypatch.setattr(cpu_ext, "_STATE", {"tried": False, "module": None, "error": None})
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    monkeypatch.setenv("QSV_PYG_CPU_KERNEL", "1")
    monkeypatch.delenv("QSV_PYG_KERNEL_LOCK_TIMEOUT", raising=False)
    if not hasattr(signal, "setitimer"):
        yield tmp_path / "ext"
        return

    def hung(signum, frame):
        raise TimeoutError(f"still waiting after {HANG_S} s: the kernel build hangs")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.setitimer(signal.ITIMER_REAL, HANG_S)
    try:
        yield tmp_path / "ext"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class FakeLoad:
    """``cpp_extension.load`` as torch does it (its lock-file baton in the build
    folder), without the compiler: "builds" by writing the library file."""

    def __init__(self, fail: BaseException = None, during=None):
        self.calls = []
        self.fail, self.during = fail, during

    def __call__(self, name, sources, build_directory=None, **kwargs):
        self.calls.append(dict(name=name, sources=sources, build_directory=build_directory,
                               **kwargs))
        folder = build_directory or os.path.join(os.environ["TORCH_EXTENSIONS_DIR"], name)
        os.makedirs(folder, exist_ok=True)
        baton = cpp_extension.FileBaton(os.path.join(folder, "lock"))
        if baton.try_acquire():
            try:
                if self.during is not None:
                    self.during()
                if self.fail is not None:
                    raise self.fail
                Path(folder, name + getattr(cpp_extension, "LIB_EXT", ".so")).write_bytes(b"")
            finally:
                baton.release()
        else:
            baton.wait()  # what torch does: no time limit
        return types.SimpleNamespace(name=name, forward=None, backward=None)


def kernel_folder(root: Path) -> Path:
    """Where the code under test builds (the legacy folder before the fix)."""
    if hasattr(cpu_ext, "build_directory"):
        return Path(cpu_ext.build_directory())
    return root / LEGACY_NAME


def stale_lock(root: Path) -> Path:
    """Torch's 0-byte ``lock``, as a killed build leaves it."""
    folder = kernel_folder(root)
    folder.mkdir(parents=True, exist_ok=True)
    lock = folder / "lock"
    lock.write_bytes(b"")
    return lock


def hold_build_lock(root: Path):
    """Act as a live process in the middle of a build: hold the folder's flock
    (and torch's lock file, as a real build would)."""
    folder = kernel_folder(root)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "lock").write_bytes(b"")
    fd = os.open(folder / getattr(cpu_ext, "OWN_LOCK", "qsv_pyg.lock"), os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.write(fd, b"pid 4242 on testhost since now\n")
    return fd


def subprocess_env(root: Path, **extra) -> dict:
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(root), QSV_PYG_CPU_KERNEL="1",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    env.pop("QSV_PYG_KERNEL_LOCK_TIMEOUT", None)
    env.update(extra)
    return env


# ======================================================== item 1: no wait without a limit


def test_stale_lock_of_a_killed_build_does_not_hang_with_torchs_own_load(fresh):
    # torch's real load and FileBaton, in a fresh process; the compiler does not
    # exist, so the build fails at once and nothing compiles. Item 8 too: the
    # warning names that cause.
    lock = stale_lock(fresh)
    ninja = cpp_extension.is_ninja_available()
    script = ("import warnings, qsv_pyg.nn._cpu_ext as c\n"
              "with warnings.catch_warnings(record=True) as w:\n"
              "    warnings.simplefilter('always')\n"
              "    print('module:', c.cpu_kernel())\n"
              "print('WARNING:', *[str(x.message) for x in w])\n")
    compiler = "/nonexistent/c++" if ninja else "/bin/false"
    try:
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                              timeout=120, env=subprocess_env(fresh, CXX=compiler))
    except subprocess.TimeoutExpired:
        pytest.fail(f"the layer waited on the stale {lock} for 120 s")
    assert done.returncode == 0, done.stderr
    assert "module: None" in done.stdout
    assert f"removed {lock}" in done.stderr
    assert not lock.exists()
    warning = done.stdout.split("WARNING:", 1)[1]
    assert "could not be built" in warning
    if ninja:  # the cause is the last line but one of ninja's output
        assert "/nonexistent/c++: not found" in warning


@needs_flock
def test_stale_lock_is_removed_and_the_build_goes_on(fresh, monkeypatch, capsys):
    load = FakeLoad()
    monkeypatch.setattr(cpp_extension, "load", load)
    lock = stale_lock(fresh)
    module = cpu_ext.cpu_kernel()
    assert module is not None and len(load.calls) == 1
    assert not lock.exists()
    assert f"removed {lock}" in capsys.readouterr().err


@needs_flock
def test_wait_for_a_live_build_is_bounded_and_names_the_lock(fresh, monkeypatch):
    load = FakeLoad()
    monkeypatch.setattr(cpp_extension, "load", load)
    monkeypatch.setenv("QSV_PYG_KERNEL_LOCK_TIMEOUT", "0.5")
    fd = hold_build_lock(fresh)
    try:
        t0 = time.monotonic()
        with pytest.warns(UserWarning) as record:
            assert cpu_ext.cpu_kernel() is None
        waited = time.monotonic() - t0
    finally:
        os.close(fd)
    assert 0.4 <= waited < 10
    message = "\n".join(str(w.message) for w in record)
    own_lock = kernel_folder(fresh) / cpu_ext.OWN_LOCK
    assert str(own_lock) in message and "delete" in message
    assert "pid 4242" in message and "QSV_PYG_KERNEL_LOCK_TIMEOUT" in message
    assert "PyTorch implementation" in message
    assert load.calls == []  # torch's load (and its unbounded wait) never reached
    assert (kernel_folder(fresh) / "lock").exists()  # a live build's lock is left alone
    assert cpu_ext.cpu_kernel() is None  # not retried in this process


@needs_flock
def test_stop_request_ends_the_wait(fresh, monkeypatch):
    # A training run under the lock: SIGTERM sets the flag, the wait ends.
    monkeypatch.setattr(cpp_extension, "load", FakeLoad())
    fd = hold_build_lock(fresh)
    t0 = time.monotonic()
    try:
        with pytest.warns(UserWarning, match="interrupted"):
            assert cpu_ext.cpu_kernel(stop=lambda: time.monotonic() - t0 > 0.3) is None
    finally:
        os.close(fd)
    assert time.monotonic() - t0 < 10  # not the 300 s default


def test_without_flock_the_wait_on_torchs_lock_is_bounded(fresh, monkeypatch):
    monkeypatch.setattr(cpp_extension, "load", FakeLoad())
    monkeypatch.setattr(cpu_ext, "fcntl", None)  # e.g. Windows
    monkeypatch.setenv("QSV_PYG_KERNEL_LOCK_TIMEOUT", "0.3")
    lock = stale_lock(fresh)
    with pytest.warns(UserWarning) as record:
        assert cpu_ext.cpu_kernel() is None
    message = "\n".join(str(w.message) for w in record)
    assert str(lock) in message and "delete" in message


@pytest.mark.parametrize("raw,expected", [("", 300.0), ("2.5", 2.5), ("0", 0.0)])
def test_lock_timeout_setting(monkeypatch, raw, expected):
    monkeypatch.setenv("QSV_PYG_KERNEL_LOCK_TIMEOUT", raw)
    assert cpu_ext.lock_timeout() == expected


@pytest.mark.parametrize("raw", ["soon", "-1", "nan"])
def test_bad_lock_timeout_warns_and_uses_the_default(monkeypatch, raw):
    monkeypatch.setenv("QSV_PYG_KERNEL_LOCK_TIMEOUT", raw)
    with pytest.warns(UserWarning, match="QSV_PYG_KERNEL_LOCK_TIMEOUT"):
        assert cpu_ext.lock_timeout() == cpu_ext.DEFAULT_TIMEOUT_S


def test_disabled_kernel_touches_nothing(fresh, monkeypatch):
    load = FakeLoad()
    monkeypatch.setattr(cpp_extension, "load", load)
    monkeypatch.setenv("QSV_PYG_CPU_KERNEL", "0")
    stale_lock(fresh)
    assert cpu_ext.cpu_kernel() is None
    assert load.calls == [] and (kernel_folder(fresh) / "lock").exists()


# ======================================================== item 8: visible, named, explained


def test_first_compile_is_announced_once_with_its_time(fresh, monkeypatch, capsys):
    monkeypatch.setattr(cpp_extension, "load", FakeLoad())
    assert cpu_ext.cpu_kernel() is not None
    assert cpu_ext.cpu_kernel() is not None
    err = capsys.readouterr().err
    assert err.count("compiling the C++ CPU kernel (first use") == 1
    assert err.count("C++ CPU kernel built in ") == 1
    # A later process finds the library: loads it without a word.
    monkeypatch.setattr(cpu_ext, "_STATE", {"tried": False, "module": None, "error": None})
    assert cpu_ext.cpu_kernel() is not None
    assert capsys.readouterr().err == ""


def test_cache_name_hashes_source_and_its_path(fresh, monkeypatch, tmp_path):
    load = FakeLoad()
    monkeypatch.setattr(cpp_extension, "load", load)
    cpu_ext.cpu_kernel()
    (call, ) = load.calls
    name = call["name"]
    assert name.startswith(LEGACY_NAME + "_") and len(name) > len(LEGACY_NAME) + 8
    assert call["build_directory"] == str(fresh / name)
    assert cpu_ext.extension_name() == name  # stable
    # Another checkout: the same source at another path gets its own folder ...
    other = tmp_path / "checkout2" / "qsv_kernel_cpu.cpp"
    other.parent.mkdir()
    shutil.copy(cpu_ext.SOURCE, other)
    monkeypatch.setattr(cpu_ext, "SOURCE", str(other))
    assert cpu_ext.extension_name() not in (name, LEGACY_NAME)
    # ... and an edited source a new one.
    before = cpu_ext.extension_name()
    other.write_text(other.read_text() + "\n// edited\n")
    assert cpu_ext.extension_name() != before


def test_cache_name_covers_the_torch_build(monkeypatch):
    name = cpu_ext.extension_name()
    monkeypatch.setattr(torch, "__version__", "0.0.0+other")
    assert cpu_ext.extension_name() != name


NINJA_FAILURE = (
    "Error building extension 'qsv_pyg_csr_kernel': [1/2] c++ -MMD -MF qsv_kernel_cpu.o.d "
    + "-isystem /very/long/include/path " * 40 + "-c qsv_kernel_cpu.cpp -o qsv_kernel_cpu.o\n"
    "FAILED: qsv_kernel_cpu.o \n"
    "c++ -MMD -MF qsv_kernel_cpu.o.d " + "-isystem /very/long/include/path " * 40 + "\n"
    "/bin/sh: 1: c++: not found\n"
    "ninja: build stopped: subcommand failed.\n")


def test_failure_warning_keeps_the_cause(fresh, monkeypatch):
    monkeypatch.setattr(cpp_extension, "load", FakeLoad(fail=RuntimeError(NINJA_FAILURE)))
    with pytest.warns(UserWarning, match="could not be built") as record:
        assert cpu_ext.cpu_kernel() is None
    message = str(record[0].message)
    assert "c++: not found" in message
    assert "ninja: build stopped: subcommand failed." in message
    assert "QSV_PYG_CPU_KERNEL=0" in message
    assert len(message) < 3000  # the command lines are cut, not the cause
    log = kernel_folder(fresh) / "build_error.log"
    assert str(log) in message
    assert log.read_text().strip() == NINJA_FAILURE.strip()  # the whole output kept


def test_interrupted_build_says_so(fresh, monkeypatch):
    failure = RuntimeError("Error building extension 'x': ninja: build stopped: interrupted "
                           "by user.")
    monkeypatch.setattr(cpp_extension, "load", FakeLoad(fail=failure))
    with pytest.warns(UserWarning, match=r"build of the C\+\+ CPU kernel was interrupted"):
        assert cpu_ext.cpu_kernel() is None


# ======================================================== item 9: Ctrl-C during the compile


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("data")
    write_tiny_cifar10(base, 64, 32)
    return base


def train_args(data_dir: Path, out: Path, model=tuple(TINY_QSV)) -> list:
    return [*model, "--data-dir", str(data_dir), "--out-dir", str(out), "--epochs", "1",
            "--batch-size", "16", "--device", "cpu", "--no-progress", "--warmup-epochs", "1"]


def sigint(times: int):
    """What a terminal Ctrl-C (pressed ``times`` times) does to the trainer."""
    def during():
        for _ in range(times):
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(20):  # the Python handler runs between bytecodes
                time.sleep(0.005)
    return during


def test_ctrl_c_during_the_first_compile_stops_at_a_boundary_and_saves(
        fresh, monkeypatch, data_dir, tmp_path, capsys):
    # Ctrl-C reaches the compiler too: ninja stops, torch raises.
    failure = RuntimeError("Error building extension 'x': ninja: build stopped: interrupted "
                           "by user.")
    load = FakeLoad(fail=failure, during=sigint(1))
    monkeypatch.setattr(cpp_extension, "load", load)
    out = tmp_path / "run"
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert main(train_args(data_dir, out)) == 130
    assert len(load.calls) == 1
    err = capsys.readouterr().err
    assert "interrupted: saved" in err, err
    state = load_checkpoint(out / "checkpoint.pt")
    assert (state["epoch"], state["batch"]) == (0, 0)  # no step after the Ctrl-C
    messages = " ".join(str(w.message) for w in record)
    assert "interrupted" in messages and "could not be built" not in messages


def test_second_ctrl_c_during_the_first_compile_still_saves(
        fresh, monkeypatch, data_dir, tmp_path, capsys):
    # The compile shows no progress for a minute, so the user presses Ctrl-C
    # again: a KeyboardInterrupt from inside the build, which used to be "in the
    # middle of a step" (nothing saved).
    load = FakeLoad(during=sigint(2))
    monkeypatch.setattr(cpp_extension, "load", load)
    out = tmp_path / "run"
    assert main(train_args(data_dir, out)) == 130
    err = capsys.readouterr().err
    assert "middle of a step" not in err and "interrupted: saved" in err, err
    state = load_checkpoint(out / "checkpoint.pt")
    assert (state["epoch"], state["batch"]) == (0, 0)
    # torch's baton was released and the module was not marked as tried.
    assert not (kernel_folder(fresh) / "lock").exists()
    assert cpu_ext._STATE["tried"] is False


def test_kernel_is_ready_before_the_first_step(fresh, monkeypatch, data_dir, tmp_path):
    load = FakeLoad()
    monkeypatch.setattr(cpp_extension, "load", load)
    seen = []
    from qsv_pyg.training import trainer
    real_epoch = trainer._train_epoch

    def epoch(*args, **kwargs):
        seen.append(len(load.calls))
        # The fake module must not run: stop right away (time budget).
        monkeypatch.setattr(cpu_ext, "_STATE", {"tried": True, "module": None, "error": None})
        return real_epoch(*args, **kwargs)

    monkeypatch.setattr(trainer, "_train_epoch", epoch)
    assert main(train_args(data_dir, tmp_path / "run")) == 0
    assert seen and seen[0] == 1


def test_models_without_qsv_layers_do_not_build_it(fresh, monkeypatch, data_dir, tmp_path):
    load = FakeLoad()
    monkeypatch.setattr(cpp_extension, "load", load)
    args = train_args(data_dir, tmp_path / "run", model=("--model", "resnet20"))
    assert main(args + ["--time-budget", "1e-9"]) == 0
    assert load.calls == []
