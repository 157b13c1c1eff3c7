"""Command line of ``qsv-train`` (also ``python examples/train_cifar.py``).

Options are layered: :class:`~qsv_pyg.training.config.TrainConfig` defaults,
then ``--config PRESET``, then the flags given explicitly (argparse keeps only
those, so a flag always wins over the preset). ``--resume`` instead takes the
configuration stored in the checkpoint and accepts only flags that do not
change what is computed (output folder, data folder, device, time budget,
progress bars, compile).

Exit codes: 0 success (also when ``--time-budget`` stopped the run), 1 non-finite
loss, 2 user error (bad flags, missing data, unusable checkpoint), 130
interrupted (Ctrl-C / SIGTERM; a checkpoint was saved when possible).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Dict, Optional, Sequence, Tuple

from qsv_pyg.models import available_models

from .config import (
    AMP_MODES,
    FIELD_INITS,
    OPTIMIZER_BACKENDS,
    PRESETS,
    QUAT_SOURCES,
    ROUTINGS,
    TRANSPORTS,
    ConfigError,
    TrainConfig,
    preset_config,
)
from .run_files import RunFolderError, find_checkpoint
from .trainer import (
    NonFiniteLossError,
    TrainingInterrupted,
    config_for_resume,
    train,
)

__all__ = ["build_parser", "config_from_args", "main"]

_DEFAULTS = TrainConfig()


def _default(name: str) -> str:
    return f" (default: {getattr(_DEFAULTS, name)})"


def _model_arg(text: str) -> Tuple[str, Any]:
    """Parse ``KEY=VALUE``; VALUE is JSON when it parses (``[16,8]``, ``2``, ``true``)."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        parsed = json.loads(value)
    except ValueError:
        parsed = value
    return key.strip(), parsed


def build_parser() -> argparse.ArgumentParser:
    """The argument parser; every option defaults to "not given" (``SUPPRESS``)."""
    models = available_models()
    p = argparse.ArgumentParser(
        prog="qsv-train", argument_default=argparse.SUPPRESS,
        description="Train a Quat-Sphere-Vision model (or a control) on CIFAR-10/100.",
        epilog="Presets: " + ", ".join(sorted(PRESETS)) + ". Exit codes: 0 done, 1 non-finite "
               "loss, 2 usage/data error, 130 interrupted (checkpoint saved).")

    g = p.add_argument_group("what to train")
    g.add_argument("--model", metavar="NAME",
                   help=f"model to train, one of: {', '.join(models)}")
    g.add_argument("--config", metavar="PRESET",
                   help="start from a named preset (full-scale schedule); explicit flags "
                        "override it")
    g.add_argument("--list-presets", action="store_true", help="print the presets and exit")
    g.add_argument("--dataset", choices=("cifar10", "cifar100"),
                   help="dataset" + _default("dataset"))
    g.add_argument("--data-dir", metavar="DIR",
                   help="folder containing cifar-10-batches-py/ or cifar-100-python/ "
                        "(default: $QSV_DATA_DIR)")
    g.add_argument("--download", action=argparse.BooleanOptionalAction,
                   help="download the dataset into --data-dir when missing")
    g.add_argument("--subset", type=int, metavar="N",
                   help="train on a class-balanced subset of N images")
    g.add_argument("--test-subset", type=int, metavar="M",
                   help="evaluate on a class-balanced subset of M images")

    g = p.add_argument_group("QSV ablations (graph models with QSV convolutions only)")
    g.add_argument("--routing", choices=ROUTINGS, help="attention routing (model default: learned)")
    g.add_argument("--transport", choices=TRANSPORTS,
                   help="message transport (model default: sandwich)")
    g.add_argument("--quat-source", choices=QUAT_SOURCES,
                   help="origin of the quaternions (model default: field)")
    g.add_argument("--field-per-head", action=argparse.BooleanOptionalAction,
                   help="QSV: one field quaternion per node and head (default) or, with "
                   "--no-field-per-head, one per node shared by the heads")
    g.add_argument("--frozen-field", action=argparse.BooleanOptionalAction,
                   help="keep the quaternion fields at their random initialisation")
    g.add_argument("--field-init", choices=FIELD_INITS,
                   help="initial quaternion field: uniform (Haar-random) or identity")
    g.add_argument("--beta-init", type=float, metavar="B", help="initial routing temperature β")
    g.add_argument("--frozen-beta", action=argparse.BooleanOptionalAction,
                   help="do not learn β")
    g.add_argument("--beta-prior", type=float, metavar="W",
                   help="weight of the log-β prior (model keyword beta_prior_weight; "
                   "model default 0.01, 0 turns it off)")
    g.add_argument("--beta-prior-centre", type=float, metavar="B",
                   help="β at the centre of the log-β prior (model default 0.79)")
    g.add_argument("--repulsion-k", type=int, metavar="K",
                   help="neighbours in the field repulsion regulariser")
    g.add_argument("--repulsion-weight", type=float, metavar="W",
                   help="weight of the field repulsion regulariser")
    g.add_argument("--model-arg", type=_model_arg, action="append", metavar="KEY=VALUE",
                   dest="model_args",
                   help="extra model keyword, VALUE parsed as JSON (e.g. widths=[32,32]); "
                        "repeatable")

    g = p.add_argument_group("optimisation")
    g.add_argument("--epochs", type=int, help="training epochs" + _default("epochs"))
    g.add_argument("--batch-size", type=int, help="images per step and process"
                   + _default("batch_size"))
    g.add_argument("--eval-batch-size", type=int, help="images per evaluation batch"
                   + _default("eval_batch_size"))
    g.add_argument("--lr", type=float, help="peak learning rate" + _default("lr"))
    g.add_argument("--weight-decay", type=float, help="decoupled weight decay"
                   + _default("weight_decay"))
    g.add_argument("--warmup-epochs", type=float, help="linear warm-up epochs"
                   + _default("warmup_epochs"))
    g.add_argument("--min-lr-ratio", type=float, help="final lr / peak lr of the cosine"
                   + _default("min_lr_ratio"))
    g.add_argument("--label-smoothing", type=float, help="label smoothing"
                   + _default("label_smoothing"))
    g.add_argument("--optimizer", choices=OPTIMIZER_BACKENDS,
                   help="sphere backend for the quaternion fields" + _default("optimizer"))
    g.add_argument("--field-lr-scale", type=float, metavar="S",
                   help="learning rate of the quaternion fields relative to --lr"
                   + _default("field_lr_scale"))
    g.add_argument("--seed", type=int, help="seed of init, data order, augmentation"
                   + _default("seed"))

    g = p.add_argument_group("runtime")
    g.add_argument("--device", help="auto (CUDA if available), cpu, cuda, cuda:N"
                   + _default("device"))
    g.add_argument("--amp", choices=AMP_MODES, help="mixed precision, CUDA only"
                   + _default("amp"))
    g.add_argument("--compile", action=argparse.BooleanOptionalAction,
                   help="wrap the model in torch.compile")
    g.add_argument("--time-budget", type=float, metavar="MINUTES",
                   help="stop cleanly (checkpoint, evaluation, metrics) after this much time")
    g.add_argument("--budget-clock", choices=("wall", "process"),
                   help="what --time-budget counts: wall time, or this process's CPU time "
                   "(equal compute per run on a shared machine)" + _default("budget_clock"))
    g.add_argument("--eval-at-minutes", type=float, nargs="+", metavar="M",
                   help="also evaluate on the test set at these marks of the budget clock "
                   "(metrics.json: budget_evals; not charged to the budget)")
    g.add_argument("--anneal-to-budget", action=argparse.BooleanOptionalAction,
                   help="end the cosine decay when the time budget ends, if that is sooner")
    g.add_argument("--threads", type=int, metavar="N",
                   help="torch CPU threads (default: torch's choice)")
    g.add_argument("--out-dir", metavar="DIR",
                   help="run folder (default: runs/<model>-<timestamp>)")
    g.add_argument("--resume", nargs="?", const="", metavar="PATH",
                   help="continue from a checkpoint file or run folder (default: --out-dir)")
    g.add_argument("--progress", action=argparse.BooleanOptionalAction,
                   help="show progress bars (default: on)")
    return p


