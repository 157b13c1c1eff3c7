"""Command line of ``qsv-train`` (also ``python examples/train_cifar.py``).

Options are layered: :class:`~qsv_pyg.training.config.TrainConfig` defaults,
then ``--config PRESET``, then the flags given explicitly (argparse keeps only
those, so a flag always wins over the preset). ``--resume`` instead takes the
configuration stored in the checkpoint and accepts only flags that do not
change what is computed (:func:`~qsv_pyg.training.config.resume_overridable`).
Every flag but ``--config``, ``--list-presets``, ``--resume`` and ``--debug``
is generated from the fields of ``TrainConfig``, with the old spelling of a
renamed field as a second flag (``--beta-prior`` = ``--beta-prior-weight``).

Exit codes: 0 success (also when ``--time-budget`` stopped the run), 1 non-finite
loss, 2 user or environment error (bad flags, missing data, unusable checkpoint
or run folder, a disk that filled up at a checkpoint: one line on stderr, the
traceback with ``--debug``), 130
interrupted (Ctrl-C / SIGTERM; a checkpoint was saved when possible).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import io
import json
import os
import sys
import traceback
import warnings
from typing import Any, Dict, Optional, Sequence, Tuple

from qsv_pyg.data import DataError
from qsv_pyg.models import available_models
from qsv_pyg.models.graph_net import DEFAULT_HEADS, DEFAULT_WIDTHS, QSV_DEFAULTS
from qsv_pyg.models.zoo import CONTROL_HEADS, MATCH_TOL

from .checkpoint import CheckpointError
from .config import ConfigError, TrainConfig, field_kind, flag_of, preset_config
from .parent_death import stop_with_parent
from .presets import AUTO_PRESETS, PRESETS, resolve_auto_preset
from .resume import config_for_resume
from .run_files import RunFolderError, as_write_error, find_checkpoint
from .trainer import NonFiniteLossError, TrainingInterrupted, train

__all__ = ["CLI_ONLY", "as_user_error", "build_parser", "config_from_args", "main",
           "parse_fields"]

#: Flags of ``qsv-train`` that are not configuration fields.
CLI_ONLY = ("config", "list_presets", "resume", "debug")

#: Errors in the user's input or environment: exit 2 with one line.
USER_ERRORS = (ConfigError, DataError, CheckpointError, RunFolderError, OSError)


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


def _add_field(group: argparse._ArgumentGroup, f: dataclasses.Field) -> None:
    """One flag for one :class:`TrainConfig` field, from its type and metadata."""
    meta, (kind, _) = f.metadata, field_kind(f.name)
    default = f.default if f.default is not dataclasses.MISSING else None
    show_default = default is not None and kind is not bool and "(default" not in meta["help"]
    kwargs: Dict[str, Any] = dict(help=meta["help"] + (f" (default: {default})"
                                                       if show_default else ""))
    if f.name == "model":  # the registry, not the config, knows the models
        kwargs["help"] += ": " + ", ".join(available_models())
    if meta["metavar"]:
        kwargs["metavar"] = meta["metavar"]
    old_flags = [flag_of(old) for old in meta["aliases"]]  # read with a FutureWarning
    if old_flags:
        kwargs["help"] += f" (old spelling: {', '.join(old_flags)})"
        if kind in (bool, dict, list):
            raise TypeError(f"{f.name}: old flag names are supported for single values only")
        kwargs.update(action=_StoreOldFlag, new_flag=flag_of(f.name))
    if kind is bool:
        kwargs["action"] = argparse.BooleanOptionalAction
    elif kind is dict:  # model_args: repeatable --model-arg KEY=VALUE
        group.add_argument("--model-arg", type=_model_arg, action="append", dest=f.name, **kwargs)
        return
    elif kind is list:
        kwargs.update(type=float, nargs="+")
    else:
        kwargs["type"] = kind
        if meta["value_aliases"]:  # an old spelling becomes the value before the choice check
            kwargs["type"] = functools.partial(_spelling, meta["value_aliases"])
            kwargs["help"] += " (old spellings: " + ", ".join(
                f"{old} = {new}" for old, new in meta["value_aliases"].items()) + ")"
        if meta["choices"] is not None:
            kwargs["choices"] = meta["choices"]
    group.add_argument(flag_of(f.name), *old_flags, **kwargs)


def _spelling(aliases: Dict[str, str], text: str) -> str:
    if text not in aliases:
        return text
    # FutureWarning, not DeprecationWarning: a command-line user must see it
    # (Python hides DeprecationWarnings raised outside __main__).
    warnings.warn(f"{text!r} is an old spelling of {aliases[text]!r}", FutureWarning,
                  stacklevel=2)
    return aliases[text]


class _StoreOldFlag(argparse._StoreAction):
    """``store``, with a :class:`FutureWarning` (shown by default) when the flag is an old name."""

    def __init__(self, option_strings, dest, new_flag: str, **kwargs):
        super().__init__(option_strings, dest, **kwargs)
        self.new_flag = new_flag

    def __call__(self, parser, namespace, values, option_string=None):
        if option_string is not None and option_string != self.new_flag:
            warnings.warn(f"{option_string} is the old name of {self.new_flag}",
                          FutureWarning, stacklevel=2)
        super().__call__(parser, namespace, values, option_string)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser; every option defaults to "not given" (``SUPPRESS``)."""
    p = argparse.ArgumentParser(
        prog="qsv-train", argument_default=argparse.SUPPRESS,
        description="Train a Quat-Sphere-Vision model (or a control) on CIFAR-10/100.",
        epilog="Presets: " + ", ".join(sorted(PRESETS) + sorted(AUTO_PRESETS))
               + ". Exit codes: 0 done, 1 non-finite loss, 2 usage/data/run-folder error, "
               "130 interrupted (checkpoint saved).")
    groups: Dict[str, argparse._ArgumentGroup] = {}
    for f in dataclasses.fields(TrainConfig):
        title = f.metadata["group"]
        if title is None:
            continue
        if title not in groups:
            groups[title] = p.add_argument_group(title)
            if len(groups) == 1:  # the preset flags belong with "what to train"
                groups[title].add_argument(
                    "--config", metavar="PRESET",
                    help="start from a named preset; explicit flags override it; auto-<model> "
                         "picks the paper schedule on a GPU, the CPU-scale run on a CPU")
                groups[title].add_argument("--list-presets", action="store_true",
                                           help="print the presets and exit")
        _add_field(groups[title], f)
    g = p.add_argument_group("resuming and errors")
    g.add_argument("--resume", nargs="?", const="", metavar="PATH",
                   help="continue from a checkpoint file or run folder (default: --out-dir)")
    g.add_argument("--debug", action="store_true",
                   help="show the traceback of a usage or data error, not only its message")
    return p


