"""CIFAR-10 / CIFAR-100 loading, validation and download.

The datasets are read from the standard "python version" layout, the one the
official ``cifar-*-python.tar.gz`` archives unpack to and that torchvision reads::

    ROOT/cifar-10-batches-py/{data_batch_1..5, test_batch, batches.meta}
    ROOT/cifar-100-python/{train, test, meta}

``ROOT`` is the folder that *contains* the layout (torchvision's ``root``). It comes
from the ``data_dir`` argument or, when that is ``None``, from the ``QSV_DATA_DIR``
environment variable. For convenience ``ROOT`` may also be the layout folder itself.

Every split is held in memory as one uint8 tensor (CIFAR-10 train is 150 MiB), so
batching and augmentation can run on the model's device (see
:mod:`qsv_pyg.data.augment`).

Every file is validated when read: a missing file raises :class:`FileNotFoundError`
and a corrupt one raises :class:`DataError`, both naming the file and what was
expected. The pickles are read with a restricted unpickler that only reconstructs
numpy arrays, so a tampered file cannot run code, and whose result may not expand
to many more items than the file has bytes, so a small file of shared nested
lists cannot make numpy allocate gigabytes (:mod:`qsv_pyg.data.pickles`). Downloading
and unpacking are in :mod:`qsv_pyg.data.download`.
"""
from __future__ import annotations

import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np
import torch

from .dataset import DataError, ImageDataset
from .download import extract_tar, fetch, local_archive, md5_of
from .pickles import read_pickle

__all__ = [
    "CIFAR_NAMES",
    "DATA_DIR_ENV",
    "DOWNLOAD_SIZE_MARGIN",
    "NUM_CLASSES",
    "download_cifar",
    "load_cifar",
    "resolve_data_dir",
]

logger = logging.getLogger(__name__)

#: Environment variable consulted by :func:`resolve_data_dir` when no directory is given.
DATA_DIR_ENV = "QSV_DATA_DIR"

_SPLITS = ("train", "test")
_PIXELS = 3 * 32 * 32  # one row of b"data": channel-major RGB 32x32
# Both variants: 50000 training and 10000 test images, archives on the same page.
_OFFICIAL_SIZES = {"train": 50000, "test": 10000}
_URL_BASE = "https://www.cs.toronto.edu/~kriz/"

#: A download of an archive with another md5 than the official one (``download_cifar(...,
#: md5=...)``, a repacked copy) may be this many times the official archive's size; one
#: with the official md5 must be exactly that size. Beyond it the download stops.
DOWNLOAD_SIZE_MARGIN = 2.0


@dataclass(frozen=True)
class _CifarSpec:
    """Static description of one CIFAR variant's python layout and archive."""

    name: str
    display: str
    folder: str
    archive: str
    md5: str
    archive_bytes: int  # size of the official archive
    files: dict[str, tuple[str, ...]]
    meta_file: str
    label_key: bytes
    names_key: bytes
    num_classes: int

    @property
    def url(self) -> str:
        return _URL_BASE + self.archive

    @property
    def official_sizes(self) -> dict[str, int]:
        return _OFFICIAL_SIZES

    def download_cap(self, md5: str) -> int:
        """The most bytes a download of the archive with ``md5`` may have."""
        if md5.lower() == self.md5:
            return self.archive_bytes
        return int(DOWNLOAD_SIZE_MARGIN * self.archive_bytes)


_SPECS = {
    "cifar10": _CifarSpec(
        name="cifar10", display="CIFAR-10", folder="cifar-10-batches-py",
        archive="cifar-10-python.tar.gz", md5="c58f30108f718f92721af3b95e74349a",
        archive_bytes=170_498_071,
        files={"train": tuple(f"data_batch_{i}" for i in range(1, 6)), "test": ("test_batch",)},
        meta_file="batches.meta", label_key=b"labels", names_key=b"label_names",
        num_classes=10,
    ),
    "cifar100": _CifarSpec(
        name="cifar100", display="CIFAR-100", folder="cifar-100-python",
        archive="cifar-100-python.tar.gz", md5="eb9058c3a382ffc7106e4002c42a8d85",
        archive_bytes=169_001_437,
        files={"train": ("train",), "test": ("test",)},
        meta_file="meta", label_key=b"fine_labels", names_key=b"fine_label_names",
        num_classes=100,
    ),
}

#: Dataset names accepted by :func:`load_cifar` and :func:`download_cifar`.
CIFAR_NAMES = tuple(_SPECS)

#: Number of classes of each dataset in :data:`CIFAR_NAMES` (read-only mapping).
NUM_CLASSES = MappingProxyType({name: spec.num_classes for name, spec in _SPECS.items()})


