"""Fault campaign (issue 14), resuming: checks of what a run resumes on, and signals.

Items covered: 2 (resume checks the dataset, its sizes and ``steps_per_epoch``
and the saved position), 10 (a checkpoint whose model, optimiser, scheduler or
RNG state belongs to another run, or whose batch is negative, exits 2 with a
message), 6 (the signal handler stays installed until the save completes; a
second signal during the save is ignored and says so), and of 9: a checkpoint
that cannot be written leaves ``log.jsonl`` at the last checkpoint.
"""
from __future__ import annotations

import signal
import threading
from pathlib import Path

import pytest
import torch


from tiny_cifar import TINY_QSV, write_tiny_cifar10  # noqa: E402

from qsv_pyg.training.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402
from qsv_pyg.training.cli import main  # noqa: E402



@pytest.fixture(scope="module")
def data_dirs(tmp_path_factory):
    """Three copies: the reference, an identical copy elsewhere, and a smaller one."""
    base = tmp_path_factory.mktemp("data")
    write_tiny_cifar10(base / "a", 64, 32)
    write_tiny_cifar10(base / "copy", 64, 32)
    write_tiny_cifar10(base / "small", 48, 32)
    return base / "a", base / "copy", base / "small"


def train_args(data_dir: Path, out: Path, *extra: str, model=("--model", "resnet20"),
               epochs: int = 2) -> list:
    return [*model, "--data-dir", str(data_dir), "--out-dir", str(out), "--epochs", str(epochs),
            "--batch-size", "16", "--device", "cpu", "--no-progress", "--warmup-epochs", "1",
            *extra]


@pytest.fixture(scope="module")
def stopped_run(data_dirs, tmp_path_factory) -> Path:
    """A resnet20 run of 2 planned epochs that stopped (time budget) before its first step."""
    out = tmp_path_factory.mktemp("stopped") / "run"
    assert main(train_args(data_dirs[0], out, "--time-budget", "1e-9")) == 0
    state = load_checkpoint(out / "checkpoint.pt")
    assert (state["epoch"], state["batch"]) == (0, 0)
    return out


def copy_run(src: Path, dst: Path, **changes) -> Path:
    """``src``'s checkpoint in a new run folder, with some of its entries replaced."""
    state = load_checkpoint(src / "checkpoint.pt")
    for key, value in changes.items():
        state[key] = value(state) if callable(value) else value
    save_checkpoint(dst / "checkpoint.pt", state)
    return dst


def refused(capsys, args, *needles) -> str:
    assert main(args) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, err
    return err


# ------------------------------------------------------------------ item 2: the data


def test_resume_on_a_copy_of_the_same_data_is_allowed(stopped_run, data_dirs, tmp_path):
    out = copy_run(stopped_run, tmp_path / "run")
    assert main(["--resume", "--out-dir", str(out), "--no-progress",
                 "--data-dir", str(data_dirs[1])]) == 0


def test_resume_on_data_of_another_size_exits_2(stopped_run, data_dirs, tmp_path, capsys):
    out = copy_run(stopped_run, tmp_path / "run")
    refused(capsys, ["--resume", "--out-dir", str(out), "--no-progress",
                     "--data-dir", str(data_dirs[2])], "64", "48")
    assert not (out / "metrics.json").exists()


def test_resume_with_another_steps_per_epoch_exits_2(stopped_run, tmp_path, capsys):
    out = copy_run(stopped_run, tmp_path / "run", steps_per_epoch=15)
    refused(capsys, ["--resume", "--out-dir", str(out), "--no-progress"], "steps")


@pytest.mark.parametrize("batch", [1000, 5, -3])
def test_resume_from_an_impossible_position_exits_2(stopped_run, tmp_path, capsys, batch):
    out = copy_run(stopped_run, tmp_path / "run", batch=batch)
    refused(capsys, ["--resume", "--out-dir", str(out), "--no-progress"], "batch", str(batch))


def test_resume_from_a_negative_epoch_exits_2(stopped_run, tmp_path, capsys):
    out = copy_run(stopped_run, tmp_path / "run", epoch=-1)
    refused(capsys, ["--resume", "--out-dir", str(out), "--no-progress"], "epoch")


# ------------------------------------------------------------------ item 10: foreign state


