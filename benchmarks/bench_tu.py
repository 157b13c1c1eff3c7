"""TU training epochs of every row of the TU table (:mod:`qsv_pyg.experiments.tu_table`), timed side by side.

The TU table times each unit's epochs while it trains, beside whatever else shares
the machine. This script builds the same models (``tu_models.build_model`` with the
table's settings, parameter-matched to QSV) on the same graphs (one-hot degrees for
IMDB-BINARY, standardised attributes for ENZYMES, as the table) and times one
training epoch of each over the first fold's training graphs in a fixed batch order
(forward, cross-entropy, backward, Adam per batch), round-robin with
:func:`common.interleaved_median_times`, so load slows every row alike and the
ratios to ``GAT`` are honest.

Run::

    python benchmarks/bench_tu.py --out benchmarks/results/<date>-cpu/bench_tu.json
    python benchmarks/bench_tu.py --datasets MUTAG --quick
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

import summarize  # noqa: E402
from common import interleaved_median_times, machine_info, write_json  # noqa: E402
from qsv_pyg.experiments import tu_data, tu_models, tu_table  # noqa: E402
from qsv_pyg.experiments.units import add_data_dir_arg  # noqa: E402

ANCHOR = "GAT"


def training_epoch(model: torch.nn.Module, batches: list, lr: float):
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)

    def epoch() -> None:
        model.train()
        for batch in batches:
            optimizer.zero_grad()
            F.cross_entropy(model(batch), batch.y).backward()
            optimizer.step()

    return epoch


def bench_dataset(name: str, data_root: Path, cache: Path, rows, repeats: int,
                  min_time: float) -> list:
    from torch_geometric.loader import DataLoader
    spec = tu_data.prepare_dataset(name, data_root, cache, tu_data.NODE_ATTRIBUTES)
    graphs = tu_data.load_graphs(spec)
    split = tu_data.make_splits(spec["labels"], tu_data.FOLDS)[0]
    graphs = tu_data.standardised(graphs, split["train"], spec.get("num_attributes", 0))
    hp = tu_table.hyperparameters()
    batches = list(DataLoader([graphs[i] for i in split["train"]],
                              batch_size=hp["batch_size"], shuffle=False))
    epochs, params = {}, {}
    for row in rows:
        torch.manual_seed(0)
        model = tu_models.build_model(row, spec["num_features"], spec["num_classes"], hp)
        epochs[row] = training_epoch(model, batches, hp["lr"])
        params[row] = sum(p.numel() for p in model.parameters())
    seconds = interleaved_median_times(epochs, torch.device("cpu"), repeats, warmup=1,
                                       min_time=min_time, inner=1)
    return [{"dataset": name, "row": row, "parameters": params[row],
             "epoch_ms": 1e3 * seconds[row], "vs_gat": seconds[row] / seconds[ANCHOR],
             "train_graphs": len(split["train"])} for row in rows]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--datasets", nargs="+", default=list(tu_data.DATASETS))
    parser.add_argument("--rows", nargs="+", default=list(tu_models.ROWS),
                        choices=tu_models.ROWS)
    add_data_dir_arg(parser)
    parser.add_argument("--cache-root", default=None,
                        help="writable folder for the processed copies (default: temporary)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds (one epoch per row each)")
    parser.add_argument("--min-time", type=float, default=1.0,
                        help="keep going until this many seconds per row were measured")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--quick", action="store_true", help="2 rounds, no minimum time")
    parser.add_argument("--out", default="benchmarks/out/bench_tu.json")
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats, args.min_time = 2, 0.0
    torch.set_num_threads(args.threads)
    rows = list(dict.fromkeys([ANCHOR, *args.rows]))
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.datasets:
            results += bench_dataset(name, Path(args.data_dir), Path(args.cache_root or tmp),
                                     rows, args.repeats, args.min_time)
    print(f"TU: one training epoch (fold 0's training graphs) per row, median ms, side by "
          f"side ({torch.get_num_threads()} thread(s))\n")
    print(summarize.tu_table({"rows": results}))
    payload = {"rows": results, "repeats": args.repeats, "min_time": args.min_time,
               "machine": machine_info(torch.device("cpu")),
               "argv": sys.argv[1:] if argv is None else list(argv)}
    write_json(args.out, payload)
    return payload


if __name__ == "__main__":
    main()
