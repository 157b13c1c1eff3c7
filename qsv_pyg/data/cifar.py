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
numpy arrays, so a tampered file cannot run code.
"""
from __future__ import annotations

import hashlib
import logging
import os
import pickle
import re
import shutil
import tarfile
import tempfile
import urllib.error
import urllib.parse
import urllib.request
import zlib
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

__all__ = [
    "CIFAR_NAMES",
    "DATA_DIR_ENV",
    "DataError",
    "ImageDataset",
    "download_cifar",
    "load_cifar",
    "resolve_data_dir",
]

logger = logging.getLogger(__name__)

#: Environment variable consulted by :func:`resolve_data_dir` when no directory is given.
DATA_DIR_ENV = "QSV_DATA_DIR"

#: Dataset names accepted by :func:`load_cifar` and :func:`download_cifar`.
CIFAR_NAMES = ("cifar10", "cifar100")

_SPLITS = ("train", "test")
_PIXELS = 3 * 32 * 32  # one row of b"data": channel-major RGB 32x32
_DOWNLOAD_TIMEOUT_S = 60.0
_CHUNK = 1 << 20


class DataError(ValueError):
    """A dataset file or archive exists but does not hold what was expected."""


@dataclass(frozen=True)
class _CifarSpec:
    """Static description of one CIFAR variant's python layout and archive."""

    name: str
    display: str
    folder: str
    archive: str
    url: str
    md5: str
    files: dict[str, tuple[str, ...]]
    meta_file: str
    label_key: bytes
    names_key: bytes
    num_classes: int
    official_sizes: dict[str, int]


_SPECS = {
    "cifar10": _CifarSpec(
        name="cifar10",
        display="CIFAR-10",
        folder="cifar-10-batches-py",
        archive="cifar-10-python.tar.gz",
        url="https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz",
        md5="c58f30108f718f92721af3b95e74349a",
        files={
            "train": tuple(f"data_batch_{i}" for i in range(1, 6)),
            "test": ("test_batch",),
        },
        meta_file="batches.meta",
        label_key=b"labels",
        names_key=b"label_names",
        num_classes=10,
        official_sizes={"train": 50000, "test": 10000},
    ),
    "cifar100": _CifarSpec(
        name="cifar100",
        display="CIFAR-100",
        folder="cifar-100-python",
        archive="cifar-100-python.tar.gz",
        url="https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz",
        md5="eb9058c3a382ffc7106e4002c42a8d85",
        files={"train": ("train",), "test": ("test",)},
        meta_file="meta",
        label_key=b"fine_labels",
        names_key=b"fine_label_names",
        num_classes=100,
        official_sizes={"train": 50000, "test": 10000},
    ),
}


# --------------------------------------------------------------------------- dataset


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


class _NumpyOnlyUnpickler(pickle.Unpickler):
    """Unpickler that only resolves the globals numpy arrays need.

    CIFAR pickles hold dicts, lists, bytes and numpy arrays; refusing every other
    global means a tampered or mis-downloaded file cannot execute code.
    """

    _ALLOWED = {
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "scalar"),
        ("numpy._core.numeric", "_frombuffer"),
        ("_codecs", "encode"),  # bytes pickled with protocol 2 by Python 3
    }

    def find_class(self, module: str, name: str) -> Any:
        # Pickles written by numpy < 2 (the official files) name numpy.core.*.
        if module.startswith("numpy.core."):
            module = "numpy._core." + module[len("numpy.core."):]
        if (module, name) not in self._ALLOWED:
            raise pickle.UnpicklingError(
                f"refusing to load global {module}.{name} (CIFAR files only contain "
                "dicts, lists, bytes and numpy arrays)")
        return super().find_class(module, name)


def _unpickle(path: Path, expected: str) -> Any:
    if not path.is_file():
        raise FileNotFoundError(
            f"{path}: missing; expected {expected}. The layout in {path.parent} is "
            "incomplete: re-extract the archive or pass --download.")
    try:
        with open(path, "rb") as f:
            return _NumpyOnlyUnpickler(f, encoding="bytes").load()
    except Exception as exc:  # any failure here means the file is not a CIFAR pickle
        raise DataError(
            f"{path}: expected {expected}; unpickling failed ({type(exc).__name__}: {exc}). "
            "The file is corrupt or truncated: delete it and re-download (--download).") from exc


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
    obj = _unpickle(path, expected)
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
    obj = _unpickle(path, expected)
    if not isinstance(obj, dict):
        raise DataError(f"{path}: expected {expected}; got {_describe(obj)}")
    names = _bytes_keys(obj).get(spec.names_key)
    if not isinstance(names, (list, tuple)) or len(names) != spec.num_classes or not all(
            isinstance(n, (bytes, str)) for n in names):
        raise DataError(f"{path}: expected {expected}; got {_describe(names)}")
    return [n.decode("utf-8") if isinstance(n, bytes) else n for n in names]


