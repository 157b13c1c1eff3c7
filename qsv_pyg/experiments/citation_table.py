"""Planetoid node classification (Cora, CiteSeer, PubMed) under the protocol of
PyG's own ``examples/gat.py``: QSVConv against GATConv, GATv2Conv and
TransformerConv.

The protocol (every row): ``NormalizeFeatures``, the public split (140 / 500 /
1,000 nodes on Cora), two layers — ``conv(in, 8, heads=8, dropout=0.6)``, ELU,
``conv(64, classes, heads=1, concat=False, dropout=0.6)`` — with dropout 0.6 on
the features before each layer and on the attention coefficients; Adam (lr
0.005, weight decay 5e-4) on the training nodes, full batch, 200 epochs,
evaluated after every epoch; the unit's result is the TEST accuracy at the
epoch of best VALIDATION accuracy (the first such epoch, as ``gat.py`` keeps
it). The table gives its mean ± std over the seeds (default 10), the
parameters and the CPU milliseconds per training epoch (forward, backward and
step; one torch thread by default; evaluation is not timed) — the published
GAT number is Veličković et al. 2018, Table 3.

Rows (``--models`` picks rows by name prefix; ``--diagnose`` adds the
diagnosis rows, one documented change each, see ``DIAGNOSIS``):

* ``GATConv``, ``GATv2Conv``, ``TransformerConv``: PyG's layers with exactly
  ``gat.py``'s arguments (TransformerConv keeps its default root weight);
* ``QSVConv literal``: ``QSVConv`` with exactly GATConv's arguments, QSVConv's
  defaults otherwise (no self-loops, a root weight, sandwich transport, no
  input projection: each head reads its slice of the raw features);
* ``QSVConv recipe``: docs/usage.md's recipe for graphs without geometry
  (``add_self_loops=True, root_weight=False, transport="identity"``) plus the
  options that the diagnosis rows justify (``RECIPE``);
* ``QSV model``: ``qsv_pyg.nn.models.QSV(in, 64, 2, classes, heads=8,
  dropout=0.6, act="elu", **RECIPE)``. Its ``dropout`` is also the attention
  dropout (as in PyG's ``GAT`` model). Two differences from the layer rows,
  both the ``BasicGNN`` way (PyG's ``GAT`` model does the same): its last
  layer keeps ``heads=8`` and averages them (``concat=False``: 8 heads of
  ``classes`` channels, averaged), where ``gat.py`` uses one head; and
  ``BasicGNN`` has no dropout before its first layer, so the script applies
  the protocol's input dropout (0.6) in front of it.

Every (row, seed) unit trains in its own run folder
``<out-root>/<dataset>/<row-slug>/seed<k>`` (``config.json``, ``log.jsonl``
with one line per epoch, ``metrics.json``; see :func:`~qsv_pyg.experiments.units.run_unit`): a rerun
of the same command reuses the finished units, and ``--report-only`` rebuilds
the table (``<out-root>/<dataset>/table.{md,csv,json}``) from the folders
alone. The table covers every finished unit under ``<out-root>/<dataset>``.

Data: ``<data-dir>/Planetoid/<Name>/raw/ind.<name>.*`` (``--data-dir``, else
``$QSV_DATA_DIR``) (the files PyG
downloads), copied into ``--cache-root`` where ``Planetoid`` writes its
``processed/`` folder (the data root may be read-only). The copy is keyed on the
raw files' content (``<cache-root>/<Name>-<digest>/``), so another data root
never reuses it. The raw pickles are read first with a restricted unpickler
(``qsv_pyg.data.planetoid``: numpy arrays, scipy csr matrices, a dict of lists):
a crafted or corrupt file exits 2 with one line, and nothing in it runs. A unit
being trained by another process (its folder's ``run.lock``) exits 2 naming
that process; a damaged ``metrics.json`` is named and left out of the table.
Run::

    python -m qsv_pyg.experiments.citation_table               # Cora, 6 rows x 10 seeds
    python -m qsv_pyg.experiments.citation_table --diagnose    # plus the diagnosis rows
    python -m qsv_pyg.experiments.citation_table --dataset CiteSeer
    python -m qsv_pyg.experiments.citation_table --report-only # the table from the folders
    python -m qsv_pyg.experiments.citation_table --small       # 2 seeds x 30 epochs (a test)

(This was ``examples/citation.py``; that script is now a short example that
trains one model. The units still record ``"script": "citation.py"``, so the
committed run folders keep matching.)
"""
from __future__ import annotations

