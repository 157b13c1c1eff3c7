"""The exclusive lock on a run folder: one live run per ``--out-dir``.

:class:`RunLock` holds an ``flock`` on ``run.lock``, which names the holder's
pid, while a run is alive; a second run fails with
:class:`~qsv_pyg.training.run_files.RunFolderError` naming the holder. The
kernel drops an ``flock`` when its process dies, so the lock file of a killed
run is simply taken over. :func:`lock_out_dir` is what a run calls first:
check the folder, lock it, and remove what a killed run left behind.
"""
from __future__ import annotations

import contextlib
import errno
import os
from pathlib import Path
from typing import Any, Optional

from .run_files import (
    LOCK_NAME,
    PathLike,
    RunFolderError,
    clean_stale_temps,
    prepare_out_dir,
)

try:
    import fcntl
except ImportError:  # not POSIX: the lock falls back to the pid in the lock file
    fcntl = None

__all__ = ["RunLock", "lock_out_dir"]


class RunLock:
    """Exclusive lock on a run folder for the lifetime of a run.

    ``run.lock`` holds the pid of the run; an ``flock`` on it makes the claim,
    so a lock file left by a killed run (whose ``flock`` the kernel released) is
    taken over. Without ``fcntl`` (not POSIX) the lock file is created
    exclusively instead, and one whose pid is not alive is taken over.

    Args:
        folder: the run folder (must exist).
        flag: the option that chose the folder, named in the error when it is
            busy (the example scripts pass ``"--out-root"``).

    Example::

        with RunLock(out_dir):
            ...  # train; a second RunLock(out_dir) raises RunFolderError meanwhile
    """

    def __init__(self, folder: PathLike, flag: str = "--out-dir"):
        self.folder = Path(folder)
        self.flag = flag
        self.path = self.folder / LOCK_NAME
        self._fd: Optional[int] = None

    def acquire(self) -> "RunLock":
        """Take the lock.

        Raises:
            RunFolderError: another live process holds it (the message names its
                pid), or the lock file cannot be written.
        """
        if self._fd is not None:
            raise RuntimeError(f"{self.path} is already held by this RunLock")
        try:
            self._fd = self._lock_flock() if fcntl is not None else self._lock_exclusive()
            os.ftruncate(self._fd, 0)
            os.write(self._fd, f"{os.getpid()}\n".encode())
            os.fsync(self._fd)
        except OSError as err:
            self._close()
            if isinstance(err, RunFolderError):
                raise
            raise RunFolderError(f"cannot lock {self.path}: {err.strerror or err}",
                                 err.errno) from err
        return self

    def release(self) -> None:
        """Remove the lock file and drop the lock (idempotent)."""
        if self._fd is None:
            return
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        self._close()

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()

    def _close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _busy(self, holder: str) -> RunFolderError:
        return RunFolderError(
            f"{self.folder} is in use by another run ({holder}, lock file {self.path}); wait "
            f"for it to finish or pick another {self.flag}", errno.EBUSY)

    def _holder(self) -> str:
        try:
            pid = self.path.read_text(encoding="utf-8").strip()
        except OSError:
            pid = ""
        return f"pid {pid}" if pid.isdigit() else "pid unknown"

    def _lock_flock(self) -> int:
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise self._busy(self._holder()) from None
            except BaseException:
                os.close(fd)
                raise
            # The previous holder may have removed the file between our open and
            # our flock: then we locked an orphan and must start again.
            try:
                if os.stat(self.path).st_ino == os.fstat(fd).st_ino:
                    return fd
            except FileNotFoundError:
                pass
            os.close(fd)

    def _lock_exclusive(self) -> int:
        for _ in range(2):
            try:
                return os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666)
            except FileExistsError:
                holder = self._holder()
                if holder != "pid unknown" and _pid_alive(int(holder.split()[1])):
                    raise self._busy(holder) from None
                with contextlib.suppress(FileNotFoundError):
                    self.path.unlink()  # stale: its process is gone
        raise self._busy(self._holder())


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists, owned by someone else
        return True
    return True


def lock_out_dir(path: PathLike) -> contextlib.ExitStack:
    """Prepare, lock and clean a run folder; the returned stack releases it.

    :func:`prepare_out_dir`, then :class:`RunLock`, then
    :func:`clean_stale_temps`. Closing the returned stack releases the lock and,
    when this call created the folder (and parents) and the run left nothing in
    it, removes them again (a run that failed on bad data leaves no empty folders).

    Raises:
        RunFolderError: see :func:`prepare_out_dir` and :meth:`RunLock.acquire`.
    """
    path = Path(path)
    created = prepare_out_dir(path)
    stack = contextlib.ExitStack()
    try:
        if created is not None:
            stack.callback(_remove_if_empty, path, created)
        stack.enter_context(RunLock(path))
        clean_stale_temps(path)
    except BaseException:
        stack.close()
        raise
    return stack


def _remove_if_empty(path: Path, outermost: Path) -> None:
    """Remove ``path`` and its parents up to ``outermost`` while they are empty."""
    for folder in (path, *path.parents):
        try:
            folder.rmdir()  # fails, as intended, when anything is in it
        except OSError:
            return
        if folder == outermost:
            return
