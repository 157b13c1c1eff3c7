"""The TU sets of the fair-comparison table (:mod:`qsv_pyg.experiments.tu_table`):
their features, the graphs, and the fixed stratified splits.

The splits are fixed: seeded (``SPLIT_SEED``), computed without sklearn (classes
shuffled, then dealt round-robin into folds: every test fold holds floor or ceil
of ``n_c / K`` graphs of every class ``c``; the validation part takes
``round(0.1 * n_c)`` of every class of the fold's training part), and saved as
``<out-root>/<DATASET>/splits.json`` (train/val/test indices per fold), which a
rerun reuses (a file that does not fit the data or ``--folds`` is an error).

Data and features (``<data-dir>/TUDataset/<NAME>/raw/``, copied into
``--cache-root`` where ``TUDataset`` writes ``processed/``, keyed on the raw
files' content so another data root never reuses the copy; the data root is
read-only). Node features are the one-hot node labels (TUDataset's default),
as Errica et al. use for the chemical sets; **ENZYMES** also gets its 18
continuous node attributes (``use_node_attr=True``: 21 features), as Errica et
al. do (``PrepareDatasets.py`` sets ``use_node_attrs`` for ENZYMES;
``_dim_features = 21  # 18 attr + 3 labels``). Unlike them, the attributes are
standardised per fold (mean and std over the nodes of the fold's training
graphs): raw, they reach 762, and in 30 epochs on fold 0 QSV reached 30% test
accuracy on raw attributes and 68% on standardised ones (the baseline 37% and
53%); Errica et al. train for thousands of epochs. A set without node
features (**IMDB-BINARY**) gets one-hot degrees, ``OneHotDegree(max_degree)``
with the largest degree in the data (135 on IMDB-BINARY: 136 features), the GIN
paper's features for social networks; Errica et al.'s code appends the degree
as one scalar feature instead (``use_node_degree``). PROTEINS: Errica et al.
read PROTEINS_full with node labels only, the same 3 features as PROTEINS here.
No graph is filtered out (Errica et al. drop graphs with one node or no edge;
none of the five sets has one). Any TU set laid out the same way runs
unchanged (``--dataset NAME``; ``--node-attributes`` names the sets whose
attributes are used).
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from qsv_pyg.experiments import compare
from qsv_pyg.experiments.compare import fail
from qsv_pyg.training.run_files import read_json, write_text

__all__ = ["DATASETS", "NODE_ATTRIBUTES", "FOLDS", "VAL_FRACTION", "SPLIT_SEED",
           "prepare_dataset", "load_graphs", "make_splits", "load_or_make_splits",
           "check_folds", "split_digest", "standardised"]

DATASETS = ("MUTAG", "PROTEINS", "NCI1", "ENZYMES", "IMDB-BINARY")
#: Sets whose continuous node attributes are features too (Errica et al.).
NODE_ATTRIBUTES = ("ENZYMES",)
FOLDS, VAL_FRACTION, SPLIT_SEED = 10, 0.1, 0


def node_features(labels: int, attrs: int, max_degree: Optional[int]) -> str:
    """The features in words (recorded in every unit's config)."""
    if max_degree is not None:
        return f"one-hot degree (max {max_degree}: {max_degree + 1} features)"
    text = f"one-hot node labels ({labels})"
    if attrs:
        text += (f" + {attrs} continuous node attributes (standardised with the mean and "
                 f"std of the fold's training graphs)")
    return text


def prepare_dataset(name: str, data_root: Path, cache_root: Path,
                    attribute_sets: Sequence[str]) -> Dict[str, Any]:
    """Copy the set into the cache (``compare.dataset_copy``: keyed on the raw
    files' content), let ``TUDataset`` process it there, and describe it: what a
    worker needs to load it, its labels and features."""
    from torch_geometric.datasets import TUDataset
    source = Path(data_root) / "TUDataset" / name
    if not (source / "raw").is_dir():
        fail(f"{name}: no folder {source / 'raw'} (check --data-dir {data_root} "
             f"and --dataset)")
    use_attr = name in attribute_sets
    # A copy keyed on the raw files' content: another --data-dir never reuses it.
    with compare.dataset_copy(source, cache_root, name) as cache:
        try:
            dataset = TUDataset(str(cache), name, use_node_attr=use_attr)
        except Exception as error:  # a malformed raw folder: one line, not a trace
            fail(f"{name}: TUDataset cannot read {source / 'raw'} ({type(error).__name__}: "
                 f"{error})")
    y = dataset._data.y.view(-1)
    max_degree = None
    if dataset.num_node_features == 0:
        from torch_geometric.utils import degree
        max_degree = max(int(degree(g.edge_index[0], g.num_nodes, dtype=torch.long).max())
                         if g.edge_index.numel() else 0 for g in dataset)
    # TUDataset puts the attributes first, then the one-hot labels; it counts the
    # attributes of the raw files also where use_node_attr leaves them out.
    attrs = dataset.num_node_attributes if use_attr and max_degree is None else 0
    spec = {"name": name, "cache": str(cache), "use_node_attr": use_attr,
            "max_degree": max_degree, "num_classes": int(y.max()) + 1,
            "num_graphs": len(dataset), "num_attributes": attrs}
    spec["num_features"] = (max_degree + 1 if max_degree is not None
                            else dataset.num_node_features)
    spec["features"] = node_features(dataset.num_node_labels, attrs, max_degree)
    # TUDataset one-hot encodes the edge labels (``<NAME>_edge_labels.txt``) as
    # ``edge_attr`` (continuous edge attributes are left out: use_edge_attr=False).
    labels = dataset.num_edge_labels
    spec["edge_dim"] = labels if labels > 0 else None
    spec["edge_features"] = f"one-hot edge labels ({labels})" if labels > 0 else None
    spec["labels"] = y.tolist()
    return spec


_GRAPHS: Dict[Tuple[Any, ...], list] = {}


def load_graphs(spec: Dict[str, Any]) -> list:
    """The set's graphs as a list (features final: one-hot degrees applied), once
    per process."""
    key = (spec["cache"], spec["name"], spec["use_node_attr"], spec["max_degree"])
    if key not in _GRAPHS:
        from torch_geometric.datasets import TUDataset
        from torch_geometric.transforms import OneHotDegree
        dataset = TUDataset(spec["cache"], spec["name"], use_node_attr=spec["use_node_attr"])
        transform = (OneHotDegree(spec["max_degree"]) if spec["max_degree"] is not None
                     else None)
        graphs = []
        for i in range(len(dataset)):
            graph = dataset[i]
            graphs.append(transform(graph) if transform is not None else graph)
        _GRAPHS[key] = graphs
    return _GRAPHS[key]


# ---------------------------------------------------------------- the splits
def labels_digest(labels: Sequence[int]) -> str:
    return hashlib.sha256(json.dumps(list(labels)).encode()).hexdigest()


def make_splits(labels: Sequence[int], folds: int, seed: int = SPLIT_SEED,
                val_fraction: float = VAL_FRACTION) -> List[Dict[str, List[int]]]:
    """Stratified ``folds``-fold train/val/test indices, seeded, without sklearn.

    Every class is shuffled and the classes, one after another, are dealt
    round-robin into the folds: each test fold holds floor or ceil of
    ``n_c / folds`` graphs of class ``c`` (and the fold sizes differ by at most
    one). The validation part takes ``round(val_fraction * m_c)`` of the ``m_c``
    graphs of class ``c`` in the fold's training part, at random."""
    y = np.asarray(labels)
    rng = np.random.RandomState(seed)
    order = np.concatenate([rng.permutation(np.flatnonzero(y == c)) for c in np.unique(y)])
    fold_of = np.empty(len(y), dtype=np.int64)
    fold_of[order] = np.arange(len(y)) % folds
    splits = []
    for k in range(folds):
        test = np.flatnonzero(fold_of == k)
        rest = np.flatnonzero(fold_of != k)
        inner = np.random.RandomState([seed, k + 1])
        val_parts = []
        for c in np.unique(y):
            members = inner.permutation(rest[y[rest] == c])
            val_parts.append(members[:int(np.floor(val_fraction * len(members) + 0.5))])
        val = np.sort(np.concatenate(val_parts))
        train = np.setdiff1d(rest, val)
        splits.append({"train": train.tolist(), "val": val.tolist(), "test": test.tolist()})
    return splits


def load_or_make_splits(path: Path, spec: Dict[str, Any], folds: int
                        ) -> List[Dict[str, List[int]]]:
    """The saved splits of ``path`` when present (checked against the data and
    ``folds``), else new ones, saved there."""
    digest = labels_digest(spec["labels"])
    saved = read_json(path)
    if saved is not None:
        if saved.get("num_graphs") != spec["num_graphs"] or saved.get("labels_sha256") != digest:
            fail(f"{path} holds splits of other data ({saved.get('num_graphs')} graphs); "
                 f"use another --out-root or remove it")
        if saved.get("folds") != folds:
            fail(f"{path} holds {saved.get('folds')}-fold splits, not --folds {folds}; "
                 f"use another --out-root or remove it")
        return [{k: fold[k] for k in ("train", "val", "test")} for fold in saved["splits"]]
    splits = make_splits(spec["labels"], folds)
    for k, split in enumerate(splits):  # checked before anything is saved
        empty = [part for part in ("train", "val", "test") if not split[part]]
        if empty:
            fail(f"{spec['name']} has too few graphs for --folds {folds}: fold {k}'s "
                 f"{' and '.join(empty)} part would be empty")
    counts = np.bincount(np.asarray(spec["labels"])).tolist()
    header = {
        "dataset": spec["name"], "num_graphs": spec["num_graphs"], "folds": folds,
        "seed": SPLIT_SEED, "val_fraction": VAL_FRACTION, "class_counts": counts,
        "labels_sha256": digest,
        "method": "stratified: classes shuffled, dealt round-robin into folds; "
                  "validation: round(val_fraction * n_c) of each class of the "
                  "training part"}
    # One line per fold (the index lists would take one line per index).
    lines = [f"  {json.dumps(k)}: {json.dumps(v)}," for k, v in header.items()]
    folds_text = ",\n".join("    " + json.dumps({"fold": k, **s}) for k, s in enumerate(splits))
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text(path, "{\n" + "\n".join(lines) + '\n  "splits": [\n' + folds_text
               + "\n  ]\n}\n")
    return splits


def check_folds(spec: Dict[str, Any], folds: int) -> None:
    """Exit 2 (one line) unless ``folds`` stratified folds of the set ``spec`` each
    get a test part holding every class: at most as many folds as graphs of the
    smallest class (more would leave test folds without it, or empty)."""
    counts = np.bincount(np.asarray(spec["labels"], dtype=np.int64))
    present = [(int(n), c) for c, n in enumerate(counts) if n > 0]
    smallest, label = min(present)
    if folds > spec["num_graphs"]:
        fail(f"--folds {folds} is more than the {spec['num_graphs']} graphs of "
             f"{spec['name']}: some test folds would be empty")
    if folds > smallest:
        fail(f"--folds {folds} is more than the {smallest} graphs of {spec['name']}'s "
             f"smallest class ({label}): some stratified test folds would lack it "
             f"(use at most --folds {smallest})")


def split_digest(split: Dict[str, List[int]]) -> str:
    return hashlib.sha256(json.dumps(
        [split["train"], split["val"], split["test"]]).encode()).hexdigest()[:16]


def standardised(graphs: list, train: Sequence[int], columns: int) -> list:
    """Copies of ``graphs`` whose first ``columns`` features (the continuous node
    attributes) are standardised with the mean and std over the nodes of the
    ``train`` graphs; ``graphs`` itself when there are none."""
    if columns == 0:
        return graphs
    x = torch.cat([graphs[i].x[:, :columns] for i in train])
    mean, std = x.mean(0), x.std(0)
    std = torch.where(std > 1e-6, std, torch.ones_like(std))
    out = []
    for graph in graphs:
        graph = graph.clone()
        features = graph.x.clone()
        features[:, :columns] = (features[:, :columns] - mean) / std
        graph.x = features
        out.append(graph)
    return out
