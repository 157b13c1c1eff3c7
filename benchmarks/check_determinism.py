"""Are two identical training runs bit-identical? Per model, in deterministic mode.

For every model: two short runs of the real training loop in this process
(``qsv_pyg.training.trainer.train``: same seed, same data, same device) under
``torch.use_deterministic_algorithms(True)`` (``--mode deterministic``, with
``CUBLAS_WORKSPACE_CONFIG=:4096:8``) or with the default settings (``--mode
default``). The final weights (``checkpoint.pt``) and the log lines (timing
fields aside) are compared bit for bit. A run that raises, e.g. on an op with
no deterministic CUDA kernel, is reported with its error.

    python benchmarks/check_determinism.py --device cuda --models qsv attention-gat resnet20
"""
from __future__ import annotations

import os

# cuBLAS needs this before its first handle for deterministic matmuls.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_cli_epoch import write_synthetic_cifar10  # noqa: E402
from common import machine_info, write_json  # noqa: E402

from qsv_pyg.models import available_models  # noqa: E402
from qsv_pyg.training.checkpoint import load_checkpoint  # noqa: E402
from qsv_pyg.training.config import TrainConfig  # noqa: E402
from qsv_pyg.training.trainer import TIMING_FIELDS, TrainingInterrupted, train  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["qsv", "attention-gat", "resnet20"],
                        choices=available_models())
    parser.add_argument("--mode", default="deterministic", choices=["deterministic", "default"])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--images", type=int, default=1024, help="training images (synthetic)")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--amp", default="none", choices=["none", "bf16", "fp16"])
    parser.add_argument("--work", default=None, help="folder for data and runs (default: temp)")
    parser.add_argument("--out", default="benchmarks/out/determinism.json")
    return parser


def _untimed(run: Path) -> list:
    lines = [json.loads(x) for x in (run / "log.jsonl").read_text().splitlines() if x.strip()]
    return [{k: v for k, v in line.items() if k not in TIMING_FIELDS} for line in lines]


def compare(a: Path, b: Path) -> dict:
    wa, wb = load_checkpoint(a / "checkpoint.pt")["model"], load_checkpoint(b / "checkpoint.pt")["model"]
    differ = [k for k in wa if not torch.equal(wa[k], wb[k])]
    max_diff = max((float((wa[k].double() - wb[k].double()).abs().max()) for k in differ
                    if wa[k].is_floating_point()), default=0.0)
    logs_equal = _untimed(a) == _untimed(b)
    return {"identical": not differ and logs_equal, "differing_tensors": len(differ),
            "tensors": len(wa), "max_abs_diff": max_diff, "logs_equal": logs_equal,
            "first_differing": differ[:5]}


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    if args.mode == "deterministic":
        torch.use_deterministic_algorithms(True)
    work = Path(args.work or tempfile.mkdtemp(prefix="qsv-determinism-"))
    data = write_synthetic_cifar10(work / "data", args.images, max(args.batch_size, 256))
    results = {}
    for name in args.models:
        runs = [work / f"{name}-{i}" for i in (1, 2)]
        try:
            for run in runs:
                cfg = TrainConfig(model=name, data_dir=str(data), out_dir=str(run), epochs=1,
                                  batch_size=args.batch_size, eval_batch_size=256,
                                  device=args.device, amp=args.amp, progress=False,
                                  warmup_epochs=0.5, seed=0)
                train(cfg)
            results[name] = compare(*runs)
        except TrainingInterrupted:
            raise  # SIGTERM from the step's time limit: stop, do not go on to the next model
        except Exception as err:  # noqa: BLE001 - the error is the result
            results[name] = {"identical": False, "error": f"{type(err).__name__}: "
                             f"{' '.join(str(err).split())[:400]}"}
        print(f"{name}: {json.dumps(results[name])}", flush=True)
    device = torch.device(args.device)
    payload = {"args": vars(args), "machine": machine_info(device), "results": results}
    write_json(args.out, payload)
    return payload


if __name__ == "__main__":
    main()