import re
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

import torch_geometric
import torch_geometric.transforms as T
from torch_geometric.nn import GATConv, GATv2Conv, TransformerConv

import qsv_pyg
from qsv_pyg.data import DataError
from qsv_pyg.data.planetoid import PLANETOID_RAW, check_planetoid_raw
from qsv_pyg.experiments import compare
from qsv_pyg.experiments.compare import (Timer, count_parameters, fail, mean_std, run_unit,
                                         warm_up)
from qsv_pyg.nn import QSVConv
from qsv_pyg.nn.models import QSV
from qsv_pyg.utils import cpu_name

#: Bump when a change to this script changes what a unit trains or records:
#: the folders of an older version then no longer match (use a new --out-root).
SCRIPT_VERSION = 1

#: gat.py's protocol.
LR, WEIGHT_DECAY, DROPOUT, HIDDEN, HEADS = 0.005, 5e-4, 0.6, 8, 8
EPOCHS, SEEDS = 200, 10
SMALL_EPOCHS, SMALL_SEEDS = 30, 2

#: Planetoid's names (PyG reads ``ind.<name lowercased>.*``).
PLANETOID = {"cora": "Cora", "citeseer": "CiteSeer", "pubmed": "PubMed"}
RAW_SUFFIXES = PLANETOID_RAW

#: Published GAT test accuracy (%) under this protocol (Veličković et al. 2018,
#: Table 3). PubMed is left out: the paper trained it differently (8 output
#: heads, lr 0.01, weight decay 0.001), so its number is not this protocol's.
PUBLISHED = {"Cora": "83.0 ± 0.7", "CiteSeer": "72.5 ± 0.7"}
ANCHOR = "GATConv"

#: docs/usage.md's recipe for graphs without geometry, plus the input
#: projection (the diagnosis rows: see docs/results and the module docstring).
USAGE_RECIPE: Dict[str, Any] = {"add_self_loops": True, "root_weight": False,
                                "transport": "identity"}
RECIPE: Dict[str, Any] = {**USAGE_RECIPE, "project_input": True}

PYG_CONVS = {"GATConv": GATConv, "GATv2Conv": GATv2Conv, "TransformerConv": TransformerConv}


# ----------------------------------------------------------------- the rows
def row(name: str, kind: str, extra: Optional[Dict[str, Any]] = None,
        init: str = "default") -> Dict[str, Any]:
    """One table row: ``kind`` is a key of ``PYG_CONVS``, ``"QSVConv"`` or
    ``"QSV"`` (the model); ``extra`` are keyword arguments of both layers;
    ``init="glorot"`` re-initialises QSVConv's feature→quaternion maps plainly
    (glorot weight, zero bias) after construction."""
    return {"name": name, "kind": kind, "extra": dict(extra or {}), "init": init}


MAIN_ROWS = [
    row("GATConv", "GATConv"),
    row("GATv2Conv", "GATv2Conv"),
    row("TransformerConv", "TransformerConv"),
    row("QSVConv literal", "QSVConv"),
    row("QSVConv recipe", "QSVConv", RECIPE),
    row("QSV model", "QSV", RECIPE),
]