def config_from_args(explicit: Dict[str, Any]) -> Tuple[TrainConfig, Optional[str]]:
    """Turn the explicitly given options into a configuration.

    Args:
        explicit: ``vars()`` of the parsed namespace (only the given options).

    Returns:
        ``(config, checkpoint to resume from or None)``.

    Raises:
        ConfigError: inconsistent options.
        RunFolderError: ``--resume`` names no checkpoint.
    """
    explicit = dict(explicit)
    resume = explicit.pop("resume", None)
    preset = explicit.pop("config", None)
    if "model_args" in explicit:
        explicit["model_args"] = dict(explicit["model_args"])
    if resume is not None:
        if preset is not None:
            raise ConfigError("--config cannot be combined with --resume: a resumed run keeps "
                              "the configuration stored in its checkpoint")
        path = find_checkpoint(resume, explicit.get("out_dir"))
        return config_for_resume(path, explicit), str(path)
    if preset is not None:
        cfg = preset_config(preset)
    elif "model" in explicit:
        cfg = TrainConfig()
    else:
        raise ConfigError("--model is required (or --config PRESET); models: "
                          + ", ".join(available_models()))
    model_args = {**cfg.model_args, **explicit.pop("model_args", {})}
    cfg = cfg.replace(**explicit, model_args=model_args)
    if cfg.model not in available_models():
        raise ConfigError(f"unknown model {cfg.model!r}; choose one of "
                          f"{', '.join(available_models())}")
    return cfg.validate(), None


def _print_presets() -> None:
    for name in sorted(PRESETS):
        values = ", ".join(f"{k}={v}" for k, v in PRESETS[name].items())
        print(f"{name}: {values}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run ``qsv-train``.

    Args:
        argv: arguments without the program name (default: ``sys.argv[1:]``).

    Returns:
        The process exit code (see the module docstring).
    """
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse already printed usage / help
        return exc.code if isinstance(exc.code, int) else 2
    explicit = vars(args)
    if explicit.pop("list_presets", False):
        _print_presets()
        return 0
    # Under torchrun every rank hits the same user error; one message is enough.
    loud = int(os.environ.get("RANK", "0")) == 0
    try:
        cfg, resume = config_from_args(explicit)
        train(cfg, resume_from=resume)
    except (ConfigError, RunFolderError) as err:
        if loud:
            print(f"error: {err}", file=sys.stderr)
        return 2
    except NonFiniteLossError as err:
        if loud:
            print(f"error: {err}", file=sys.stderr)
        return 1
    except TrainingInterrupted as err:
        if loud:
            print(str(err), file=sys.stderr)
        return 130
    except KeyboardInterrupt:
        if loud:
            print("interrupted outside the training loop; nothing more was saved (an existing "
                  "checkpoint stays valid for --resume)", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
