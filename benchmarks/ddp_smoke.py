"""Two DDP training steps through the trainer's own pieces, under torchrun.

    torchrun --standalone --nproc_per_node=1 benchmarks/ddp_smoke.py --device cuda

What it exercises on one GPU: the process group (NCCL on CUDA, Gloo on CPU),
the training model wrapped as the trainer wraps it (``WithAuxiliaryLoss`` in
``DistributedDataParallel``), two optimiser steps of the real optimiser with
DDP's gradient all-reduce, ``all_reduce_sum`` of a device tensor over the
default group, and the per-step host agreement of the ranks
(``all_reduce_max_host``: a Gloo group next to NCCL).

NCCL refuses two ranks on one GPU ("duplicate GPU"), and the trainer itself
only wraps in DDP with two or more processes, so with one GPU this runs one
rank and wraps explicitly; with ``--nproc_per_node=N`` on N GPUs it runs N.
Prints one JSON line and exits non-zero on a failure.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import write_json  # noqa: E402

from qsv_pyg.models import build_model  # noqa: E402
from qsv_pyg.training import distributed  # noqa: E402
from qsv_pyg.training.evaluation import WithAuxiliaryLoss  # noqa: E402
from qsv_pyg.training.optim import build_optimizer  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--model", default="qsv")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--out", default=None, help="also write the JSON line here (rank 0)")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if not distributed.launched_by_torchrun():
        raise SystemExit("launch with torchrun (e.g. torchrun --standalone --nproc_per_node=1)")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    if args.device == "cuda":
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend=backend)
    try:
        torch.manual_seed(0)
        model = build_model(args.model, num_classes=10).to(device)
        opt = build_optimizer(model, lr=1e-3, weight_decay=0.05)
        ddp = DDP(WithAuxiliaryLoss(model), device_ids=[local] if device.type == "cuda" else None)
        gen = torch.Generator().manual_seed(rank)
        losses = []
        for _ in range(args.steps):
            images = torch.randn(args.batch_size, 3, 32, 32, generator=gen).to(device)
            labels = torch.randint(0, 10, (args.batch_size,), generator=gen).to(device)
            logits, aux = ddp(images)
            loss = F.cross_entropy(logits, labels) + aux
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
        total = distributed.all_reduce_sum(torch.ones(1, device=device)).item()
        # The host agreement: _active() is false for one rank, so reduce over the
        # Gloo group directly, as all_reduce_max_host does with several ranks.
        box = torch.tensor([rank], dtype=torch.int64)
        dist.all_reduce(box, op=dist.ReduceOp.MAX, group=distributed._host_group())
        agreed = distributed.all_reduce_max_host([rank])
        ok = (all(math.isfinite(x) for x in losses) and total == world
              and int(box.item()) == world - 1 and agreed[0] == (world - 1 if world > 1 else 0))
        result = {"ok": ok, "backend": backend, "world_size": world, "device": str(device),
                  "steps": args.steps, "losses": losses, "all_reduce_sum": total,
                  "host_group": "default" if distributed._host_group() is None else "gloo"}
        if rank == 0:
            print(json.dumps(result))
            if args.out:
                write_json(args.out, result)
        return 0 if ok else 1
    finally:
        distributed.cleanup_distributed()


if __name__ == "__main__":
    sys.exit(main())