def parse_fields(argv: Sequence[str]) -> Dict[str, Any]:
    """The configuration fields (and ``CLI_ONLY`` options) that ``argv`` gives explicitly.

    Raises:
        ConfigError: argparse rejected ``argv`` (its message, without the usage text).
    """
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            explicit = vars(build_parser().parse_args(list(argv)))
    except SystemExit:
        lines = [ln for ln in err.getvalue().splitlines() if ln.strip()]
        raise ConfigError(lines[-1] if lines else "rejected by qsv-train") from None
    if "model_args" in explicit:
        explicit["model_args"] = dict(explicit["model_args"])
    return explicit


def config_from_args(explicit: Dict[str, Any]) -> Tuple[TrainConfig, Optional[str]]:
    """Turn the explicitly given options into a configuration.

    Args:
        explicit: ``vars()`` of the parsed namespace (only the given options).

    Returns:
        ``(config, checkpoint to resume from or None)``.

    Raises:
        ConfigError: inconsistent options.
    """
    explicit = dict(explicit)
    explicit.pop("debug", None)
    resume = explicit.pop("resume", None)
    preset = explicit.pop("config", None)
    if isinstance(explicit.get("model_args"), list):
        explicit["model_args"] = dict(explicit["model_args"])
    if resume is not None:
        if preset is not None:
            raise ConfigError("--config cannot be combined with --resume: a resumed run keeps "
                              "the configuration stored in its checkpoint")
        path = find_checkpoint(resume, explicit.get("out_dir"))
        return config_for_resume(path, explicit), str(path)
    if preset in AUTO_PRESETS:
        preset, _ = resolve_auto_preset(preset, explicit.get("device", "auto"))
    if preset is not None:
        cfg = preset_config(preset)
    elif "model" in explicit:
        cfg = TrainConfig()
    else:
        raise ConfigError("--model is required (or --config PRESET); models: "
                          + ", ".join(available_models()))
    model_args = {**cfg.model_args, **explicit.pop("model_args", {})}
    cfg = cfg.replace(**explicit, model_args=model_args)
    return cfg.validate(), None  # the model name too; train() does not check it again


