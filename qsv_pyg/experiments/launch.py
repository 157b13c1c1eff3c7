"""Launch one ``qsv-train`` run, in a fresh interpreter or in this process.

Runs are launched in a subprocess (``python -m qsv_pyg.training.cli``) by
default: every run then starts from a fresh interpreter (no model, data or
allocator state leaks from one run into the next, a crash or out-of-memory kill
stays in its run, and Ctrl-C reaches the trainer, which checkpoints). A
subprocess stops too when this process dies, even by SIGKILL
(:mod:`~qsv_pyg.training.parent_death`): it saves a checkpoint at its next step
and ends, releasing its run folder, instead of training on unattended. The
``in-process`` launcher calls :func:`qsv_pyg.training.cli.main` directly; it
saves the interpreter start-up (a few seconds per run) and suits tiny runs and
tests.
"""
from __future__ import annotations

import contextlib
import os
import shlex
import subprocess
import sys
import traceback
from datetime import datetime
from pathlib import Path
from typing import Sequence, Tuple

from qsv_pyg.training import cli as train_cli
from qsv_pyg.training.parent_death import child_env

__all__ = ["LAUNCHERS", "OUTPUT_NAME", "TRAINER_COMMAND", "launch_training", "tail"]

#: Everything a run printed, appended launch after launch, in its run folder.
OUTPUT_NAME = "output.txt"
LAUNCHERS = ("subprocess", "in-process")
#: What the subprocess launcher runs, followed by the ``qsv-train`` arguments (a
#: test may point it at a stand-in that calls
#: :func:`~qsv_pyg.training.parent_death.stop_with_parent` as ``qsv-train`` does).
TRAINER_COMMAND: Tuple[str, ...] = (sys.executable, "-m", "qsv_pyg.training.cli")


def launch_training(argv: Sequence[str], out_dir: Path, launcher: str = "subprocess") -> int:
    """Run ``qsv-train argv`` with its output appended to ``out_dir/output.txt``.

    Args:
        argv: ``qsv-train`` arguments.
        out_dir: the run folder (created).
        launcher: ``"subprocess"`` or ``"in-process"`` (see the module docstring).

    Returns:
        The trainer's exit code (0 done, 1 failed, 2 usage error, 130 interrupted).
    """
    if launcher not in LAUNCHERS:
        raise ValueError(f"launcher must be one of {', '.join(LAUNCHERS)}; got {launcher!r}")
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / OUTPUT_NAME, "a", encoding="utf-8") as log:
        log.write(f"# {datetime.now():%Y-%m-%d %H:%M:%S} qsv-train {shlex.join(argv)}\n")
        log.flush()
        if launcher == "subprocess":
            return _run_subprocess(argv, log)
        return _run_in_process(argv, log)


def _run_subprocess(argv: Sequence[str], log) -> int:
    # The child stops (checkpoint at its next step) if this process dies, even by
    # SIGKILL: it would otherwise train on, holding its run folder's lock.
    env = child_env(dict(os.environ, PYTHONUNBUFFERED="1"))
    # The child imports this very checkout even when the package is not installed.
    source_root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (source_root, env.get("PYTHONPATH")) if p)
    proc = subprocess.Popen([*TRAINER_COMMAND, *argv],
                            stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        return proc.wait()
    except KeyboardInterrupt:
        # The child got the same Ctrl-C and is writing its checkpoint: let it finish.
        try:
            proc.wait(timeout=300)
        except (KeyboardInterrupt, subprocess.TimeoutExpired):
            proc.kill()
            proc.wait()
        return 130


def _run_in_process(argv: Sequence[str], log) -> int:
    with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        try:
            return train_cli.main(list(argv))
        except KeyboardInterrupt:
            return 130
        except Exception:  # a crash of one run must not take the table down
            traceback.print_exc()
            return 1


def tail(path: Path, lines: int = 12) -> str:
    """The last ``lines`` lines of a text file (``""`` when it cannot be read)."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])
