"""When a training run stops early: signals, the time budget and its clocks.

* :class:`InterruptFlag` turns the first SIGINT/SIGTERM into a flag the loop
  polls between steps. Its handlers stay installed until the run has saved its
  checkpoint; a further signal while a checkpoint is being written is ignored
  (and says so), so a second Ctrl-C or a supervisor's repeated SIGTERM cannot
  leave a run without its last state.
* :class:`TimeBudget` is ``--time-budget`` on the clock ``--budget-clock``
  chooses: wall time since the run started, or this process's CPU time.
* :func:`stop_requested` is the per-step check, agreed on by every rank
  (on the host, over Gloo: no device sync, see
  :func:`~qsv_pyg.training.distributed.all_reduce_max_host`).

The clocks are the module functions :func:`wall_clock` and
:func:`process_clock`, looked up at every call, so a test can replace them.
"""
from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from typing import Any, Dict, Iterator, Optional

import torch

from .distributed import all_reduce_max_host

__all__ = ["InterruptFlag", "TimeBudget", "process_clock", "stop_requested", "wall_clock"]


def wall_clock() -> float:
    """Monotonic wall clock in seconds (the default budget clock)."""
    return time.monotonic()


def process_clock() -> float:
    """CPU seconds of this process, all threads (``--budget-clock process``)."""
    return time.process_time()


class TimeBudget:
    """A budget of ``minutes`` on the wall clock or on this process's CPU time.

    The budget counts per process: a resumed run gets the ``--time-budget`` it is
    given (the experiment runner passes the rest). The *run's* count, across
    resumes, is :meth:`run_seconds`, which checkpoints keep. Time spent on
    evaluations at budget marks (``--eval-at-minutes``) is *charged off*
    (:attr:`charge`): it moves the deadline instead of using the budget.

    Args:
        minutes: the budget of this process; ``None`` for no budget.
        clock: ``"wall"`` (elapsed since ``t_start``) or ``"process"`` (CPU
            seconds this process spent since ``cpu_start``; with a fixed thread
            count runs then get equal compute even when other work shares the
            machine).
        t_start: :func:`wall_clock` reading when the process started the run.
        used_before: budget-clock seconds the run used in earlier processes.
        eval_before: seconds of mark evaluations in earlier processes.
        cpu_start: :func:`process_clock` reading when the process started the
            run; ``None`` reads it now. Never ``0``: a run trained inside a
            longer-lived process (``--launcher in-process``, a notebook) must not
            be charged the CPU time the process spent before the run began.
    """

    def __init__(self, minutes: Optional[float], clock: str, t_start: float,
                 used_before: float = 0.0, eval_before: float = 0.0,
                 cpu_start: Optional[float] = None):
        self.minutes, self.clock = minutes, clock
        self.used_before, self.eval_before = used_before, eval_before
        self.charge = 0.0  # mark evaluations of this process
        if clock == "wall":
            self.origin = t_start
        else:
            self.origin = process_clock() if cpu_start is None else cpu_start
        self.last = self.origin  # the latest reading

    def now(self) -> float:
        """Read the budget's clock."""
        self.last = wall_clock() if self.clock == "wall" else process_clock()
        return self.last

    def elapsed(self) -> float:
        """Seconds of this process's budget used (clock time less the charged-off time)."""
        return self.now() - self.origin - self.charge

    def used(self) -> float:
        """Fraction of this process's budget used (``0`` without a budget)."""
        return self.elapsed() / (60.0 * self.minutes) if self.minutes else 0.0

    def expired(self) -> bool:
        """Whether the budget is used up (never, without a budget)."""
        return bool(self.minutes) and self.now() > self.origin + 60.0 * self.minutes + self.charge

    def run_seconds(self, fresh: bool = True) -> float:
        """Budget-clock seconds the whole run has used, mark evaluations excluded.

        Args:
            fresh: read the clock; ``False`` takes the latest reading (the last
                step boundary's, for a run with a budget), so that saving a
                checkpoint reads no clock.
        """
        now = self.now() if fresh or not self.minutes else self.last
        return self.used_before + now - self.origin - self.charge

    def eval_seconds(self) -> float:
        """Seconds of mark evaluations of the whole run."""
        return self.eval_before + self.charge


class InterruptFlag:
    """Turns the first SIGINT/SIGTERM into a flag the loop polls between steps.

    Use as a context manager around the whole loop *and* the save that an
    interrupt triggers. A second signal in a single process raises
    :class:`KeyboardInterrupt` at once (the user insists), except while a
    checkpoint is being written (:meth:`saving`): then it is ignored until the
    write completes, with a message. Under torchrun repeated signals are ignored
    too, since the launcher forwards its own copy of every signal and kills the
    workers after a grace period anyway. Handlers can only be installed from
    the main thread; elsewhere signals keep their default behaviour.

    Args:
        distributed: whether several processes train together.
    """

    def __init__(self, distributed: bool):
        self.distributed = distributed
        self.requested = False
        self._saving = False
        self._previous: Dict[int, Any] = {}

    def _handle(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        # os.write, not print: a handler must not re-enter buffered stdout.
        if self._saving:
            again = self.requested
            self.requested = True
            os.write(2, (f"\n{name} received again while the checkpoint is being written: "
                         "ignored until the save completes\n" if again else
                         f"\n{name} received while a checkpoint is being written: stopping "
                         "after the save, at the next step boundary\n").encode())
            return
        if self.requested and not self.distributed:
            raise KeyboardInterrupt
        self.requested = True
        os.write(2, f"\n{name} received: stopping at the next step boundary and saving a "
                    "checkpoint (Ctrl-C again to abort without saving)\n".encode())

    @contextlib.contextmanager
    def saving(self) -> Iterator[None]:
        """Within this block signals only set the flag: a checkpoint write completes."""
        previous, self._saving = self._saving, True
        try:
            yield
        finally:
            self._saving = previous

    def __enter__(self) -> "InterruptFlag":
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


def stop_requested(interrupt: InterruptFlag, budget: TimeBudget, device: torch.device,
                   distributed: bool) -> Optional[str]:
    """``"interrupt"``, ``"time_budget"`` or ``None``, agreed on by every rank.

    Reads the budget's clock exactly once. With several processes the ranks agree
    on the host (a Gloo all-reduce of a CPU tensor), so the check never waits for
    the GPU: it stays at every step boundary, and all ranks stop at the same one.
    ``device`` is kept for callers; the agreement no longer uses it.
    """
    expired = budget.expired()
    code = 2 if interrupt.requested else 1 if expired else 0
    if distributed:
        # All ranks must stop at the same step, or the next all-reduce would hang.
        code = all_reduce_max_host([code])[0]
    return {0: None, 1: "time_budget", 2: "interrupt"}[code]

