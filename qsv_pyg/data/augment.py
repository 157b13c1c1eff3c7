"""Batch augmentation, normalisation and device-resident batching.

Everything here works on whole ``[N, 3, H, W]`` uint8 batches on any device, with
no Python loop over images, so on a GPU the input pipeline costs a few kernels per
batch instead of CPU-side per-image transforms.

Reproducibility without hidden state: :class:`DeviceLoader` derives the sample order
of an epoch from ``(seed, epoch)`` and the augmentation randomness of a batch from
``(seed, epoch, rank, batch index)``. A training run that saves ``seed`` and the
current epoch (and, to resume mid-epoch, the number of batches already consumed)
regenerates exactly the same batches with ``loader.epoch(epoch, start_batch=k)``;
there is no generator state to checkpoint. Random draws are made on the loader's
device, so a run resumed on another device type (CPU vs. CUDA) gets the same
sample order but different crops and flips.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch

from .dataset import ImageDataset

__all__ = [
    "CIFAR10_MEAN",
    "CIFAR10_STD",
    "CIFAR100_MEAN",
    "CIFAR100_STD",
    "CIFAR_STATS",
    "BatchAugment",
    "DeviceLoader",
    "batches",
    "derive_seed",
    "normalize",
    "random_crop_flip",
]

#: Per-channel RGB mean / std of the CIFAR-10 training images (pixel values in [0, 1]).
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)
#: Per-channel RGB mean / std of the CIFAR-100 training images (pixel values in [0, 1]).
CIFAR100_MEAN = (0.5071, 0.4865, 0.4409)
CIFAR100_STD = (0.2673, 0.2564, 0.2762)
#: ``name -> (mean, std)`` for :meth:`BatchAugment.for_dataset`.
CIFAR_STATS = {
    "cifar10": (CIFAR10_MEAN, CIFAR10_STD),
    "cifar100": (CIFAR100_MEAN, CIFAR100_STD),
}

#: Signature of an augmentation: ``(uint8 [B, 3, H, W], generator) -> float [B, 3, H', W']``.
AugmentFn = Callable[[torch.Tensor, "torch.Generator | None"], torch.Tensor]


def _check_uint8_batch(images: torch.Tensor, what: str) -> None:
    if images.dtype != torch.uint8 or images.dim() != 4:
        raise TypeError(f"{what}: expected a uint8 tensor of shape [N, C, H, W]; got "
                        f"{images.dtype} of shape {list(images.shape)}")


def derive_seed(*parts: int | str) -> int:
    """Stable 63-bit seed derived from ``parts`` (identical in every process).

    Python's ``hash`` is salted per process, so a cryptographic hash is used to
    combine e.g. ``(seed, "augment", epoch, rank, batch)``.

    Args:
        *parts: integers or strings identifying the random stream.

    Returns:
        A non-negative integer below ``2**63``, usable with ``Generator.manual_seed``.
    """
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def random_crop_flip(images: torch.Tensor, padding: int = 4,
                     generator: torch.Generator | None = None, *,
                     flip: bool = True) -> torch.Tensor:
    """Random crop with zero padding plus random horizontal flip, per image.

    Equivalent to zero-padding every image by ``padding`` pixels on each side,
    cropping an ``H x W`` window at an independent random offset in
    ``[0, 2 * padding]^2`` and mirroring it left-right with probability 1/2, but
    implemented as two ``gather`` calls and a mask (the padded batch is never
    materialised).

    Args:
        images: ``[N, C, H, W]`` uint8 batch on any device.
        padding: zero padding on each side (``0`` disables the crop).
        generator: source of randomness (any device; draws are moved to the batch's
            device); ``None`` uses the global generator of the batch's device.
        flip: also apply random horizontal flips.

    Returns:
        ``[N, C, H, W]`` uint8 batch on the same device (``images`` itself when
        there is nothing to do).

    Raises:
        TypeError: if ``images`` is not a 4-d uint8 tensor.
        ValueError: if ``padding`` is negative.
    """
    _check_uint8_batch(images, "random_crop_flip")
    if padding < 0:
        raise ValueError(f"padding must be >= 0; got {padding}")
    n, c, h, w = images.shape
    if n == 0 or (padding == 0 and not flip):
        return images
    device = images.device
    draw_device = generator.device if generator is not None else device
    # Fixed draw order (dy, dx, flip) keeps results reproducible for a given generator.
    dy = torch.randint(0, 2 * padding + 1, (n,), generator=generator, device=draw_device)
    dx = torch.randint(0, 2 * padding + 1, (n,), generator=generator, device=draw_device)
    mirror = (torch.randint(0, 2, (n,), generator=generator, device=draw_device).bool()
              if flip else torch.zeros(n, dtype=torch.bool, device=draw_device))
    dy, dx, mirror = dy.to(device), dx.to(device), mirror.to(device)

    # Source coordinate in the unpadded image of every output row / column.
    rows = dy[:, None] - padding + torch.arange(h, device=device)  # [N, H]
    cols = dx[:, None] - padding + torch.arange(w, device=device)  # [N, W]
    cols = torch.where(mirror[:, None], cols.flip(1), cols)  # out[x] = crop[W - 1 - x]
    valid = (((rows >= 0) & (rows < h))[:, None, :, None]
             & ((cols >= 0) & (cols < w))[:, None, None, :])  # [N, 1, H, W]

    out = images.gather(2, rows.clamp(0, h - 1)[:, None, :, None].expand(n, c, h, w))
    out = out.gather(3, cols.clamp(0, w - 1)[:, None, None, :].expand(n, c, h, w))
    return out.masked_fill_(~valid, 0)  # pixels that came from the zero padding


def _check_stats(mean: Sequence[float], std: Sequence[float],
                 channels: int | None = None) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """``mean``/``std`` as tuples of floats, checked on the host (no device tensor).

    Raises:
        ValueError: different lengths, not ``channels`` entries, or a std that is not
            positive (or not finite).
    """
    mean_t = tuple(float(m) for m in mean)
    std_t = tuple(float(s) for s in std)
    c = len(mean_t) if channels is None else channels
    if len(mean_t) != c or len(std_t) != c:
        raise ValueError(f"mean and std need {c} entries; got {len(mean_t)} and {len(std_t)}")
    if not all(s > 0 and s < float("inf") for s in std_t):
        raise ValueError(f"std must be positive; got {list(std_t)}")
    return mean_t, std_t


#: ``(mean, std, device) -> ([C] mean, [C] std)`` float32 tensors: built once per device.
_STATS_ON_DEVICE: dict = {}


def _stats_on(mean: tuple[float, ...], std: tuple[float, ...],
              device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Checked ``mean``/``std`` as float32 tensors on ``device``, cached.

    Building them on a GPU is a host-to-device copy, which waits for the device:
    done once per ``(mean, std, device)`` rather than once per batch.
    """
    key = (mean, std, device)
    hit = _STATS_ON_DEVICE.get(key)
    if hit is None:
        hit = (torch.tensor(mean, dtype=torch.float32, device=device),
               torch.tensor(std, dtype=torch.float32, device=device))
        _STATS_ON_DEVICE[key] = hit
    return hit