# --------------------------------------------------------------------------- paths


def resolve_data_dir(data_dir: str | os.PathLike | None) -> Path:
    """Resolve the data root: the argument, else ``$QSV_DATA_DIR``.

    The directory need not exist yet (a download creates it).

    Args:
        data_dir: folder that contains ``cifar-10-batches-py/`` and/or
            ``cifar-100-python/``; ``None`` (or ``""``) falls back to the environment.

    Returns:
        The root as an absolute, user-expanded :class:`~pathlib.Path`.

    Raises:
        DataError: if neither the argument nor ``$QSV_DATA_DIR`` is set.
    """
    if data_dir is None or str(data_dir) == "":
        data_dir = os.environ.get(DATA_DIR_ENV) or None
    if data_dir is None:
        raise DataError(
            "no data directory given: pass --data-dir DIR (data_dir=...) or set the "
            f"{DATA_DIR_ENV} environment variable to the folder that contains "
            "cifar-10-batches-py/ or cifar-100-python/ (add --download to fetch it there)")
    return Path(data_dir).expanduser().absolute()


def _spec(name: str) -> _CifarSpec:
    key = name.lower().replace("-", "").replace("_", "")
    if key not in _SPECS:
        raise ValueError(f"unknown dataset {name!r}; expected one of {', '.join(CIFAR_NAMES)}")
    return _SPECS[key]


def _layout_candidates(root: Path, spec: _CifarSpec) -> list[Path]:
    # ROOT/<folder> is the documented layout; ROOT itself is accepted when the user
    # points at the layout folder directly.
    return [root / spec.folder, root]


def _find_layout(root: Path, spec: _CifarSpec) -> Path:
    for candidate in _layout_candidates(root, spec):
        if (candidate / spec.meta_file).is_file():
            return candidate
    looked = ", ".join(str(c / spec.meta_file) for c in _layout_candidates(root, spec))
    raise FileNotFoundError(
        f"{spec.display} not found under {root}: looked for {looked}. Expected the "
        f"'python version' layout {spec.folder}/ ({', '.join(_all_files(spec))}). "
        f"Pass --download (download=True) to fetch {spec.url}, or point --data-dir / "
        f"{DATA_DIR_ENV} at the folder that contains {spec.folder}/.")


def _all_files(spec: _CifarSpec) -> tuple[str, ...]:
    return spec.files["train"] + spec.files["test"] + (spec.meta_file,)


# --------------------------------------------------------------------------- reading


def _bytes_keys(obj: dict) -> dict:
    # Pickles written by Python 3 with str keys are accepted as well.
    return {k.encode() if isinstance(k, str) else k: v for k, v in obj.items()}


def _describe(value: Any) -> str:
    if isinstance(value, np.ndarray):
        return f"{value.dtype} array of shape {list(value.shape)}"
    if isinstance(value, (list, tuple)):
        return f"{type(value).__name__} of length {len(value)}"
    return type(value).__name__


def _read_batch(path: Path, spec: _CifarSpec) -> tuple[np.ndarray, np.ndarray]:
    """Read one batch file.

    Returns:
        ``([N, 3072] uint8 data, [N] int64 labels)``.
    """
    expected = (
        f"a pickled dict with b'data' uint8 array of shape [N, {_PIXELS}] (N = 10000 per "
        f"official CIFAR-10 batch) and {spec.label_key!r} list of N ints in "
        f"[0, {spec.num_classes})")
    obj = read_pickle(path, expected)
    if not isinstance(obj, dict):
        raise DataError(f"{path}: expected {expected}; got {_describe(obj)}")
    obj = _bytes_keys(obj)
    missing = [k for k in (b"data", spec.label_key) if k not in obj]
    if missing:
        raise DataError(
            f"{path}: expected {expected}; keys {missing} are missing (found "
            f"{sorted(map(repr, obj))})")
    data = obj[b"data"]
    if (not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2
            or data.shape[1] != _PIXELS):
        raise DataError(f"{path}: expected {expected}; got b'data' {_describe(data)}")
    if data.shape[0] == 0:
        # A valid pickle, not a damaged one: say so rather than "corrupt".
        raise DataError(
            f"{path}: the batch file is empty: 0 images (a valid pickle whose b'data' has "
            f"shape (0, {_PIXELS})); expected {expected}. Re-extract the archive, or delete "
            "the folder and re-download (--download).")
    raw_labels = obj[spec.label_key]
    try:
        labels = np.asarray(raw_labels)
    except Exception:  # ragged or exotic objects
        labels = np.asarray([], dtype=object)
    if labels.ndim != 1 or labels.shape[0] != data.shape[0] or (
            labels.size and labels.dtype.kind not in "iu"):
        raise DataError(
            f"{path}: expected {expected}; got {spec.label_key!r} {_describe(raw_labels)} "
            f"(element dtype {labels.dtype}) for {data.shape[0]} images")
    labels = labels.astype(np.int64, copy=False)
    if labels.size and (labels.min() < 0 or labels.max() >= spec.num_classes):
        raise DataError(
            f"{path}: expected {expected}; labels out of range: found values in "
            f"[{labels.min()}, {labels.max()}]")
    return data, labels


