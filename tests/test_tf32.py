"""--tf32: an explicit option (off by default), applied on CUDA only."""
from __future__ import annotations


import pytest
import torch

from qsv_pyg.training import setup
from qsv_pyg.training.cli import build_parser, config_from_args, main
from qsv_pyg.training.config import TrainConfig, resume_overridable

from tiny_cifar import write_tiny_cifar10  # noqa: E402

CUDA = torch.device("cuda", 0)


@pytest.fixture(autouse=True)
def tf32_flags():
    """Each test starts from torch's defaults (matmul off, cuDNN on); the values found
    before it are set back afterwards.

    Saved and restored by hand, not with ``monkeypatch``: ``torch.backends.cuda.matmul``
    serves ``allow_tf32`` through ``__getattr__`` (the value lives in torch's C++ state,
    not on the object), so pytest 9's ``monkeypatch`` finds no old value and undoes the
    patch with ``delattr``, which fails at teardown."""
    saved = _flags()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = True
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def _flags():
    return torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32


def test_flag_default_off_and_documented():
    assert TrainConfig().tf32 is False
    for argv, want in (([], False), (["--tf32"], True), (["--no-tf32"], False)):
        cfg, _ = config_from_args(vars(build_parser().parse_args(["--model", "qsv", *argv])))
        assert cfg.tf32 is want, argv
    assert "TF32" in TrainConfig.describe()["tf32"] and "CUDA" in TrainConfig.describe()["tf32"]
    assert "--tf32" in build_parser().format_help()
    assert "tf32" in resume_overridable()  # how fast a device computes, like --compile
    # Runs saved before the option existed had TF32 on (on CUDA): a resume keeps that.
    old = {k: v for k, v in TrainConfig().to_dict().items() if k != "tf32"}
    assert TrainConfig.from_dict(old).tf32 is True


def test_default_leaves_tf32_off_on_cuda():
    setup._set_tf32(TrainConfig().tf32, CUDA, say=lambda m: None)
    assert _flags() == (False, False)  # full float32 matmuls and convolutions


def test_tf32_sets_both_switches_on_cuda():
    setup._set_tf32(True, CUDA, say=lambda m: None)
    assert _flags() == (True, True)
    setup._set_tf32(False, CUDA, say=lambda m: None)  # a later run in the process: off again
    assert _flags() == (False, False)


def test_tf32_changes_nothing_off_cuda():
    said = []
    setup._set_tf32(True, torch.device("cpu"), say=said.append)
    assert _flags() == (False, True) and "only used on CUDA" in said[0]
    setup._set_tf32(False, torch.device("cpu"), say=said.append)
    assert _flags() == (False, True) and len(said) == 1


def test_training_applies_the_option_to_the_placed_device(tmp_path, monkeypatch, capsys):
    """build_run hands --tf32 and the device it placed the run on to _set_tf32; on a
    CPU run nothing changes (and a note says so)."""
    write_tiny_cifar10(tmp_path / "data", 32, 16)
    calls = []
    original = setup._set_tf32
    monkeypatch.setattr(setup, "_set_tf32",
                        lambda enabled, device, say: (calls.append((enabled, device.type)),
                                                      original(enabled, device, say)))
    args = ["--model", "resnet20", "--data-dir", str(tmp_path / "data"), "--epochs", "1",
            "--batch-size", "16", "--device", "cpu", "--no-progress", "--threads", "1"]
    assert main([*args, "--out-dir", str(tmp_path / "a")]) == 0
    assert main([*args, "--out-dir", str(tmp_path / "b"), "--tf32"]) == 0
    assert calls == [(False, "cpu"), (True, "cpu")]
    assert _flags() == (False, True)
    assert "--tf32 is only used on CUDA" in capsys.readouterr().out
