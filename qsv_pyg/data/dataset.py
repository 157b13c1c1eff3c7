"""An image classification split held in memory, and the error of unusable data files."""
from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["DataError", "ImageDataset"]


class DataError(ValueError):
    """A dataset file or archive exists but does not hold what was expected."""


@dataclass
class ImageDataset:
    """One split of an image classification dataset, held in memory.

    Attributes:
        images: ``[N, 3, H, W]`` uint8 tensor (``H = W = 32`` for CIFAR), RGB.
        labels: ``[N]`` int64 tensor of class indices in ``[0, len(classes))``.
        classes: class names; ``classes[k]`` names label ``k``.

    Raises:
        DataError: (on construction) if the tensors have the wrong dtype or shape,
            disagree in length, or a label has no class name.
    """

    images: torch.Tensor
    labels: torch.Tensor
    classes: list[str]

    def __post_init__(self) -> None:
        if self.images.dtype != torch.uint8 or self.images.dim() != 4 or self.images.shape[1] != 3:
            raise DataError(
                f"ImageDataset.images: expected a uint8 tensor of shape [N, 3, H, W]; got "
                f"{self.images.dtype} of shape {list(self.images.shape)}")
        if self.labels.dtype != torch.int64 or self.labels.dim() != 1:
            raise DataError(
                f"ImageDataset.labels: expected an int64 tensor of shape [N]; got "
                f"{self.labels.dtype} of shape {list(self.labels.shape)}")
        if self.labels.shape[0] != self.images.shape[0]:
            raise DataError(
                f"ImageDataset: {self.images.shape[0]} images but {self.labels.shape[0]} labels")
        if self.labels.numel() and (
                int(self.labels.min()) < 0 or int(self.labels.max()) >= len(self.classes)):
            raise DataError(
                f"ImageDataset.labels: expected values in [0, {len(self.classes)}); got "
                f"[{int(self.labels.min())}, {int(self.labels.max())}]")

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    @property
    def num_classes(self) -> int:
        """Number of classes (``len(classes)``)."""
        return len(self.classes)

    def class_counts(self) -> torch.Tensor:
        """Number of samples per class.

        Returns:
            ``[num_classes]`` int64 tensor.
        """
        return torch.bincount(self.labels, minlength=self.num_classes)

    def subset(self, n: int, seed: int = 0) -> "ImageDataset":
        """A deterministic, class-balanced random subset (``--subset`` / ``--test-subset``).

        Samples are drawn round-robin over the classes in a random order fixed by
        ``seed``, so class counts differ by at most one while every class still has
        samples left. The selected samples keep their original relative order.

        Args:
            n: number of samples to keep; ``n >= len(self)`` returns ``self``.
            seed: seed of the ``torch.Generator`` that fixes the choice.

        Returns:
            A new dataset with ``min(n, len(self))`` samples (views are not shared:
            the tensors are copies).

        Raises:
            ValueError: if ``n < 1``.
        """
        if n < 1:
            raise ValueError(f"subset size must be >= 1; got {n}")
        total = len(self)
        if n >= total:
            return self
        gen = torch.Generator().manual_seed(int(seed))
        perm = torch.randperm(total, generator=gen)
        labels = self.labels[perm]
        # Rank of every permuted sample among the samples of its own class.
        order = torch.sort(labels, stable=True).indices
        sorted_labels = labels[order]
        class_start = torch.searchsorted(sorted_labels, sorted_labels, side="left")
        rank = torch.empty_like(perm)
        rank[order] = torch.arange(total) - class_start
        # Taking the smallest (rank, position) pairs = round-robin over classes.
        key = rank * total + torch.arange(total)
        chosen = perm[torch.argsort(key)[:n]].sort().values
        return ImageDataset(self.images[chosen].clone(), self.labels[chosen].clone(),
                            list(self.classes))
