"""End-to-end tests of the training CLI/loop on a tiny CIFAR-10 layout (CPU only).

Every run is a few steps on 64 random training and 32 test images: the point is
the bookkeeping (files, resume exactness, interrupts, early stops, errors,
torchrun), not accuracy.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from qsv_pyg.data import DeviceLoader
from qsv_pyg.training import stopping, trainer
from qsv_pyg.training.checkpoint import load_checkpoint
from qsv_pyg.training.cli import build_parser, config_from_args, main
from qsv_pyg.training.config import (
    PRESETS,
    SHARED,
    TABLE,
    ConfigError,
    TrainConfig,
    ablation_fields,
    fields_with_role,
    preset_config,
    resume_overridable,
    to_argv,
)
from qsv_pyg.training.presets import AUTO_PRESETS, resolve_auto_preset
from qsv_pyg.utils import cpu_name

from tiny_cifar import TINY_QSV, write_tiny_cifar10  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
N_TRAIN, N_TEST, BATCH = 64, 32, 16  # 4 steps per epoch


# --------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("data")
    write_tiny_cifar10(root)
    return root


def base_args(data_dir: Path, out: Path, *extra: str, model=("--model", "resnet20"),
              epochs: int = 2) -> list:
    return [*model, "--data-dir", str(data_dir), "--out-dir", str(out), "--epochs", str(epochs),
            "--batch-size", str(BATCH), "--device", "cpu", "--no-progress", "--warmup-epochs", "1",
            "--lr", "3e-3", *extra]


def read_log(out: Path) -> list:
    return [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]


def untimed(lines: list) -> list:
    return [{k: v for k, v in line.items() if k not in trainer.TIMING_FIELDS} for line in lines]


def run_ok(args: list) -> None:
    assert main(args) == 0


@pytest.fixture(scope="module")
def straight_qsv(data_dir, tmp_path_factory) -> Path:
    """A tiny QSV run of two uninterrupted epochs, the reference for the resume tests."""
    out = tmp_path_factory.mktemp("straight") / "run"
    run_ok(base_args(data_dir, out, model=TINY_QSV))
    return out


class CallCounter:
    """Wraps a method; ``action(call_index)`` runs before every call (1-based)."""

    def __init__(self, original, action):
        self.original, self.action, self.calls = original, action, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        transform = self.action(self.calls)
        result = self.original(*args, **kwargs)
        return result if transform is None else transform(result)


def patch_aux_loss(monkeypatch, model_cls, action) -> CallCounter:
    """Make ``action`` run inside every training step (auxiliary_loss is called once per step)."""
    counter = CallCounter(model_cls.auxiliary_loss, action)
    monkeypatch.setattr(model_cls, "auxiliary_loss",
                        lambda self, *a, **k: counter(self, *a, **k))
    return counter


def graph_net_cls():
    from qsv_pyg.models import GraphNet
    return GraphNet


# --------------------------------------------------------------------------- config


def test_config_json_round_trip_and_presets(tmp_path):
    cfg = TrainConfig(model="qsv", routing="abs", frozen_beta=True, beta_prior_weight=0.1,
                      model_args={"widths": (16, 16)})
    back = TrainConfig.from_json(cfg.to_json())
    assert back.to_dict() == cfg.to_dict() and back.model_args == {"widths": [16, 16]}
    cfg.save(tmp_path / "c.json")
    assert TrainConfig.load(tmp_path / "c.json").to_dict() == cfg.to_dict()
    assert cfg.model_overrides() == {"routing": "abs", "learn_beta": False,
                                     "beta_prior_weight": 0.1, "widths": (16, 16)}
    for name in ("paper-qsv", "paper-attention-gat", "paper-attention-transformer",
                 "paper-lattice", "paper-resnet20", "paper-qsv-routing-uniform"):
        assert name in PRESETS
    for name in PRESETS:
        preset_config(name).validate()
    with pytest.raises(ConfigError, match="unknown configuration key"):
        TrainConfig.from_dict({"modle": "qsv"})


def test_preset_then_explicit_flags():
    cfg, resume = config_from_args({"config": "paper-qsv-routing-abs", "epochs": 3,
                                    "routing": "uniform"})
    assert resume is None
    assert (cfg.model, cfg.epochs, cfg.routing, cfg.preset) == ("qsv", 3, "uniform",
                                                               "paper-qsv-routing-abs")
    assert cfg.lr == PRESETS["paper-qsv-routing-abs"]["lr"]


def test_the_parser_and_the_field_lists_come_from_the_config():
    parser = build_parser()
    dests = {a.dest for a in parser._actions}
    fields = set(TrainConfig().to_dict()) - {"preset"}
    assert fields <= dests  # one flag per field, nothing restated by hand
    assert dests - fields == {"help", "config", "list_presets", "resume", "debug"}
    # The roles give the lists that used to be kept by hand.
    assert resume_overridable() == {"out_dir", "data_dir", "download", "download_url", "device",
                                    "time_budget", "threads", "progress", "compile", "tf32"}
    assert set(fields_with_role(SHARED)) == {
        "dataset", "epochs", "batch_size", "lr", "weight_decay", "warmup_epochs",
        "min_lr_ratio", "label_smoothing", "subset", "test_subset", "time_budget",
        "budget_clock", "threads"}
    assert set(ablation_fields()) <= set(fields_with_role(TABLE))
    assert ablation_fields()["frozen_beta"] == "learn_beta"
    # Flags round-trip: the runner builds configurations directly and launches them as argv.
    cfg = TrainConfig(model="qsv", routing="abs", frozen_beta=True, beta_prior_weight=0.1,
                      model_args={"widths": [16, 16]}, lr=3e-3, eval_at_minutes=[1.0, 2.5],
                      time_budget=5.0, progress=False)
    values = {k: v for k, v in cfg.to_dict().items() if k != "preset"}
    again, _ = config_from_args(vars(parser.parse_args(to_argv(values))))
    assert again.to_dict() == cfg.to_dict()


def test_auto_preset_picks_the_scale_from_the_device(data_dir, tmp_path, capsys):
    assert set(AUTO_PRESETS) >= {"auto-qsv", "auto-resnet20"}
    name, why = resolve_auto_preset("auto-qsv", "cpu")
    assert name == "cpu-qsv" and "--device cpu" in why and "paper-qsv" in why
    name, why = resolve_auto_preset("auto-qsv", "cuda")
    assert name == "paper-qsv" and "300 epochs" in why
    cfg, _ = config_from_args({"config": "auto-resnet20", "device": "cpu"})
    assert cfg.preset == "cpu-resnet20"
    assert cfg.time_budget == PRESETS["cpu-resnet20"]["time_budget"]
    out = tmp_path / "run"
    run_ok(["--config", "auto-resnet20", "--device", "cpu", "--data-dir", str(data_dir),
            "--out-dir", str(out), "--subset", "16", "--test-subset", "16", "--batch-size", "16",
            "--time-budget", "1e-7", "--no-progress"])
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("auto-resnet20: --device cpu, so cpu-resnet20"), first


# --------------------------------------------------------------------------- end to end


def test_one_epoch_resnet20_writes_all_files(data_dir, tmp_path):
    out = tmp_path / "run"
    run_ok(base_args(data_dir, out, "--test-subset", "20", epochs=1))
    metrics = json.loads((out / "metrics.json").read_text())
    assert 0.0 <= metrics["test_acc"] <= 1.0 and 0.0 <= metrics["train_acc"] <= 1.0
    assert metrics["best_test_acc"] == metrics["test_acc"]
    assert metrics["epochs"] == 1 and metrics["steps"] == N_TRAIN // BATCH
    assert metrics["params"] == 269_722 and metrics["model"] == "resnet20"
    assert metrics["dataset"] == "cifar10" and metrics["test_images"] == 20
    assert metrics["optimizer_backend"] in ("riemannian", "projected")
    assert metrics["stopped_early"] is False and metrics["seconds"] > 0
    # The machine a budget is spent on: recorded, so reports can compare like with like.
    assert metrics["cpu"] == cpu_name() and metrics["cpu"] and metrics["cpu_count"] >= 1
    (line,) = read_log(out)
    assert line["epoch"] == 1 and line["step"] == 4 and line["betas"] == {}
    for key in ("train_loss", "train_acc", "test_loss", "test_acc", "lr", "seconds",
                "images_per_s"):
        assert isinstance(line[key], float), key
    assert line["test_acc"] == metrics["test_acc"]
    cfg = TrainConfig.load(out / "config.json")
    assert (cfg.model, cfg.epochs, cfg.batch_size, cfg.out_dir) == ("resnet20", 1, BATCH, str(out))
    state = load_checkpoint(out / "checkpoint.pt")
    assert (state["epoch"], state["batch"]) == (1, 0)
    assert TrainConfig.from_dict(state["config"]).to_dict() == cfg.to_dict()
    # Resuming a finished run only rewrites the metrics.
    assert main(["--resume", str(out), "--no-progress"]) == 0
    assert json.loads((out / "metrics.json").read_text())["test_acc"] == metrics["test_acc"]
    assert len(read_log(out)) == 1


def test_graph_model_logs_betas(straight_qsv):
    lines = read_log(straight_qsv)
    assert [line["epoch"] for line in lines] == [1, 2]
    betas = lines[-1]["betas"]
    assert betas and all(isinstance(v, list) and len(v) == 2 for v in betas.values())
    metrics = json.loads((straight_qsv / "metrics.json").read_text())
    assert metrics["model"] == "qsv" and metrics["betas"] == betas


def test_resume_resnet20_matches_straight_run(data_dir, tmp_path, monkeypatch):
    straight = tmp_path / "straight"
    run_ok(base_args(data_dir, straight))
    # Stop after epoch 1 through the time budget (a fake clock), then resume.
    steps = N_TRAIN // BATCH
    clock = iter([0.0] * (steps + 1) + [1e9] * 1000)  # t_start + 4 step checks
    monkeypatch.setattr(stopping, "wall_clock", lambda: next(clock))
    resumed = tmp_path / "resumed"
    run_ok(base_args(data_dir, resumed, "--time-budget", "1"))
    state = load_checkpoint(resumed / "checkpoint.pt")
    assert (state["epoch"], state["batch"]) == (1, 0)
    monkeypatch.undo()
    run_ok(["--resume", "--out-dir", str(resumed), "--no-progress"])
    assert untimed(read_log(resumed)) == untimed(read_log(straight))
    a = json.loads((straight / "metrics.json").read_text())
    b = json.loads((resumed / "metrics.json").read_text())
    for key in ("test_acc", "test_loss", "train_acc", "train_loss", "best_test_acc", "steps"):
        assert a[key] == b[key], key


def test_time_budget_mid_epoch_then_resume_is_exact(data_dir, tmp_path, monkeypatch,
                                                   straight_qsv):
    out = tmp_path / "run"
    clock = iter([0.0] * 7 + [1e9] * 1000)  # expires before the 7th step (epoch 2, batch 3)
    monkeypatch.setattr(stopping, "wall_clock", lambda: next(clock))
    run_ok(base_args(data_dir, out, "--time-budget", "5", model=TINY_QSV))
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["stopped_early"] is True and metrics["stop_reason"] == "time_budget"
    assert metrics["epochs"] == 1 and metrics["steps"] == 6
    assert 0.0 <= metrics["test_acc"] <= 1.0 and metrics["train_acc"] is not None
    state = load_checkpoint(out / "checkpoint.pt")
    assert (state["epoch"], state["batch"]) == (1, 2)
    monkeypatch.undo()
    run_ok(["--resume", str(out / "checkpoint.pt"), "--no-progress"])
    assert untimed(read_log(out)) == untimed(read_log(straight_qsv))
    assert json.loads((out / "metrics.json").read_text())["stopped_early"] is False


def test_real_time_budget_stops_cleanly(data_dir, tmp_path):
    out = tmp_path / "run"
    run_ok(base_args(data_dir, out, "--time-budget", "1e-7", model=TINY_QSV))
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["stopped_early"] is True and metrics["epochs"] == 0
    assert metrics["steps"] == 0 and metrics["train_acc"] is None
    assert 0.0 <= metrics["test_acc"] <= 1.0
    assert (out / "checkpoint.pt").exists() and not (out / "log.jsonl").read_text()


# --------------------------------------------------------------------------- interrupts


def test_sigint_saves_mid_epoch_and_resume_matches(data_dir, tmp_path, monkeypatch, capsys,
                                                   straight_qsv):
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers can only be installed from the main thread")
    out = tmp_path / "run"
    handler_before = signal.getsignal(signal.SIGINT)

    def ctrl_c(call):  # a real SIGINT in the middle of the 6th step
        if call == 6:
            signal.raise_signal(signal.SIGINT)

    patch_aux_loss(monkeypatch, graph_net_cls(), ctrl_c)
    assert main(base_args(data_dir, out, model=TINY_QSV)) == 130
    assert "interrupted: saved" in capsys.readouterr().err
    state = load_checkpoint(out / "checkpoint.pt")
    assert (state["epoch"], state["batch"]) == (1, 2)  # the 6th step completed first
    assert len(read_log(out)) == 1 and not (out / "metrics.json").exists()
    assert signal.getsignal(signal.SIGINT) is handler_before  # handler restored
    monkeypatch.undo()
    run_ok(["--resume", "--out-dir", str(out), "--no-progress"])
    assert untimed(read_log(out)) == untimed(read_log(straight_qsv))


def test_keyboard_interrupt_between_steps_is_saved(data_dir, tmp_path, monkeypatch, capsys,
                                                   straight_qsv):
    out = tmp_path / "run"
    original = DeviceLoader.epoch

    def epoch(self, ep, start_batch=0):
        for b, item in enumerate(original(self, ep, start_batch), start=start_batch):
            if self.shuffle and ep == 1 and b == 1:  # training loader, second batch of epoch 2
                raise KeyboardInterrupt
            yield item

    monkeypatch.setattr(DeviceLoader, "epoch", epoch)
    assert main(base_args(data_dir, out, model=TINY_QSV)) == 130
    assert "interrupted: saved" in capsys.readouterr().err
    state = load_checkpoint(out / "checkpoint.pt")
    assert (state["epoch"], state["batch"]) == (1, 1)
    monkeypatch.undo()
    run_ok(["--resume", "--out-dir", str(out), "--no-progress"])
    assert untimed(read_log(out)) == untimed(read_log(straight_qsv))


def test_keyboard_interrupt_mid_step_keeps_last_checkpoint(data_dir, tmp_path, monkeypatch,
                                                          capsys, straight_qsv):
    out = tmp_path / "run"

    def abort(call):
        if call == 7:
            raise KeyboardInterrupt

    patch_aux_loss(monkeypatch, graph_net_cls(), abort)
    assert main(base_args(data_dir, out, model=TINY_QSV)) == 130
    assert "nothing new was saved" in capsys.readouterr().err
    state = load_checkpoint(out / "checkpoint.pt")
    assert (state["epoch"], state["batch"]) == (1, 0)  # the end of epoch 1
    monkeypatch.undo()
    run_ok(["--resume", "--out-dir", str(out), "--no-progress"])
    assert untimed(read_log(out)) == untimed(read_log(straight_qsv))


def test_non_finite_loss_stops_and_keeps_good_checkpoint(data_dir, tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"

    def poison(call):  # the 6th step (epoch 2, batch 2) gets a NaN loss
        if call == 6:
            return lambda aux: aux + float("nan")

    patch_aux_loss(monkeypatch, graph_net_cls(), poison)
    assert main(base_args(data_dir, out, model=TINY_QSV)) == 1
    err = capsys.readouterr().err
    assert "error: non-finite training loss (nan) at epoch 2, step 5 (batch 2/4)" in err
    state = load_checkpoint(out / "checkpoint.pt")
    assert (state["epoch"], state["batch"]) == (1, 0)
    assert all(torch.isfinite(v).all() for v in state["model"].values() if v.is_floating_point())
    assert len(read_log(out)) == 1 and not (out / "metrics.json").exists()


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize("args, message", [
    (["--model", "nope"], "unknown model 'nope'"),
    (["--model", "resnet20", "--routing", "abs"], "--routing does not apply to model 'resnet20'"),
    (["--model", "resnet20", "--frozen-field"], "--frozen-field does not apply"),
    (["--model", "resnet20", "--lr", "-1"], "--lr must be > 0"),
    (["--config", "paper-nope"], "unknown preset"),
    (["--dataset", "cifar100", "--model", "resnet20"], "CIFAR-100 not found"),
])
def test_user_errors_exit_2(data_dir, tmp_path, capsys, args, message):
    assert main([*args, "--data-dir", str(data_dir), "--out-dir", str(tmp_path / "o"),
                 "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and "Traceback" not in err
    assert not (tmp_path / "o").exists()


def test_missing_data_and_bad_values_exit_2(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("QSV_DATA_DIR", raising=False)
    assert main(["--model", "resnet20", "--data-dir", str(tmp_path / "none")]) == 2
    assert "CIFAR-10 not found under" in capsys.readouterr().err
    assert main(["--model", "resnet20"]) == 2
    assert "no data directory given" in capsys.readouterr().err
    assert main(["--model", "resnet20", "--epochs", "two"]) == 2  # argparse
    assert "invalid int value" in capsys.readouterr().err
    assert main(["--resume"]) == 2
    assert "--resume without a path needs --out-dir" in capsys.readouterr().err


def test_refuses_to_overwrite_or_change_a_run(straight_qsv, data_dir, capsys):
    assert main(base_args(data_dir, straight_qsv, model=TINY_QSV)) == 2
    assert "already holds a run" in capsys.readouterr().err
    assert main(["--resume", str(straight_qsv), "--lr", "0.5"]) == 2
    assert "cannot change --lr" in capsys.readouterr().err


def test_console_script_subprocess_error(tmp_path):
    """The example wrapper exits 2 without a traceback on a user error."""
    proc = subprocess.run([sys.executable, str(REPO / "examples" / "train_cifar.py"),
                           "--model", "resnet20", "--data-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=120, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("error: CIFAR-10 not found") and "Traceback" not in proc.stderr


# --------------------------------------------------------------------------- torchrun


@pytest.mark.slow
def test_torchrun_two_processes_gloo(data_dir, tmp_path):
    out = tmp_path / "ddp"
    # --standalone lets torchrun bind a free rendezvous port itself (no port race with
    # other jobs on the machine).
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(REPO / "examples" / "train_cifar.py"),
           *base_args(data_dir, out, "--batch-size", "8", "--routing", "uniform", model=TINY_QSV)]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    # Its own session, so a timeout kills torchrun's workers too (killing torchrun
    # alone would leave them waiting on each other for ever).
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=REPO, env=env, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        # torchrun starts each worker in its own session: kill them by their run
        # folder (in their command line) before torchrun's group
        subprocess.run(["pkill", "-9", "-f", str(out)], check=False)
        os.killpg(proc.pid, signal.SIGKILL)
        try:  # bounded: a worker that left the group keeps the pipes open (seen once)
            stdout, stderr = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            stdout, stderr = "(no output: a worker still holds the pipes)", ""
        pytest.fail(f"torchrun did not finish in 300 s:\n{stdout[-3000:]}\n{stderr[-3000:]}")
    output = f"stdout:\n{stdout[-3000:]}\nstderr:\n{stderr[-3000:]}"
    assert proc.returncode == 0, output
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["world_size"] == 2 and metrics["epochs"] == 2, metrics
    assert metrics["steps"] == 2 * (N_TRAIN // 2 // 8), metrics  # 32 images per rank and epoch
    assert 0.0 <= metrics["test_acc"] <= 1.0 and metrics["test_images"] == N_TEST, metrics
    assert [line["epoch"] for line in read_log(out)] == [1, 2]  # rank 0 only, once per epoch
    assert stdout.count("done: test acc") == 1, output
    state = load_checkpoint(out / "checkpoint.pt")
    assert state["world_size"] == 2 and len(state["rng"]) == 2


def test_process_clock_budget_and_threads(data_dir, tmp_path, fake_process_clock):
    """--budget-clock process stops on this process's CPU time, not wall time."""
    fake = fake_process_clock(30.0)  # every check "burns" 30 CPU-seconds
    out = tmp_path / "run"
    code = main(base_args(data_dir, out, "--epochs", "3", "--time-budget", "1",
                          "--budget-clock", "process", "--threads", "1"))
    assert code == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["stopped_early"] is True and metrics["stop_reason"] == "time_budget"
    # The run's start reading, then about two checks: not three epochs.
    assert fake["cpu"] <= 5 * 30.0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["budget_clock"] == "process" and cfg["threads"] == 1


