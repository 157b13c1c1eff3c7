"""Reproduce the paper's tables: definitions, a resumable runner, and the report.

* :mod:`~qsv_pyg.experiments.tables`: the rows of the controls and ablations
  tables and the numbers the paper reports (kept apart from measured ones).
* :mod:`~qsv_pyg.experiments.runner`: trains every row × seed under one
  wall-clock budget, reusing finished runs and resuming interrupted ones.
* :mod:`~qsv_pyg.experiments.launch`: starts one training run (a fresh
  interpreter by default) and collects its output.
* :mod:`~qsv_pyg.experiments.run_reader`: reads and checks the run folders of
  a table into one summary.
* :mod:`~qsv_pyg.experiments.report`: ``table.md``, ``table.csv``,
  ``results.json``, ``accuracy.png`` and ``beta_probe.png`` from the summary.
* :mod:`~qsv_pyg.experiments.cli`: the command line of ``examples/reproduce.py``.
* the real-data tables, each ``python -m qsv_pyg.experiments.<name>``:
  :mod:`~qsv_pyg.experiments.citation_table` (Planetoid, gat.py's protocol),
  :mod:`~qsv_pyg.experiments.tu_table` (TU sets, Errica et al.'s protocol),
  :mod:`~qsv_pyg.experiments.modelnet_table` (ModelNet10 at equal CPU time); their
  run folders, locks, dataset cache and data folder are
  :mod:`~qsv_pyg.experiments.units`, the controls and matched widths
  :mod:`~qsv_pyg.experiments.compare`.

Command line: ``python examples/reproduce.py --help``.
"""
from .tables import ABLATIONS, CONTROLS, PAPER_SOURCE, TABLES, PaperValue, Row, Table, get_table

__all__ = ["ABLATIONS", "CONTROLS", "PAPER_SOURCE", "TABLES", "PaperValue", "Row", "Table",
           "get_table"]