#: ``--diagnose``: why does QSV trail GAT on Cora? One change at a time, from
#: the literal drop-in (self-loops, root weight, input projection, the
#: quaternion maps' initialisation) and from the recipe (the projection, the
#: transport, the routing).
DIAGNOSIS = [
    row("QSVConv +loops", "QSVConv", {"add_self_loops": True}),
    row("QSVConv -root", "QSVConv", {"root_weight": False}),
    row("QSVConv +loops -root", "QSVConv", {"add_self_loops": True, "root_weight": False}),
    row("QSVConv +project", "QSVConv", {"project_input": True}),
    row("QSVConv +project init=glorot", "QSVConv", {"project_input": True}, init="glorot"),
    # The recipe with the input projection toggled (``-project`` or ``+project``).
    row("QSVConv recipe " + ("-project" if RECIPE.get("project_input") else "+project"),
        "QSVConv", {k: v for k, v in RECIPE.items() if k != "project_input"}
        if RECIPE.get("project_input") else {**RECIPE, "project_input": True}),
    row("QSVConv recipe sandwich", "QSVConv", {**RECIPE, "transport": "sandwich"}),
    row("QSVConv recipe uniform", "QSVConv", {**RECIPE, "routing": "uniform"}),
]
#: ``--source-logit``: the per-source logit term (``source_logit=True``: a
#: per-head linear score of the source's features added to the routing logit,
#: GAT's source half), each row beside the same row without it (issue 29).
SOURCE_LOGIT = [
    row("QSVConv literal +source", "QSVConv", {"source_logit": True}),
    row("QSVConv +project", "QSVConv", {"project_input": True}),
    row("QSVConv +project +source", "QSVConv", {"project_input": True, "source_logit": True}),
    row("QSVConv recipe +source", "QSVConv", {**RECIPE, "source_logit": True}),
]
ALL_ROWS = MAIN_ROWS + DIAGNOSIS + [r for r in SOURCE_LOGIT
                                    if r["name"] not in {d["name"] for d in DIAGNOSIS}]


def slug(name: str) -> str:
    """The row's folder name: ``"QSVConv +loops -root"`` ->
    ``"qsvconv_with-loops_no-root"`` (``+``/``-`` options stay distinct)."""
    parts = []
    for token in name.split():
        if token.startswith("+"):
            token = "with-" + token[1:]
        elif token.startswith("-"):
            token = "no-" + token[1:]
        parts.append(re.sub(r"[^a-z0-9]+", "-", token.lower()).strip("-"))
    return "_".join(p for p in parts if p)


def model_kwargs(spec: Dict[str, Any], num_features: int,
                 num_classes: int) -> Dict[str, Any]:
    """Every argument the row's model is built with (recorded in the config)."""
    extra = spec["extra"]
    if spec["kind"] == "QSV":
        return {"in_channels": num_features, "hidden_channels": HIDDEN * HEADS,
                "num_layers": 2, "out_channels": num_classes, "heads": HEADS,
                "dropout": DROPOUT, "act": "elu", **extra}
    return {"layer1": {"in_channels": num_features, "out_channels": HIDDEN,
                       "heads": HEADS, "dropout": DROPOUT, **extra},
            "layer2": {"in_channels": HIDDEN * HEADS, "out_channels": num_classes,
                       "heads": 1, "concat": False, "dropout": DROPOUT, **extra}}


class TwoLayer(torch.nn.Module):
    """``gat.py``'s network: dropout, conv1, ELU, dropout, conv2."""

    def __init__(self, conv1: torch.nn.Module, conv2: torch.nn.Module, p: float) -> None:
        super().__init__()
        self.conv1, self.conv2, self.p = conv1, conv2, p

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor) -> torch.Tensor:
        x = F.dropout(x, p=self.p, training=self.training)
        x = F.elu(self.conv1(x, edge_index))
        x = F.dropout(x, p=self.p, training=self.training)
        return self.conv2(x, edge_index)


class InputDropout(torch.nn.Module):
    """The protocol's dropout on the input features, in front of a ``BasicGNN``
    (which drops only between its layers)."""

    def __init__(self, model: torch.nn.Module, p: float) -> None:
        super().__init__()
        self.model, self.p = model, p

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor) -> torch.Tensor:
        return self.model(F.dropout(x, p=self.p, training=self.training), edge_index)


def qsv_convs(model: torch.nn.Module) -> List[QSVConv]:
    return [m for m in model.modules() if isinstance(m, QSVConv)]


