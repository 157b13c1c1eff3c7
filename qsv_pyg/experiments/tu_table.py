"""TU graph classification under the fair-comparison protocol of Errica et al. 2020:
QSV against GAT, GATv2, a TransformerConv GNN, GIN and a structure-agnostic baseline.

The protocol (Errica, Podda, Bacciu, Micheli, "A Fair Comparison of Graph Neural
Networks for Graph Classification", ICLR 2020; github.com/diningphil/gnn-comparison):

* **outer**: stratified 10-fold cross-validation; every fold's test part is used
  once, for the model chosen on that fold's training part;
* **inner**: a stratified 10% of the fold's training part is held out for model
  selection. Here the only choice made on it is the **epoch** (early stopping):
  after every epoch the validation accuracy is measured; the selected epoch is
  the last one with the best validation accuracy so far (``>=``, as Errica's
  ``Patience`` stopper), training stops ``--patience`` epochs after it (or at
  ``--epochs``), and the unit's result is the **test accuracy at the selected
  epoch**;
* the table gives the mean ± std (sample std) over the folds.

What differs from Errica et al. (say so wherever the numbers are compared):
they select the hyper-parameters too (a grid per model, on the same inner
hold-out) and average three final trainings per fold; they train up to
1,000-5,000 epochs with patience 500. Here every row has one fixed setting and
one training per fold under a small epoch budget (below), so our numbers are a
cheaper estimate of the same quantity, comparable among our rows (same splits,
same budget, same selection rule) and only roughly with the published ones.

Rows (``--models`` picks rows by name prefix), all with 3 message-passing
layers of width 64, dropout 0, no normalisation, then **sum pooling** over each
graph's nodes (Errica's GIN and baseline read out by sums; sums see graph size,
means do not) and a linear map to the classes; Adam, lr 0.005, batches of 64
graphs, cross-entropy (one setting for all rows, not tuned per row):

* ``QSV``: ``qsv_pyg.nn.models.QSV(in, 64, 3, heads=4, add_self_loops=True,
  root_weight=False, transport="identity", project_input=True)``: docs/usage.md's
  recipe for graphs without geometry, plus the input projection
  (``project_input``, GATConv's ``lin``): without it each head reads only its
  slice of the raw features (with 7 one-hot labels on MUTAG, two of four heads
  would read zero padding) and, with no root weight, the heads never mix from
  one layer to the next. (QSV trains on its fused kernel.)
* ``GAT`` (PyG ``GAT``), ``GATv2`` (``GAT(v2=True)``), ``Transformer``
  (:class:`~qsv_pyg.experiments.compare.Transformer`): heads 4, hidden width chosen by
  :func:`~qsv_pyg.experiments.compare.matched_control` so that the parameter count of the GNN is closest
  to QSV's on that dataset (~14-23k parameters, see ``costs.md``).
* ``GIN``: PyG's ``GIN`` (2-layer MLPs, ``train_eps=False``, no batch norm, like
  the other rows), its hidden width matched to QSV's parameter count the same way
  (``matched_gin``), not Errica's grid sizes.
* ``MLP (sum of node features)``: Errica's structure-agnostic baseline
  (DeepMultisets: ``Linear(in, 64)``, ReLU, sum over the graph's nodes,
  ``Linear(64, 64)``, ReLU, ``Linear(64, classes)``); it never sees an edge.
  (Errica's chemical baseline, MolecularFingerprint, sums the raw features
  first; with one-hot labels the two differ only by the per-node layer.)

Rows added by flags (the same protocol, folds, splits and settings, so each is
paired by fold with the row it extends; ``<out-root>/paired.*`` gives the
per-fold differences):

* ``--source-logit``: ``QSV +source``, the QSV row with ``source_logit=True``
  added to its QSV options (a per-head linear score of the source's features
  added to the routing logit, GAT's source half; issue 29). Off by default.
* ``--edge-attr``: a ``<row> +edge`` twin of every row that takes edge features,
  with the set's one-hot edge labels (MUTAG's bond types: 4) as ``edge_attr``:
  QSV (and QSV +source) with ``edge_dim`` (the labels enter the logit;
  ``fill_value="mean"`` on the self-loops), GAT, GATv2 and Transformer with
  ``edge_dim`` (widths matched by ``compare.matched_control`` to the QSV row
  with edge features), GIN as ``GINE``: PyG's ``GINEConv`` in the same 3-layer
  ``BasicGNN`` with 2-layer MLPs, its width matched the same way. The MLP
  baseline sees no edge and is the node-only row. The ``+edge`` units have
  their own folders (``<slug>-edge``) and the keys ``edge_features`` and
  ``edge_dim`` in their configs, so they never mix with node-only units; the
  tables show them beside their node-only rows. Only sets with edge labels
  (``<NAME>_edge_labels.txt``; of the five, MUTAG) get ``+edge`` rows: the
  others are named on stderr and get the node-only rows; when none of the
  given sets has edge labels the script exits 2.

Budget: ``--epochs 25 --patience 8`` by default. The arithmetic, from CPU
milliseconds per training epoch measured on this machine (AMD EPYC, one torch
thread, the two cores shared with other jobs: load average 3-5) on fold 0::

    ms/epoch      MUTAG  PROTEINS   NCI1  ENZYMES  IMDB-B
    QSV             102       924   2355      455     715
    GAT              93       876   2329      451     787
    GATv2            85      1272   2773      537     893
    Transformer      70       791   2043      380     692
    GIN              55       409   1096      193     318
    MLP              29       156    511       83     127
    all six rows    433      4427  11108     2100    3532   = 21.6 s
    + evaluation    106       465   1208      276     411   =  2.5 s

One epoch of every row on one fold: 24.1 CPU-s; of the whole table (10
folds): 241 s. At most 25 epochs: 6,025 CPU-s = 1.7 h in one process, 0.85 h
with ``--jobs 2`` on two cores (plus ~10 s per worker to start); early stopping
(patience 8) ends many units sooner. (50 epochs with patience 15, ~1.7 h on two
cores, was the first plan; the committed table was run in one session together
with the Cora and ModelNet10 tables, so each got about half of that.) Why batches of 64: batches of 32 (lr
0.001) cost 30.6 s per fold-epoch (47 epochs in two hours), and in 15 epochs on
NCI1 fold 0 they reached no better validation accuracy than batches of 64
(QSV 0.71 vs 0.71, GIN 0.73 vs 0.76) at 1.45x the cost; batches of 128 (lr
0.01) cost 0.9x with half the steps and reached 0.69 for both. ``costs.md``
has the measured numbers of the actual units.

Every unit (one dataset, row and fold) trains in its own run folder
``<out-root>/<DATASET>/<row-slug>/fold<k>`` (``config.json``, ``log.jsonl`` with
one line per epoch — train loss and accuracy, validation and test accuracy,
CPU seconds —, ``metrics.json`` with the selected epoch, its validation and test
accuracy, the parameters, the time per epoch, the CPU and the versions; see
:func:`~qsv_pyg.experiments.units.run_unit`). Units run dataset by dataset, fold by fold, all rows of a
fold before the next fold, so an interrupted table holds whole folds (paired
across rows); a rerun of the same command reuses the finished units and
restarts the unfinished ones; ``--jobs N`` trains N units at a time in worker
processes (a failed unit cancels the queued ones). A unit that another process
is training (its folder's ``run.lock``) exits 2 naming that process; a damaged
``metrics.json`` is named and left out of the tables. ``--folds`` may not exceed
the graphs of the smallest class (a test fold would lack it). The tables
(rebuilt from the folders, also by ``--report-only``):
``<out-root>/table.{md,csv,json}`` (test accuracy per model and dataset, with
the published numbers beside ours), ``<out-root>/costs.*`` (parameters and
CPU ms per epoch) and ``<out-root>/<DATASET>/table.*`` (per dataset). Run::

    python -m qsv_pyg.experiments.tu_table --jobs 2                 # the whole table
    python -m qsv_pyg.experiments.tu_table --dataset MUTAG,PROTEINS --models QSV,GIN
    python -m qsv_pyg.experiments.tu_table --report-only            # tables from the folders
    python -m qsv_pyg.experiments.tu_table --source-logit --models QSV   # QSV vs QSV +source
    python -m qsv_pyg.experiments.tu_table --edge-attr --dataset MUTAG   # + the '+edge' rows
    python -m qsv_pyg.experiments.tu_table --dataset MUTAG --max-folds 2 --epochs 15 \\
        --out-root /tmp/tu-small                                    # a tiny run

(This was ``examples/tu_graphs.py``; that script is now a short example that
trains one model on one fold. The units still record ``"script": "tu_graphs.py"``,
so the committed run folders keep matching.)

The data, features and splits: :mod:`qsv_pyg.experiments.tu_data`; the rows' models:
:mod:`qsv_pyg.experiments.tu_models`; the tables and the published numbers beside
ours: :mod:`qsv_pyg.experiments.tu_report`.
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.nn.functional as F

import torch_geometric

import qsv_pyg
from qsv_pyg.experiments import compare
from qsv_pyg.experiments.compare import Timer, count_parameters, fail, warm_up
from qsv_pyg.experiments.tu_data import (DATASETS, FOLDS, NODE_ATTRIBUTES, SPLIT_SEED,
                                         VAL_FRACTION, check_folds, load_graphs,
                                         load_or_make_splits, prepare_dataset, split_digest,
                                         standardised)
from qsv_pyg.experiments.tu_models import (EDGE, EDGE_ROWS, QSV_OPTIONS, ROW_QSV_OPTIONS,
                                           ROWS, SOURCE, base_row, build_model, row_slug)
from qsv_pyg.experiments.tu_report import report
from qsv_pyg.nn import QSVConv
from qsv_pyg.utils import cpu_name

#: Bump when a change to this script changes what a unit trains or records: the
#: folders of an older version then no longer match (use a new --out-root).
SCRIPT_VERSION = 1

EPOCHS, PATIENCE = 25, 8
SMALL_FOLDS, SMALL_EPOCHS, SMALL_PATIENCE = 2, 15, 15
HIDDEN, LAYERS, HEADS, DROPOUT, LR, BATCH_SIZE, READOUT = 64, 3, 4, 0.0, 0.005, 64, "sum"
EVAL_BATCH_SIZE = 512


def hyperparameters(epochs: int = EPOCHS, patience: int = PATIENCE,
                    row: Optional[str] = None) -> Dict[str, Any]:
    """Every unit's training settings (recorded in its config); the row ``row``'s
    QSV options are ``QSV_OPTIONS`` plus its ``ROW_QSV_OPTIONS``."""
    base = None if row is None else base_row(row)[0]
    return {"epochs": epochs, "patience": patience, "hidden": HIDDEN, "layers": LAYERS,
            "heads": HEADS, "dropout": DROPOUT, "lr": LR, "batch_size": BATCH_SIZE,
            "readout": READOUT,
            "qsv_options": {**QSV_OPTIONS, **ROW_QSV_OPTIONS.get(base, {})}}


# ------------------------------------------------------------------ training
def evaluate(model: torch.nn.Module, loader) -> Tuple[float, float]:
    """Accuracy and mean cross-entropy over ``loader``."""
    model.eval()
    correct, loss, total = 0, 0.0, 0
    with torch.no_grad():
        for batch in loader:
            out = model(batch)
            correct += int((out.argmax(-1) == batch.y).sum())
            loss += float(F.cross_entropy(out, batch.y, reduction="sum"))
            total += batch.y.numel()
    return correct / max(total, 1), loss / max(total, 1)


def train_unit(graphs: list, split: Dict[str, List[int]], spec: Dict[str, Any],
               row: str, hp: Dict[str, Any], seed: int,
               log: Callable[[Dict[str, Any]], None]) -> Dict[str, Any]:
    """Adam on cross-entropy for up to ``hp["epochs"]`` epochs with early stopping
    on the validation accuracy (patience ``hp["patience"]``); the test accuracy at
    the selected epoch."""
    from torch_geometric.loader import DataLoader
    graphs = standardised(graphs, split["train"], spec.get("num_attributes", 0))
    torch.manual_seed(seed)
    model = build_model(row, spec["num_features"], spec["num_classes"], hp,
                        spec.get("edge_dim"))
    generator = torch.Generator().manual_seed(seed)
    train_loader = DataLoader([graphs[i] for i in split["train"]],
                              batch_size=hp["batch_size"], shuffle=True, generator=generator)
    val_loader = DataLoader([graphs[i] for i in split["val"]], batch_size=EVAL_BATCH_SIZE)
    test_loader = DataLoader([graphs[i] for i in split["test"]], batch_size=EVAL_BATCH_SIZE)
    optimizer = torch.optim.Adam(model.parameters(), lr=hp["lr"])
    first = next(iter(DataLoader([graphs[i] for i in split["train"][:hp["batch_size"]]],
                                 batch_size=hp["batch_size"])))
    model.train()
    warm_up(lambda: model(first).sum(), model)
    convs = [m for m in model.modules() if isinstance(m, QSVConv)]
    paths = sorted({" / ".join(conv.path_reason(first.x, None, first.edge_index))
                    for conv in convs})
    timer = Timer()
    stats: Dict[str, float] = {}

    def one_epoch() -> None:
        model.train()
        loss_sum, correct, total = 0.0, 0, 0
        for batch in train_loader:
            optimizer.zero_grad()
            out = model(batch)
            loss = F.cross_entropy(out, batch.y)
            loss.backward()
            optimizer.step()
            n = batch.y.numel()
            loss_sum += float(loss.detach()) * n
            correct += int((out.detach().argmax(-1) == batch.y).sum())
            total += n
        stats["loss"], stats["acc"] = loss_sum / total, correct / total

    best: Dict[str, Any] = {"epoch": 0, "val_acc": -1.0}
    eval_seconds: List[float] = []
    start_wall = time.perf_counter()
    epoch = 0
    for epoch in range(1, hp["epochs"] + 1):
        timer.epoch(one_epoch)
        start = time.process_time()
        val_acc, val_loss = evaluate(model, val_loader)
        test_acc, test_loss = evaluate(model, test_loader)
        eval_seconds.append(time.process_time() - start)
        if val_acc >= best["val_acc"]:  # the latest of equal ones (Errica's Patience)
            best = {"epoch": epoch, "val_acc": val_acc, "val_loss": val_loss,
                    "test_acc": test_acc, "train_loss": stats["loss"],
                    "train_acc": stats["acc"]}
        log({"epoch": epoch, "train_loss": stats["loss"], "train_acc": stats["acc"],
             "val_acc": val_acc, "val_loss": val_loss, "test_acc": test_acc,
             "seconds": timer.seconds[-1], "eval_seconds": eval_seconds[-1]})
        if epoch - best["epoch"] >= hp["patience"]:
            break
    return {
        "dataset": spec["name"], "model": row, "fold": seed,
        "selected_epoch": best["epoch"], "epochs_run": epoch,
        "stopped_early": epoch < hp["epochs"],
        "val_acc": best["val_acc"], "test_acc": best["test_acc"],
        "val_loss": best["val_loss"], "train_loss": best["train_loss"],
        "train_acc": best["train_acc"], "final_test_acc": test_acc,
        "params": count_parameters(model),
        "time_per_epoch": timer.per_epoch, "ms_per_epoch": 1000 * timer.per_epoch,
        "eval_ms_per_epoch": 1000 * statistics.fmean(eval_seconds),
        "cpu_seconds": sum(timer.seconds) + sum(eval_seconds),
        "wall_seconds": time.perf_counter() - start_wall,
        "qsv_paths": paths, "cpu": cpu_name(), "threads": torch.get_num_threads(),
        "versions": {"python": sys.version.split()[0], "torch": torch.__version__,
                     "torch_geometric": torch_geometric.__version__,
                     "qsv_pyg": qsv_pyg.__version__, "qsv_pyg_commit": compare.source_commit(),
                     "numpy": np.__version__},
    }


def init_worker(threads: int) -> None:
    torch.set_num_threads(threads)


def run_task(task: Dict[str, Any]) -> Dict[str, Any]:
    """Train one unit in its folder (in this process or a worker)."""
    torch.set_num_threads(task["threads"])
    graphs = load_graphs(task["data"])

    def train(log):
        return train_unit(graphs, task["split"], task["data"], task["row"], task["hp"],
                          task["fold"], log)

    return compare.run_unit(Path(task["folder"]), task["config"], train)


# ----------------------------------------------------------------------- main
def parser():
    p = compare.base_parser(__doc__.split("\n\n")[0])
    p.prog = "python -m qsv_pyg.experiments.tu_table"
    p.set_defaults(seeds=None)
    for action in p._actions:  # base_parser's options that do not apply here
        if action.dest == "seeds":
            action.help = "unused (the folds are the repetitions)"
        if action.dest == "small":
            action.help = (f"a tiny run: --max-folds {SMALL_FOLDS} --epochs {SMALL_EPOCHS} "
                           f"--patience {SMALL_PATIENCE} unless given, default --out-root "
                           f"docs/results/tu-small")
    compare.add_data_args(p, ",".join(DATASETS), "docs/results/tu")
    for action in p._actions:
        if action.dest == "dataset":
            action.help = f"comma-separated TU names (default {','.join(DATASETS)})"
    p.add_argument("--folds", type=int, default=FOLDS,
                   help=f"outer cross-validation folds (default {FOLDS})")
    p.add_argument("--max-folds", type=int, default=None,
                   help="train only the first M folds (default all)")
    p.add_argument("--epochs", type=int, default=None,
                   help=f"most epochs per unit (default {EPOCHS})")
    p.add_argument("--patience", type=int, default=None,
                   help=f"stop this many epochs after the best validation accuracy "
                        f"(default {PATIENCE})")
    p.add_argument("--jobs", type=int, default=1,
                   help="units trained at a time, in worker processes (default 1: in "
                        "this process)")
    p.add_argument("--source-logit", action="store_true",
                   help=f"add the row {SOURCE!r}: the QSV row with source_logit=True "
                        f"(the per-source logit term), paired by fold with the QSV row")
    p.add_argument("--edge-attr", action="store_true",
                   help="add a '<row> +edge' row for every row that takes edge features "
                        f"({', '.join(EDGE_ROWS)}; GIN as GINEConv) with the one-hot edge "
                        "labels as edge_attr, on the sets that have edge labels (the others "
                        "get only the node-only rows; exit 2 when no set has them)")
    p.add_argument("--node-attributes", default=",".join(NODE_ATTRIBUTES),
                   help=f"comma-separated sets whose continuous node attributes are "
                        f"features too (default {','.join(NODE_ATTRIBUTES)})")
    p.add_argument("--cache-root", type=Path, default=Path("~/.cache/qsv_pyg/tu"),
                   help="writable folder where the sets are copied and processed "
                        "(default ~/.cache/qsv_pyg/tu)")
    return p


def unit_order(datasets: Sequence[str], folds: int, rows: Sequence[str]
               ) -> List[Tuple[str, int, str]]:
    """The order units train in: dataset by dataset, fold by fold, every row of a
    fold before the next fold (an interrupted table holds whole, paired folds)."""
    return [(d, fold, row) for d in datasets for fold in range(folds) for row in rows]


def candidate_rows(source_logit: bool = False, edge_attr: bool = False) -> List[str]:
    """The rows ``--models`` chooses from: ``ROWS`` (``SOURCE`` only with
    ``source_logit``), then with ``edge_attr`` a ``+edge`` twin of every
    ``EDGE_ROWS`` row among them."""
    rows = [r for r in ROWS if r != SOURCE or source_logit]
    if edge_attr:
        rows += [r + EDGE for r in rows if r in EDGE_ROWS]
    return rows


def names(text: str) -> List[str]:
    return [n.strip() for n in text.split(",") if n.strip()]


def main(argv: Optional[Sequence[str]] = None) -> str:
    args = parser().parse_args(argv)
    out_root = Path(args.out_root)
    if args.small and out_root == Path("docs/results/tu"):
        out_root = Path("docs/results/tu-small")  # never mixed with the full table
    compare.check_folder(out_root, "--out-root")
    if args.report_only:
        text = report(out_root)
        print(text)
        return text
    datasets = list(dict.fromkeys(names(args.dataset)))
    if not datasets:
        fail("--dataset names no dataset")
    rows = [name for name, _ in compare.selected(
        [(r, None) for r in candidate_rows(args.source_logit, args.edge_attr)], args.models)]
    epochs = args.epochs if args.epochs is not None else (SMALL_EPOCHS if args.small else EPOCHS)
    patience = (args.patience if args.patience is not None
                else (SMALL_PATIENCE if args.small else PATIENCE))
    max_folds = (args.max_folds if args.max_folds is not None
                 else (min(SMALL_FOLDS, args.folds) if args.small else args.folds))
    if args.folds < 2:
        fail(f"--folds must be at least 2 (got {args.folds})")
    if not 1 <= max_folds <= args.folds:
        fail(f"--max-folds must be between 1 and --folds {args.folds} (got {max_folds})")
    for flag, value in (("--epochs", epochs), ("--patience", patience),
                        ("--jobs", args.jobs), ("--threads", args.threads)):
        if value < 1:
            fail(f"{flag} must be positive (got {value})")
    torch.set_num_threads(args.threads)
    attribute_sets = names(args.node_attributes)

    # Every set is checked and prepared before anything trains.
    specs = [prepare_dataset(name, args.data_dir, args.cache_root, attribute_sets)
             for name in datasets]
    for spec in specs:
        check_folds(spec, args.folds)
    if any(base_row(r)[1] for r in rows):
        without = [spec["name"] for spec in specs if spec["edge_dim"] is None]
        if len(without) == len(specs):
            fail(f"--edge-attr: {', '.join(without)} "
                 f"{'has' if len(without) == 1 else 'have'} no edge labels "
                 f"(no <NAME>_edge_labels.txt in the raw folder); of the default sets only "
                 f"MUTAG has them")
        for name in without:
            print(f"tu_graphs: --edge-attr: {name} has no edge labels: its '+edge' rows "
                  f"are skipped", file=sys.stderr)
    splits = {spec["name"]: load_or_make_splits(out_root / spec["name"] / "splits.json",
                                                spec, args.folds) for spec in specs}
    data = {spec["name"]: {k: v for k, v in spec.items() if k != "labels"} for spec in specs}
    tasks, done = [], 0
    for name, fold, row in unit_order(datasets, max_folds, rows):
        split, spec = splits[name][fold], data[name]
        edge = base_row(row)[1]
        if edge and spec["edge_dim"] is None:
            continue
        config = {
            "script": "tu_graphs.py", "version": SCRIPT_VERSION,
            "dataset": name, "model": row, "fold": fold,
            "folds": args.folds, "split_seed": SPLIT_SEED,
            "val_fraction": VAL_FRACTION, "split_sha256": split_digest(split),
            "num_train": len(split["train"]), "num_val": len(split["val"]),
            "num_test": len(split["test"]), "num_graphs": spec["num_graphs"],
            "num_classes": spec["num_classes"],
            "num_features": spec["num_features"], "features": spec["features"],
            "seed": fold, "threads": args.threads,
            "hp": hyperparameters(epochs, patience, row),
            "selection": "test accuracy at the last epoch of best validation "
                         "accuracy (>=); early stopping with patience"}
        if edge:  # only here: the node-only units' configs stay as they were
            config["edge_features"] = spec["edge_features"]
            config["edge_dim"] = spec["edge_dim"]
        folder = out_root / name / row_slug(row) / f"fold{fold}"
        if compare.finished_unit(folder, config) is not None:
            done += 1
            continue
        tasks.append({"folder": str(folder), "config": config, "data": spec,
                      "split": split, "row": row, "fold": fold, "hp": config["hp"],
                      "threads": args.threads})
    from tqdm.auto import tqdm
    bar = tqdm(total=done + len(tasks), initial=done, desc="tu_graphs", unit="unit",
               disable=args.no_progress)
    if args.jobs == 1 or len(tasks) <= 1:
        for task in tasks:
            bar.set_postfix_str(f"{task['data']['name']} fold {task['fold']} {task['row']}")
            run_task(task)
            bar.update()
    else:
        def done(index: int, _metrics: Dict[str, Any]) -> None:
            task = tasks[index]
            bar.set_postfix_str(f"{task['data']['name']} fold {task['fold']} {task['row']}")
            bar.update()

        # The first failed unit (or ^C) cancels the queued ones.
        compare.run_in_workers(run_task, [(task,) for task in tasks], args.jobs,
                               init_worker, (args.threads,), done)
    bar.close()
    text = report(out_root)
    print(text)
    return text


if __name__ == "__main__":
    main()
