"""Rotation-invariant ModelNet10 classification with QSVGeometric.

The shapes come from an npz (``<data-dir>/ModelNet10/*.npz``: 1,024
Poisson-disk points per shape, the official 3,991 / 908 split; it has no meshes,
so PyG's ``SamplePoints`` does not apply and every shape becomes a
``Data(pos, y)``). ``qsv_pyg.transforms`` prepares each cloud once, as a PyG
``pre_transform`` would: centre and scale to the unit sphere, the kNN graph and
every point's local frame. :class:`qsv_pyg.nn.models.QSVGeometric` reads them
from the batch and is invariant to rotations of the input by construction:
trained on aligned shapes, it scores the same on randomly rotated test shapes.

    python examples/modelnet.py --epochs 20 --data-dir DIR   # or set $QSV_DATA_DIR

The side-by-side table (VN-DGCNN, DGCNN, PointNet++, ablations, equal CPU time
per unit) is ``python -m qsv_pyg.experiments.modelnet_table``.
"""
import argparse
import time

import numpy as np
import torch
import torch_geometric.transforms as T
from torch_geometric.data import Data
from torch_geometric.loader import DataLoader

import qsv_pyg.transforms as QT
from qsv_pyg.nn.models import QSVGeometric
from qsv_pyg.experiments.units import add_data_dir_arg
from qsv_pyg.quaternion import quaternion_to_matrix, random_unit_quaternion


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_data_dir_arg(parser, "ModelNet10/*.npz")
    parser.add_argument("--points", type=int, default=512, help="points per shape")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--k", type=int, default=20, help="kNN neighbours")
    parser.add_argument("--max-train", type=int, default=None, help="a subset (smoke tests)")
    parser.add_argument("--max-test", type=int, default=None, help="a subset (smoke tests)")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def load_split(path, split, points, limit, seed):
    """A list of ``Data(pos [points, 3], y)``: the first ``limit`` shapes of a
    fixed shuffle, ``points`` of each shape's points (a fixed random choice)."""
    with np.load(path) as f:
        pos, y = f[f"pos_{split}"], f[f"y_{split}"]
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(y))[:limit]
    return [Data(pos=torch.from_numpy(pos[i][rng.permutation(pos.shape[1])[:points]]),
                 y=torch.tensor([int(y[i])])) for i in order]


class RandomRotation(T.BaseTransform):
    """Rotates ``data.pos`` by one uniformly random 3-D rotation (seeded)."""

    def __init__(self, generator):
        self.generator = generator

    def forward(self, data):
        rot = quaternion_to_matrix(random_unit_quaternion(1, generator=self.generator,
                                                          dtype=torch.float64))[0]
        data.pos = (data.pos.double() @ rot.T).float()
        return data


def train_epoch(model, loader, optimizer):
    model.train()
    total = correct = 0
    for data in loader:
        optimizer.zero_grad()
        out = model(data)  # reads pos, batch, edge_index and the frames
        loss = torch.nn.functional.cross_entropy(out, data.y)
        loss.backward()
        optimizer.step()
        total += float(loss.detach()) * data.num_graphs
        correct += int((out.argmax(-1) == data.y).sum())
    return total / len(loader.dataset), correct / len(loader.dataset)


@torch.no_grad()
def test(model, loader):
    model.eval()
    correct = sum(int((model(data).argmax(-1) == data.y).sum()) for data in loader)
    return correct / len(loader.dataset)


def main(argv=None):
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    path = next((args.data_dir / "ModelNet10").glob("*.npz"))
    # What the model reads, computed once per cloud (a PyG pre_transform).
    prepare = T.Compose([QT.NormalizeRadius(), QT.KNNGraph(k=args.k), QT.LocalFrames()])
    train = [prepare(d) for d in load_split(path, "train", args.points, args.max_train, 1)]
    test_shapes = load_split(path, "test", args.points, args.max_test, 2)
    aligned = [prepare(d.clone()) for d in test_shapes]
    rotate = RandomRotation(torch.Generator().manual_seed(3))
    rotated = [prepare(rotate(d.clone())) for d in test_shapes]  # frames after rotation

    train_loader = DataLoader(train, batch_size=args.batch_size, shuffle=True,
                              drop_last=len(train) > args.batch_size)
    aligned_loader = DataLoader(aligned, batch_size=64)
    rotated_loader = DataLoader(rotated, batch_size=64)

    model = QSVGeometric(out_channels=10, k=args.k)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, args.epochs)
    print(f"{model}: {sum(p.numel() for p in model.parameters()):,} parameters, "
          f"{len(train)} training shapes of {args.points} points")
    for epoch in range(1, args.epochs + 1):
        start = time.process_time()
        loss, acc = train_epoch(model, train_loader, optimizer)
        scheduler.step()
        print(f"epoch {epoch:3d}  loss {loss:.4f}  train acc {acc:.3f}  "
              f"{time.process_time() - start:.1f} CPU-s")
    result = {"aligned": test(model, aligned_loader), "so3": test(model, rotated_loader)}
    print(f"test accuracy: aligned {result['aligned']:.3f}, "
          f"randomly rotated {result['so3']:.3f}")
    return result


if __name__ == "__main__":
    main()
