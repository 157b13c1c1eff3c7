"""The optional C++ kernel of QSV attention on CPU, compiled on first use.

``qsv_pyg/csrc/qsv_kernel_cpu.cpp`` computes what the PyTorch implementation of
:mod:`qsv_pyg.nn.qsv_kernel` computes, in two OpenMP passes over the CSR graph
instead of some forty separate kernels (timings: benchmarks/README.md). It is
built with :func:`torch.utils.cpp_extension.load` the first time it is needed
(about a minute on 2 cores; the start and the measured time are printed on
stderr) and cached under ``$TORCH_EXTENSIONS_DIR`` or
``~/.cache/torch_extensions/<py>_<accelerator>``, in a folder whose name holds a
hash of the source, its path, the build flags, the Python and the torch build,
so two checkouts or virtual environments keep one build each. On an x86-64 CPU
with AVX2 it is built for 8-lane vectors (:func:`cflags`), with the baseline
build's rounding. Without a C++ compiler and ninja,
or with ``QSV_PYG_CPU_KERNEL=0``, the PyTorch implementation is used; results
agree to rounding.

The build never waits without a limit (issue 23):

* Builds of one folder are serialised by an ``flock`` on ``qsv_pyg.lock`` in
  it, which the operating system releases when its holder dies, however it
  dies. Whoever holds it may therefore remove torch's own ``lock`` file there:
  only a killed build (Ctrl-C, SIGTERM, a timeout) leaves one behind, and
  torch would wait for it forever.
* Waiting for another process's build lasts at most
  ``QSV_PYG_KERNEL_LOCK_TIMEOUT`` seconds (default 300; a caller's ``stop``
  callback ends it sooner); then this process warns, naming the lock file,
  and uses the PyTorch implementation.
* A failed build warns with the cause: the first error lines and the last
  lines of the compiler's output (the whole output goes to
  ``build_error.log`` in the build folder).

A cached library is loaded only if it is the one its build wrote (issue 28,
item 6): after every successful build or load the library's size and SHA-256
are recorded in ``library_record.json`` next to it (written atomically), and
they are checked before :func:`torch.utils.cpp_extension.load` maps the file.
A truncated library would otherwise kill the process with SIGBUS, every time
(ninja sees it as up to date). A library that differs from its record, or has
none, is removed and linked again; if that build fails, the object files are
removed too (the next attempt compiles from scratch) and this process warns
once and uses the PyTorch implementation.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import subprocess
import sys
import sysconfig
import threading
import time
import warnings
from types import ModuleType
from typing import Callable, Iterator, List, Optional

try:
    import fcntl
except ImportError:  # Windows: no flock, see _wait_for_baton
    fcntl = None  # type: ignore[assignment]

__all__ = ["KernelBuildError", "build_directory", "cflags", "cpu_kernel", "enabled",
           "extension_name", "lock_timeout"]

_LOCK = threading.Lock()
_STATE: dict = {"tried": False, "module": None, "error": None}
SOURCE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "csrc",
                      "qsv_kernel_cpu.cpp")
NAME = "qsv_pyg_csr_kernel"
CFLAGS = ("-O3", "-fopenmp", "-fno-trapping-math")  # the last: softmax_exp vectorises
# Added on x86-64 where torch reports an AVX2 or AVX-512 CPU (see cflags):
# 8-lane vectors, and no fused multiply-adds, so every product and sum is
# rounded as in the baseline (SSE2) build and both builds give the same bits.
AVX2_CFLAGS = ("-mavx2", "-mfma", "-ffp-contract=off")
LDFLAGS = ("-fopenmp",)
TIMEOUT_ENV = "QSV_PYG_KERNEL_LOCK_TIMEOUT"
DEFAULT_TIMEOUT_S = 300.0
OWN_LOCK = "qsv_pyg.lock"  # flock-ed while a process builds or loads; never stale
TORCH_LOCK = "lock"  # torch's FileBaton: stale when its creator was killed
ERROR_LOG = "build_error.log"
RECORD = "library_record.json"  # size and SHA-256 of the library the last build wrote
_POLL_S = 0.1
_SAY_WAITING_AFTER_S = 2.0
_REASON_TAIL_LINES = 10  # last lines of a failed build's output kept in the warning
_REASON_ERROR_LINES = 3  # and its first lines that mention an error
_REASON_LINE_CHARS = 300


class KernelBuildError(RuntimeError):
    """The kernel was not built for a reason of ours (a lock, a stop request)."""


class _LockTimeout(KernelBuildError):
    pass


class _Stopped(KernelBuildError):
    pass


def enabled() -> bool:
    """False when ``QSV_PYG_CPU_KERNEL=0`` (checked at every call)."""
    return os.environ.get("QSV_PYG_CPU_KERNEL", "1") != "0"


def lock_timeout() -> float:
    """Seconds to wait for another process's build: ``$QSV_PYG_KERNEL_LOCK_TIMEOUT``
    (default 300; ``0`` does not wait)."""
    raw = os.environ.get(TIMEOUT_ENV, "").strip()
    if not raw:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value >= 0:  # also NaN
        warnings.warn(f"qsv_pyg: {TIMEOUT_ENV}={raw!r} is not a number of seconds >= 0; "
                      f"waiting at most {DEFAULT_TIMEOUT_S:g} s")
        return DEFAULT_TIMEOUT_S
    return value


def cflags() -> tuple:
    """The compiler flags of this machine's build: :data:`CFLAGS`, plus
    :data:`AVX2_CFLAGS` on x86-64 when ``torch.backends.cpu.get_cpu_capability()``
    is ``"AVX2"`` or ``"AVX512"`` (``ATEN_CPU_CAPABILITY=default`` opts out).
    The kernel is built on the machine that runs it; the flags are part of
    :func:`extension_name`, so a cache shared with another kind of CPU keeps
    one build per kind."""
    import platform

    import torch

    capability = getattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")()
    if platform.machine().lower() in ("x86_64", "amd64") and capability in ("AVX2", "AVX512"):
        return CFLAGS + AVX2_CFLAGS
    return CFLAGS


def extension_name() -> str:
    """``qsv_pyg_csr_kernel_<hash>``: the hash covers the source (content and
    path), the build flags, the Python and the torch build, so a change of any
    of them gets a folder of its own instead of rebuilding another's."""
    import torch

    digest = hashlib.sha256()
    with open(SOURCE, "rb") as f:
        digest.update(f.read())
    for part in (os.path.realpath(SOURCE), " ".join(cflags() + LDFLAGS), sys.version,
                 getattr(sys, "abiflags", ""), sysconfig.get_paths().get("include", ""),
                 torch.__version__, os.path.realpath(os.path.dirname(torch.__file__)),
                 sys.platform):
        digest.update(b"\0" + str(part).encode())
    return f"{NAME}_{digest.hexdigest()[:12]}"


