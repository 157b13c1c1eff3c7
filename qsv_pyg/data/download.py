"""Fetching a dataset archive and unpacking it safely.

Nothing here knows about CIFAR: :func:`fetch` downloads a file and checks its
md5, :func:`extract_tar` unpacks an archive into a folder while refusing every
member that could write outside it. :func:`~qsv_pyg.data.cifar.download_cifar`
puts the two together.
"""
from __future__ import annotations

import hashlib
import os
import re
import secrets
import socket
import tarfile
import urllib.error
import urllib.parse
import zlib
from pathlib import Path, PurePosixPath

import torch.hub

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
          timeout: float = 60.0) -> None:
    """Download ``url`` to ``dest`` and check its md5; ``dest`` is absent or verified.

    The bytes go to a temporary file next to ``dest``
    (:func:`torch.hub.download_url_to_file`), which is renamed to ``dest`` only
    when its md5 matches. A connection that delivers nothing for ``timeout``
    seconds fails as a failed download.

    Raises:
        OSError: the download failed (the message says how to proceed offline).
        DataError: the md5 does not match (the download is deleted).
    """
    tmp = dest.with_name(f".{dest.name}.{secrets.token_hex(6)}.part")
    try:
        try:
            # download_url_to_file takes no timeout; its urlopen uses the default one.
            previous = socket.getdefaulttimeout()
            socket.setdefaulttimeout(timeout)
            try:
                torch.hub.download_url_to_file(url, str(tmp), progress=progress)
            finally:
                socket.setdefaulttimeout(previous)
        except (urllib.error.URLError, OSError, ValueError) as exc:
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
