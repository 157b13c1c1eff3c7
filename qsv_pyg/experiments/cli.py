"""Command line of ``examples/reproduce.py``: train a table, then write its report.

Exit codes of :func:`main`: 0 every run finished, 1 some run failed (e.g. a
non-finite loss; the others still ran and the report marks it), 2 usage error,
130 interrupted (run the same command again to resume).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
from pathlib import Path
from typing import Any, Dict, Optional, Sequence, Tuple

from qsv_pyg.models.zoo import CONTROL_HEADS
from qsv_pyg.training import cli as train_cli
from qsv_pyg.training.config import TABLE, ConfigError, fields_with_role, flag_of
from qsv_pyg.training.run_files import RunFolderError

from . import report
from .runner import LAUNCHERS, ExperimentError, ExperimentInterrupted, RunSettings, run_table
from .tables import TABLES, get_table

__all__ = ["RESERVED_TRAIN_OPTIONS", "build_parser", "main"]

#: ``qsv-train`` options that ``--train-args`` may not contain: what the table
#: (model, ablation switches) or the runner sets per run, and the preset/resume flags.
RESERVED_TRAIN_OPTIONS = frozenset(fields_with_role(TABLE)) | {"config", "list_presets", "resume"}


def _json_object(text: str) -> Dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON ({exc}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object such as "
                                         f"'{{\"widths\": [32, 32]}}', got {text!r}")
    return value


def _positive(kind):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            what = "number" if kind is float else "integer"
            raise argparse.ArgumentTypeError(f"expected a {what}, got {text!r}") from None
        if not (value > 0 and math.isfinite(value)):
            raise argparse.ArgumentTypeError(f"must be positive, got {text!r}")
        return value
    return parse


def _seed(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``examples/reproduce.py``."""
    rows = "; ".join(f"{t.name}: {', '.join(t.slugs)}" for t in TABLES.values())
    p = argparse.ArgumentParser(
        prog="reproduce.py",
        description="Train every row × seed of a paper table under one wall-clock budget, "
                    "then write table.md/.csv, results.json, accuracy.png and beta_probe.png.",
        epilog=f"Rows: {rows}. Exit codes: 0 done, 1 some run failed, 2 usage error, "
               "130 interrupted (run again to resume).")
    p.add_argument("--table", required=True, choices=sorted(TABLES), help="which table")
    p.add_argument("--rows", nargs="+", metavar="SLUG", help="only these rows (default: all)")
    p.add_argument("--seeds", nargs="+", type=_seed, metavar="K",
                   help="training seeds of every row (default: the table's plan, seed 0 and "
                        "for the study also seed 1 of its main rows; with --report-only: "
                        "every seed on disk)")
    p.add_argument("--out-root", default="runs/reproduce", metavar="DIR",
                   help="runs go to DIR/<table>/<row>/seed<k> (default: runs/reproduce)")
    p.add_argument("--report-only", action="store_true",
                   help="only write the report from the runs on disk (training flags are ignored)")

    g = p.add_argument_group("training (the same for every run)")
    g.add_argument("--data-dir", metavar="DIR",
                   help="folder containing cifar-10-batches-py/ (default: $QSV_DATA_DIR)")
    g.add_argument("--dataset", default="cifar10", choices=("cifar10", "cifar100"),
                   help="dataset (the paper column is CIFAR-10; default: cifar10)")
    g.add_argument("--budget-minutes", type=_positive(float), metavar="M",
                   help="wall-clock budget of every run, in minutes (required to train)")
    g.add_argument("--epochs", type=_positive(int), metavar="E",
                   help="planned epochs (default: the trainer's)")
    g.add_argument("--batch-size", type=_positive(int), metavar="B")
    g.add_argument("--lr", type=_positive(float), metavar="LR")
    g.add_argument("--subset", type=_positive(int), metavar="N",
                   help="class-balanced subset of N training images")
    g.add_argument("--test-subset", type=_positive(int), metavar="M",
                   help="class-balanced subset of M test images")
    g.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N (default: auto)")
    g.add_argument("--model-overrides", type=_json_object, default={}, metavar="JSON",
                   help="model keywords for every graph model, e.g. '{\"shell_sizes\": [64, 16], "
                        "\"widths\": [32, 32], \"heads\": 2}'; heads and widths are QSV's: "
                        "each attention control is parameter-matched to that QSV model with its "
                        f"own control_heads (default {CONTROL_HEADS}); a model-name key holds "
                        "keywords for that model only, e.g. '{\"attention-gat\": "
                        "{\"match_tol\": 0.2}}'")
    g.add_argument("--train-args", default="", metavar="'FLAGS'",
                   help="further qsv-train flags for every run, e.g. "
                        "'--warmup-epochs 1 --amp bf16' (a lone flag needs the = form: "
                        "--train-args=--compile)")

    g = p.add_argument_group("runner")
    g.add_argument("--jobs", type=_positive(int), default=1, metavar="N",
                   help="train N runs side by side, each in its own subprocess (default: 1; "
                        "with --threads 1 in --train-args, one run per core)")
    g.add_argument("--launcher", choices=LAUNCHERS, default="subprocess",
                   help="run each training in a fresh subprocess (default) or in this process")
    g.add_argument("--overwrite", action="store_true",
                   help="delete and retrain runs whose saved configuration differs")
    g.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True,
                   help="progress bar over the runs (default: on)")
    return p