def _read_split(layout: Path, spec: _CifarSpec, split: str) -> ImageDataset:
    classes = _read_classes(layout, spec)
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


def _validate_layout(layout: Path, spec: _CifarSpec) -> None:
    # Reads every file: the only trustworthy check, since copies of CIFAR (such as
    # re-encoded mirrors) do not match the official per-file checksums.
    for split in _SPLITS:
        _read_split(layout, spec, split)


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
            a local path); ``None`` is the official URL.
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
    if download:
        try:
            return _read_split(_find_layout(root, spec), spec, split)
        except (FileNotFoundError, DataError) as exc:
            logger.info("%s not usable under %s (%s); downloading", spec.display, root, exc)
        download_cifar(spec.name, root, url=url, md5=md5, progress=progress)
    return _read_split(_find_layout(root, spec), spec, split)


# --------------------------------------------------------------------------- download


def _md5_of(path: Path) -> str:
    digest = hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _local_archive(source: str) -> Path | None:
    """The local path ``source`` names, or ``None`` if it is a URL."""
    scheme = urllib.parse.urlparse(source).scheme.lower()
    # One-letter "schemes" are Windows drive letters.
    if scheme in ("http", "https", "ftp", "file"):
        return None
    if scheme and len(scheme) > 1:
        raise ValueError(f"unsupported URL scheme {scheme!r} in {source!r}")
    return Path(source).expanduser()


def _fetch(url: str, dest: Path, expected_md5: str, progress: bool) -> None:
    """Download ``url`` to ``dest`` via a temporary file, verifying its md5."""
    fd, tmp_name = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".part")
    tmp = Path(tmp_name)
    try:
        digest = hashlib.md5(usedforsecurity=False)
        received = 0
        request = urllib.request.Request(url, headers={"User-Agent": "qsv_pyg"})
        with os.fdopen(fd, "wb") as out:
            try:
                response = urllib.request.urlopen(request, timeout=_DOWNLOAD_TIMEOUT_S)
            except (urllib.error.URLError, OSError) as exc:
                reason = getattr(exc, "reason", exc)
                raise OSError(
                    f"could not download {url}: {reason}. Without internet access, put "
                    f"the archive or the unpacked folder under {dest.parent} by hand, or "
                    "pass a reachable copy as url (a local path or file:// URL works)") from exc
            with response:
                length = response.headers.get("Content-Length")
                total = int(length) if length and length.isdigit() else None
                with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024,
                          desc=dest.name, disable=not progress) as bar:
                    while chunk := response.read(_CHUNK):
                        out.write(chunk)
                        digest.update(chunk)
                        received += len(chunk)
                        bar.update(len(chunk))
        if total is not None and received != total:
            raise OSError(f"download of {url} was truncated: got {received} of {total} bytes")
        actual = digest.hexdigest()
        if actual != expected_md5:
            raise DataError(
                f"checksum mismatch for {dest.name} downloaded from {url}: expected md5 "
                f"{expected_md5}, got {actual}; the downloaded file was deleted")
        os.replace(tmp, dest)  # atomic: dest is either absent or complete
    finally:
        tmp.unlink(missing_ok=True)


def _member_path(member: tarfile.TarInfo, archive: Path) -> PurePosixPath | None:
    """Validated relative path of an archive member (``None`` for the root entry)."""
    name = member.name.replace("\\", "/")
    if name.startswith("/") or re.match(r"^[A-Za-z]:", name):
        raise DataError(f"{archive}: refusing to extract member {member.name!r}: absolute path")
    parts = [p for p in PurePosixPath(name).parts if p != "."]
    if ".." in parts:
        raise DataError(
            f"{archive}: refusing to extract member {member.name!r}: '..' would escape "
            "the target folder")
    if not (member.isfile() or member.isdir()):
        raise DataError(
            f"{archive}: refusing to extract member {member.name!r}: only regular files "
            "and directories are allowed (links and device files are not)")
    return PurePosixPath(*parts) if parts else None


