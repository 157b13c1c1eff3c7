"""The rows of the TU table (:mod:`qsv_pyg.experiments.tu_table`) and their models:
QSV with the recipe for graphs without geometry, GAT, GATv2 and a TransformerConv GNN
(parameter-matched to QSV through :func:`~qsv_pyg.experiments.compare.matched_control`),
GIN (GINE with edge features) matched the same way, and Errica et al.'s
structure-agnostic baseline; every GNN is pooled per graph and mapped to the classes
(:class:`GraphClassifier`).
"""
from __future__ import annotations

from typing import Any, Dict, Final, Optional, Tuple

import torch
import torch.nn.functional as F
from torch_geometric.nn import MLP, GINEConv, MessagePassing, global_add_pool, global_mean_pool
from torch_geometric.nn.models import GIN
from torch_geometric.nn.models.basic_gnn import BasicGNN

from qsv_pyg.experiments import compare
from qsv_pyg.experiments.compare import count_parameters, matched_width
from qsv_pyg.nn.models import QSV

__all__ = ["ROWS", "BASELINE", "SOURCE", "EDGE", "EDGE_ROWS", "VARIANTS", "QSV_OPTIONS",
           "ROW_QSV_OPTIONS", "SLUGS", "base_row", "row_slug", "qsv_gnn", "matched_gin",
           "build_model", "GraphClassifier", "GINE", "SumOfNodeFeatures"]

#: docs/usage.md's recipe for graphs without geometry, plus the input projection.
QSV_OPTIONS: Dict[str, Any] = {"add_self_loops": True, "root_weight": False,
                               "transport": "identity", "project_input": True}

BASELINE = "MLP (sum of node features)"
#: ``--source-logit``'s row: the QSV row with the per-source logit term
#: (``source_logit=True`` added to ``QSV_OPTIONS``; issue 29).
SOURCE = "QSV +source"
#: Options a row adds to ``QSV_OPTIONS`` (recorded in its config's ``hp``).
ROW_QSV_OPTIONS: Dict[str, Dict[str, Any]] = {SOURCE: {"source_logit": True}}
ROWS = ("QSV", SOURCE, "GAT", "GATv2", "Transformer", "GIN", BASELINE)
SLUGS = {"QSV": "qsv", SOURCE: "qsv-source", "GAT": "gat", "GATv2": "gatv2",
         "Transformer": "transformer", "GIN": "gin", BASELINE: "mlp-sum"}
#: ``--edge-attr``: the rows that take edge features get a twin named
#: ``<row> +edge`` (folder ``<slug>-edge``) on the sets with edge labels.
EDGE = " +edge"
EDGE_ROWS = ("QSV", SOURCE, "GAT", "GATv2", "Transformer", "GIN")
#: Name suffixes of the variants; ``paired.*`` compares each with the row without it.
VARIANTS = (" +source", EDGE)


def base_row(row: str) -> Tuple[str, bool]:
    """The row without its ``+edge`` suffix, and whether it had one."""
    if row.endswith(EDGE):
        return row[:-len(EDGE)], True
    return row, False


def row_slug(row: str) -> str:
    """The row's folder name: ``SLUGS`` of its base row, ``-edge`` for ``+edge``."""
    base, edge = base_row(row)
    return SLUGS.get(base, base) + ("-edge" if edge else "")


class GraphClassifier(torch.nn.Module):
    """A ``BasicGNN``'s node embeddings, pooled per graph (sum or mean), then a
    linear map to the classes. With ``edge_attr`` the GNN also gets the batch's
    edge features (``batch.edge_attr``)."""

    def __init__(self, gnn: torch.nn.Module, num_classes: int, readout: str,
                 edge_attr: bool = False) -> None:
        super().__init__()
        self.gnn = gnn
        self.readout = readout
        self.edge_attr = edge_attr
        self.pool = global_add_pool if readout == "sum" else global_mean_pool
        self.head = torch.nn.Linear(gnn.out_channels, num_classes)

    def forward(self, batch) -> torch.Tensor:
        if self.edge_attr:
            h = self.gnn(batch.x, batch.edge_index, edge_attr=batch.edge_attr)
        else:
            h = self.gnn(batch.x, batch.edge_index)
        return self.head(self.pool(h, batch.batch))