def _read_classes(layout: Path, spec: _CifarSpec) -> list[str]:
    path = layout / spec.meta_file
    expected = (f"a pickled dict with {spec.names_key!r}: a list of {spec.num_classes} "
                "class names")
    obj = read_pickle(path, expected)
    if not isinstance(obj, dict):
        raise DataError(f"{path}: expected {expected}; got {_describe(obj)}")
    names = _bytes_keys(obj).get(spec.names_key)
    if not isinstance(names, (list, tuple)) or len(names) != spec.num_classes or not all(
            isinstance(n, (bytes, str)) for n in names):
        raise DataError(f"{path}: expected {expected}; got {_describe(names)}")
    return [n.decode("utf-8") if isinstance(n, bytes) else n for n in names]


def _read_split(layout: Path, spec: _CifarSpec, split: str,
                classes: list[str] | None = None) -> ImageDataset:
    classes = _read_classes(layout, spec) if classes is None else classes
    parts = [_read_batch(layout / f, spec) for f in spec.files[split]]
    data = np.concatenate([p[0] for p in parts])
    labels = np.concatenate([p[1] for p in parts])
    if data.shape[0] == 0:
        raise DataError(f"{layout}: the {split} split of {spec.display} contains no images")
    if data.shape[0] != spec.official_sizes[split]:
        # Small layouts are legitimate (tests, excerpts), so this is only logged.
        logger.info("%s %s split at %s has %d images (official: %d)", spec.display, split,
                    layout, data.shape[0], spec.official_sizes[split])
    images = torch.from_numpy(data.reshape(-1, 3, 32, 32))
    return ImageDataset(images=images, labels=torch.from_numpy(labels), classes=classes)


def _read_layout(layout: Path, spec: _CifarSpec) -> dict[str, ImageDataset]:
    """Both splits, every file read once: the validation of a layout.

    Reading is the only trustworthy check, since copies of CIFAR (such as
    re-encoded mirrors) do not match the official per-file checksums.
    """
    classes = _read_classes(layout, spec)
    return {split: _read_split(layout, spec, split, classes) for split in _SPLITS}


def load_cifar(name: str, split: str, data_dir: str | os.PathLike | None = None,
               download: bool = False, url: str | None = None, md5: str | None = None,
               progress: bool = True) -> ImageDataset:
    """Load one split of CIFAR-10 or CIFAR-100 into memory.

    Args:
        name: ``"cifar10"`` or ``"cifar100"`` (case and ``-``/``_`` are ignored).
        split: ``"train"`` (50 000 images) or ``"test"`` (10 000 images).
        data_dir: folder that contains the layout folder (``cifar-10-batches-py/``
            or ``cifar-100-python/``), or the layout folder itself; ``None`` uses
            ``$QSV_DATA_DIR``.
        download: if the split cannot be read, fetch and unpack the archive into
            ``data_dir`` first (see :func:`download_cifar`).
        url: archive source used with ``download`` (``http(s)://``, ``file://`` or
            a local path); ``None`` is the official URL. ``--download-url``
            sets it.
        md5: expected archive checksum used with ``download``; ``None`` is the
            official archive's.
        progress: show a tqdm progress bar while downloading.

    Returns:
        The split: ``images`` ``[N, 3, 32, 32]`` uint8, ``labels`` ``[N]`` int64 with
        CIFAR-100 using the 100 fine labels, ``classes`` the class names.

    Raises:
        ValueError: for an unknown ``name``/``split``, or ``url``/``md5`` without
            ``download``.
        DataError: if no directory is configured, or a file is corrupt (the message
            names the file and what was expected).
        FileNotFoundError: if the layout or one of its files is missing and
            ``download`` is false.
        OSError: if a download fails.
    """
    spec = _spec(name)
    if split not in _SPLITS:
        raise ValueError(f"unknown split {split!r}; expected 'train' or 'test'")
    if not download and (url is not None or md5 is not None):
        raise ValueError("url and md5 are only used together with download=True")
    root = resolve_data_dir(data_dir)
    try:
        return _read_split(_find_layout(root, spec), spec, split)
    except (FileNotFoundError, DataError) as exc:
        if not download:
            raise
        logger.warning("%s is not usable under %s (%s); downloading it", spec.display, root,
                       exc)
    return _download(spec, root, url, md5, progress)[split]


