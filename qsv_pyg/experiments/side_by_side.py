"""Run tasks a few at a time, in order, each in its own thread: ``--jobs N``.

The tasks of the table runner are training runs, each a subprocess that the
calling thread waits for; threads therefore only wait, and the runs themselves
use the cores. :func:`run_side_by_side` keeps the runner's sequential rules:

* tasks start in the given order, at most ``jobs`` at a time, and the results
  come back in that order, whichever ended first;
* after a task raised one of ``stop_on``, no further task starts; the tasks in
  flight end on their own, then the first error is raised;
* on Ctrl-C the main thread waits until every task in flight has ended (the
  trainers got the same signal and are writing their checkpoints), then raises
  ``interrupted()``;
* if this process dies without a word (SIGKILL), the trainers stop by
  themselves at their next step, with a checkpoint
  (:mod:`~qsv_pyg.training.parent_death`; the thread that started a trainer
  waits for it, so the parent-death signal fires only with the process).
"""
from __future__ import annotations

import threading
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Type, TypeVar

__all__ = ["run_side_by_side"]

T = TypeVar("T")
R = TypeVar("R")


def run_side_by_side(task: Callable[[T], R], items: Sequence[T], jobs: int, *,
                     stop_on: Tuple[Type[BaseException], ...] = (Exception,),
                     interrupted: Callable[[], BaseException] = KeyboardInterrupt,
                     on_result: Optional[Callable[[T, R], None]] = None) -> List[R]:
    """``[task(item) for item in items]`` with up to ``jobs`` tasks running at once.

    Args:
        task: called once per item, from a worker thread.
        items: the work, in start order.
        jobs: how many tasks run at once (≥ 1).
        stop_on: exceptions of ``task`` that stop further starts and are re-raised
            (others escape in their worker thread and are reported by Python).
        interrupted: builds the exception raised after a Ctrl-C; errors of type
            ``type(interrupted())`` raised by tasks take precedence over others too.
        on_result: called with ``(item, result)`` as each task ends, under a lock.

    Returns:
        The results in item order.
    """
    if jobs < 1:
        raise ValueError(f"jobs must be at least 1; got {jobs}")
    lock = threading.Lock()
    pending = iter(enumerate(items))
    results: Dict[int, R] = {}
    errors: List[BaseException] = []

    def worker() -> None:
        while True:
            with lock:
                item = None if errors else next(pending, None)
            if item is None:
                return
            i, value = item
            try:
                result = task(value)
            except stop_on as exc:
                with lock:
                    errors.append(exc)
                return
            with lock:
                results[i] = result
                if on_result is not None:
                    on_result(value, result)

    workers = [threading.Thread(target=worker, name=f"side-by-side-{k}", daemon=True)
               for k in range(min(jobs, len(items)))]
    try:
        for t in workers:
            t.start()
        _join(workers)
    except KeyboardInterrupt:
        with lock:
            errors.insert(0, interrupted())
        while any(t.is_alive() for t in workers):
            try:  # a repeated Ctrl-C reaches the tasks too; keep waiting for them
                _join(workers)
            except KeyboardInterrupt:
                pass
    if errors:
        kind = type(interrupted())
        raise next((e for e in errors if isinstance(e, kind)), errors[0])
    return [results[i] for i in sorted(results)]


def _join(threads: Sequence[threading.Thread]) -> None:
    """Wait for ``threads`` in short slices, so that Ctrl-C reaches this thread."""
    for t in threads:
        while t.is_alive():
            t.join(timeout=0.2)
