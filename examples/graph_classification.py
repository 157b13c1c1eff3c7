"""Graph classification: QSV against GAT, GATv2 and Transformer models.

A generated task whose answer depends on structure only: which random-graph
model drew a graph of 20-40 nodes with mean degree about 4 (Erdős–Rényi,
Watts–Strogatz small world, Barabási–Albert, two communities). Node features are
one-hot degrees (capped at 9, so 10 channels: not a multiple of four; QSV
handles that). Variable-size graphs are batched by ``DataLoader``; a model is
three layers, ``global_mean_pool`` and a linear classifier, and the controls'
hidden widths match QSV's parameter count; ``QSV identity-transport`` shows
what rotating the messages adds or costs here. Run::

    python examples/graph_classification.py
    python examples/graph_classification.py --small     # a few seconds
"""
from __future__ import annotations

from typing import List, Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from qsv_pyg.experiments.compare import (CONTROLS, QSV, PoolClassifier, base_parser,
                                         collect, matched_control, count_parameters,
                                         print_table, seed_all, selected, train_graphs)
from torch_geometric.data import Data
from torch_geometric.loader import DataLoader
from torch_geometric.utils import (barabasi_albert_graph, degree, erdos_renyi_graph,
                                   to_undirected)

FAMILIES = ("Erdős–Rényi", "small world", "Barabási–Albert", "two communities")
MAX_DEGREE = 9


def small_world(n: int, rewire: float = 0.2) -> Tensor:
    """Ring lattice with 4 neighbours per node, each edge rewired with ``rewire``."""
    src = torch.arange(n).repeat(2)
    dst = (src + torch.tensor([1, 2]).repeat_interleave(n)) % n
    moved = torch.rand(src.numel()) < rewire
    dst[moved] = torch.randint(n, (int(moved.sum()),))
    keep = src != dst
    return to_undirected(torch.stack([src[keep], dst[keep]]), num_nodes=n)


def two_communities(n: int) -> Tensor:
    """Two halves, dense inside (mean degree ~3.6), joined by ~n/10 random edges."""
    half = n // 2
    a = erdos_renyi_graph(half, 3.6 / (half - 1))
    b = erdos_renyi_graph(n - half, 3.6 / (n - half - 1)) + half
    bridges = max(1, n // 10)
    cross = torch.stack([torch.randint(half, (bridges,)),
                         torch.randint(half, n, (bridges,))])
    return to_undirected(torch.cat([a, b, cross], 1), num_nodes=n)


def random_graph(label: int, n: int) -> Data:
    if label == 0:
        edge_index = erdos_renyi_graph(n, 4.0 / (n - 1))
    elif label == 1:
        edge_index = small_world(n)
    elif label == 2:
        edge_index = barabasi_albert_graph(n, 2)
    else:
        edge_index = two_communities(n)
    deg = degree(edge_index[1], n).long().clamp_max(MAX_DEGREE)
    x = F.one_hot(deg, MAX_DEGREE + 1).float()
    return Data(x=x, edge_index=edge_index, y=torch.tensor([label]))


def make_split(per_class: int, seed: int) -> List[Data]:
    # PyG's random-graph generators use the global RNGs (Barabási–Albert numpy's).
    torch.manual_seed(seed)
    np.random.seed(seed)
    return [random_graph(label, int(torch.randint(20, 41, ())))
            for label in range(len(FAMILIES)) for _ in range(per_class)]


def main(argv: Optional[List[str]] = None) -> dict:
    args = base_parser(__doc__.splitlines()[0]).parse_args(argv)
    torch.set_num_threads(args.threads)
    per_class, epochs = (25, 10) if args.small else (100, 25)
    hidden, layers, heads = 32, 3, 2
    train = DataLoader(make_split(per_class, 0), batch_size=32, shuffle=True)
    test = {"acc": DataLoader(make_split(per_class, 1), batch_size=256)}
    c = MAX_DEGREE + 1
    target = count_parameters(QSV(c, hidden, layers, heads=heads))
    specs = [("QSV", lambda: QSV(c, hidden, layers, heads=heads)),
             ("QSV identity-transport",
              lambda: QSV(c, hidden, layers, heads=heads, transport="identity"))] + [
        (name, lambda name=name: matched_control(name, c, target, layers, None, heads))
        for name in CONTROLS]
    results: dict = {}
    for name, build in selected(specs, args.models):
        for seed in range(args.seeds):
            seed_all(seed)
            model = PoolClassifier(build(), len(FAMILIES))
            out = train_graphs(model, train, test, epochs)
            collect(results, name, count_parameters(model), out["time"], acc=out["acc"])
    print_table(f"Graph classification: {len(FAMILIES)} random-graph families, "
                f"{per_class} train / {per_class} test graphs per class, 20-40 nodes "
                f"(chance {1 / len(FAMILIES):.2f}); {epochs} epochs, {args.seeds} seeds",
                list(results.values()), ("acc",))
    return results


if __name__ == "__main__":
    main()
