"""Issue 28 (items 6, 8, 14 and the pinned install) and issue 32 (the install on a
machine that already has a torch).

* The install: ``.ci/constraints.txt`` pins every package exactly; ``.ci/deps.py``
  decides what ``.ci/install`` installs: a supported torch (>= 2.11, CUDA or CPU) is
  kept and never replaced, only a missing one becomes the pinned CPU wheel (first
  and alone); next to a CUDA torch (or with ``QSV_PYG_EXTRAS=0``) torch-scatter and
  torch-cluster are not compiled; with everything present pip is not run.
* Item 6: a truncated cached C++ kernel no longer kills the process with SIGBUS:
  the library is checked against the size and SHA-256 its build recorded, and
  linked again (or, when that fails, the PyTorch ops are used, with one warning).
* Item 8: ``reproduce.py --overwrite`` does not delete a run folder whose
  ``run.lock`` a live process holds (exit 2, one line naming the pid); a dead
  holder's folder is deleted and retrained.
* Item 14: an epoch of 10**30 in ``log.jsonl`` no longer crashes
  ``reproduce.py --report-only``; the record is named (file and field) and left
  out of the β probe.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import types
import warnings
from pathlib import Path

import pytest
import torch.utils.cpp_extension as cpp_extension


from tiny_cifar import write_tiny_cifar10  # noqa: E402

import qsv_pyg.nn._cpu_ext as cpu_ext  # noqa: E402
from qsv_pyg.experiments import ABLATIONS, runner  # noqa: E402
from qsv_pyg.experiments.cli import main as reproduce_main  # noqa: E402
from qsv_pyg.experiments.report import collect  # noqa: E402
from qsv_pyg.experiments.runner import ExperimentError, run_dir  # noqa: E402
from qsv_pyg.training.run_lock import RunLock, live_holder  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
CI = REPO / ".ci"


def load_deps():
    spec = importlib.util.spec_from_file_location("ci_deps", CI / "deps.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


deps = load_deps()
PINS = deps.read_pins()
# The GPU machine of issue 32, as it is: a CUDA torch, its Triton, PyG, no extras.
GPU_IMAGE = {"torch": "2.11.0+cu130", "triton": "3.6.0", "torch-geometric": "2.8.0.post1",
             "numpy": "2.1.2", "tqdm": "4.67.1", "matplotlib": "3.10.1", "geoopt": "0.5.1",
             "pytest": "8.4.2"}


# =================================================================== the pinned install


def test_every_direct_dependency_is_pinned_exactly_and_torch_stays_2_13_0():
    lines = [ln for ln in (CI / "constraints.txt").read_text().splitlines()
             if ln.strip() and not ln.startswith("#")]
    assert lines and all(re.fullmatch(r"[a-z0-9][a-z0-9-]*==[0-9][^\s]*", ln) for ln in lines)
    for name in deps.direct(linux=True):
        assert name in PINS, name
    assert PINS["torch"] == "2.13.0"
    # What torch, PyG, pytest and matplotlib pull in is pinned too, not left to float.
    for name in ("sympy", "setuptools", "aiohttp", "requests", "pluggy", "packaging", "pillow"):
        assert name in PINS, name


def test_every_pip_call_of_the_install_uses_the_pins():
    install = (CI / "install").read_text()
    code = [ln for ln in install.splitlines() if not ln.lstrip().startswith("#")]
    pip_lines = [ln for ln in code if "pip install" in ln]
    # The only direct pip call installs the checkout itself, offline and without deps.
    assert len(pip_lines) == 1 and "--no-deps" in pip_lines[0] and "--no-index" in pip_lines[0]
    assert any("deps.py install" in ln for ln in code)
    readme = (REPO / "README.md").read_text()
    assert "bash .ci/install" in readme and ".ci/constraints.txt" in readme
    assert "bash .ci/update-pins" in readme


def test_a_fresh_machine_gets_torch_first_alone_then_the_pins():
    p = deps.plan({}, cuda=False, pins=PINS, linux=True)
    assert p.steps[0] == [f"torch=={PINS['torch']}"]  # never a bare `torch`
    rest = p.steps[1]
    assert sorted(rest) == sorted(f"{n}=={PINS[n]}" for n in
                                  ("numpy", "tqdm", "matplotlib", "geoopt", "pytest",
                                   "torch-geometric", "triton"))
    assert p.steps[2:] == [["--no-build-isolation", f"torch-scatter=={PINS['torch-scatter']}"],
                           ["--no-build-isolation", f"torch-cluster=={PINS['torch-cluster']}"]]
    assert p.constraints == PINS  # nothing kept: exactly what CI last passed with


def test_the_gpu_image_is_kept_as_it_is_and_pip_is_not_run():
    p = deps.plan(GPU_IMAGE, cuda=True, pins=PINS, linux=True)
    assert p.steps == []  # no pip: the image is offline
    assert p.extras is False
    assert p.constraints["torch"] == "2.11.0+cu130" and p.constraints["triton"] == "3.6.0"
    assert p.constraints["torch-geometric"] == "2.8.0.post1"
    notes = "\n".join(p.notes)
    assert "torch 2.11.0+cu130: kept (CUDA build" in notes
    assert "torch-scatter and torch-cluster: optional extras, not compiled" in notes
    assert "no network call" in notes


def test_a_cuda_torch_is_never_replaced_and_missing_pieces_come_from_the_pins():
    present = {"torch": "2.12.1", "torch-geometric": "2.7.0"}  # PyPI's CUDA wheel, an old PyG
    p = deps.plan(present, cuda=True, pins=PINS, linux=True)
    flat = [a for step in p.steps for a in step]
    assert not any(a.startswith("torch==") for a in flat)
    assert p.constraints["torch"] == "2.12.1"  # pip may not move it to satisfy anything
    assert f"torch-geometric=={PINS['torch-geometric']}" in flat  # below 2.8: the pin
    assert not any(a.startswith(("triton", "torch-scatter", "torch-cluster")) for a in flat)
    # Its own triton, even below 3.6, is torch's business: kept, with a note.
    p = deps.plan(dict(present, triton="3.2.0"), cuda=True, pins=PINS, linux=True)
    assert p.constraints["triton"] == "3.2.0" and "Triton kernels are unsupported" in \
        "\n".join(p.notes)


@pytest.mark.parametrize("torch_version", ["2.11.0", "2.13.0+cpu"])
def test_both_ends_of_the_supported_cpu_torch_are_kept_and_get_the_extras(torch_version):
    present = {"torch": torch_version, "triton": "3.6.0"}
    p = deps.plan(present, cuda=False, pins=PINS, linux=True)
    flat = [a for step in p.steps for a in step]
    assert not any(a.startswith("torch==") for a in flat)
    assert p.constraints["torch"] == torch_version and p.constraints["triton"] == "3.6.0"
    assert f"torch-scatter=={PINS['torch-scatter']}" in flat and "--no-build-isolation" in flat
    # Next to a CPU torch an old triton has no ties: it is moved to the pin.
    p = deps.plan(dict(present, triton="3.5.1"), cuda=False, pins=PINS, linux=True)
    assert f"triton=={PINS['triton']}" in [a for step in p.steps for a in step]


def test_extras_switch():
    cpu = {"torch": "2.13.0+cpu"}
    off = deps.plan(cpu, cuda=False, pins=PINS, extras_env="0", linux=True)
    assert off.extras is False and not any("torch-scatter" in a for s in off.steps for a in s)
    assert "QSV_PYG_EXTRAS=0" in "\n".join(off.notes)
    on = deps.plan(GPU_IMAGE, cuda=True, pins=PINS, extras_env="1", linux=True)
    assert on.steps == [["--no-build-isolation", f"torch-scatter=={PINS['torch-scatter']}"],
                        ["--no-build-isolation", f"torch-cluster=={PINS['torch-cluster']}"]]
    with pytest.raises(deps.PlanError, match="QSV_PYG_EXTRAS='yes'"):
        deps.plan(cpu, cuda=False, pins=PINS, extras_env="yes", linux=True)


def test_an_extra_built_for_another_torch_is_compiled_again_past_the_wheel_cache():
    p = deps.plan({"torch": "2.13.0+cpu", "torch-cluster": "1.6.3"}, cuda=False, pins=PINS,
                  linux=True, broken=["torch-scatter"])
    assert p.steps[-1] == ["--no-build-isolation", "--force-reinstall", "--no-deps",
                           "--no-cache-dir", f"torch-scatter=={PINS['torch-scatter']}"]
    assert "does not import" in "\n".join(p.notes)


def test_an_unsupported_torch_exits_2_with_one_line_and_nothing_planned():
    with pytest.raises(deps.PlanError, match="torch 2.10.0 is installed"):
        deps.plan({"torch": "2.10.0"}, cuda=False, pins=PINS, linux=True)
    out = subprocess.run([sys.executable, str(CI / "deps.py"), "--plan", "--pretend",
                          "torch=2.10.0+cu128", "--pretend-cuda"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.count("\n") == 1 and "never replaces an installed torch" in out.stderr


def test_plan_command_on_the_gpu_image():
    argv = [sys.executable, str(CI / "deps.py"), "--plan", "--pretend-cuda"]
    for name, version in GPU_IMAGE.items():
        argv += ["--pretend", f"{name}={version}"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, QSV_PYG_EXTRAS=""))
    assert out.returncode == 0, out.stderr
    assert "would run" not in out.stdout
    assert "[install] nothing to install: pip is not run (no network call)" in out.stdout


def test_update_pins_dry_run_tests_before_it_rewrites_and_keeps_torch(tmp_path):
    before = (CI / "constraints.txt").read_bytes()
    out = subprocess.run(["bash", str(CI / "update-pins"), "--dry-run"], capture_output=True,
                         text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    cmds = [ln[2:] for ln in out.stdout.splitlines() if ln.startswith("+ ")]
    assert "-m venv" in cmds[0]
    torch_at = next(i for i, c in enumerate(cmds) if f"torch=={PINS['torch']}" in c)
    newest = next(i for i, c in enumerate(cmds) if "--upgrade numpy" in c)
    tests = next(i for i, c in enumerate(cmds) if "-m pytest -q tests" in c)
    rewrite = next(i for i, c in enumerate(cmds) if "constraints.txt" in c and "pins" in c)
    assert torch_at < newest < tests < rewrite == len(cmds) - 1
    assert "-c " in cmds[newest]  # torch held at its pin while the rest moves
    assert (CI / "constraints.txt").read_bytes() == before


# ================================================= item 6: a truncated cached kernel


def _cached_build() -> Path:
    """This checkout's built kernel in its cache (``.ci/install`` builds it)."""
    folder = Path(cpu_ext.build_directory())
    library = folder / (folder.name + getattr(cpp_extension, "LIB_EXT", ".so"))
    if not (library.is_file() and any(folder.glob("*.o")) and (folder / "build.ninja").is_file()):
        pytest.skip(f"the C++ kernel of this checkout is not built in {folder} (bash "
                    ".ci/install builds it; without a compiler there is nothing to damage)")
    return folder


