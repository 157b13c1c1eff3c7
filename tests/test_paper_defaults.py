"""The paper-faithful defaults (16 heads, β prior, presets) and the study's tools:
test evaluations at budget marks and a separate learning rate for the field."""
import json
import math

import pytest
import torch

from qsv_pyg.models import build_model
from qsv_pyg.models.matching import count_parameters
from qsv_pyg.training.cli import main
from qsv_pyg.training.config import (CPU_SCALE_MODEL_ARGS, PRESETS, ConfigError, TrainConfig,
                                     preset_config)
from qsv_pyg.training.checkpoint import load_checkpoint
from qsv_pyg.training.optim import build_optimizer
from qsv_pyg.training.schedule import warmup_cosine

from tiny_cifar import write_tiny_cifar10

TINY_QSV = ["--model", "qsv", "--model-arg", "shell_sizes=[16,8]", "--model-arg", "widths=[16,16]",
            "--model-arg", "heads=2", "--model-arg", "k_cross=4", "--model-arg", "k_inner=4",
            "--model-arg", "within_rounds=1", "--model-arg", "repulsion_k=4"]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    write_tiny_cifar10(root)
    return root


# ----------------------------------------------------------------------- presets
def test_presets_follow_the_paper():
    assert preset_config("paper-qsv-frozen-beta").beta_init == 5.0  # the paper's probe
    assert preset_config("paper-qsv-frozen-beta").frozen_beta is True
    assert preset_config("paper-qsv-beta-warm5").beta_init == 5.0
    assert preset_config("paper-qsv-no-beta-prior").beta_prior_weight == 0.0
    for model in ("qsv", "lattice"):
        assert preset_config(f"paper-{model}-cifar100").repulsion_k == 16
        assert preset_config(f"paper-{model}").repulsion_k is None  # model default: 8
    # Controls have no field: no QSV switch in their presets.
    assert preset_config("paper-attention-transformer-cifar100").repulsion_k is None
    # The field probe's winner (docs/results.md); --field-lr-scale 1 restores the old step.
    assert preset_config("paper-qsv").field_lr_scale == 20.0
    assert preset_config("cpu-qsv").field_lr_scale == 20.0
    assert CPU_SCALE_MODEL_ARGS["qsv"]["heads"] == 16
    assert CPU_SCALE_MODEL_ARGS["lattice"]["heads"] == 16
    assert all(name in PRESETS for name in ("cpu-qsv", "cpu-attention-transformer"))


def test_cpu_scale_models_are_matched_and_have_16_heads():
    qsv = build_model("qsv", **CPU_SCALE_MODEL_ARGS["qsv"])
    assert qsv.heads == 16 and all(w == 64 for w in qsv.widths)  # one block per head
    n = count_parameters(qsv)
    assert count_parameters(build_model("lattice", **CPU_SCALE_MODEL_ARGS["lattice"])) == n
    for control in ("attention-transformer", "attention-gat", "attention-gatv2"):
        model = build_model(control, **CPU_SCALE_MODEL_ARGS[control])
        assert model.heads == 4
        assert abs(count_parameters(model) - n) <= 0.05 * n, control


# ------------------------------------------------------------ field learning rate
def test_field_lr_scale_sets_the_sphere_group_and_survives_the_schedule():
    model = build_model("qsv", shell_sizes=(16, 8), widths=(16, 16), heads=2, k_cross=4,
                        k_inner=4, within_rounds=1, repulsion_k=4)
    opt = build_optimizer(model, lr=1e-3, weight_decay=0.05, sphere_lr_scale=5.0)
    lrs = {g["name"]: g["lr"] for g in opt.param_groups}
    assert lrs["sphere"] == pytest.approx(5e-3) and lrs["decay"] == pytest.approx(1e-3)
    sched = warmup_cosine(opt, 2, 10)
    for _ in range(5):
        opt.step()
        sched.step()
    lrs = {g["name"]: g["lr"] for g in opt.param_groups}
    assert lrs["sphere"] == pytest.approx(5 * lrs["decay"])
    with pytest.raises(ValueError, match="sphere_lr_scale"):
        build_optimizer(model, lr=1e-3, weight_decay=0.0, sphere_lr_scale=0.0)


def test_a_config_saved_before_field_lr_scale_keeps_the_old_field_rate():
    saved = TrainConfig().to_dict()
    assert saved["field_lr_scale"] == 20.0  # today's default
    del saved["field_lr_scale"]  # as in a config.json written before the option
    assert TrainConfig.from_dict(saved).field_lr_scale == 1.0
    saved["field_lr_scale"] = 5.0
    assert TrainConfig.from_dict(saved).field_lr_scale == 5.0


