"""Node classification: QSV against GAT, GATv2 and Transformer models.

Two transductive tasks, full-batch training, accuracy on the unlabelled nodes
after the last epoch:

* KarateClub (ships with PyG): 34 nodes, one-hot features, 4 labelled nodes;
* a generated stochastic block model: ``blocks`` communities, noisy Gaussian
  features whose class means overlap, a few labelled nodes per class.

Every model has two layers; the controls' hidden widths match QSV's parameter
count. For QSV models that rotate messages, the table also gives the mean angle
of the first layer's relative rotations ``r_ij`` before and after training.
``--karate-ablation`` adds a table of QSV variants on KarateClub (why QSV
with its defaults generalises worse there; see docs/usage.md). Run::

    python examples/node_classification.py [--karate-ablation]
    python examples/node_classification.py --small     # a few seconds
"""
from __future__ import annotations

from typing import Callable, List, Optional

import torch
import torch.nn.functional as F

from qsv_pyg.experiments.compare import (CONTROLS, QSV, Timer, base_parser, collect,
                                         matched_control, count_parameters,
                                         print_table, rotation_angle, seed_all,
                                         selected, warm_up)
from torch_geometric.data import Data
from torch_geometric.datasets import KarateClub
from torch_geometric.utils import stochastic_blockmodel_graph

HIDDEN, LAYERS, HEADS, DROPOUT = 16, 2, 2, 0.5
# Mean rotation angle of r_ij in the first layer (degrees), before and after training.
ANGLES = ("r° init", "r° trained")


def sbm(blocks: int, size: int, labelled: int, seed: int = 0) -> Data:
    """Stochastic block model with 8-d class-mean features plus unit Gaussian noise."""
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)  # stochastic_blockmodel_graph draws from the global RNG
    probs = torch.full((blocks, blocks), 0.6 / (blocks * size))
    probs.fill_diagonal_(4.0 / size)
    edge_index = stochastic_blockmodel_graph([size] * blocks, probs)
    y = torch.arange(blocks).repeat_interleave(size)
    means = 0.5 * torch.randn(blocks, 8, generator=g)
    x = means[y] + torch.randn(blocks * size, 8, generator=g)
    train_mask = torch.zeros(blocks * size, dtype=torch.bool)
    for c in range(blocks):
        members = (y == c).nonzero().view(-1)
        train_mask[members[torch.randperm(size, generator=g)[:labelled]]] = True
    return Data(x=x, edge_index=edge_index, y=y, train_mask=train_mask)


def fit(model: torch.nn.Module, data: Data, epochs: int) -> dict:
    """Adam (lr 0.01, weight decay 5e-4) on the labelled nodes; accuracy on the rest."""
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01, weight_decay=5e-4)
    timer = Timer()
    rotates = isinstance(model, QSV) and model.convs[0].transport == "sandwich"
    angle_init = rotation_angle(model, data.x, data.edge_index) if rotates else None
    warm_up(lambda: model(data.x, data.edge_index).sum(), model)

    def step() -> None:
        model.train()
        optimizer.zero_grad()
        out = model(data.x, data.edge_index)
        F.cross_entropy(out[data.train_mask], data.y[data.train_mask]).backward()
        optimizer.step()

    for _ in range(epochs):
        timer.epoch(step)
    model.eval()
    with torch.no_grad():
        pred = model(data.x, data.edge_index).argmax(-1)
    test = ~data.train_mask
    out = {"acc": float((pred[test] == data.y[test]).float().mean()),
           "time": timer.per_epoch}
    if angle_init is not None:
        out[ANGLES[0]] = angle_init
        out[ANGLES[1]] = rotation_angle(model, data.x, data.edge_index)
    return out


def compare(data: Data, num_classes: int, epochs: int, seeds: int,
            variants: List[tuple], models: Optional[str] = None) -> dict:
    """Train every ``(name, builder)`` of ``variants`` and the matched controls."""
    in_channels = data.num_features
    target = count_parameters(variants[0][1]())
    specs = list(variants) + [
        (name, lambda name=name: matched_control(name, in_channels, target, LAYERS,
                                                 num_classes, HEADS, dropout=DROPOUT))
        for name in CONTROLS]
    results: dict = {}
    for name, build in selected(specs, models):
        for seed in range(seeds):
            seed_all(seed)
            model = build()
            out = fit(model, data, epochs)
            collect(results, name, count_parameters(model), out.pop("time"), **out)
    return results


def qsv(in_channels: int, num_classes: int, **kwargs) -> Callable[[], QSV]:
    """A builder of the two-layer QSV model with ``kwargs`` for its layers."""
    return lambda: QSV(in_channels, HIDDEN, LAYERS, num_classes, heads=HEADS,
                       dropout=DROPOUT, **kwargs)


def variants(data: Data, num_classes: int, ablation: bool = False) -> List[tuple]:
    """QSV rows: its defaults, GAT's layer options (self-loops, no root weight:
    ``+loops -root``), and those with the identity transport. ``ablation`` adds
    one change at a time (KarateClub: with one-hot features a root weight is a
    free per-node embedding, and a field gives every node a free rotation)."""
    c, n = data.num_features, num_classes
    gat_like = dict(add_self_loops=True, root_weight=False)
    rows = [
        ("QSV", qsv(c, n)),
        ("QSV +loops -root", qsv(c, n, **gat_like)),
        ("QSV +loops -root identity-transport", qsv(c, n, transport="identity", **gat_like)),
    ]
    if ablation:
        rows += [
            ("QSV -root", qsv(c, n, root_weight=False)),
            ("QSV +loops", qsv(c, n, add_self_loops=True)),
            ("QSV +loops -root uniform-routing", qsv(c, n, routing="uniform", **gat_like)),
            ("QSV +loops -root uniform-routing identity-transport",
             qsv(c, n, routing="uniform", transport="identity", **gat_like)),
            ("QSV +loops -root field",
             qsv(c, n, quat_source="field", num_nodes=data.num_nodes, **gat_like)),
        ]
    return rows


def main(argv: Optional[List[str]] = None) -> dict:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--karate-ablation", action="store_true",
                        help="also compare QSV variants on KarateClub")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    karate = KarateClub()[0]
    blocks, size, labelled = (3, 30, 5) if args.small else (5, 100, 10)
    graph = sbm(blocks, size, labelled)
    epochs = 50 if args.small else 100
    tables = {}
    tables["karate"] = compare(karate, 4, epochs, args.seeds,
                               variants(karate, 4, args.karate_ablation), args.models)
    print_table(f"KarateClub: 4 labelled nodes, accuracy on the other 30; {epochs} "
                f"epochs, {args.seeds} seeds", list(tables["karate"].values()),
                ("acc", *ANGLES))
    tables["sbm"] = compare(graph, blocks, epochs, args.seeds, variants(graph, blocks),
                            args.models)
    print_table(f"Stochastic block model: {blocks} blocks of {size}, {labelled} labelled "
                f"per class, accuracy on the rest (chance {1 / blocks:.2f}); {epochs} "
                f"epochs, {args.seeds} seeds", list(tables["sbm"].values()),
                ("acc", *ANGLES))
    return tables


if __name__ == "__main__":
    main()