def plain_init(conv: QSVConv) -> None:
    """Glorot weight and zero bias for the feature→quaternion maps, in place of
    QSVConv's near-identity start (``_near_identity``: weight × 0.5, bias
    (1, 0, 0, 0) per head)."""
    for lin in (conv.lin_quat, conv.lin_quat_src, conv.lin_quat_dst):
        if lin is not None:
            lin.reset_parameters()  # PyG Linear, weight_initializer="glorot"
            with torch.no_grad():
                lin.bias.zero_()


def build(spec: Dict[str, Any], kwargs: Dict[str, Any]) -> torch.nn.Module:
    if spec["kind"] == "QSV":
        model: torch.nn.Module = InputDropout(QSV(**kwargs), DROPOUT)
    else:
        cls = QSVConv if spec["kind"] == "QSVConv" else PYG_CONVS[spec["kind"]]
        model = TwoLayer(cls(**kwargs["layer1"]), cls(**kwargs["layer2"]), DROPOUT)
    if spec["init"] == "glorot":
        for conv in qsv_convs(model):
            plain_init(conv)
    elif spec["init"] != "default":
        raise ValueError(f"unknown init {spec['init']!r}")
    return model


# ------------------------------------------------------------------ the data
def canonical_name(dataset: str) -> str:
    name = PLANETOID.get(dataset.lower())
    if name is None:
        fail(f"unknown --dataset {dataset!r}; Planetoid has {', '.join(PLANETOID.values())}")
    return name


def load(data_root: Path, name: str, cache_root: Path):
    """The Planetoid graph ``name`` from ``data_root``, processed in a writable
    copy under ``cache_root`` (keyed on the raw files' content).

    Every raw pickle is read first with a restricted unpickler
    (:func:`qsv_pyg.data.planetoid.check_planetoid_raw`: numpy arrays, scipy
    csr matrices and a dict of lists only), in the data root and again in the
    copy that ``Planetoid`` reads: a crafted or corrupt file exits 2 (one line)
    and nothing in it runs."""
    source = Path(data_root) / "Planetoid" / name
    raw = source / "raw"
    if not raw.is_dir():
        fail(f"{name}: no folder {raw} (check --data-dir {data_root} and --dataset)")
    try:
        check_planetoid_raw(raw, name)
    except DataError as error:
        fail(str(error))
    from torch_geometric.datasets import Planetoid
    with compare.dataset_copy(source, cache_root, name) as root:
        try:
            check_planetoid_raw(root / name / "raw", name)
            dataset = Planetoid(str(root), name, split="public",
                                transform=T.NormalizeFeatures())
            data = dataset[0]
        except DataError as error:
            fail(str(error))
        except Exception as error:  # files PyG cannot combine: one line, not a trace
            fail(f"{name}: Planetoid cannot read {raw} ({type(error).__name__}: "
                 f"{' '.join(str(error).split())})")
    return data, dataset.num_features, dataset.num_classes


# ------------------------------------------------------------------ training


def accuracies(model: torch.nn.Module, data) -> Tuple[float, float, float]:
    model.eval()
    with torch.no_grad():
        pred = model(data.x, data.edge_index).argmax(dim=-1)
    return tuple(float((pred[m] == data.y[m]).sum()) / int(m.sum())  # type: ignore
                 for m in (data.train_mask, data.val_mask, data.test_mask))


