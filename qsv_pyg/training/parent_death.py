"""A launched trainer stops when the process that launched it dies.

The experiment runner (``examples/reproduce.py``, ``--jobs N``) starts every run
as a child process and waits for it. If the runner is killed outright
(SIGKILL, an out-of-memory kill), nothing forwards a signal to its children: they
would train on, holding their run folders' locks, until their budgets end. So
the launcher names itself in the child's environment (:func:`child_env`), and
the child (:func:`stop_with_parent`, called first thing by ``qsv-train``) sends
itself **one SIGTERM** when that parent dies: the trainer then stops at its
next step boundary and saves a checkpoint, exactly as after a supervisor's
SIGTERM (before the training loop, SIGTERM ends the process at once).

How the child notices:

* Linux: ``prctl(PR_SET_PDEATHSIG, SIGTERM)`` (through ``ctypes``), so the kernel
  sends the signal the moment the parent is gone;
* elsewhere (or where ``prctl`` fails): a daemon thread checks twice a second
  whether the parent is still the parent (a dead parent's children are handed
  to another process, so ``os.getppid()`` changes).

Either way the child first checks that the parent is still alive, so a parent
that died while the child was starting up is noticed too.

Only the standard library is used, so any Python child can call this cheaply.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys
import threading
from typing import Dict, Mapping, MutableMapping, Optional

__all__ = ["PARENT_PID_ENV", "POLL_SECONDS", "child_env", "stop_with_parent"]

#: Environment variable holding the pid of the process the child stops with.
PARENT_PID_ENV = "QSV_STOP_WITH_PARENT"
#: How often the portable watcher checks its parent.
POLL_SECONDS = 0.5
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def child_env(environ: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
    """``environ`` (default: this process's) plus the variable that ties a child to
    this process: pass it as the ``env`` of a child that calls :func:`stop_with_parent`."""
    env = dict(os.environ if environ is None else environ)
    env[PARENT_PID_ENV] = str(os.getpid())
    return env


def stop_with_parent(environ: Optional[MutableMapping[str, str]] = None,
                     use_prctl: bool = True) -> Optional[str]:
    """Send this process one SIGTERM when the parent named in ``environ`` dies.

    Does nothing unless ``environ`` (default: ``os.environ``) holds
    :data:`PARENT_PID_ENV`; the variable is removed, so this process's own
    children are not tied to its parent.

    Args:
        environ: where to find (and remove) the parent's pid.
        use_prctl: use ``prctl(PR_SET_PDEATHSIG)`` on Linux; ``False`` uses the
            portable watcher thread (for tests of it).

    Returns:
        ``"prctl"``, ``"thread"``, ``"gone"`` (the parent had already died: the
        SIGTERM is sent now), or ``None`` when no parent was named.
    """
    environ = os.environ if environ is None else environ
    text = environ.pop(PARENT_PID_ENV, None)
    try:
        parent = int(text) if text is not None else 0
    except ValueError:
        parent = 0
    if parent <= 0:
        return None
    direct = os.getppid() == parent  # the launcher started this interpreter itself
    how = "prctl" if direct and use_prctl and _set_parent_death_signal() else "thread"
    # The parent may have died before the death signal was set up.
    if not _parent_alive(parent, direct):
        _terminate_self(parent)
        return "gone"
    if how == "thread":
        watcher = threading.Thread(target=_watch, args=(parent, direct), daemon=True,
                                   name="stop-with-parent")
        watcher.start()
    return how


def _set_parent_death_signal() -> bool:
    """``prctl(PR_SET_PDEATHSIG, SIGTERM)``; whether it worked (Linux only)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _parent_alive(parent: int, direct: bool) -> bool:
    if direct:
        # A dead parent's children are re-parented at once (even while it is a zombie).
        return os.getppid() == parent
    try:
        os.kill(parent, 0)
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError: it exists, owned by someone else
        return True
    return True


def _watch(parent: int, direct: bool) -> None:
    stop = threading.Event()
    while not stop.wait(POLL_SECONDS):
        if not _parent_alive(parent, direct):
            _terminate_self(parent)
            return


def _terminate_self(parent: int) -> None:
    try:
        os.write(2, f"\nthe launching process (pid {parent}) is gone: stopping\n".encode())
    except OSError:
        pass
    os.kill(os.getpid(), signal.SIGTERM)