def _truncated_copy(tmp_path: Path) -> Path:
    """A copy of the built kernel folder (times kept, so ninja finds it up to date)
    whose library is cut to half its size, as a full disk leaves it."""
    source = _cached_build()
    root = tmp_path / "ext"
    folder = root / source.name
    shutil.copytree(source, folder, ignore=shutil.ignore_patterns("*.lock", "lock"))
    library = folder / (source.name + getattr(cpp_extension, "LIB_EXT", ".so"))
    os.truncate(library, library.stat().st_size // 2)
    return folder


LOAD = ("import warnings, sys\n"
        "from qsv_pyg.nn._cpu_ext import cpu_kernel\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    m = cpu_kernel()\n"
        "print('module', m is not None, 'warnings', len(w))\n"
        "for x in w: print('warning:', str(x.message).splitlines()[0])\n")


def _load_in_subprocess(root: Path, **env) -> subprocess.CompletedProcess:
    full = dict(os.environ, TORCH_EXTENSIONS_DIR=str(root), QSV_PYG_CPU_KERNEL="1",
                OMP_NUM_THREADS="1",
                PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    full.pop("QSV_PYG_KERNEL_LOCK_TIMEOUT", None)
    full.update(env)
    return subprocess.run([sys.executable, "-c", LOAD], capture_output=True, text=True,
                          timeout=300, env=full, cwd=REPO)


def test_a_truncated_cached_kernel_is_linked_again_instead_of_killing_the_process(tmp_path):
    folder = _truncated_copy(tmp_path)
    out = _load_in_subprocess(folder.parent)
    assert out.returncode == 0, f"exit {out.returncode} (-7: SIGBUS)\n{out.stderr[-2000:]}"
    assert "module True warnings 0" in out.stdout, out.stdout + out.stderr
    assert "is not the library its build wrote" in out.stderr
    record = json.loads((folder / cpu_ext.RECORD).read_text())
    library = folder / (folder.name + getattr(cpp_extension, "LIB_EXT", ".so"))
    assert record["size"] == library.stat().st_size
    # And the next process loads it without relinking.
    again = _load_in_subprocess(folder.parent)
    assert again.returncode == 0 and "module True" in again.stdout
    assert "not the library" not in again.stderr and "built in" not in again.stderr


def test_a_truncated_kernel_that_cannot_be_rebuilt_falls_back_with_one_warning(tmp_path):
    folder = _truncated_copy(tmp_path)
    out = _load_in_subprocess(folder.parent, CXX="false")  # the linker fails at once
    assert out.returncode == 0, f"exit {out.returncode} (-7: SIGBUS)\n{out.stderr[-2000:]}"
    assert "module False warnings 1" in out.stdout, out.stdout + out.stderr
    assert "could not be built" in out.stdout
    # The objects went with it: the next attempt compiles from scratch (not the same
    # failed link of a perhaps damaged object file, forever).
    assert not any(folder.glob("*.o"))


@pytest.fixture
def fresh_kernel_state(monkeypatch, tmp_path):
    monkeypatch.setattr(cpu_ext, "_STATE", {"tried": False, "module": None, "error": None})
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    monkeypatch.setenv("QSV_PYG_CPU_KERNEL", "1")
    return tmp_path / "ext"


def _fake_load(built: bytes, calls: list):
    def load(name, sources, build_directory=None, **kwargs):
        library = Path(build_directory, name + getattr(cpp_extension, "LIB_EXT", ".so"))
        calls.append(library.exists())  # what the library was when torch got to it
        if not library.exists():
            library.write_bytes(built)
        return types.SimpleNamespace(name=name)
    return load


def test_the_library_is_checked_against_its_record_before_it_is_loaded(fresh_kernel_state,
                                                                       monkeypatch):
    """Without a compiler: a library that differs from the record of its build (or has
    none) is removed before ``cpp_extension.load`` maps it; a matching one is kept."""
    calls = []
    monkeypatch.setattr(cpp_extension, "load", _fake_load(b"\x7fELF" + b"k" * 1000, calls))
    folder = Path(cpu_ext.build_directory())
    folder.mkdir(parents=True)
    library = folder / (folder.name + getattr(cpp_extension, "LIB_EXT", ".so"))
    library.write_bytes(b"\x7fELF" + b"k" * 400)  # no record: an older build, or a cut one
    assert cpu_ext.cpu_kernel() is not None
    assert calls == [False] and library.stat().st_size == 1004
    assert json.loads((folder / cpu_ext.RECORD).read_text())["size"] == 1004
    for damage, expect in ((lambda: os.truncate(library, 500), [False]),
                           (lambda: library.write_bytes(b"\x7fELF" + b"x" * 1000), [False]),
                           (lambda: None, [True])):
        damage()
        calls.clear()
        monkeypatch.setattr(cpu_ext, "_STATE", {"tried": False, "module": None, "error": None})
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert cpu_ext.cpu_kernel() is not None
        assert calls == expect


# ================================================ item 8: --overwrite and a live run

TINY = {"shell_sizes": [16, 4], "widths": [8, 8], "heads": 2, "k_cross": 4, "k_inner": 3,
        "within_rounds": 1, "repulsion_k": 3}


def _overwrite_argv(data: Path, root: Path) -> list:
    return ["--table", "ablations", "--data-dir", str(data), "--out-root", str(root),
            "--budget-minutes", "1", "--seeds", "0", "--epochs", "1", "--batch-size", "8",
            "--device", "cpu", "--no-progress", "--rows", "full", "--overwrite",
            "--model-overrides", json.dumps(TINY)]


def _old_run(root: Path) -> Path:
    """A finished run whose saved configuration differs (so --overwrite retrains it)."""
    folder = run_dir(root, "ablations", "full", 0)
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"time_budget": 99.0}))
    (folder / "metrics.json").write_text(json.dumps({"test_acc": 0.5}))
    return folder


