"""Fetching a dataset archive and unpacking it safely.

Nothing here knows about CIFAR: :func:`fetch` downloads a file (at most a given
number of bytes) and checks its md5, :func:`extract_tar` unpacks an archive into
a folder while refusing every member that could write outside it.
:func:`~qsv_pyg.data.cifar.download_cifar` puts the two together.
"""
from __future__ import annotations

import hashlib
import http.client
import os
import re
import secrets
import sys
import tarfile
import urllib.error
import urllib.parse
import urllib.request
import zlib
from pathlib import Path, PurePosixPath

from tqdm import tqdm

from .dataset import DataError

__all__ = ["extract_tar", "fetch", "local_archive", "md5_of"]

_CHUNK = 1 << 20
_HAS_FILTERS = hasattr(tarfile, "data_filter")  # extraction filters (PEP 706)


def md5_of(path: Path) -> str:
    """Hex md5 of a file, read in 1 MiB chunks."""
    digest = hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def local_archive(source: str) -> Path | None:
    """The local path ``source`` names, or ``None`` if it is a URL.

    Raises:
        ValueError: an unsupported URL scheme.
    """
    scheme = urllib.parse.urlparse(source).scheme.lower()
    # One-letter "schemes" are Windows drive letters.
    if scheme in ("http", "https", "ftp", "file"):
        return None
    if scheme and len(scheme) > 1:
        raise ValueError(f"unsupported URL scheme {scheme!r} in {source!r}")
    return Path(source).expanduser()


def fetch(url: str, dest: Path, expected_md5: str, progress: bool = True,
          timeout: float = 60.0, max_bytes: int | None = None) -> None:
    """Download ``url`` to ``dest`` and check its md5; ``dest`` is absent or verified.

    The bytes go to a temporary file next to ``dest``, which is renamed to
    ``dest`` only when its md5 matches. A connection that delivers nothing for
    ``timeout`` seconds fails as a failed download, and so does one that
    announces or delivers more than ``max_bytes`` (a wrong URL or an endless
    server would otherwise fill the disk): it stops at the cap.

    Args:
        url: ``http(s)://``, ``ftp://`` or ``file://`` URL.
        dest: the file to create.
        expected_md5: hex md5 the file must have.
        progress: show a progress bar (tqdm, on stderr).
        timeout: seconds a connection may stay silent.
        max_bytes: the most bytes accepted; ``None`` for no cap.

    Raises:
        OSError: the download failed (the message says how to proceed offline).
        DataError: more than ``max_bytes``, or the md5 does not match (nothing is
            kept either way).
    """
    tmp = dest.with_name(f".{dest.name}.{secrets.token_hex(6)}.part")
    try:
        try:
            _download_to(url, tmp, progress, timeout, max_bytes)
        except _TooLarge as exc:
            raise DataError(
                f"download from {url} stopped: {exc}, more than the {max_bytes:,} bytes "
                f"accepted for {dest.name} (a wrong URL, or a server that does not end?); "
                "the partial file was deleted") from None
        except (urllib.error.URLError, OSError, ValueError, http.client.HTTPException) as exc:
            reason = getattr(exc, "reason", exc)
            raise OSError(
                f"could not download {url}: {reason}. Without internet access, put "
                f"{dest.name} or the unpacked folder under {dest.parent} by hand, or pass "
                "--download-url URL with a reachable copy (a local path or a file:// URL "
                "works)") from exc
        actual = md5_of(tmp)
        if actual != expected_md5:
            raise DataError(
                f"checksum mismatch for {dest.name} downloaded from {url}: expected md5 "
                f"{expected_md5}, got {actual} (a truncated or different file); the "
                "downloaded file was deleted")
        os.replace(tmp, dest)  # atomic: dest is either absent or complete
    finally:
        tmp.unlink(missing_ok=True)


class _TooLarge(Exception):
    """The download is larger than its cap (the message says how large)."""


def _download_to(url: str, path: Path, progress: bool, timeout: float,
                 max_bytes: int | None) -> None:
    """Stream ``url`` into the new file ``path``, at most ``max_bytes`` of it."""
    request = urllib.request.Request(url, headers={"User-Agent": "qsv_pyg"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        length = response.headers.get("Content-Length") if response.headers else None
        total = int(length) if length and length.strip().isdigit() else None
        if max_bytes is not None and total is not None and total > max_bytes:
            raise _TooLarge(f"the server announced {total:,} bytes")
        with open(path, "xb") as f, tqdm(total=total, disable=not progress, unit="B",
                                         unit_scale=True, unit_divisor=1024,
                                         file=sys.stderr) as bar:
            done = 0
            while chunk := response.read(_CHUNK):
                done += len(chunk)
                if max_bytes is not None and done > max_bytes:
                    raise _TooLarge(f"it sent more than {max_bytes:,} bytes")
                f.write(chunk)
                bar.update(len(chunk))


def _refuse_unsafe(archive: Path):
    """A tarfile extraction filter: today's checks, then :func:`tarfile.data_filter`.

    ``data_filter`` alone would extract absolute names below the destination
    and allow links inside it; an archive that has them is not a dataset
    archive, so it is refused as a whole.
    """
    def refuse(member: tarfile.TarInfo, why: str) -> DataError:
        return DataError(f"{archive}: refusing to extract member {member.name!r}: {why}")

    def check(member: tarfile.TarInfo, dest: str) -> tarfile.TarInfo:
        name = member.name.replace("\\", "/")
        if name.startswith("/") or re.match(r"^[A-Za-z]:", name):
            raise refuse(member, "absolute path")
        if ".." in PurePosixPath(name).parts:
            raise refuse(member, "'..' would escape the target folder")
        if not (member.isfile() or member.isdir()):
            raise refuse(member, "only regular files and directories are allowed (links "
                                 "and device files are not)")
        if not _HAS_FILTERS:
            return member
        try:
            return tarfile.data_filter(member, dest)  # also drops owners and odd modes
        except tarfile.FilterError as exc:
            raise refuse(member, str(exc)) from None
    return check


def extract_tar(archive: Path, dest: Path) -> None:
    """Unpack ``archive`` into the existing folder ``dest``.

    Members with absolute paths, ``..`` components, links or device files are
    refused before anything is written for them; the caller should extract into
    a staging folder and remove it on error.

    Raises:
        DataError: an unsafe member, or an unreadable archive.
    """
    try:
        with tarfile.open(archive, "r:*") as tar:
            check = _refuse_unsafe(archive)
            if _HAS_FILTERS:
                tar.extractall(dest, filter=check)
            else:  # Python < 3.10.12 / 3.11.4: our checks alone, before anything is written
                tar.extractall(dest, members=[check(m, str(dest)) for m in tar])
    except (tarfile.TarError, EOFError, zlib.error, OSError) as exc:
        raise DataError(f"{archive}: not a readable tar archive ({exc})") from exc