def build_directory(name: Optional[str] = None) -> str:
    """Where the kernel is built: ``$TORCH_EXTENSIONS_DIR/<name>``, else torch's
    default root (``~/.cache/torch_extensions/py311_cpu/<name>`` and the like)."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is None:
        import torch
        from torch.utils.cpp_extension import get_default_build_root

        accelerator = (f"rocm{torch.version.hip.replace('.', '')}" if torch.version.hip else
                       f"cu{torch.version.cuda.replace('.', '')}" if torch.version.cuda else
                       "cpu")
        python = f"py{sys.version_info.major}{sys.version_info.minor}" \
                 f"{getattr(sys, 'abiflags', '')}"
        root = os.path.join(get_default_build_root(), f"{python}_{accelerator}")
    return os.path.join(root, name or extension_name())


def cpu_kernel(stop: Optional[Callable[[], bool]] = None) -> Optional[ModuleType]:
    """The compiled module, or None (disabled, or not built: warned once).

    Tried once per process; a ``KeyboardInterrupt`` during the build
    propagates and leaves it untried.

    Args:
        stop: polled while waiting for another process's build; when it returns
            true the wait ends and this process uses the PyTorch implementation
            (the training loop passes its interrupt flag).
    """
    if not enabled():
        return None
    if _STATE["tried"]:
        return _STATE["module"]
    with _LOCK:
        if not _STATE["tried"]:
            try:
                _STATE["module"] = _build(stop)
            except Exception as exc:  # no compiler or ninja, read-only cache, a lock, ...
                _STATE["error"] = exc
                warnings.warn(_failure_message(exc, stop), stacklevel=2)
            _STATE["tried"] = True
    return _STATE["module"]


# ============================================================================ the build


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _build(stop: Optional[Callable[[], bool]]) -> ModuleType:
    from torch.utils import cpp_extension

    name = extension_name()
    directory = build_directory(name)
    os.makedirs(directory, exist_ok=True)
    with _build_lock(directory, lock_timeout(), stop) as exclusive:
        if exclusive:
            _clear_stale_baton(directory)
        library = os.path.join(directory, name + getattr(cpp_extension, "LIB_EXT", ".so"))
        record = os.path.join(directory, RECORD)
        mismatch = _check_record(library, record) if os.path.exists(library) else None
        if mismatch is not None:
            _say(f"qsv_pyg: the cached C++ CPU kernel {library} is not the library its build "
                 f"wrote ({mismatch}); linking it again")
            for path in (library, record):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(path)
        fresh = not os.path.exists(library)
        if fresh and mismatch is None:
            _say(f"qsv_pyg: compiling the C++ CPU kernel (first use, about a minute; cached "
                 f"in {directory})...")
        t0 = time.monotonic()
        try:
            module = cpp_extension.load(name=name, sources=[SOURCE], extra_cflags=list(cflags()),
                                        extra_ldflags=list(LDFLAGS), build_directory=directory,
                                        verbose=False)
        except Exception as exc:
            _write_error_log(directory, exc)
            if mismatch is not None:  # damaged objects too, perhaps: compile afresh next time
                _remove_objects(directory)
            raise
        _write_record(library, record)
        if fresh:
            _say(f"qsv_pyg: ... C++ CPU kernel built in {time.monotonic() - t0:.0f} s")
        with contextlib.suppress(OSError):
            os.remove(os.path.join(directory, ERROR_LOG))
    return module


def _digest(path: str) -> dict:
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
            size += len(block)
    return {"size": size, "sha256": digest.hexdigest()}


def _check_record(library: str, record: str) -> Optional[str]:
    """None when ``library`` has the size and SHA-256 in ``record``; else what differs.

    Read before the library is mapped: a truncated shared object passes the
    loader's first checks and then kills the process with SIGBUS."""
    try:
        with open(record) as f:
            want = json.load(f)
        want_size, want_sha = int(want["size"]), str(want["sha256"])
    except FileNotFoundError:
        return f"it has no {RECORD}: built before the record existed, or the build was cut short"
    except (OSError, ValueError, TypeError, KeyError) as exc:
        return f"its {RECORD} is unreadable: {exc}"
    try:
        have = _digest(library)
    except OSError as exc:
        return f"it cannot be read: {exc}"
    if have["size"] != want_size:
        return f"{have['size']} bytes, the build wrote {want_size}"
    if have["sha256"] != want_sha:
        return "its SHA-256 differs from the build's"
    return None


