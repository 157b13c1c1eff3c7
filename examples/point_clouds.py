"""Point-cloud classification under rotations: QSV with geometric quaternions.

Generated shapes (sphere, cube, cylinder, cone, torus surfaces with random
per-axis scaling and noise) are trained in their canonical orientation and tested
on fresh shapes, once as generated and once under random 3-D rotations. Graphs are
kNN graphs (``torch_cluster.knn_graph``); every node has a local PCA frame
(:func:`qsv_pyg.geometry.local_frames`). Two input encodings, one quaternion block
each, ``(|p|, v)`` with ``p`` the point relative to the shape's centroid:

* ``xyz``: ``v = p`` in the global axes (changes with a rotation);
* ``local``: ``v = R_i^T p``, written in the node's own frame (does not).

QSV-geometric reads ``local`` inputs with the frames' quaternions and ``|Re r|``
routing; its transport ``q_i* q_j`` carries a neighbour's vector from that
neighbour's frame into the target's frame, so the whole model is rotation
invariant. QSV-features and the controls (GAT, GATv2, Transformer, matched
parameter counts) run on both encodings; ``QSV-geometric (identity transport)``
isolates what the transport adds. Run::

    python examples/point_clouds.py            # about a minute on one core
    python examples/point_clouds.py --small    # a few seconds
"""
from __future__ import annotations

import math
from typing import List, Optional

import torch
from torch import Tensor

from qsv_pyg.experiments.compare import (PoolClassifier, QSV, CONTROLS, base_parser,
                                         collect, matched_control, count_parameters,
                                         print_table, seed_all, selected, train_graphs)
from torch_cluster import knn_graph
from torch_geometric.data import Data
from torch_geometric.loader import DataLoader

from qsv_pyg.geometry import local_frames, matrix_to_quaternion
from qsv_pyg.quaternion import quaternion_to_matrix, random_unit_quaternion

SHAPES = ("sphere", "cube", "cylinder", "cone", "torus")


def sample_shape(label: int, n: int, g: torch.Generator) -> Tensor:
    """``n`` points on the surface of shape ``SHAPES[label]``, canonical axes."""
    u = torch.rand(n, 3, generator=g)
    angle = 2 * math.pi * u[:, 0]
    name = SHAPES[label]
    if name == "sphere":
        p = torch.randn(n, 3, generator=g)
        p = p / p.norm(dim=1, keepdim=True)
    elif name == "cube":
        p = u * 2 - 1
        face = torch.randint(3, (n,), generator=g)
        sign = torch.randint(2, (n,), generator=g) * 2.0 - 1
        p[torch.arange(n), face] = sign
    elif name == "cylinder":
        p = torch.stack([0.6 * angle.cos(), 0.6 * angle.sin(), u[:, 1] * 2 - 1], 1)
    elif name == "cone":  # area-uniform along the slant: t ~ sqrt(U)
        t = u[:, 1].sqrt()
        p = torch.stack([0.8 * t * angle.cos(), 0.8 * t * angle.sin(), 1 - 2 * t], 1)
    else:  # torus, major radius 0.7, minor 0.3
        phi = 2 * math.pi * u[:, 1]
        ring = 0.7 + 0.3 * phi.cos()
        p = torch.stack([ring * angle.cos(), ring * angle.sin(), 0.3 * phi.sin()], 1)
    return p


def encode(pos: Tensor, label: int, k: int) -> Data:
    """kNN graph, frames, quaternions and both input encodings of one shape."""
    edge_index = knn_graph(pos, k=k, loop=False)
    frames = local_frames(pos, edge_index)
    radius = pos.norm(dim=1, keepdim=True)
    local = (frames.transpose(1, 2) @ pos.unsqueeze(-1)).squeeze(-1)
    return Data(edge_index=edge_index, y=torch.tensor([label]), num_nodes=pos.size(0),
                x_xyz=torch.cat([radius, pos], 1), x_local=torch.cat([radius, local], 1),
                quat=matrix_to_quaternion(frames))


