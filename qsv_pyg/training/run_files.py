"""The run folder: its file names, crash-safe writes, the lock and the checks.

One training run owns one folder (``--out-dir``)::

    config.json     the full TrainConfig of the run           (:data:`CONFIG_NAME`)
    log.jsonl       one JSON line per finished epoch          (:data:`LOG_NAME`)
    checkpoint.pt   the latest state, for --resume            (:data:`CHECKPOINT_NAME`)
    metrics.json    final summary, written when the run ends  (:data:`METRICS_NAME`)
    run.lock        the pid of the live run; gone after it    (:data:`LOCK_NAME`)

Guarantees:

* **Atomic files.** Every file is written to a temporary file in the same
  folder, fsync'ed and renamed over the target (:func:`atomic_write` and the
  helpers built on it), so a crash or a full disk leaves the previous version
  or the new one, never a torn file. The log is the one file that grows by
  appending (:func:`append_jsonl`); a failed append is cut back, so the log
  holds only whole lines.
* **One run per folder.** :mod:`~qsv_pyg.training.run_lock` holds ``run.lock``
  while a run is alive; a second run fails with :class:`RunFolderError` naming
  the holder.
* **Clear errors.** Every failure to create, lock or write the folder raises
  :class:`RunFolderError` (an :class:`OSError`) naming the file and the reason;
  :func:`prepare_out_dir` finds the common ones (a file in the way, a read-only
  folder, a full disk, a file-size limit) before any data is loaded.
"""
from __future__ import annotations

import contextlib
import csv
import errno
import json
import os
import secrets
import shutil
from pathlib import Path
from typing import IO, Any, Callable, Dict, Iterable, List, Optional, Sequence, Union

try:
    import resource
except ImportError:  # not POSIX: no file-size limit to check
    resource = None

__all__ = [
    "CHECKPOINT_NAME",
    "CONFIG_NAME",
    "LOCK_NAME",
    "LOG_NAME",
    "METRICS_NAME",
    "RUN_FILES",
    "RunFolderError",
    "append_jsonl",
    "as_write_error",
    "atomic_write",
    "checkpoint_file",
    "clean_stale_temps",
    "check_free_space",
    "find_checkpoint",
    "prepare_out_dir",
    "read_json",
    "read_log",
    "truncate_log",
    "write_json",
    "write_text",
]

CONFIG_NAME = "config.json"
LOG_NAME = "log.jsonl"
CHECKPOINT_NAME = "checkpoint.pt"
METRICS_NAME = "metrics.json"
LOCK_NAME = "run.lock"

#: The files a run writes (the lock excluded: it only exists while the run does).
RUN_FILES = (CONFIG_NAME, LOG_NAME, CHECKPOINT_NAME, METRICS_NAME)

_PROBE_NAME = "write-probe"  # :func:`prepare_out_dir`'s test file (a temp name too)

PathLike = Union[str, "os.PathLike[str]"]


class RunFolderError(OSError):
    """The run folder cannot be created, locked or written (a user/environment error).

    The message names the path and the reason; ``errno`` is the underlying
    error's where there was one.
    """

    def __init__(self, message: str, errno_: Optional[int] = None):
        super().__init__(message)
        self.errno = errno_


def _os_reason(err: OSError) -> str:
    return err.strerror or str(err)


# ============================================================================ writing


def _temp_name(path: Path) -> Path:
    """``.<name>.<hex>.tmp`` next to ``path``: same filesystem, so the rename is atomic."""
    return path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")