def _normalize(images: torch.Tensor, mean_t: torch.Tensor, std_t: torch.Tensor) -> torch.Tensor:
    c = images.shape[1]
    out = images.to(torch.float32).div_(255.0)
    return out.sub_(mean_t.view(1, c, 1, 1)).div_(std_t.view(1, c, 1, 1))


def normalize(images: torch.Tensor, mean: Sequence[float] | torch.Tensor,
              std: Sequence[float] | torch.Tensor) -> torch.Tensor:
    """Scale uint8 pixels to [0, 1] and standardise each channel.

    Sequences of numbers are checked on the host and their device copies are cached,
    so a call reads nothing back from the device. Tensors are checked too, which
    waits for the device when they live on one; prefer sequences (or
    :class:`BatchAugment`) in a training loop.

    Args:
        images: ``[N, C, H, W]`` uint8 batch on any device.
        mean: ``C`` per-channel means of the [0, 1]-scaled pixels.
        std: ``C`` per-channel standard deviations (all positive).

    Returns:
        ``[N, C, H, W]`` float32 tensor ``(images / 255 - mean) / std`` on the same
        device.

    Raises:
        TypeError: if ``images`` is not a 4-d uint8 tensor (normalising twice or
            normalising floats in [0, 255] are the errors this guards against).
        ValueError: if ``mean``/``std`` do not have one entry per channel or a std is
            not positive.
    """
    _check_uint8_batch(images, "normalize")
    c = images.shape[1]
    if torch.is_tensor(mean) or torch.is_tensor(std):
        mean_t = torch.as_tensor(mean, dtype=torch.float32, device=images.device).reshape(-1)
        std_t = torch.as_tensor(std, dtype=torch.float32, device=images.device).reshape(-1)
        if mean_t.numel() != c or std_t.numel() != c:
            raise ValueError(f"mean and std need {c} entries; got {mean_t.numel()} and "
                             f"{std_t.numel()}")
        if bool((std_t <= 0).any()):
            raise ValueError(f"std must be positive; got {std_t.tolist()}")
        return _normalize(images, mean_t, std_t)
    mean_h, std_h = _check_stats(mean, std, c)
    return _normalize(images, *_stats_on(mean_h, std_h, images.device))


