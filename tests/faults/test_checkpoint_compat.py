"""Resuming a checkpoint written before an option existed (issue 23, item 4).

The option takes its old behaviour where that is known (``--field-lr-scale``: 1.0,
and changing it is refused as a change of the run), otherwise the value given now
(accepted, not refused as a change) or today's default; a warning names the
options the checkpoint lacked. Fields the checkpoint does record are still checked.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from qsv_pyg.training.checkpoint import load_checkpoint, save_checkpoint
from qsv_pyg.training.cli import main
from qsv_pyg.training.config import TrainConfig
from qsv_pyg.training.resume import config_for_resume, load_for_resume, unrecorded_fields

from .conftest import train_args


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