def _fsync_dir(directory: Path) -> None:
    """Persist a rename on POSIX; a no-op where directories cannot be opened."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(path: PathLike, write: Callable[[IO], None], *, binary: bool = False) -> None:
    """Write ``path`` via ``write(file)``: all of it or nothing.

    The data goes to a fresh temporary file in the same folder, is fsync'ed and
    renamed over ``path``. Whatever happens before the rename (an exception, a
    ``KeyboardInterrupt``, a full disk), ``path`` keeps its previous content and
    the temporary file is removed.

    Args:
        path: the target; its folder must exist.
        write: called once with the open temporary file.
        binary: open the file in binary (``"wb"``) instead of text (UTF-8) mode.

    Raises:
        RunFolderError: an :class:`OSError` while writing, or the ``RuntimeError``
            that torch's zip writer makes of one (:func:`as_write_error`; the
            message names ``path`` and the reason, e.g. "No space left on device").
    """
    path = Path(path)
    tmp = _temp_name(path)
    try:
        # O_EXCL gives a fresh file; mode 0o666 lets the umask decide permissions as
        # for any ordinary file (tempfile.mkstemp would force 0600).
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0),
                     0o666)
        with os.fdopen(fd, "wb" if binary else "w", **({} if binary else {"encoding": "utf-8"})
                       ) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as err:
        with contextlib.suppress(OSError):
            tmp.unlink()
        failed = as_write_error(err, path)
        if failed is not None and failed is not err:
            raise failed from err
        raise
    _fsync_dir(path.parent)


#: Messages of the RuntimeError that torch's zip writer (``torch.save``) raises when a
#: write fails (a full disk, ``ulimit -f``): the failed write is only its context.
_TORCH_WRITE_FAILURES = ("inline_container", "file write failed", "unexpected pos")


def as_write_error(err: BaseException, path: Optional[PathLike] = None
                   ) -> Optional["RunFolderError"]:
    """``err`` as the :class:`RunFolderError` of a failed write, or ``None`` if it is none.

    A :class:`RunFolderError` is returned as it is, another :class:`OSError` and the
    ``RuntimeError`` of torch's zip writer (``[enforce fail at inline_container.cc:...]
    unexpected pos ...``, ``file write failed``) become one naming ``path`` and the
    reason: the underlying :class:`OSError`'s where torch kept it as the context
    (e.g. "No space left on device"), else "write failed".
    """
    if isinstance(err, RunFolderError):
        return err
    if isinstance(err, OSError):
        cause: BaseException = err
    elif isinstance(err, RuntimeError) and any(
            needle in str(err) for needle in _TORCH_WRITE_FAILURES):
        cause = err
        while cause is not None and not isinstance(cause, OSError):  # the failed write
            cause = cause.__cause__ or cause.__context__
        if cause is None:
            where = f" {path}" if path is not None else ""
            return RunFolderError(f"cannot write{where}: write failed (no space left on the "
                                  f"device, or a file-size limit?) ({_first_line(err)})",
                                  errno.EIO)
    else:
        return None
    where = path if path is not None else getattr(cause, "filename", None)
    reason = _os_reason(cause)
    if cause.errno == errno.EFBIG:
        reason += " (the file-size limit of this process, ulimit -f)"
    return RunFolderError(f"cannot write {where}: {reason}" if where is not None
                          else f"write failed: {reason}", cause.errno)


def _first_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return " ".join(lines[0].split()) if lines else type(err).__name__


def write_text(path: PathLike, text: str) -> None:
    """Atomically write ``text`` (UTF-8) to ``path`` (see :func:`atomic_write`)."""
    atomic_write(path, lambda f: f.write(text))


def write_csv(path: PathLike, fieldnames: Sequence[str], rows: Iterable[Dict[str, Any]]) -> None:
    """Write ``rows`` (dicts keyed by ``fieldnames``) as a CSV file with a header, atomically."""
    def write(f: IO) -> None:
        writer = csv.DictWriter(f, fieldnames=list(fieldnames))
        writer.writeheader()
        writer.writerows(rows)

    atomic_write(path, write)


def write_json(path: PathLike, data: Any) -> None:
    """Atomically write ``data`` as indented JSON with a final newline."""
    write_text(path, json.dumps(data, indent=2) + "\n")


def append_jsonl(path: PathLike, record: Dict[str, Any]) -> None:
    """Append ``record`` as one JSON line and fsync it.

    A failed write (e.g. a full disk) is cut back to the previous end, so the
    file never keeps half a line.

    Raises:
        RunFolderError: the line could not be written.
    """
    line = (json.dumps(record) + "\n").encode("utf-8")
    try:
        with open(path, "ab") as f:
            end = f.seek(0, os.SEEK_END)
            try:
                f.write(line)
                f.flush()
                os.fsync(f.fileno())
            except OSError:
                with contextlib.suppress(OSError):
                    f.truncate(end)
                raise
    except OSError as err:
        raise RunFolderError(f"cannot append to {path}: {_os_reason(err)}", err.errno) from err


# ============================================================================ reading


def read_json(path: PathLike) -> Optional[Dict[str, Any]]:
    """The JSON object in ``path``, or ``None`` if it is missing or unreadable."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _parse_line(line: bytes) -> Optional[Dict[str, Any]]:
    """A whole JSON-object line, or ``None`` (torn: no newline, or not JSON)."""
    if not line.endswith(b"\n"):
        return None
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def read_log(path: PathLike) -> List[Dict[str, Any]]:
    """The records of a ``log.jsonl``; torn lines are skipped, a missing file is empty."""
    try:
        data = Path(path).read_bytes()
    except OSError:
        return []
    records = (_parse_line(line) for line in data.splitlines(keepends=True))
    return [r for r in records if r is not None]


def truncate_log(path: PathLike, keep_epochs: int) -> None:
    """Keep the log lines of epochs ``1..keep_epochs`` (those a checkpoint covers).

    Creates an empty log when there is none, so every run folder has one. When
    the kept lines are the start of the file (always, for logs written by the
    trainer), the file is cut in place, which needs no free space; otherwise it
    is rewritten atomically.

    Raises:
        RunFolderError: the log cannot be read or written.
    """
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        write_text(path, "")
        return
    except OSError as err:
        raise RunFolderError(f"cannot read {path}: {_os_reason(err)}", err.errno) from err
    kept: List[bytes] = []
    prefix_end, is_prefix = 0, True
    for line in data.splitlines(keepends=True):
        record = _parse_line(line)
        epoch = record.get("epoch") if record is not None else None
        if isinstance(epoch, int) and epoch <= keep_epochs:
            kept.append(line)
            prefix_end += len(line) if is_prefix else 0
        else:
            is_prefix = False
    if prefix_end == sum(map(len, kept)):
        if prefix_end != len(data):
            try:
                os.truncate(path, prefix_end)
            except OSError as err:
                raise RunFolderError(f"cannot shorten {path}: {_os_reason(err)}",
                                     err.errno) from err
        return
    atomic_write(path, lambda f: f.writelines(kept), binary=True)


