"""A tiny CIFAR-10 in the standard "python version" layout, written by tests."""
from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np

#: ``qsv-train`` flags of a QSV GraphNet small enough for a whole epoch to take milliseconds.
TINY_QSV = ["--model", "qsv", "--model-arg", "shell_sizes=[16,8]", "--model-arg", "widths=[16,16]",
            "--model-arg", "heads=2", "--model-arg", "k_cross=4", "--model-arg", "k_inner=4",
            "--model-arg", "within_rounds=1", "--model-arg", "repulsion_k=4"]

CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship",
           "truck"]


def write_tiny_cifar10(root: Path, n_train: int = 64, n_test: int = 32) -> None:
    """Random images with balanced labels in ``root/cifar-10-batches-py``."""
    rng = np.random.default_rng(0)
    folder = Path(root) / "cifar-10-batches-py"
    folder.mkdir(parents=True)

    def dump(name: str, n: int) -> None:
        data = rng.integers(0, 256, size=(n, 3072), dtype=np.uint8)
        labels = [int(i % 10) for i in rng.permutation(n)]
        with open(folder / name, "wb") as f:
            pickle.dump({b"data": data, b"labels": labels, b"filenames": [b"x.png"] * n}, f)

    for i, part in enumerate(np.array_split(np.arange(n_train), 5), start=1):
        dump(f"data_batch_{i}", len(part))
    dump("test_batch", n_test)
    with open(folder / "batches.meta", "wb") as f:
        pickle.dump({b"label_names": [c.encode() for c in CLASSES]}, f)
