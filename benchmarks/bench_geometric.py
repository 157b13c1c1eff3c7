"""QSVGeometric's training step against the same network with GATConv in QSVConv's place.

Issue 30's goal "time per epoch at most GAT's at matched parameters", measured side
by side in one process: ``QSVGeometric(10)`` with its defaults, and the same model
whose three ``QSVConv`` layers are ``GATConv(h, h // heads, heads, edge_dim=...)``
(the same width, heads, invariant node features, point-pair edge features, residuals,
norms and head: 0.7% fewer parameters; GATConv reads no frames, so it is not a
rotation-invariant *transport* model, only the same invariant input). One training step is
what the ModelNet10 table times per mini-batch: the model's forward from positions with
the kNN graph and frames given (as the table's aligned training encodes them once; the
pair features and node features are derived inside every forward), the loss, the
backward and an Adam step, on real ModelNet10 training shapes. With ``--encode`` a step
starts from the positions alone, as under the table's SO3 training (the kNN graph, the
frames and the features computed in every forward, for both models). Steps are timed
round-robin (``common.interleaved_median_times``), so load on a shared machine slows
both alike; the wall time of a step with one thread is the table's CPU time per step.

Examples::

    python benchmarks/bench_geometric.py --data-dir ../shared/data
    python benchmarks/bench_geometric.py --threads 2 --batch-size 32 --out results/geo.json
    python benchmarks/bench_geometric.py --encode --out results/geo_encode.json
    python benchmarks/bench_geometric.py --encode --hidden-channels 128
    python benchmarks/bench_geometric.py --encode --edge-messages   # + edge_message modes
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Dict, Optional

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import interleaved_median_times, machine_info, write_json  # noqa: E402

from qsv_pyg.experiments import modelnet_data as md  # noqa: E402
from qsv_pyg.experiments.modelnet_table import DATASET  # noqa: E402
from qsv_pyg.models.matching import count_parameters  # noqa: E402
from qsv_pyg.nn.models import QSVGeometric  # noqa: E402
from qsv_pyg.transforms.functional import EDGE_FEATURES  # noqa: E402


class GATInPlace(torch.nn.Module):
    """``GATConv`` called as ``QSVGeometric`` calls its layers (``quat`` and
    ``pos`` are accepted and not read)."""

    def __init__(self, channels: int, heads: int, edge_dim: Optional[int]) -> None:
        super().__init__()
        from torch_geometric.nn import GATConv
        self.conv = GATConv(channels, channels // heads, heads=heads, edge_dim=edge_dim)

    def forward(self, x: Any, edge_index: Tensor, quat: Any = None,
                edge_attr: Optional[Tensor] = None, pos: Any = None) -> Tensor:
        return self.conv(x, edge_index, edge_attr=edge_attr)


def gat_twin(num_classes: int, **kwargs: Any) -> QSVGeometric:
    """``QSVGeometric(num_classes, **kwargs)`` with every QSVConv replaced by GATConv."""
    model = QSVGeometric(num_classes, **kwargs)
    edge_dim = len(EDGE_FEATURES) if model.pair_features else None
    model.convs = torch.nn.ModuleList(
        [GATInPlace(model.hidden_channels, model.heads, edge_dim) for _ in model.convs])
    return model


def main(argv: Optional[list] = None) -> Dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", default=os.environ.get("QSV_DATA_DIR", "../shared/data"))
    parser.add_argument("--dataset", default=DATASET)
    parser.add_argument("--points", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--batches", type=int, default=4,
                        help="distinct training mini-batches cycled through")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--encode", action="store_true",
                        help="compute the kNN graph and frames in every step (SO3 training)")
    parser.add_argument("--hidden-channels", type=int, default=None,
                        help="QSVGeometric's hidden_channels for both models (default: "
                             "the model's default)")
    parser.add_argument("--edge-messages", action="store_true",
                        help="also time QSVGeometric with the edge_message modes other "
                             "than its default (False, 'target', 'source')")
    parser.add_argument("--out", default=None, help="JSON file for the results")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    path = md.find_npz(Path(args.data_dir), args.dataset, None)
    cfg = {"points": args.points, "max_train": args.batch_size * args.batches,
           "max_test": 1}
    pos, y = md.base_sets(str(path), cfg)["train"]
    kw = {} if args.hidden_channels is None else {"hidden_channels": args.hidden_channels}
    models = {"QSVGeometric": QSVGeometric(10, **kw), "GATConv in place": gat_twin(10, **kw)}
    if args.edge_messages:  # the other modes beside the default's
        for mode in (False, "target", "source"):
            if mode != models["QSVGeometric"].edge_message:
                models[f"QSVGeometric edge_message={mode}"] = QSVGeometric(
                    10, edge_message=mode, **kw)
    shapes = ({"pos": pos.float(), "y": y} if args.encode
              else md.encode(models["QSVGeometric"], pos, y))
    batches = [torch.arange(i * args.batch_size, min((i + 1) * args.batch_size, y.numel()))
               for i in range(args.batches)]
    batches = [b for b in batches if b.numel()]

    steps: Dict[str, Any] = {}
    for name, model in models.items():
        model.train()
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        state = {"i": 0}

        def step(model=model, opt=opt, state=state) -> None:
            idx = batches[state["i"] % len(batches)]
            state["i"] += 1
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(md.forward(model, shapes, idx), shapes["y"][idx])
            loss.backward()
            opt.step()
        steps[name] = step
    times = interleaved_median_times(steps, torch.device("cpu"), args.repeats, warmup=2)
    ref = times["GATConv in place"]
    rows = [{"model": name, "params": count_parameters(models[name]),
             "ms_per_step": 1e3 * t, "ratio_to_gat": t / ref,
             "cpu_s_per_epoch_est": t * (3592 / args.batch_size)}
            for name, t in times.items()]
    payload = {"machine": machine_info(torch.device("cpu")), "threads": args.threads,
               "batch_size": args.batch_size, "points": args.points, "encode": args.encode,
               "k": models["QSVGeometric"].k,
               "hidden_channels": models["QSVGeometric"].hidden_channels,
               "command": " ".join(sys.argv), "rows": rows}
    print(f"{'model':<36} {'params':>8} {'ms/step':>9} {'÷ GAT':>6} {'s/epoch est':>12}")
    for r in rows:
        print(f"{r['model']:<36} {r['params']:>8,} {r['ms_per_step']:>9.1f} "
              f"{r['ratio_to_gat']:>6.2f} {r['cpu_s_per_epoch_est']:>12.1f}")
    if args.out:
        write_json(args.out, payload)
    return payload


if __name__ == "__main__":
    main()