def _train_args(text: str) -> Tuple[str, ...]:
    """Split and check ``--train-args``: valid trainer flags, none the runner sets."""
    try:
        args = tuple(shlex.split(text))
    except ValueError as exc:
        raise ExperimentError(f"--train-args: {exc}") from None
    if not args:
        return ()
    try:
        given = train_cli.parse_fields(args)
    except ConfigError as exc:
        raise ExperimentError(f"--train-args {text!r}: {exc}") from None
    # The row's model and switches, and what the runner sets per run, come from the
    # table and the runner's own options: a flag for any of them is refused.
    reserved = sorted(RESERVED_TRAIN_OPTIONS & set(given))
    if reserved:
        names = ", ".join(flag_of(k) for k in reserved)
        raise ExperimentError(f"--train-args may not contain {names}: the table and the "
                              "runner set these per run (use the runner's own options, or "
                              "the table rows for the model and the ablations)")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run ``examples/reproduce.py``.

    Args:
        argv: arguments without the program name (default: ``sys.argv[1:]``).

    Returns:
        The exit code (see the module docstring).
    """
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse printed usage and the error
        return exc.code if isinstance(exc.code, int) else 2
    table = get_table(args.table)
    try:
        rows = [r.slug for r in table.select(args.rows)]
    except KeyError as exc:
        print(f"error: {exc.args[0]}", file=sys.stderr)
        return 2
    try:
        if args.report_only:
            # A damaged run file makes its run invalid (left out, named here and in
            # table.md), never a traceback; an unwritable report folder exits 2.
            try:
                paths = report.write_report(
                    table, args.out_root, rows=rows, seeds=args.seeds,
                    warn=lambda w: print(f"warning: {w}", file=sys.stderr))
            except OSError as exc:
                reason = str(exc) if isinstance(exc, RunFolderError) else (
                    f"{exc.filename}: {exc.strerror}" if exc.filename and exc.strerror
                    else str(exc))
                print(f"error: cannot write the report of {table.name} under "
                      f"{args.out_root}: {reason}", file=sys.stderr)
                return 2
            print(f"report: {paths['table.md'].parent}")
            return 0
        if args.budget_minutes is None:
            raise ExperimentError("--budget-minutes is required to train (or pass --report-only)")
        data_dir = args.data_dir or os.environ.get("QSV_DATA_DIR")
        if not data_dir:
            raise ExperimentError("--data-dir is required (or set $QSV_DATA_DIR)")
        if not Path(data_dir).expanduser().is_dir():
            raise ExperimentError(f"--data-dir {data_dir}: no such folder")
        settings = RunSettings(
            budget_minutes=args.budget_minutes,
            data_dir=str(Path(data_dir).expanduser().resolve()), dataset=args.dataset,
            epochs=args.epochs, batch_size=args.batch_size, lr=args.lr, subset=args.subset,
            test_subset=args.test_subset, device=args.device,
            model_overrides=args.model_overrides, train_args=_train_args(args.train_args))
        results = run_table(table, args.seeds, args.out_root, settings, rows=rows,
                            launcher=args.launcher, overwrite=args.overwrite,
                            progress=args.progress, jobs=args.jobs)
        # Without --seeds the table's plan ran: report every seed of the rows on disk.
        paths = report.write_report(table, args.out_root, rows=rows, seeds=args.seeds,
                                    warn=lambda w: print(f"warning: {w}", file=sys.stderr))
    except ExperimentError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except ExperimentInterrupted as exc:
        print(str(exc), file=sys.stderr)
        return 130
    failed = [r for r in results if r.status == "failed"]
    counts = {s: sum(r.status == s for r in results)
              for s in ("trained", "resumed", "reused", "failed")}
    print(f"{table.name}: " + ", ".join(f"{n} {s}" for s, n in counts.items() if n)
          + f"; report in {paths['table.md'].parent}")
    for r in failed:
        print(f"failed: {r.spec.name}: {r.message}", file=sys.stderr)
    return 1 if failed else 0