# --------------------------------------------------------------------------- download


def download_cifar(name: str, root: str | os.PathLike, url: str | None = None,
                   md5: str | None = None, progress: bool = True,
                   keep_archive: bool = False) -> Path:
    """Download and unpack a CIFAR archive into ``root`` unless already present.

    Nothing is fetched when ``root/<layout folder>`` already holds a complete, valid
    layout (every file is read and checked). Otherwise the archive is downloaded
    to a temporary file in ``root``, its md5 is verified, it is renamed into place
    (atomic) and unpacked via a staging folder: members with absolute paths, ``..``
    components, links or device files are rejected, and the layout is validated
    before it replaces anything in ``root`` (see :mod:`qsv_pyg.data.download`).

    Args:
        name: ``"cifar10"`` or ``"cifar100"``.
        root: folder that will contain ``cifar-10-batches-py/`` or
            ``cifar-100-python/``; created if needed.
        url: ``http(s)://``, ``ftp://`` or ``file://`` URL of the archive, or the path
            of a local archive (used in place, never deleted); ``None`` is the
            official URL.
        md5: expected hex md5 of the archive; ``None`` is the official archive's.
            A download stops at the official archive's size (with another
            ``md5``: :data:`DOWNLOAD_SIZE_MARGIN` times it).
        progress: show a tqdm progress bar while downloading.
        keep_archive: keep the downloaded ``.tar.gz`` in ``root`` after unpacking.

    Returns:
        The layout folder, ``root/cifar-10-batches-py`` or ``root/cifar-100-python``.

    Raises:
        DataError: on a checksum mismatch (naming the file and both checksums; the
            bad download is deleted), a download larger than its cap, an unsafe or
            unreadable archive, or an archive without a valid layout.
        FileNotFoundError: if ``url`` is a local path that does not exist.
        OSError: if the download fails.
    """
    spec = _spec(name)
    root = Path(root).expanduser().absolute()
    layout = root / spec.folder
    if layout.is_dir():
        try:
            _read_layout(layout, spec)
            return layout
        except (FileNotFoundError, DataError) as exc:
            logger.warning("existing %s is incomplete or corrupt (%s); downloading it again",
                           layout, exc)
    _download(spec, root, url, md5, progress, keep_archive)
    return layout


def _download(spec: _CifarSpec, root: Path, url: str | None, md5: str | None,
              progress: bool, keep_archive: bool = False) -> dict[str, ImageDataset]:
    """Fetch (or take the local) archive, unpack it into ``root``; returns both splits."""
    root.mkdir(parents=True, exist_ok=True)
    expected = (md5 or spec.md5).lower()
    source = url or spec.url
    local = local_archive(source)
    downloaded = False
    if local is not None:
        if not local.is_file():
            raise FileNotFoundError(f"{local}: archive not found (expected {spec.archive})")
        actual = md5_of(local)
        if actual != expected:
            raise DataError(
                f"checksum mismatch for {local}: expected md5 {expected}, got {actual}")
        archive = local
    else:
        archive = root / spec.archive
        if not (archive.is_file() and md5_of(archive) == expected):
            fetch(source, archive, expected, progress, max_bytes=spec.download_cap(expected))
            downloaded = True
    try:
        return _install(archive, root, spec)
    finally:
        if downloaded and not keep_archive:
            archive.unlink(missing_ok=True)


def _install(archive: Path, root: Path, spec: _CifarSpec) -> dict[str, ImageDataset]:
    """Unpack ``archive`` in a staging folder, validate it, move it to ``root/spec.folder``."""
    staging = Path(tempfile.mkdtemp(dir=root, prefix=".extract-"))
    try:
        extract_tar(archive, staging)
        unpacked = staging / spec.folder
        if not unpacked.is_dir():
            found = sorted(p.name for p in staging.iterdir())
            raise DataError(
                f"{archive}: expected the archive to contain {spec.folder}/; found {found}")
        try:
            splits = _read_layout(unpacked, spec)
        except (FileNotFoundError, DataError) as exc:
            raise DataError(
                f"{archive}: does not contain a valid {spec.display} layout: {exc}") from exc
        final = root / spec.folder
        if not final.exists():
            os.replace(unpacked, final)
        else:
            # Replace only the files the archive provides; other files stay.
            for item in unpacked.iterdir():
                dest = final / item.name
                if dest.is_dir() and not dest.is_symlink():
                    shutil.rmtree(dest)
                os.replace(item, dest)
        return splits
    finally:
        shutil.rmtree(staging, ignore_errors=True)


