"""Cora training steps of every row of the citation table, timed side by side.

The table (:mod:`qsv_pyg.experiments.citation_table`) times each row's epochs while it trains, beside whatever
else shares the machine, so its "ms/epoch vs GATConv" column compares rows that may
have run under different load (the diagnosis rows ran hours after the main ones).
This script builds the same models (``citation.build`` with the same arguments, on
the same Planetoid graph and features) and times one full training step of each
(dropout, forward, cross-entropy on the training nodes, backward, Adam), round-robin
with :func:`common.interleaved_median_times`, so a burst of load slows every row
alike and the ratios to ``GATConv`` are honest. QSVConv keeps its default
``check_finite=True`` here, as a user's model does (``--no-check-finite`` turns it
off for the layer-only comparison of ``bench_conv.py``).

Run::

    python benchmarks/bench_cora.py --out benchmarks/results/<date>-cpu/bench_cora.json
    python benchmarks/bench_cora.py --rows "GATConv,QSVConv literal" --quick
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
from qsv_pyg.experiments import citation_table as citation  # noqa: E402
from qsv_pyg.experiments.units import add_data_dir_arg  # noqa: E402
from qsv_pyg.utils import resolve_device  # noqa: E402


def training_step(model: torch.nn.Module, data) -> callable:
    """One epoch of ``citation.train_unit``'s loop (without its evaluation)."""
    optimizer = torch.optim.Adam(model.parameters(), lr=citation.LR,
                                 weight_decay=citation.WEIGHT_DECAY)
    x, edge_index, y, mask = data.x, data.edge_index, data.y, data.train_mask

    def step() -> None:
        model.train()
        optimizer.zero_grad()
        F.cross_entropy(model(x, edge_index)[mask], y[mask]).backward()
        optimizer.step()

    return step


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default=None,
                        help="comma-separated row names of the citation table (default: "
                             "every main and diagnosis row)")
    add_data_dir_arg(parser)
    parser.add_argument("--dataset", default="Cora")
    parser.add_argument("--cache-root", default=None,
                        help="writable folder for the processed copy (default: a temporary one)")
    parser.add_argument("--repeats", type=int, default=5, help="rounds (each row 3 steps a round)")
    parser.add_argument("--min-time", type=float, default=2.0,
                        help="keep going until this many seconds per row were measured")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--no-check-finite", action="store_true",
                        help="QSVConv without its NaN/inf input check")
    parser.add_argument("--quick", action="store_true", help="2 rounds, no minimum time")
    parser.add_argument("--out", default="benchmarks/out/bench_cora.json")
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats, args.min_time = 2, 0.0
    torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    by_name = {spec["name"]: spec for spec in citation.ALL_ROWS}
    names = list(by_name) if args.rows is None else [
        n.strip() for n in args.rows.split(",") if n.strip()]
    unknown = [n for n in names if n not in by_name]
    if unknown:
        parser.error(f"unknown --rows {unknown}; the rows are {list(by_name)}")
    if citation.ANCHOR not in names:
        names.insert(0, citation.ANCHOR)

    name = citation.canonical_name(args.dataset)
    with tempfile.TemporaryDirectory() as tmp:
        data, num_features, num_classes = citation.load(
            Path(args.data_dir), name, Path(args.cache_root or tmp))
    data = data.to(device)
    steps, params = {}, {}
    for row_name in names:
        spec = by_name[row_name]
        torch.manual_seed(0)
        model = citation.build(spec, citation.model_kwargs(spec, num_features,
                                                           num_classes)).to(device)
        if args.no_check_finite:
            for conv in citation.qsv_convs(model):
                conv.check_finite = False
        steps[row_name] = training_step(model, data)
        params[row_name] = sum(p.numel() for p in model.parameters())
    seconds = interleaved_median_times(steps, device, args.repeats, warmup=3,
                                       min_time=args.min_time)
    anchor = seconds[citation.ANCHOR]
    rows = [{"row": n, "parameters": params[n], "step_ms": 1e3 * seconds[n],
             "vs_gatconv": seconds[n] / anchor} for n in names]
    print(f"{name}: one training step per row, median ms, side by side "
          f"({torch.get_num_threads()} thread(s), device {device})\n")
    print(summarize.cora_table({"rows": rows}))
    payload = {"dataset": name, "rows": rows, "check_finite": not args.no_check_finite,
               "repeats": args.repeats, "min_time": args.min_time,
               "machine": machine_info(device), "argv": sys.argv[1:] if argv is None
               else list(argv)}
    write_json(args.out, payload)
    return payload


if __name__ == "__main__":
    main()