def train_unit(model: torch.nn.Module, data, epochs: int,
               log: Callable[[Dict[str, Any]], None]) -> Dict[str, Any]:
    """``gat.py``'s loop: one full-batch Adam step per epoch, then evaluation;
    the test accuracy at the first epoch of best validation accuracy."""
    optimizer = torch.optim.Adam(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    x, edge_index, y, mask = data.x, data.edge_index, data.y, data.train_mask
    model.train()
    # One untimed forward and backward: one-off costs (a CSR, a kernel's first
    # build) stay out of the time per epoch.
    warm_up(lambda: model(x, edge_index).sum(), model)
    # The aggregation QSVConv takes while training, and why (qsv_pyg's choice).
    paths = [" / ".join(conv.path_reason(x, None, edge_index)) for conv in qsv_convs(model)]
    timer = Timer()
    losses: List[float] = []

    def step() -> None:
        model.train()
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x, edge_index)[mask], y[mask])
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))

    best = {"epoch": 0, "val": -1.0, "test": 0.0, "train": 0.0}
    eval_seconds: List[float] = []
    for epoch in range(1, epochs + 1):
        timer.epoch(step)
        start = time.process_time()
        train_acc, val_acc, test_acc = accuracies(model, data)
        eval_seconds.append(time.process_time() - start)
        if val_acc > best["val"]:
            best = {"epoch": epoch, "val": val_acc, "test": test_acc, "train": train_acc}
        log({"epoch": epoch, "loss": losses[-1], "train_acc": train_acc,
             "val_acc": val_acc, "test_acc": test_acc, "seconds": timer.seconds[-1]})
    return {"best_epoch": best["epoch"], "val_acc": best["val"], "test_acc": best["test"],
            "train_acc": best["train"], "final_test_acc": test_acc,
            "params": count_parameters(model), "ms_per_epoch": 1000 * timer.per_epoch,
            "eval_ms": 1000 * statistics.fmean(eval_seconds),
            "train_paths": paths, "torch": torch.__version__,
            "pyg": torch_geometric.__version__, "qsv_pyg": qsv_pyg.__version__,
            "qsv_pyg_commit": compare.source_commit(),
            "cpu": cpu_name(), "threads": torch.get_num_threads()}


# --------------------------------------------------------------------- table
COLUMNS = ("row", "test acc (%)", "seeds", "parameters", "ms/epoch",
           f"ms/epoch vs {ANCHOR}", "published")


def table_rows(units: List[Tuple[Dict[str, Any], Dict[str, Any]]],
               dataset: str) -> Tuple[List[Dict[str, Any]], List[int]]:
    """One table row per row name (in ``ALL_ROWS`` order, unknown names last),
    and the epoch counts the units were trained for."""
    by_row: Dict[str, List[Tuple[Dict[str, Any], Dict[str, Any]]]] = {}
    for config, metrics in units:
        by_row.setdefault(config["row"], []).append((config, metrics))
    order = [spec["name"] for spec in ALL_ROWS]
    names = sorted(by_row, key=lambda n: (order.index(n) if n in order else len(order), n))
    ms = {n: statistics.fmean(m["ms_per_epoch"] for _, m in by_row[n]) for n in names}
    rows = []
    for name in names:
        group = sorted(by_row[name], key=lambda u: u[0]["seed"])
        params = sorted({m["params"] for _, m in group})
        rel = f"{ms[name] / ms[ANCHOR]:.2f}×" if ANCHOR in ms and ms[ANCHOR] > 0 else "–"
        rows.append({
            "row": name,
            "test acc (%)": mean_std([m["test_acc"] for _, m in group]),
            "seeds": len(group),
            "parameters": ", ".join(f"{p:,}" for p in params),
            "ms/epoch": f"{ms[name]:.1f}",
            f"ms/epoch vs {ANCHOR}": rel,
            "published": PUBLISHED.get(dataset, "–") if name == ANCHOR else "–",
        })
    epochs = sorted({c["epochs"] for c, _ in units})
    return rows, epochs


#: What the table reads of every unit (a unit lacking one is named and left out).
CONFIG_FIELDS = {"row": str, "seed": int, "epochs": int, "threads": int}
METRICS_FIELDS = {"test_acc": compare.NUMBER, "params": int, "ms_per_epoch": compare.NUMBER}


def report(root: Path, dataset: str, models: Optional[str]) -> Tuple[str, List[Dict[str, Any]]]:
    units = compare.read_units(root, CONFIG_FIELDS, METRICS_FIELDS)
    if models is not None:
        prefixes = tuple(m.strip() for m in models.split(",") if m.strip())
        units = [u for u in units if u[0]["row"].startswith(prefixes)]
    if not units:
        fail(f"no finished units under {root}" + (f" for --models {models!r}" if models else ""))
    rows, epochs = table_rows(units, dataset)
    threads = sorted({c["threads"] for c, _ in units})
    title = (f"Planetoid {dataset}, public split, gat.py's protocol: test accuracy at the "
             f"best validation epoch of {'/'.join(map(str, epochs))} epochs; CPU ms per "
             f"training epoch, {'/'.join(map(str, threads))} thread(s)")
    text = compare.write_table(root / "table", COLUMNS, rows, title=title)
    return text, rows