@pytest.fixture(scope="module")
def qsv_state(data_dirs, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("qsv") / "run"
    assert main(train_args(data_dirs[0], out, "--time-budget", "1e-9", model=TINY_QSV)) == 0
    return load_checkpoint(out / "checkpoint.pt")


FOREIGN = {
    "model": lambda qsv: qsv["model"],
    "optimizer": lambda qsv: qsv["optimizer"],
    "scheduler": lambda qsv: {"step_size": 30, "gamma": 0.1},  # another scheduler's state
    "rng": lambda qsv: [{"torch": torch.zeros(3, dtype=torch.uint8)}],
}


@pytest.mark.parametrize("part, needle", [("model", "model"), ("optimizer", "optimizer"),
                                          ("scheduler", "scheduler"), ("rng", "RNG")])
def test_resume_with_state_of_another_run_exits_2(stopped_run, qsv_state, tmp_path, capsys,
                                                  part, needle):
    out = copy_run(stopped_run, tmp_path / "run", **{part: FOREIGN[part](qsv_state)})
    refused(capsys, ["--resume", "--out-dir", str(out), "--no-progress"], needle)
    assert not (out / "metrics.json").exists()


def test_resume_with_a_scheduler_at_another_step_exits_2(stopped_run, tmp_path, capsys):
    def moved(state):
        return dict(state["scheduler"], last_epoch=state["scheduler"]["last_epoch"] + 3)

    out = copy_run(stopped_run, tmp_path / "run", scheduler=moved)
    refused(capsys, ["--resume", "--out-dir", str(out), "--no-progress"], "scheduler", "step")


# ------------------------------------------------------------------ item 6: signals


def test_second_signal_during_the_save_is_ignored(data_dirs, tmp_path, monkeypatch, capfd):
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers can only be installed from the main thread")
    from qsv_pyg.models import GraphNet

    calls = {"steps": 0, "saves_after": 0}
    aux = GraphNet.auxiliary_loss

    def step_then_signal(self, *a, **k):
        calls["steps"] += 1
        if calls["steps"] == 6:  # the first signal, inside the 6th training step
            signal.raise_signal(signal.SIGTERM)
        return aux(self, *a, **k)

    real_save = torch.save

    def save_with_signal(*a, **k):
        if calls["steps"] >= 6:  # the save that the first signal triggered
            calls["saves_after"] += 1
            signal.raise_signal(signal.SIGTERM)  # the second signal, mid-save
        return real_save(*a, **k)

    class ReachedOutsideHandler(Exception):
        pass

    def outside(signum, frame):  # stands in for the default action (ending the process)
        raise ReachedOutsideHandler(signal.Signals(signum).name)

    monkeypatch.setattr(GraphNet, "auxiliary_loss", step_then_signal)
    monkeypatch.setattr(torch, "save", save_with_signal)
    previous = signal.signal(signal.SIGTERM, outside)
    try:
        out = tmp_path / "run"
        assert main(train_args(data_dirs[0], out, model=TINY_QSV)) == 130
        assert signal.getsignal(signal.SIGTERM) is outside  # restored afterwards
    finally:
        signal.signal(signal.SIGTERM, previous)
    err = capfd.readouterr().err  # the handler writes to the file descriptor
    assert calls["saves_after"] >= 1
    assert "interrupted: saved" in err and "ignored" in err, err
    monkeypatch.undo()
    state = load_checkpoint(out / "checkpoint.pt")
    assert (state["epoch"], state["batch"]) == (1, 2)  # the interrupt's save completed


# ------------------------------------------------------------------ item 9: a save that fails


def test_failed_checkpoint_leaves_the_log_at_the_last_checkpoint(data_dirs, tmp_path,
                                                                 monkeypatch, capsys):
    import errno
    import json

    real_save = torch.save
    saves = {"n": 0}

    def full_disk_on_second_save(*a, **k):
        saves["n"] += 1
        if saves["n"] == 2:  # the checkpoint at the end of epoch 2
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(*a, **k)

    monkeypatch.setattr(torch, "save", full_disk_on_second_save)
    out = tmp_path / "run"
    refused(capsys, train_args(data_dirs[0], out, epochs=3), "No space left on device")
    monkeypatch.undo()
    state = load_checkpoint(out / "checkpoint.pt")
    assert (state["epoch"], state["batch"]) == (1, 0)
    log = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert [line["epoch"] for line in log] == [1]  # epoch 2's line was cut back
    assert main(["--resume", "--out-dir", str(out), "--no-progress"]) == 0
    log = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert [line["epoch"] for line in log] == [1, 2, 3]
