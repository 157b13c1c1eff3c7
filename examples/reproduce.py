"""Reproduce a table of the paper: every row × seed under one wall-clock budget, then a report.

CPU-scale ablations (two seeds, five minutes per run, shrunk models)::

    python examples/reproduce.py --table ablations --data-dir ../shared/data \\
        --budget-minutes 5 --seeds 0 1 --epochs 10 --batch-size 64 \\
        --subset 5000 --test-subset 1000 --device cpu \\
        --model-overrides '{"shell_sizes": [64, 36, 16], "widths": [32, 32, 32], "heads": 2}'

The controls table, two rows only, on a GPU::

    python examples/reproduce.py --table controls --rows qsv resnet20 \\
        --data-dir ../shared/data --budget-minutes 60 --seeds 0 1 2

Runs go to ``runs/reproduce/<table>/<row>/seed<k>`` (``--out-root``). Running the
same command again reuses finished runs and resumes interrupted ones; add
``--report-only`` to rewrite ``table.md``, ``table.csv``, ``results.json``,
``accuracy.png`` and ``beta_probe.png`` without training. ``--help`` lists the rows.
"""
import sys
from pathlib import Path

try:
    from qsv_pyg.experiments.cli import main
except ImportError:  # running from a source checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from qsv_pyg.experiments.cli import main

if __name__ == "__main__":
    sys.exit(main())