# ---------------------------------------------------------------------- main
def parser():
    p = compare.base_parser(__doc__.split("\n\n")[0])
    p.prog = "python -m qsv_pyg.experiments.citation_table"
    p.set_defaults(seeds=None)
    for action in p._actions:  # base_parser's help names its own default
        if action.dest == "seeds":
            action.help = f"number of seeds (default {SEEDS}; {SMALL_SEEDS} with --small)"
        if action.dest == "small":
            action.help = (f"a tiny run for tests: {SMALL_SEEDS} seeds, {SMALL_EPOCHS} "
                           f"epochs, default --out-root docs/results/citation-small")
    compare.add_data_args(p, "Cora", "docs/results/citation")
    p.add_argument("--epochs", type=int, default=None,
                   help=f"training epochs (default {EPOCHS}; {SMALL_EPOCHS} with --small)")
    p.add_argument("--diagnose", action="store_true",
                   help="add the diagnosis rows (one change each from the literal drop-in "
                        "and from the recipe)")
    p.add_argument("--source-logit", action="store_true",
                   help="add the per-source logit rows (source_logit=True), each "
                        "beside the same row without it")
    p.add_argument("--cache-root", type=Path, default=Path("~/.cache/qsv_pyg/planetoid"),
                   help="writable folder where the dataset is copied and processed "
                        "(default ~/.cache/qsv_pyg/planetoid)")
    return p


def main(argv: Optional[Sequence[str]] = None) -> List[Dict[str, Any]]:
    args = parser().parse_args(argv)
    dataset = canonical_name(args.dataset)
    epochs = args.epochs if args.epochs is not None else (SMALL_EPOCHS if args.small else EPOCHS)
    seeds = args.seeds if args.seeds is not None else (SMALL_SEEDS if args.small else SEEDS)
    if epochs < 1 or seeds < 1:
        fail(f"--epochs and --seeds must be positive (got {epochs} and {seeds})")
    if args.threads < 1:
        fail(f"--threads must be positive (got {args.threads})")
    out_root = args.out_root
    if args.small and out_root == Path("docs/results/citation"):
        out_root = Path("docs/results/citation-small")
    root = out_root / dataset
    compare.check_folder(root, "--out-root")

    if not args.report_only:
        candidates = MAIN_ROWS + (DIAGNOSIS if args.diagnose else [])
        if args.source_logit:
            candidates += [r for r in SOURCE_LOGIT
                           if r["name"] not in {c["name"] for c in candidates}]
        specs = [spec for _, spec in compare.selected(
            [(spec["name"], spec) for spec in candidates], args.models)]
        torch.set_num_threads(args.threads)
        data, num_features, num_classes = load(args.data_dir, dataset, args.cache_root)
        units = [(spec, seed) for spec in specs for seed in range(seeds)]
        from tqdm.auto import tqdm
        bar = tqdm(units, desc=f"citation {dataset}", unit="unit", disable=args.no_progress)
        for spec, seed in bar:
            bar.set_postfix_str(f"{spec['name']} seed {seed}")
            kwargs = model_kwargs(spec, num_features, num_classes)
            config = {"script": "citation.py", "version": SCRIPT_VERSION,
                      "dataset": dataset, "split": "public", "transform": "NormalizeFeatures",
                      "row": spec["name"], "kind": spec["kind"], "seed": seed,
                      "epochs": epochs, "lr": LR, "weight_decay": WEIGHT_DECAY,
                      "dropout": DROPOUT, "input_dropout": DROPOUT,
                      "threads": args.threads, "model": kwargs, "init": spec["init"]}

            def train(log, spec=spec, seed=seed, kwargs=kwargs):
                torch.manual_seed(seed)
                return train_unit(build(spec, kwargs), data, epochs, log)

            run_unit(root / slug(spec["name"]) / f"seed{seed}", config, train)
        bar.close()
    text, rows = report(root, dataset, args.models)
    print(text)
    return rows


if __name__ == "__main__":
    main()