def _write_record(library: str, record: str) -> None:
    """Record the loaded library's size and SHA-256 (atomically; unchanged records are
    not rewritten). Where it cannot be written, the next process links again."""
    tmp = f"{record}.{os.getpid()}.tmp"
    try:
        have = _digest(library)
        with contextlib.suppress(OSError, ValueError):
            with open(record) as f:
                if json.load(f) == have:
                    return
        with open(tmp, "w") as f:
            json.dump(have, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, record)
    except OSError as exc:
        _say(f"qsv_pyg: could not record the C++ CPU kernel's checksum in {record} ({exc})")
        with contextlib.suppress(OSError):
            os.remove(tmp)


def _remove_objects(directory: str) -> None:
    """Remove the build's object files, so the next build compiles every source again."""
    with contextlib.suppress(OSError):
        for entry in os.listdir(directory):
            if entry.endswith((".o", ".obj")):
                with contextlib.suppress(OSError):
                    os.remove(os.path.join(directory, entry))


@contextlib.contextmanager
def _build_lock(directory: str, timeout: float,
                stop: Optional[Callable[[], bool]]) -> Iterator[bool]:
    """Hold the folder's own lock; yields whether it is exclusive (flock works).

    Without flock (Windows, some network file systems) it only waits, within
    the same limit, for torch's lock file to go away.
    """
    path = os.path.join(directory, OWN_LOCK)
    fd = _acquire_flock(path, timeout, stop)
    try:
        if fd is None:
            _wait_for_baton(directory, timeout, stop)
        yield fd is not None
    finally:
        if fd is not None:
            os.close(fd)  # releases the flock


def _acquire_flock(path: str, timeout: float,
                   stop: Optional[Callable[[], bool]]) -> Optional[int]:
    """The open, flock-ed ``path``; None where flock is not available."""
    if fcntl is None:
        return None
    t0 = time.monotonic()
    said = False
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # another process holds it
                waited = time.monotonic() - t0
                if waited >= timeout:
                    raise _LockTimeout(
                        f"waited {timeout:g} s for another process's build of the C++ CPU "
                        f"kernel (lock {path}, {_read_holder(fd)}). If no such process is "
                        f"running, delete {path}; {TIMEOUT_ENV}=<seconds> sets the wait") from None
                if stop is not None and stop():
                    raise _Stopped(f"stopped while waiting for another process's build "
                                   f"(lock {path}, {_read_holder(fd)})") from None
                if not said and waited >= _SAY_WAITING_AFTER_S:
                    said = True
                    _say(f"qsv_pyg: waiting for another process's build of the C++ CPU kernel "
                         f"({_read_holder(fd)}; lock {path}; at most {timeout:g} s, "
                         f"{TIMEOUT_ENV})...")
                time.sleep(_POLL_S)
                continue
            except OSError:  # flock not supported by this file system
                os.close(fd)
                return None
            # The file may have been deleted (by hand) while we waited: our lock
            # would then be on a file nobody else opens; take the one at the path.
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(path))
            except FileNotFoundError:
                same = False
            if same:
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, 0)
                    os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()} since "
                                  f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode(), 0)
                return fd
            os.close(fd)
            fd = -1
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    except BaseException:  # a timeout, a stop, Ctrl-C
        if fd >= 0:
            os.close(fd)
        raise