def _extract(archive: Path, root: Path, spec: _CifarSpec) -> Path:
    """Safely unpack ``archive`` and move its validated layout to ``root/spec.folder``."""
    staging = Path(tempfile.mkdtemp(dir=root, prefix=".extract-"))
    try:
        try:
            with tarfile.open(archive, "r:*") as tar:
                for member in tar:
                    rel = _member_path(member, archive)
                    if rel is None:
                        continue
                    target = staging.joinpath(*rel.parts)
                    if member.isdir():
                        target.mkdir(parents=True, exist_ok=True)
                        continue
                    target.parent.mkdir(parents=True, exist_ok=True)
                    # Copying the bytes ourselves (instead of tar.extract) ignores
                    # permissions, owners and times stored in the archive.
                    src = tar.extractfile(member)
                    assert src is not None  # regular files always have a stream
                    with src, open(target, "wb") as dst:
                        shutil.copyfileobj(src, dst, _CHUNK)
        except (tarfile.TarError, EOFError, zlib.error, OSError) as exc:
            raise DataError(f"{archive}: not a readable tar archive ({exc})") from exc
        unpacked = staging / spec.folder
        if not unpacked.is_dir():
            found = sorted(p.name for p in staging.iterdir())
            raise DataError(
                f"{archive}: expected the archive to contain {spec.folder}/; found {found}")
        try:
            _validate_layout(unpacked, spec)
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
        return final
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def download_cifar(name: str, root: str | os.PathLike, url: str | None = None,
                   md5: str | None = None, progress: bool = True,
                   keep_archive: bool = False) -> Path:
    """Download and unpack a CIFAR archive into ``root`` unless already present.

    Nothing is fetched when ``root/<layout folder>`` already holds a complete, valid
    layout (every file is read and checked). Otherwise the archive is streamed to a
    temporary file in ``root``, its md5 is verified, it is renamed into place
    (atomic) and unpacked via a staging folder: members with absolute paths, ``..``
    components, links or device files are rejected, and the layout is validated
    before it replaces anything in ``root``.

    Args:
        name: ``"cifar10"`` or ``"cifar100"``.
        root: folder that will contain ``cifar-10-batches-py/`` or
            ``cifar-100-python/``; created if needed.
        url: ``http(s)://``, ``ftp://`` or ``file://`` URL of the archive, or the path
            of a local archive (used in place, never deleted); ``None`` is the
            official URL.
        md5: expected hex md5 of the archive; ``None`` is the official archive's.
        progress: show a tqdm progress bar while downloading.
        keep_archive: keep the downloaded ``.tar.gz`` in ``root`` after unpacking.

    Returns:
        The layout folder, ``root/cifar-10-batches-py`` or ``root/cifar-100-python``.

    Raises:
        DataError: on a checksum mismatch (naming the file and both checksums; the
            bad download is deleted), an unsafe or unreadable archive, or an archive
            without a valid layout.
        FileNotFoundError: if ``url`` is a local path that does not exist.
        OSError: if the download fails.
    """
    spec = _spec(name)
    root = Path(root).expanduser().absolute()
    layout = root / spec.folder
    if layout.is_dir():
        try:
            _validate_layout(layout, spec)
            return layout
        except (FileNotFoundError, DataError) as exc:
            logger.info("existing %s is incomplete or corrupt (%s); downloading again", layout,
                        exc)
    root.mkdir(parents=True, exist_ok=True)
    expected = (md5 or spec.md5).lower()
    source = url or spec.url
    local = _local_archive(source)
    downloaded = False
    if local is not None:
        if not local.is_file():
            raise FileNotFoundError(f"{local}: archive not found (expected {spec.archive})")
        actual = _md5_of(local)
        if actual != expected:
            raise DataError(
                f"checksum mismatch for {local}: expected md5 {expected}, got {actual}")
        archive = local
    else:
        archive = root / spec.archive
        if not (archive.is_file() and _md5_of(archive) == expected):
            _fetch(source, archive, expected, progress)
            downloaded = True
    try:
        return _extract(archive, root, spec)
    finally:
        if downloaded and not keep_archive:
            archive.unlink(missing_ok=True)