def _print_presets() -> None:
    # What every preset inherits: the training defaults a preset does not set, and the
    # QSV model's own defaults (the paper-faithful ones).
    shown = ("field_lr_scale", "optimizer", "eval_batch_size")
    print("every preset: " + ", ".join(f"{k}={getattr(TrainConfig(), k)}" for k in shown))
    qsv = dict(heads=DEFAULT_HEADS, widths=DEFAULT_WIDTHS, **QSV_DEFAULTS)
    print("qsv and lattice models (unless a preset's model_args say otherwise): "
          + ", ".join(f"{k}={v}" for k, v in qsv.items()))
    print(f"attention-* controls: control_heads={CONTROL_HEADS} (their own), parameter-matched "
          f"within {MATCH_TOL:.0%} to the qsv model of qsv_heads={DEFAULT_HEADS}, "
          f"qsv_widths={DEFAULT_WIDTHS} (the shared heads and widths of reproduce.py "
          "--model-overrides are that QSV model's)")
    for name in sorted(PRESETS):
        values = ", ".join(f"{k}={v}" for k, v in PRESETS[name].items())
        print(f"{name}: {values}")
    for name, (gpu, cpu) in sorted(AUTO_PRESETS.items()):
        print(f"{name}: {gpu} on a GPU, {cpu} on a CPU")


def _run(explicit: Dict[str, Any], say) -> int:
    """Configure and train; exceptions other than the user errors propagate."""
    if explicit.get("config") in AUTO_PRESETS and "resume" not in explicit:
        _, why = resolve_auto_preset(explicit["config"], explicit.get("device", "auto"))
        say(why, out=sys.stdout)  # the first line of the run: which scale and why
    cfg, resume = config_from_args(explicit)
    try:
        train(cfg, resume_from=resume)
    except NonFiniteLossError as err:
        say(f"error: {err}")
        return 1
    except TrainingInterrupted as err:
        say(str(err))
        return 130
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run ``qsv-train``.

    Args:
        argv: arguments without the program name (default: ``sys.argv[1:]``).

    Returns:
        The process exit code (see the module docstring).
    """
    stop_with_parent()  # launched by the experiment runner: stop when it dies
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse already printed usage / help
        return exc.code if isinstance(exc.code, int) else 2
    explicit = vars(args)
    if explicit.pop("list_presets", False):
        _print_presets()
        return 0
    debug = explicit.get("debug", False)
    # Under torchrun every rank hits the same user error; one message is enough.
    loud = int(os.environ.get("RANK", "0")) == 0

    def say(message: str, out=None) -> None:
        if loud:
            print(message, file=out or sys.stderr, flush=True)

    try:
        return _run(explicit, say)
    except Exception as err:
        # The one place that turns an error in the user's input or environment into
        # exit 2: one line (the traceback only with --debug).
        user_error = as_user_error(err)
        if user_error is None:
            raise
        if debug and loud:
            traceback.print_exc()
        say("error: " + _one_line(user_error))
        return 2
    except KeyboardInterrupt:
        say("interrupted outside the training loop; nothing more was saved (an existing "
            "checkpoint stays valid for --resume)")
        return 130


def as_user_error(err: BaseException) -> Optional[BaseException]:
    """The error to report with exit code 2 for ``err``, or ``None`` when it is a bug.

    The :data:`USER_ERRORS`, and torch's zip-writer ``RuntimeError`` of a failed
    write (a full disk at a later checkpoint) as the
    :class:`~qsv_pyg.training.run_files.RunFolderError` it stands for.
    """
    if isinstance(err, USER_ERRORS):
        return err
    return as_write_error(err)


def _one_line(err: BaseException) -> str:
    """The error's message on one line (an OSError without one is named by its type)."""
    text = " ".join(str(err).split())
    if isinstance(err, OSError) and not isinstance(err, RunFolderError):
        if err.filename is not None and str(err.filename) not in text:
            text = f"{text}: {err.filename}"
        text = text or type(err).__name__
    return text


if __name__ == "__main__":
    sys.exit(main())