# ----------------------------------------------------------- evaluations at marks
def test_eval_at_minutes_needs_a_budget():
    cfg = preset_config("cpu-qsv", time_budget=None, eval_at_minutes=[5])
    with pytest.raises(ConfigError, match="eval-at-minutes needs --time-budget"):
        cfg.validate()
    with pytest.raises(ConfigError, match="positive numbers"):
        preset_config("cpu-qsv", eval_at_minutes=[-1]).validate()


def test_eval_marks_are_logged_and_not_charged_to_the_budget(
        data_dir, tmp_path, fake_process_clock):
    fake = fake_process_clock(3.0)  # every clock read "burns" 3 CPU-seconds
    out = tmp_path / "run"
    args = [*TINY_QSV, "--data-dir", str(data_dir), "--out-dir", str(out), "--epochs", "50",
            "--batch-size", "8", "--device", "cpu", "--no-progress", "--time-budget", "1",
            "--budget-clock", "process", "--anneal-to-budget", "--field-lr-scale", "2",
            "--eval-at-minutes", "0.25", "0.5", "2"]
    assert main(args) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    evals = metrics["budget_evals"]
    assert [e["minutes"] for e in evals] == [0.25, 0.5]  # the 2-minute mark is past the budget
    assert evals[0]["step"] <= evals[1]["step"] <= metrics["steps"]
    assert all(0.0 <= e["test_acc"] <= 1.0 and math.isfinite(e["test_loss"]) for e in evals)
    # Each evaluation read the clock twice (3 s each): 3 s charged per mark, and
    # the deadline moved by as much, so training kept its full minute.
    assert metrics["budget_eval_seconds"] == pytest.approx(6.0)
    assert metrics["stopped_early"] and metrics["stop_reason"] == "time_budget"
    ckpt = load_checkpoint(out / "checkpoint.pt")
    assert [e["minutes"] for e in ckpt["budget_evals"]] == [0.25, 0.5]
    lrs = {g["name"]: g["lr"] for g in ckpt["optimizer"]["param_groups"]}
    assert lrs["sphere"] == pytest.approx(2 * lrs["decay"])


def test_budget_count_and_marks_continue_across_a_resume(data_dir, tmp_path, fake_process_clock):
    fake = fake_process_clock(3.0)
    out = tmp_path / "run"
    common = ["--data-dir", str(data_dir), "--device", "cpu", "--no-progress"]
    assert main([*TINY_QSV, *common, "--out-dir", str(out), "--epochs", "50", "--batch-size",
                 "8", "--time-budget", "1", "--budget-clock", "process",
                 "--eval-at-minutes", "0.5", "1.5"]) == 0
    first = json.loads((out / "metrics.json").read_text())
    assert [e["minutes"] for e in first["budget_evals"]] == [0.5]
    assert 60.0 <= first["budget_used_s"] <= 70.0
    # A new process: its CPU clock starts again at zero, the run's count does not.
    fake["cpu"] = 0.0
    assert main(["--resume", "--out-dir", str(out), "--time-budget", "1", *common[:2]]) == 0
    second = json.loads((out / "metrics.json").read_text())
    assert [e["minutes"] for e in second["budget_evals"]] == [0.5, 1.5]
    assert 120.0 <= second["budget_used_s"] <= 135.0
    assert second["budget_eval_seconds"] == pytest.approx(6.0)
    from qsv_pyg.experiments.runner import _used_minutes
    # The runner resumes with what the checkpoint counted (saved a clock read earlier).
    assert abs(_used_minutes(out / "checkpoint.pt") - second["budget_used_s"] / 60) <= 0.1


def test_list_presets_shows_the_paper_defaults(capsys):
    assert main(["--list-presets"]) == 0
    out = capsys.readouterr().out
    assert "field_lr_scale=20.0" in out.splitlines()[0]
    models = out.splitlines()[1]
    assert "heads=16" in models and "beta_prior_centre=0.79" in models
    assert "beta_prior_weight=0.01" in models
    frozen = next(line for line in out.splitlines() if line.startswith("paper-qsv-frozen-beta:"))
    assert "frozen_beta=True" in frozen and "beta_init=5.0" in frozen
    assert "repulsion_k=16" in next(line for line in out.splitlines()
                                    if line.startswith("paper-qsv-cifar100:"))
