"""Planetoid node classification (Cora, CiteSeer, PubMed) with QSVConv, the way
PyG's ``examples/gat.py`` trains GATConv.

Two layers, ``conv(in, 8, heads=8)``, ELU, ``conv(64, classes, heads=1,
concat=False)``, dropout 0.6 on the features and on the attention; Adam (lr
0.005, weight decay 5e-4), full batch; the reported number is the test accuracy
at the epoch of best validation accuracy. ``--conv gat`` trains PyG's GATConv
instead; ``--literal`` gives QSVConv exactly GATConv's arguments (without the
recipe for graphs without geometry: self-loops, no root weight, identity
transport, input projection).

    python examples/citation.py                      # QSVConv on Cora
    python examples/citation.py --conv gat --dataset CiteSeer

The data folder is ``--data-dir`` (else ``$QSV_DATA_DIR``) holding
``Planetoid/<Name>/raw``; it is read through a restricted unpickler and
processed in a copy under ``--cache-root`` (the data folder may be read-only).
The table with every row, 10 seeds and its run folders is
``python -m qsv_pyg.experiments.citation_table``.
"""
import argparse
from pathlib import Path

import torch
import torch.nn.functional as F
from torch_geometric.nn import GATConv

from qsv_pyg.experiments.citation_table import RECIPE, canonical_name, load
from qsv_pyg.experiments.units import add_data_dir_arg, fail
from qsv_pyg.nn import QSVConv

#: Flags of the table, which moved to the package.
TABLE_FLAGS = ("--report-only", "--out-root", "--models", "--seeds", "--diagnose",
               "--source-logit", "--small", "--threads", "--no-progress")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_data_dir_arg(parser, "Planetoid/<Name>/raw")
    parser.add_argument("--dataset", default="Cora", help="Cora, CiteSeer or PubMed")
    parser.add_argument("--conv", choices=("qsv", "gat"), default="qsv")
    parser.add_argument("--literal", action="store_true",
                        help="QSVConv with GATConv's arguments only (no recipe)")
    parser.add_argument("--epochs", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cache-root", type=Path, default=Path("~/.cache/qsv_pyg/planetoid"))
    args, unknown = parser.parse_known_args(argv)
    moved = [flag for flag in unknown if flag.split("=")[0] in TABLE_FLAGS]
    if moved:
        fail(f"{moved[0].split('=')[0]} belongs to the table, which moved: run "
             f"python -m qsv_pyg.experiments.citation_table {' '.join(unknown)}")
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.epochs < 1:
        fail(f"--epochs must be positive (got {args.epochs})")
    return args


class Net(torch.nn.Module):
    def __init__(self, conv, in_channels, hidden_channels, out_channels, heads, **kwargs):
        super().__init__()
        self.conv1 = conv(in_channels, hidden_channels, heads=heads, dropout=0.6, **kwargs)
        self.conv2 = conv(hidden_channels * heads, out_channels, heads=1, concat=False,
                          dropout=0.6, **kwargs)

    def forward(self, x, edge_index):
        x = F.dropout(x, p=0.6, training=self.training)
        x = F.elu(self.conv1(x, edge_index))
        x = F.dropout(x, p=0.6, training=self.training)
        return self.conv2(x, edge_index)


def train(model, optimizer, data):
    model.train()
    optimizer.zero_grad()
    out = model(data.x, data.edge_index)
    loss = F.cross_entropy(out[data.train_mask], data.y[data.train_mask])
    loss.backward()
    optimizer.step()
    return float(loss.detach())


@torch.no_grad()
def test(model, data):
    model.eval()
    pred = model(data.x, data.edge_index).argmax(dim=-1)
    return [int((pred[mask] == data.y[mask]).sum()) / int(mask.sum())
            for mask in (data.train_mask, data.val_mask, data.test_mask)]


def main(argv=None):
    args = parse_args(argv)
    torch.manual_seed(args.seed)

    # Data: the public split, features normalised (gat.py's NormalizeFeatures).
    name = canonical_name(args.dataset)
    data, num_features, num_classes = load(args.data_dir, name, args.cache_root)

    # Model.
    if args.conv == "gat":
        model = Net(GATConv, num_features, 8, num_classes, heads=8)
    else:
        model = Net(QSVConv, num_features, 8, num_classes, heads=8,
                    **({} if args.literal else RECIPE))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.005, weight_decay=5e-4)

    # Train; keep the test accuracy of the best validation epoch.
    best_val = test_acc = 0.0
    for epoch in range(1, args.epochs + 1):
        loss = train(model, optimizer, data)
        train_acc, val_acc, tmp_test_acc = test(model, data)
        if val_acc > best_val:
            best_val, test_acc = val_acc, tmp_test_acc
        print(f"Epoch: {epoch:03d}, Loss: {loss:.4f}, Train: {train_acc:.4f}, "
              f"Val: {val_acc:.4f}, Test: {tmp_test_acc:.4f}")
    print(f"{name} {args.conv}: test accuracy {test_acc:.4f} at the best validation "
          f"accuracy {best_val:.4f}")
    return {"val_acc": best_val, "test_acc": test_acc}


if __name__ == "__main__":
    main()