HOLD = ("import fcntl, os, sys, time\n"
        "fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)\n"
        "fcntl.flock(fd, fcntl.LOCK_EX)\n"  # what RunLock does
        "os.ftruncate(fd, 0); os.write(fd, f'{os.getpid()}\\n'.encode())\n"
        "print('held', flush=True)\n"
        "time.sleep(120)\n")


@pytest.fixture
def fake_training(monkeypatch):
    launched = []

    def launch(argv, out_dir, launcher="subprocess"):
        launched.append(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "metrics.json").write_text(json.dumps({"test_acc": 0.6, "epochs": 1}))
        return 0
    monkeypatch.setattr(runner, "launch_training", launch)
    return launched


@pytest.mark.skipif(sys.platform == "win32", reason="holds the lock with fcntl.flock")
def test_overwrite_keeps_the_folder_of_a_live_run_and_names_its_pid(tmp_path, capsys,
                                                                    fake_training):
    write_tiny_cifar10(tmp_path / "data", 16, 8)
    folder = _old_run(tmp_path / "runs")
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(folder / "run.lock")],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        rc = reproduce_main(_overwrite_argv(tmp_path / "data", tmp_path / "runs"))
        err = capsys.readouterr().err
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert rc == 2 and len(lines) == 1, err
        assert f"pid {holder.pid}" in lines[0] and "nothing was deleted" in lines[0]
        assert (folder / "metrics.json").read_text() == json.dumps({"test_acc": 0.5})
        assert fake_training == []
    finally:
        holder.kill()
        holder.wait(timeout=30)
    # Its holder dead (the kernel dropped the flock; run.lock still names it): deleted
    # and retrained.
    assert (folder / "run.lock").read_text().strip() == str(holder.pid)
    assert live_holder(folder) is None
    assert reproduce_main(_overwrite_argv(tmp_path / "data", tmp_path / "runs")) == 0
    assert fake_training == [folder]
    assert json.loads((folder / "metrics.json").read_text())["test_acc"] == 0.6
    assert not (folder / "config.json").exists()  # the old folder went first