@dataclass(frozen=True)
class BatchAugment:
    """Callable batch transform: optional crop/flip, then normalisation.

    Args:
        mean: per-channel mean (pixels in [0, 1]).
        std: per-channel standard deviation.
        crop_padding: zero padding of the random crop; ``0`` disables cropping.
        flip: apply random horizontal flips.

    Calling it maps a ``[B, 3, H, W]`` uint8 batch (and an optional generator) to a
    ``[B, 3, H, W]`` float32 batch on the same device. ``mean`` and ``std`` are
    checked once, here, on the host; their device copies are made on the first
    batch of each device and reused, so a call never waits for the device.

    Raises:
        ValueError: ``mean``/``std`` of different lengths or a std that is not positive.
    """

    mean: tuple[float, ...]
    std: tuple[float, ...]
    crop_padding: int = 0
    flip: bool = False

    def __post_init__(self) -> None:
        mean, std = _check_stats(self.mean, self.std)
        object.__setattr__(self, "mean", mean)  # frozen: tuples of floats from here on
        object.__setattr__(self, "std", std)

    @classmethod
    def for_dataset(cls, name: str, train: bool) -> "BatchAugment":
        """Standard CIFAR pipeline: crop(pad 4) + flip + normalise for training,
        normalise only for evaluation.

        Args:
            name: ``"cifar10"`` or ``"cifar100"``.
            train: whether to enable the random crop and flip.

        Returns:
            The configured transform.

        Raises:
            ValueError: for an unknown dataset name.
        """
        key = name.lower().replace("-", "").replace("_", "")
        if key not in CIFAR_STATS:
            raise ValueError(f"no statistics for dataset {name!r}; expected one of "
                             f"{', '.join(CIFAR_STATS)}")
        mean, std = CIFAR_STATS[key]
        return cls(mean=mean, std=std, crop_padding=4 if train else 0, flip=train)

    @property
    def is_random(self) -> bool:
        """Whether the transform draws random numbers."""
        return self.crop_padding > 0 or self.flip

    def __call__(self, images: torch.Tensor,
                 generator: torch.Generator | None = None) -> torch.Tensor:
        """Apply the transform.

        Args:
            images: ``[B, 3, H, W]`` uint8 batch.
            generator: randomness for crop/flip (see :func:`random_crop_flip`).

        Returns:
            ``[B, 3, H, W]`` float32 normalised batch.
        """
        if self.is_random:
            images = random_crop_flip(images, self.crop_padding, generator, flip=self.flip)
        _check_uint8_batch(images, "normalize")
        if images.shape[1] != len(self.mean):
            raise ValueError(f"mean and std need {images.shape[1]} entries; got "
                             f"{len(self.mean)} and {len(self.std)}")
        return _normalize(images, *_stats_on(self.mean, self.std, images.device))


def _make_generator(device: torch.device, seed: int) -> torch.Generator:
    try:
        gen = torch.Generator(device=device)
    except RuntimeError:  # backends without device generators draw on the CPU
        gen = torch.Generator()
    return gen.manual_seed(seed)


