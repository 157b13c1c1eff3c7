"""TU graph classification (MUTAG, PROTEINS, NCI1, ENZYMES, IMDB-BINARY) with the
QSV model: one fold of the stratified 10-fold protocol of Errica et al. 2020.

Three QSV layers of width 64 (4 heads, docs/usage.md's recipe for graphs without
geometry), the sum of each graph's node embeddings, a linear map to the classes;
Adam (lr 0.005), batches of 64 graphs. A stratified 10 % of the fold's training
graphs is held out to choose the epoch: training stops ``--patience`` epochs after
the best validation accuracy, and the reported number is the test accuracy at
that epoch.

    python examples/tu_graphs.py                     # MUTAG, fold 0
    python examples/tu_graphs.py --dataset PROTEINS --fold 3

The data folder is ``--data-dir`` (else ``$QSV_DATA_DIR``) holding
``TUDataset/<NAME>/raw``; ``TUDataset`` processes a copy under ``--cache-root``
(the data folder may be read-only). The table with every row (GAT, GATv2,
TransformerConv, GIN, a structure-agnostic baseline), all folds, run folders and
published numbers is ``python -m qsv_pyg.experiments.tu_table``.
"""
import argparse
from pathlib import Path

import torch
import torch.nn.functional as F
from torch_geometric.loader import DataLoader
from torch_geometric.nn import global_add_pool

from qsv_pyg.experiments.tu_data import (NODE_ATTRIBUTES, check_folds, load_graphs,
                                         make_splits, prepare_dataset, standardised)
from qsv_pyg.experiments.tu_models import QSV_OPTIONS
from qsv_pyg.experiments.units import add_data_dir_arg, fail
from qsv_pyg.nn.models import QSV

#: Flags of the table, which moved to the package.
TABLE_FLAGS = ("--report-only", "--out-root", "--models", "--folds", "--max-folds",
               "--jobs", "--source-logit", "--edge-attr", "--small", "--no-progress")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_data_dir_arg(parser, "TUDataset/<NAME>/raw")
    parser.add_argument("--dataset", default="MUTAG", help="a TU set (default MUTAG)")
    parser.add_argument("--fold", type=int, default=0, help="which of the 10 folds")
    parser.add_argument("--epochs", type=int, default=25)
    parser.add_argument("--patience", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cache-root", type=Path, default=Path("~/.cache/qsv_pyg/tu"))
    args, unknown = parser.parse_known_args(argv)
    moved = [flag for flag in unknown if flag.split("=")[0] in TABLE_FLAGS]
    if moved:
        fail(f"{moved[0].split('=')[0]} belongs to the table, which moved: run "
             f"python -m qsv_pyg.experiments.tu_table {' '.join(unknown)}")
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if not 0 <= args.fold < 10:
        fail(f"--fold must be between 0 and 9 (got {args.fold})")
    if args.epochs < 1 or args.patience < 1:
        fail("--epochs and --patience must be positive")
    return args


class Net(torch.nn.Module):
    def __init__(self, in_channels, num_classes):
        super().__init__()
        self.gnn = QSV(in_channels, 64, 3, heads=4, **QSV_OPTIONS)
        self.head = torch.nn.Linear(64, num_classes)

    def forward(self, x, edge_index, batch):
        return self.head(global_add_pool(self.gnn(x, edge_index), batch))


def train(model, optimizer, loader):
    model.train()
    total_loss = 0.0
    for data in loader:
        optimizer.zero_grad()
        loss = F.cross_entropy(model(data.x, data.edge_index, data.batch), data.y)
        loss.backward()
        optimizer.step()
        total_loss += float(loss.detach()) * data.num_graphs
    return total_loss / len(loader.dataset)


@torch.no_grad()
def test(model, loader):
    model.eval()
    correct = 0
    for data in loader:
        pred = model(data.x, data.edge_index, data.batch).argmax(dim=-1)
        correct += int((pred == data.y).sum())
    return correct / len(loader.dataset)


def main(argv=None):
    args = parse_args(argv)

    # Data: node labels one-hot (ENZYMES: also its attributes, standardised on the
    # fold's training graphs; sets without node features: one-hot degrees).
    spec = prepare_dataset(args.dataset, args.data_dir, args.cache_root, NODE_ATTRIBUTES)
    check_folds(spec, 10)
    split = make_splits(spec["labels"], 10)[args.fold]
    graphs = standardised(load_graphs(spec), split["train"], spec["num_attributes"])
    torch.manual_seed(args.seed)
    train_loader = DataLoader([graphs[i] for i in split["train"]], batch_size=64, shuffle=True)
    val_loader = DataLoader([graphs[i] for i in split["val"]], batch_size=512)
    test_loader = DataLoader([graphs[i] for i in split["test"]], batch_size=512)

    # Model.
    model = Net(spec["num_features"], spec["num_classes"])
    optimizer = torch.optim.Adam(model.parameters(), lr=0.005)

    # Train with early stopping on the validation accuracy (the last best epoch).
    best = {"epoch": 0, "val_acc": -1.0, "test_acc": 0.0}
    for epoch in range(1, args.epochs + 1):
        loss = train(model, optimizer, train_loader)
        val_acc, test_acc = test(model, val_loader), test(model, test_loader)
        if val_acc >= best["val_acc"]:
            best = {"epoch": epoch, "val_acc": val_acc, "test_acc": test_acc}
        print(f"Epoch: {epoch:03d}, Loss: {loss:.4f}, Val: {val_acc:.4f}, "
              f"Test: {test_acc:.4f}")
        if epoch - best["epoch"] >= args.patience:
            break
    print(f"{spec['name']} fold {args.fold}: test accuracy {best['test_acc']:.4f} at epoch "
          f"{best['epoch']} (validation accuracy {best['val_acc']:.4f})")
    return best


if __name__ == "__main__":
    main()