def test_a_run_that_takes_the_folder_after_the_check_still_keeps_it(tmp_path):
    """The deletion itself holds the run lock: a run that started since the plan was
    checked is not deleted under it."""
    folder = _old_run(tmp_path)
    with RunLock(folder):
        with pytest.raises(ExperimentError, match=rf"pid {os.getpid()}.*nothing was deleted"):
            runner._remove_run_folder(folder)
        assert (folder / "metrics.json").is_file()
    runner._remove_run_folder(folder)
    assert not folder.exists()


# ===================================================== item 14: an absurd epoch in the log

GOOD_METRICS = {"test_acc": 0.70, "best_test_acc": 0.71, "train_acc": 0.8, "steps": 1000,
                "stopped_early": True, "epochs": 3, "epochs_planned": 10, "params": 1000,
                "seconds": 60.0, "cpu": "CPU A"}


def test_an_epoch_of_ten_to_the_thirty_is_named_and_left_out_of_the_beta_probe(tmp_path,
                                                                              capsys):
    folder = run_dir(tmp_path, "ablations", "full", 0)
    folder.mkdir(parents=True)
    (folder / "metrics.json").write_text(json.dumps(GOOD_METRICS))
    (folder / "config.json").write_text(json.dumps({"time_budget": 30.0, "epochs": 10}))
    (folder / "log.jsonl").write_text(
        '{"epoch": 1, "betas": {"cross0": [1.0, 2.0]}}\n'
        '{"epoch": %d, "betas": {"cross0": [1.5, 2.5]}}\n' % 10 ** 30)
    rc = reproduce_main(["--table", "ablations", "--out-root", str(tmp_path), "--report-only",
                         "--rows", "full"])
    err = capsys.readouterr().err
    assert rc == 0 and "Traceback" not in err, err
    report = tmp_path / "ablations"
    assert (report / "beta_probe.png").stat().st_size > 0
    md = (report / "table.md").read_text()
    assert "full/seed0: log.jsonl: epoch is 1000000000000000000000000000000" in md
    assert "beyond the run's 10 planned epochs" in md
    summary = collect(ABLATIONS, tmp_path, rows=["full"])
    assert summary["rows"][0]["_betas"] == [(0, [(1, {"cross0": [1.0, 2.0]})])]
    assert summary["rows"][0]["measured"]["n"] == 1  # its accuracy still counts