class GINE(BasicGNN):
    r"""PyG's ``GIN`` with :class:`~torch_geometric.nn.conv.GINEConv` layers (the
    same 2-layer MLPs), which add a linear map of the edge features to every
    neighbour's features: :math:`\mathbf{x}_i' = h_\Theta\big(\mathbf{x}_i +
    \sum_{j} \mathrm{ReLU}(\mathbf{x}_j + \mathbf{W}_e \mathbf{e}_{ji})\big)`
    (``edge_dim`` gives :math:`\mathbf{W}_e`)."""
    supports_edge_weight: Final[bool] = False
    supports_edge_attr: Final[bool] = True
    supports_norm_batch: Final[bool]

    def init_conv(self, in_channels: int, out_channels: int, **kwargs) -> MessagePassing:
        mlp = MLP([in_channels, out_channels, out_channels], act=self.act,
                  act_first=self.act_first, norm=self.norm, norm_kwargs=self.norm_kwargs)
        return GINEConv(mlp, **kwargs)


class SumOfNodeFeatures(torch.nn.Module):
    """Errica et al.'s structure-agnostic baseline (their ``DeepMultisets``): a
    linear map and ReLU per node, the sum over the graph's nodes, an MLP."""

    def __init__(self, in_channels: int, hidden: int, num_classes: int) -> None:
        super().__init__()
        self.node = torch.nn.Linear(in_channels, hidden)
        self.graph = torch.nn.Linear(hidden, hidden)
        self.out = torch.nn.Linear(hidden, num_classes)

    def forward(self, batch) -> torch.Tensor:
        h = global_add_pool(F.relu(self.node(batch.x)), batch.batch)
        return self.out(F.relu(self.graph(h)))


def qsv_gnn(in_channels: int, hp: Dict[str, Any], edge_dim: Optional[int] = None) -> QSV:
    extra = {} if edge_dim is None else {"edge_dim": edge_dim}
    return QSV(in_channels, hp["hidden"], hp["layers"], heads=hp["heads"],
               dropout=hp["dropout"], **hp["qsv_options"], **extra)


def matched_gin(in_channels: int, target: int, num_layers: int, dropout: float,
                edge_dim: Optional[int] = None) -> BasicGNN:
    """PyG's ``GIN`` (``GINE`` with ``edge_dim``) whose hidden width gives the
    parameter count closest to ``target`` (as ``compare.matched_control`` does for
    the attention controls: :func:`~qsv_pyg.experiments.compare.matched_width`)."""
    def build(width: int) -> BasicGNN:
        if edge_dim is None:
            return GIN(in_channels, width, num_layers, dropout=dropout)
        return GINE(in_channels, width, num_layers, dropout=dropout, edge_dim=edge_dim)

    return matched_width(build, target)


def build_model(row: str, in_channels: int, num_classes: int,
                hp: Dict[str, Any], edge_dim: Optional[int] = None) -> torch.nn.Module:
    """The row's model; a ``+edge`` row takes ``edge_dim`` edge features. The
    controls' widths are matched to the parameters of the QSV row with the same
    edge features (``QSV_OPTIONS``, without a row's own options)."""
    base, edge = base_row(row)
    if edge and edge_dim is None:
        raise ValueError(f"row {row!r} needs edge_dim")
    edge_dim = edge_dim if edge else None
    if base == BASELINE:
        return SumOfNodeFeatures(in_channels, hp["hidden"], num_classes)
    if base in ("QSV", SOURCE):
        gnn: torch.nn.Module = qsv_gnn(in_channels, hp, edge_dim)
    else:
        with torch.random.fork_rng(devices=[]):  # the target's model is not kept
            target = count_parameters(qsv_gnn(
                in_channels, {**hp, "qsv_options": dict(QSV_OPTIONS)}, edge_dim))
        if base == "GIN":
            gnn = matched_gin(in_channels, target, hp["layers"], hp["dropout"], edge_dim)
        else:
            extra = {} if edge_dim is None else {"edge_dim": edge_dim}
            gnn = compare.matched_control(base, in_channels, target, hp["layers"], None,
                                          hp["heads"], dropout=hp["dropout"], **extra)
    return GraphClassifier(gnn, num_classes, hp["readout"], edge_attr=edge)
