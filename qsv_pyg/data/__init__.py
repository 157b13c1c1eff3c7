"""CIFAR data: the in-memory split (:mod:`.dataset`), loading and validation
(:mod:`.cifar`, reading through :mod:`.pickles`), download and safe unpacking
(:mod:`.download`), and on-device batching and augmentation (:mod:`.augment`)."""
from .augment import (
    CIFAR10_MEAN,
    CIFAR10_STD,
    CIFAR100_MEAN,
    CIFAR100_STD,
    CIFAR_STATS,
    BatchAugment,
    DeviceLoader,
    batches,
    derive_seed,
    normalize,
    random_crop_flip,
)
from .cifar import (
    CIFAR_NAMES,
    DATA_DIR_ENV,
    NUM_CLASSES,
    download_cifar,
    load_cifar,
    resolve_data_dir,
)
from .dataset import DataError, ImageDataset

__all__ = [
    "CIFAR10_MEAN",
    "CIFAR10_STD",
    "CIFAR100_MEAN",
    "CIFAR100_STD",
    "CIFAR_NAMES",
    "CIFAR_STATS",
    "DATA_DIR_ENV",
    "BatchAugment",
    "DataError",
    "DeviceLoader",
    "ImageDataset",
    "NUM_CLASSES",
    "batches",
    "derive_seed",
    "download_cifar",
    "load_cifar",
    "normalize",
    "random_crop_flip",
    "resolve_data_dir",
]