def make_shapes(per_class: int, n: int, noise: float, g: torch.Generator) -> List[tuple]:
    """``(points, label)`` pairs: scaled per axis, noisy, centred, unit radius."""
    shapes = []
    for label in range(len(SHAPES)):
        for _ in range(per_class):
            p = sample_shape(label, n, g) * (0.75 + 0.5 * torch.rand(3, generator=g))
            p = p + noise * torch.randn(n, 3, generator=g)
            p = p - p.mean(0)
            shapes.append((p / p.norm(dim=1).max(), label))
    return shapes


def encode_all(shapes: List[tuple], k: int, g: Optional[torch.Generator] = None
               ) -> List[Data]:
    """Encode every shape, each under its own random rotation when ``g`` is given."""
    out = []
    for p, label in shapes:
        if g is not None:
            p = p @ quaternion_to_matrix(random_unit_quaternion(generator=g)).T
        out.append(encode(p, label, k))
    return out


def with_inputs(data: List[Data], key: str) -> List[Data]:
    return [Data(x=d[key], edge_index=d.edge_index, y=d.y, quat=d.quat) for d in data]


def main(argv: Optional[List[str]] = None) -> dict:
    args = base_parser(__doc__.splitlines()[0]).parse_args(argv)
    torch.set_num_threads(args.threads)
    small = args.small
    per_class, test_per_class, n, epochs = (12, 12, 32, 12) if small else (30, 30, 48, 20)
    k, hidden, layers, heads = 8, 32, 3, 1
    g = torch.Generator().manual_seed(1234)
    train = encode_all(make_shapes(per_class, n, 0.02, g), k)
    test_shapes = make_shapes(test_per_class, n, 0.02, g)
    # The same test shapes as generated and under random rotations.
    tests = {"aligned": encode_all(test_shapes, k),
             "rotated": encode_all(test_shapes, k, g)}
    num_classes = len(SHAPES)
    qsv_kw = dict(heads=heads)
    # (row name, input encoding, model builder)
    specs = [
        ("QSV-geometric", "x_local",
         lambda: QSV(4, hidden, layers, quat_source="given", routing="abs", **qsv_kw)),
        ("QSV-geometric (identity transport)", "x_local",
         lambda: QSV(4, hidden, layers, quat_source="given", routing="abs",
                     transport="identity", **qsv_kw)),
        ("QSV-features xyz", "x_xyz", lambda: QSV(4, hidden, layers, **qsv_kw)),
    ]
    target = count_parameters(QSV(4, hidden, layers, **qsv_kw))
    for name in CONTROLS:
        for key in ("x_xyz", "x_local"):
            specs.append((f"{name} {key[2:]}", key,
                          lambda name=name: matched_control(name, 4, target, layers, None,
                                                            heads)))
    results: dict = {}
    for row, key, build in selected(specs, args.models):
        train_loader = DataLoader(with_inputs(train, key), batch_size=32, shuffle=True)
        test_loaders = {s: DataLoader(with_inputs(d, key), batch_size=256)
                        for s, d in tests.items()}
        for seed in range(args.seeds):
            seed_all(seed)
            gnn = build()
            uses_quat = isinstance(gnn, QSV) and gnn.quat_source == "given"
            model = PoolClassifier(gnn, num_classes,
                                   (lambda b: {"quat": b.quat}) if uses_quat else None)
            out = train_graphs(model, train_loader, test_loaders, epochs)
            collect(results, row, count_parameters(model), out["time"], aligned=out["aligned"],
                    rotated=out["rotated"])
    print_table(f"Point clouds: {num_classes} shapes, {n} points, k={k}; trained "
                f"aligned, tested aligned and randomly rotated (chance "
                f"{1 / num_classes:.2f}); {args.seeds} seeds", list(results.values()),
                ("aligned", "rotated"))
    return results


if __name__ == "__main__":
    main()
