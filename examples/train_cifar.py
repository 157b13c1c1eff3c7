"""Train Quat-Sphere-Vision (or a control) on CIFAR: a thin wrapper around ``qsv-train``.

Train QSV on CIFAR-10 at the scale of the machine: the paper's full schedule on a
GPU, one CPU-scale study run (5 CPU-minutes) on a CPU; the first line says which::

    python examples/train_cifar.py --config auto-qsv --data-dir ../shared/data

The paper's full schedule on any device::

    python examples/train_cifar.py --config paper-qsv --data-dir ../shared/data

One-minute CPU smoke run (tiny subsets, one epoch, no progress bars)::

    python examples/train_cifar.py --model resnet20 --data-dir ../shared/data \\
        --subset 512 --test-subset 256 --epochs 1 --batch-size 64 --device cpu --no-progress

An ablation, with a time budget, continued later from where it stopped::

    python examples/train_cifar.py --config paper-qsv --routing uniform \\
        --data-dir ../shared/data --out-dir runs/qsv-uniform --time-budget 60
    python examples/train_cifar.py --resume --out-dir runs/qsv-uniform

Two data-parallel processes (Gloo on CPU, NCCL on GPUs)::

    torchrun --nproc_per_node=2 examples/train_cifar.py --model qsv \\
        --data-dir ../shared/data --epochs 1 --subset 1024 --test-subset 512

Every run folder gets ``config.json``, ``log.jsonl`` (one line per epoch),
``checkpoint.pt`` and ``metrics.json``; ``--help`` lists all options and presets.
User errors exit 2 with one line (add ``--debug`` for the traceback).
"""
import sys
from pathlib import Path

try:
    from qsv_pyg.training.cli import main
except ImportError:  # running from a source checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from qsv_pyg.training.cli import main

if __name__ == "__main__":
    sys.exit(main())