def _read_holder(fd: int) -> str:
    try:
        text = os.pread(fd, 200, 0).decode(errors="replace").strip()
    except OSError:
        text = ""
    return f"held by {text}" if text else "holder unknown"


def _clear_stale_baton(directory: str) -> None:
    """Remove torch's ``lock`` left by a killed build (we hold the folder's flock,
    so no live build of ours owns it)."""
    path = os.path.join(directory, TORCH_LOCK)
    if not os.path.lexists(path):
        return
    try:
        os.remove(path)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise KernelBuildError(f"{path} was left by a killed build and cannot be removed "
                               f"({exc}); delete it") from exc
    _say(f"qsv_pyg: removed {path}, a stale lock left by an interrupted build of the C++ "
         f"CPU kernel")


def _wait_for_baton(directory: str, timeout: float,
                    stop: Optional[Callable[[], bool]]) -> None:
    """Without flock: wait (bounded) for torch's lock file to go away."""
    path = os.path.join(directory, TORCH_LOCK)
    t0 = time.monotonic()
    while os.path.lexists(path):
        waited = time.monotonic() - t0
        if waited >= timeout:
            raise _LockTimeout(
                f"{path} has been there for {timeout:g} s: another process is building the "
                f"C++ CPU kernel, or a killed build left it. If no such process is running, "
                f"delete {path}; {TIMEOUT_ENV}=<seconds> sets the wait")
        if stop is not None and stop():
            raise _Stopped(f"stopped while waiting for {path}")
        time.sleep(_POLL_S)


# ============================================================================ failures


def _write_error_log(directory: str, exc: BaseException) -> None:
    with contextlib.suppress(OSError):
        with open(os.path.join(directory, ERROR_LOG), "w") as f:
            f.write(f"{exc}\n")


def _interrupted(exc: BaseException, stop: Optional[Callable[[], bool]]) -> bool:
    """Whether the build died of a signal (Ctrl-C reaches ninja too) or a stop request."""
    if isinstance(exc, _Stopped) or (stop is not None and stop()):
        return True
    cause = exc.__cause__
    if isinstance(cause, subprocess.CalledProcessError) and cause.returncode < 0:
        return True
    return "interrupted by user" in str(exc)  # ninja's words on SIGINT


def _failure_message(exc: BaseException, stop: Optional[Callable[[], bool]]) -> str:
    fallback = "this process uses the PyTorch implementation (slower on small graphs)"
    if _interrupted(exc, stop):
        return (f"qsv_pyg: the build of the C++ CPU kernel was interrupted "
                f"({_reason(str(exc), tail=2)}); {fallback}; the build is tried again the "
                f"next time")
    if isinstance(exc, _LockTimeout):
        return f"qsv_pyg: the C++ CPU kernel is not used: {exc}; {fallback}"
    log = ""
    with contextlib.suppress(Exception):
        path = os.path.join(build_directory(), ERROR_LOG)
        if os.path.exists(path):
            log = f" (the whole output: {path})"
    return (f"qsv_pyg: the C++ CPU kernel could not be built: {_reason(str(exc))}\n"
            f"qsv_pyg: {fallback}{log}. Set QSV_PYG_CPU_KERNEL=0 to skip the attempt.")


def _reason(text: str, tail: int = _REASON_TAIL_LINES) -> str:
    """The cause of a failed build in a few lines: the first line, the first lines
    that name an error and the last ``tail`` lines (where the compiler and ninja
    say what went wrong); long lines (compiler command lines) are cut."""
    lines = [line.rstrip() for line in text.strip().splitlines() if line.strip()]
    if not lines:
        return "no message"
    keep = {0, *range(max(0, len(lines) - tail), len(lines))}
    keep.update([i for i, line in enumerate(lines) if "error" in line.lower()
                 and i not in keep][:_REASON_ERROR_LINES])
    out: List[str] = []
    previous = -1
    for i in sorted(keep):
        if i > previous + 1:
            out.append(f"[... {i - previous - 1} line(s)]")
        line = lines[i]
        if len(line) > _REASON_LINE_CHARS:
            line = line[:_REASON_LINE_CHARS - 60] + " [...] " + line[-50:]
        out.append(line)
        previous = i
    return "\n  ".join(out)