# ============================================================================ finding


def checkpoint_file(path: PathLike) -> Path:
    """``path`` itself, or the checkpoint inside it when ``path`` is a run folder."""
    path = Path(path).expanduser()
    return path / CHECKPOINT_NAME if path.is_dir() else path


def find_checkpoint(resume: Optional[PathLike], out_dir: Optional[PathLike]) -> Path:
    """The checkpoint file that ``--resume [PATH]`` refers to.

    Args:
        resume: a checkpoint file, a run folder, or ``None``/``""`` for
            ``out_dir``'s checkpoint.
        out_dir: the run folder given with ``--out-dir`` (may be ``None``).

    Raises:
        RunFolderError: nothing to resume from.
    """
    if resume is None or str(resume) == "":
        if not out_dir:
            raise RunFolderError("--resume without a path needs --out-dir (the run folder to "
                                 "continue)")
        resume = out_dir
    path = checkpoint_file(resume)
    if not path.is_file():
        raise RunFolderError(f"no checkpoint to resume from: {path} does not exist",
                             errno.ENOENT)
    return path


# ============================================================================ checks


def prepare_out_dir(path: PathLike) -> Optional[Path]:
    """Create the run folder if needed and make sure files can be written in it.

    Call it before loading data, so a bad ``--out-dir`` costs no time.

    Args:
        path: the run folder.

    Returns:
        The outermost folder this call created (``path`` or one of its parents),
        or ``None`` when ``path`` existed.

    Raises:
        RunFolderError: ``path`` is a file or lies under one, cannot be created,
            or a small test file cannot be written in it (read-only, full disk,
            no permission).
    """
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise RunFolderError(f"--out-dir {path} is a file, not a folder; pick another "
                             "--out-dir", errno.ENOTDIR)
    blocker = next((p for p in path.parents if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise RunFolderError(f"--out-dir {path} cannot be created: {blocker} is a file, "
                             "not a folder", errno.ENOTDIR)
    created = next((p for p in reversed((path, *path.parents)) if not p.exists()), None)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise RunFolderError(f"cannot create --out-dir {path}: {_os_reason(err)}",
                             err.errno) from err
    try:
        atomic_write(path / _PROBE_NAME, lambda f: f.write(b"\0" * 4096), binary=True)
        os.unlink(path / _PROBE_NAME)
    except OSError as err:
        reason = _os_reason(err.__cause__ if err.__cause__ is not None else err)
        if err.errno == errno.EFBIG:
            reason += " (the file-size limit of this process, ulimit -f, is too low)"
        raise RunFolderError(f"cannot write into --out-dir {path}: {reason}",
                             err.errno) from err
    return created


def check_free_space(path: PathLike, need_bytes: int, what: str = "a checkpoint") -> None:
    """Refuse to start when ``need_bytes`` cannot be written under ``path``.

    Looks at the free space of the filesystem and at the file-size limit of the
    process (``ulimit -f``).

    Raises:
        RunFolderError: less free space, or a lower file-size limit, than ``need_bytes``.
    """
    mib = need_bytes / 2**20
    free = shutil.disk_usage(path).free
    if free < need_bytes:
        raise RunFolderError(f"only {free / 2**20:.1f} MiB free under {path}; {what} needs "
                             f"about {mib:.1f} MiB", errno.ENOSPC)
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0] if resource else -1
    if 0 <= limit < need_bytes and limit != getattr(resource, "RLIM_INFINITY", -1):
        raise RunFolderError(f"the file-size limit of this process (ulimit -f) is "
                             f"{limit / 2**20:.1f} MiB; {what} in {path} needs about "
                             f"{mib:.1f} MiB", errno.EFBIG)


def clean_stale_temps(path: PathLike) -> List[Path]:
    """Remove temporary files of the run files that a killed writer left in ``path``.

    Only call it while holding the folder's lock
    (:class:`~qsv_pyg.training.run_lock.RunLock`): the temporary file of a live
    writer looks the same.

    Returns:
        The removed files.
    """
    names = tuple(f".{name}." for name in RUN_FILES + (_PROBE_NAME,))
    removed = []
    for entry in Path(path).iterdir():
        if entry.name.endswith(".tmp") and entry.name.startswith(names) and entry.is_file():
            with contextlib.suppress(FileNotFoundError):
                entry.unlink()
                removed.append(entry)
    return removed