def test_process_clock_budget_counts_from_the_run_start(data_dir, tmp_path, fake_process_clock):
    """A run trained inside a process that already burned CPU (``--launcher in-process``,
    a notebook, a test session) gets its whole budget: the clock counts from the run's
    start, not from the process's (CI once stopped every run at 0 epochs)."""
    fake = fake_process_clock(0.01)
    fake["cpu"] = 10_000.0  # the process has used far more than the budget before the run
    out = tmp_path / "run"
    code = main(base_args(data_dir, out, "--epochs", "2", "--time-budget", "1",
                          "--budget-clock", "process"))
    assert code == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["stopped_early"] is False, metrics
    assert [line["epoch"] for line in read_log(out)] == [1, 2]


def test_anneal_to_budget_ends_the_cosine_with_the_budget(data_dir, tmp_path, fake_process_clock):
    fake = fake_process_clock(5.0)
    out = tmp_path / "run"
    run_ok(base_args(data_dir, out, "--epochs", "50", "--time-budget", "1",
                     "--budget-clock", "process", "--anneal-to-budget",
                     "--warmup-epochs", "0"))
    lrs = [line["lr"] for line in read_log(out)]
    assert lrs[-1] < 0.3 * 3e-3  # well into the decay, although 50 epochs were planned
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))