class DeviceLoader:
    """Batches of a dataset that lives on the model's device.

    The uint8 images and labels are copied to ``device`` once, at construction;
    each batch is then an index + augmentation on that device.

    Per epoch, the sample order is a permutation derived from ``(seed, epoch)``
    (identical on every rank) or the natural order when ``shuffle`` is false. With
    ``world_size > 1`` the first ``world_size * (N // world_size)`` entries of that
    order are dealt round-robin, so every rank gets a disjoint shard of the same
    size (equal step counts keep distributed training in lock-step); the at most
    ``world_size - 1`` leftover samples differ from epoch to epoch when shuffling.
    For exact distributed evaluation make ``N`` divisible by ``world_size`` or
    evaluate on one rank.

    Args:
        dataset: the split to iterate.
        batch_size: samples per batch (per rank).
        augment: ``(uint8 batch, generator) -> float batch``, e.g. a
            :class:`BatchAugment`.
        device: where the data, batches and random draws live; ``None`` keeps the
            dataset's device.
        shuffle: use a fresh random order every epoch.
        seed: base seed for the order and the augmentation.
        drop_last: drop the last batch of a shard if it is smaller than
            ``batch_size``.
        rank: index of this process in ``[0, world_size)``.
        world_size: number of processes sharing the data.

    Raises:
        ValueError: for a non-positive ``batch_size`` / ``world_size``, a ``rank``
            outside ``[0, world_size)``, or fewer samples than ranks.

    Example:
        >>> loader = DeviceLoader(train, 128, augment=BatchAugment.for_dataset(
        ...     "cifar10", train=True), device="cuda", shuffle=True, seed=0)
        >>> for epoch in range(start_epoch, epochs):
        ...     for images, labels in loader.epoch(epoch):
        ...         ...
    """

    def __init__(self, dataset: ImageDataset, batch_size: int, *, augment: AugmentFn,
                 device: torch.device | str | None = None, shuffle: bool = False,
                 seed: int = 0, drop_last: bool = False, rank: int = 0,
                 world_size: int = 1) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1; got {batch_size}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need 0 <= rank < world_size; got rank={rank}, "
                             f"world_size={world_size}")
        if len(dataset) < world_size:
            raise ValueError(f"{len(dataset)} samples cannot be shared by {world_size} ranks")
        self.device = torch.device(device) if device is not None else dataset.images.device
        self.images = dataset.images.to(self.device)  # [N, 3, H, W] uint8, moved once
        self.labels = dataset.labels.to(self.device)  # [N] int64
        self.batch_size = batch_size
        self.augment = augment
        self.shuffle = shuffle
        self.seed = int(seed)
        self.drop_last = drop_last
        self.rank = rank
        self.world_size = world_size

    @property
    def shard_size(self) -> int:
        """Samples this rank sees per epoch."""
        return self.labels.shape[0] // self.world_size

    def __len__(self) -> int:
        """Batches per epoch on this rank."""
        if self.drop_last:
            return self.shard_size // self.batch_size
        return -(-self.shard_size // self.batch_size)

    def indices(self, epoch: int) -> torch.Tensor:
        """This rank's sample order for ``epoch``.

        Args:
            epoch: epoch number (any integer).

        Returns:
            ``[shard_size]`` int64 CPU tensor of dataset indices.
        """
        n = self.labels.shape[0]
        if self.shuffle:
            # Drawn on the CPU so the order does not depend on the device type.
            gen = torch.Generator().manual_seed(derive_seed(self.seed, "order", int(epoch)))
            order = torch.randperm(n, generator=gen)
        else:
            order = torch.arange(n)
        return order[: self.shard_size * self.world_size][self.rank::self.world_size]

    def epoch(self, epoch: int, start_batch: int = 0) -> Iterator[tuple[torch.Tensor,
                                                                        torch.Tensor]]:
        """Iterate over the batches of one epoch.

        Args:
            epoch: epoch number; together with ``seed`` it fixes order and augmentation.
            start_batch: skip this many batches (resume mid-epoch); the remaining
                batches are identical to those of an uninterrupted epoch.

        Yields:
            ``(images, labels)``: ``[B, 3, H, W]`` float (the output of ``augment``)
            and ``[B]`` int64, both on ``device``; ``B = batch_size`` except possibly
            for the last batch.
        """
        # non_blocking: a copy from pageable host memory that does not wait for the
        # device queue (a plain .to() would, once per epoch).
        order = self.indices(epoch).to(self.device, non_blocking=True)
        for b in range(start_batch, len(self)):
            idx = order[b * self.batch_size:(b + 1) * self.batch_size]
            gen = _make_generator(self.device,
                                  derive_seed(self.seed, "augment", int(epoch), self.rank, b))
            yield self.augment(self.images[idx], gen), self.labels[idx]


def batches(dataset: ImageDataset, batch_size: int, *, augment: AugmentFn,
            device: torch.device | str | None = None, shuffle: bool = False,
            seed: int = 0, epoch: int = 0, drop_last: bool = False, rank: int = 0,
            world_size: int = 1, start_batch: int = 0) -> Iterator[tuple[torch.Tensor,
                                                                         torch.Tensor]]:
    """One epoch of batches; shorthand for ``DeviceLoader(...).epoch(epoch)``.

    Each call copies the dataset to ``device``; for multi-epoch loops build one
    :class:`DeviceLoader` instead.

    Args:
        dataset: the split to iterate.
        batch_size: samples per batch (per rank).
        augment: ``(uint8 batch, generator) -> float batch``, e.g. :class:`BatchAugment`.
        device: target device; ``None`` keeps the dataset's device.
        shuffle: shuffle with the order derived from ``(seed, epoch)``.
        seed: base seed.
        epoch: epoch number.
        drop_last: drop a final partial batch.
        rank: this process's rank.
        world_size: number of processes.
        start_batch: batches to skip (resume mid-epoch).

    Returns:
        An iterator of ``(images [B, 3, H, W] float, labels [B] int64)`` on ``device``.

    Raises:
        ValueError: see :class:`DeviceLoader`.
    """
    loader = DeviceLoader(dataset, batch_size, augment=augment, device=device,
                          shuffle=shuffle, seed=seed, drop_last=drop_last, rank=rank,
                          world_size=world_size)
    return loader.epoch(epoch, start_batch)
