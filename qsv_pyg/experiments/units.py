"""The units of the real-data tables (:mod:`~qsv_pyg.experiments.citation_table`,
:mod:`~qsv_pyg.experiments.tu_table`, :mod:`~qsv_pyg.experiments.modelnet_table`,
``benchmarks/modelnet_legacy.py``): one run folder per unit, its lock, the
dataset cache, the data folder (``--data-dir`` / ``$QSV_DATA_DIR``), and the
reading of finished units for ``--report-only``.

Every unit (one model on one seed, fold or protocol) trains in its own folder::

    config.json   what the unit trains (written first)
    log.jsonl     one JSON line per epoch
    metrics.json  the unit's results (written last: its presence marks the unit done)
    run.lock      the pid of the process training it (only while it does)
    checkpoint.pt a resumable unit's state at its last finished epoch (only until
                  the unit finishes; :data:`UNIT_CHECKPOINT`)
    model.pt      a resumable unit's final weights (kept after it finishes, not
                  committed; :data:`UNIT_WEIGHTS`), for evaluations after the fact

What a user may rely on:

* **exit 2, one line.** Every user error here ends the script through
  :func:`fail`: one line on stderr naming the problem, exit status 2, no
  traceback.
* **One writer per unit.** :func:`run_unit` holds the folder's
  :class:`~qsv_pyg.training.run_lock.RunLock` while it trains; a second process
  on the same ``--out-root`` that reaches a unit being trained exits 2 naming
  the holder's pid, and never writes into that folder. A finished unit is
  reused by everyone.
* **Nothing mixed.** A folder holding another configuration is refused
  (:func:`finished_unit`); the dataset cache is keyed on the content of the
  source folder (:func:`dataset_copy`), so another ``--data-dir`` never reuses
  a copy of different data.
* **Damaged units are named, not fatal.** :func:`read_units` leaves out a unit
  whose ``config.json`` or ``metrics.json`` is unreadable, not a JSON object,
  or lacks a field the table needs, with one warning line naming the file and
  the field.
* **Long units resume.** A unit run with ``resumable=True`` saves its state
  after every finished epoch (atomically, CRC-checked:
  :mod:`~qsv_pyg.training.checkpoint`); the next run of the same command
  continues from there, with the log cut back to that epoch, instead of
  training the unit again. An unreadable checkpoint is named in one warning
  line and the unit starts again.
* **A failed unit stops the queue.** :func:`run_in_workers` cancels the units
  not yet started as soon as one fails (the running ones finish).
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import secrets
import shutil
import sys
import warnings
from concurrent.futures import ProcessPoolExecutor, as_completed
from multiprocessing import get_context
from pathlib import Path
from typing import (Any, Callable, Dict, Iterator, List, Mapping, NoReturn, Optional,
                    Sequence, Tuple)

from ..training.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from ..training.run_files import (RunFolderError, append_jsonl, clean_stale_temps,
                                  read_json, truncate_log, write_json)
from ..training.run_lock import RunLock

try:
    import fcntl
except ImportError:  # not POSIX: the cache copy is made without a lock
    fcntl = None

__all__ = ["fail", "check_folder", "finished_unit", "run_unit", "UnitCheckpoint",
           "UNIT_CHECKPOINT", "UNIT_WEIGHTS", "read_units",
           "run_in_workers", "source_digest", "dataset_copy", "NUMBER", "DATA_DIR_ENV",
           "default_data_dir", "add_data_dir_arg"]

#: The root flag of the example tables, named in their errors.
OUT_ROOT_FLAG = "--out-root"

#: The environment variable naming the data folder (as for ``qsv-train``'s
#: ``--data-dir``): it holds ``Planetoid/``, ``TUDataset/``, ``ModelNet10/``...
DATA_DIR_ENV = "QSV_DATA_DIR"
#: The data folder when neither ``--data-dir`` nor ``$QSV_DATA_DIR`` names one:
#: ``shared/data`` beside the checkout (the team's shared, read-only folder).
FALLBACK_DATA_DIR = Path(__file__).resolve().parents[3] / "shared" / "data"


def default_data_dir() -> Path:
    """``$QSV_DATA_DIR`` when set, else :data:`FALLBACK_DATA_DIR`."""
    env = os.environ.get(DATA_DIR_ENV)
    return Path(env).expanduser() if env else FALLBACK_DATA_DIR


class _DeprecatedDataRoot(argparse.Action):
    """``--data-root``: the old name of ``--data-dir``; still works, with a
    ``DeprecationWarning`` and a one-line notice on stderr."""

    def __call__(self, parser, namespace, values, option_string=None):
        message = f"{option_string} is deprecated; use --data-dir (or ${DATA_DIR_ENV})"
        warnings.warn(message, DeprecationWarning, stacklevel=2)
        print(f"note: {message}", file=sys.stderr)
        setattr(namespace, self.dest, values)


def add_data_dir_arg(parser: argparse.ArgumentParser, what: str = "the datasets") -> None:
    """``--data-dir DIR`` (default :func:`default_data_dir`) and its deprecated
    alias ``--data-root``; both set ``args.data_dir``."""
    parser.add_argument("--data-dir", type=Path, default=default_data_dir(), metavar="DIR",
                        help=f"folder holding {what} (default: ${DATA_DIR_ENV}, else "
                             f"shared/data beside the checkout)")
    parser.add_argument("--data-root", dest="data_dir", type=Path, metavar="DIR",
                        action=_DeprecatedDataRoot, help="deprecated alias of --data-dir")


def fail(message: str) -> NoReturn:
    """A user error: one line on stderr, exit status 2."""
    print(f"error: {' '.join(str(message).split())}", file=sys.stderr)
    raise SystemExit(2)


def _reason(err: OSError) -> str:
    return err.strerror or str(err)


def check_folder(path: Path, flag: str) -> None:
    """Exit 2 (one line) unless the folder ``path`` (given with ``flag``) exists or
    can be created, and can be written; creates nothing.

    Refused: ``path`` is a regular file, one of its parents is, or the nearest
    existing folder above it is not writable.
    """
    path = Path(path).expanduser()
    if path.exists() and not path.is_dir():
        fail(f"{flag} {path} is a file, not a folder; pick another {flag}")
    blocker = next((p for p in path.parents if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        fail(f"{flag} {path} cannot be created: {blocker} is a file, not a folder")
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not os.access(existing, os.W_OK | os.X_OK):
        fail(f"{flag} {path} cannot be written: no write permission in {existing}")


# ------------------------------------------------------------------ one unit
def finished_unit(folder: Path, config: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """The metrics of a finished unit in ``folder`` trained with ``config``; None if
    the unit has not finished (no ``metrics.json``, or one that is not a JSON
    object: the unit is trained again). A folder that holds another config is an
    error (exit 2): its results belong to a different command."""
    folder = Path(folder)
    old = read_json(folder / "config.json")
    if old is None:
        return None
    if not isinstance(old, dict):
        fail(f"{folder / 'config.json'} is damaged (not a JSON object); remove the folder "
             f"or use another {OUT_ROOT_FLAG}")
    if old != config:
        changed = sorted(k for k in set(old) | set(config) if old.get(k) != config.get(k))
        fail(f"{folder} holds a unit trained with a different configuration "
             f"({', '.join(changed)} differ); use another {OUT_ROOT_FLAG} or remove the "
             f"folder")
    metrics = read_json(folder / "metrics.json")
    return metrics if isinstance(metrics, dict) else None


#: A resumable unit's checkpoint in its folder.
UNIT_CHECKPOINT = "checkpoint.pt"
#: A resumable unit's final weights in its folder (:meth:`UnitCheckpoint.save_weights`).
UNIT_WEIGHTS = "model.pt"


class UnitCheckpoint:
    """What a resumable unit's ``train(log, checkpoint)`` gets: ``state``, the
    dict it last saved (``None`` on a fresh start), and :meth:`save`.

    ``state`` must hold an int ``"epoch"`` (the finished epochs it covers: the
    log is cut back to them on resume) and only tensors, state dicts and plain
    values (it is loaded with ``weights_only=True``). Call :meth:`save` after
    the epoch's ``log`` line, so that a crash between the two loses no line."""

    def __init__(self, folder: Path, state: Optional[Dict[str, Any]] = None) -> None:
        self.path = Path(folder) / UNIT_CHECKPOINT
        self.state = state

    def save(self, state: Dict[str, Any]) -> None:
        if not isinstance(state.get("epoch"), int):
            raise ValueError("a unit checkpoint needs an int 'epoch'")
        save_checkpoint(self.path, state)

    def save_weights(self, state: Dict[str, Any]) -> None:
        """Keep the trained unit's ``state`` (its ``"model"`` state dict and where
        it stands) as :data:`UNIT_WEIGHTS` beside the checkpoint; unlike the
        checkpoint it stays after the unit finishes."""
        if not isinstance(state.get("model"), dict):
            raise ValueError("unit weights need a 'model' state dict")
        save_checkpoint(self.path.with_name(UNIT_WEIGHTS), state)

    @classmethod
    def resume(cls, folder: Path) -> "UnitCheckpoint":
        """The folder's checkpoint; an unreadable one is named in a warning
        line and removed (the unit then starts again)."""
        path = Path(folder) / UNIT_CHECKPOINT
        if not path.exists():
            return cls(folder)
        try:
            state = load_checkpoint(path)
            if not isinstance(state.get("epoch"), int) or state["epoch"] < 0:
                raise CheckpointError("it holds no finished epoch count")
        except (CheckpointError, OSError) as err:
            print(f"warning: {path}: cannot resume ({' '.join(str(err).split())}); "
                  f"the unit starts again", file=sys.stderr)
            path.unlink(missing_ok=True)
            return cls(folder)
        return cls(folder, state)


def run_unit(folder: Path, config: Dict[str, Any], train: Callable[..., Dict[str, Any]],
             resumable: bool = False) -> Dict[str, Any]:
    """Train one unit in ``folder`` unless it has finished with ``config``.

    ``train(log)`` trains and returns the metrics; it calls ``log(record)`` once
    per epoch. With ``resumable``, ``train(log, checkpoint)`` gets a
    :class:`UnitCheckpoint`: its ``state`` when an earlier run of this unit
    saved one (the log then holds that run's lines up to the saved epoch), and
    its ``save`` for every finished epoch; the checkpoint is removed once
    ``metrics.json`` is written. The folder's lock is held from before the old
    files are removed until ``metrics.json`` is written: a unit that another
    live process is training exits 2 (one line naming its pid) and leaves that
    folder alone. Every file is written atomically (the log appended line by
    line), so an interrupted unit leaves no torn file and is restarted (or
    resumed) by the next run.
    """
    folder = Path(folder)
    done = finished_unit(folder, config)
    if done is not None:
        return done
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        fail(f"cannot create the run folder {folder}: {_reason(err)} (check {OUT_ROOT_FLAG})")
    lock = RunLock(folder, flag=OUT_ROOT_FLAG)
    try:
        lock.acquire()
    except RunFolderError as err:
        fail(str(err))
    try:
        done = finished_unit(folder, config)  # another process may have just finished it
        if done is not None:
            return done
        clean_stale_temps(folder)
        # A checkpoint resumes only beside the config.json it was saved under
        # (finished_unit checked that this equals ``config``); without one it is
        # of unknown origin and the unit starts again (the else branch removes it).
        checkpoint = None if not resumable else UnitCheckpoint.resume(folder) \
            if (folder / "config.json").is_file() else UnitCheckpoint(folder)
        if checkpoint is not None and checkpoint.state is not None:
            truncate_log(folder / "log.jsonl", checkpoint.state["epoch"])
            (folder / "metrics.json").unlink(missing_ok=True)
        else:
            for name in ("log.jsonl", "metrics.json", UNIT_CHECKPOINT, UNIT_WEIGHTS):
                (folder / name).unlink(missing_ok=True)
            write_json(folder / "config.json", config)

        def log(record: Dict[str, Any]) -> None:
            append_jsonl(folder / "log.jsonl", record)

        metrics = train(log) if checkpoint is None else train(log, checkpoint)
        write_json(folder / "metrics.json", metrics)
        (folder / UNIT_CHECKPOINT).unlink(missing_ok=True)
        return metrics
    except RunFolderError as err:  # a full disk, a read-only folder: one line
        fail(str(err))
    finally:
        lock.release()


# ------------------------------------------------------------------ reading
#: A field type of :func:`read_units`: an int or a float (not a bool).
NUMBER = "number"


def _type_ok(value: Any, kind: Any) -> bool:
    if kind is None:
        return True
    if kind == NUMBER:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, kind)


def _kind_name(kind: Any) -> str:
    return "a number" if kind == NUMBER else f"a {getattr(kind, '__name__', kind)}"


def _field_problem(data: Dict[str, Any], fields: Mapping[str, Any]) -> Optional[str]:
    """The first field of ``fields`` (dotted names reach into objects) that
    ``data`` lacks or holds with the wrong type, in words."""
    for name, kind in fields.items():
        value: Any = data
        for part in name.split("."):
            if not isinstance(value, dict) or part not in value:
                return f"lacks the field {name!r}"
            value = value[part]
        if not _type_ok(value, kind):
            return f"field {name!r} is not {_kind_name(kind)} ({type(value).__name__})"
    return None


def read_units(root: Path, config_fields: Mapping[str, Any] = {},
               metrics_fields: Mapping[str, Any] = {},
               keep: Optional[Callable[[Dict[str, Any]], bool]] = None,
               check: Optional[Callable[[Dict[str, Any], Dict[str, Any]], Optional[str]]] = None,
               ) -> List[Tuple[Dict[str, Any], Dict[str, Any]]]:
    """``(config, metrics)`` of every finished unit under ``root``, in path order.

    Args:
        root: searched recursively for ``metrics.json``.
        config_fields, metrics_fields: the fields the caller reads, name ->
            type (``int``, ``str``, ``dict``, :data:`NUMBER`, or ``None`` for
            any); dotted names reach into objects (``"hp.epochs"``).
        keep: units whose config it rejects are skipped silently (another
            script's units under the same root).
        check: a further test of a unit; returns the problem in words, or None.

    A unit that is damaged (a file unreadable or not a JSON object, a field
    missing or of the wrong type, ``check``'s problem) is left out with one
    warning line on stderr naming the file and the problem.
    """
    units = []
    for path in sorted(Path(root).rglob("metrics.json")):
        config_path = path.parent / "config.json"
        config, metrics = read_json(config_path), read_json(path)
        problem = None
        if not isinstance(config, dict):
            problem = (f"{config_path}: " + ("missing or not valid JSON" if config is None
                                             else "not a JSON object"))
        elif keep is not None and not keep(config):
            continue
        elif not isinstance(metrics, dict):
            problem = f"{path}: " + ("not valid JSON" if metrics is None
                                     else "not a JSON object")
        else:
            problem = _field_problem(config, config_fields)
            if problem is not None:
                problem = f"{config_path}: {problem}"
            else:
                problem = _field_problem(metrics, metrics_fields)
                if problem is not None:
                    problem = f"{path}: {problem}"
                elif check is not None:
                    found = check(config, metrics)
                    problem = None if found is None else f"{path}: {found}"
        if problem is not None:
            print(f"warning: {' '.join(problem.split())}; unit left out of the table",
                  file=sys.stderr)
            continue
        units.append((config, metrics))
    return units


# ------------------------------------------------------------------ workers
def run_in_workers(fn: Callable[..., Any], calls: Sequence[Tuple[Any, ...]], jobs: int,
                   initializer: Optional[Callable[..., None]] = None,
                   initargs: Tuple[Any, ...] = (),
                   on_done: Optional[Callable[[int, Any], None]] = None) -> None:
    """``fn(*args)`` for every ``args`` of ``calls`` in ``jobs`` spawned worker
    processes; ``on_done(index, result)`` as each one finishes.

    The first failure (an exception, a unit's exit 2, or ^C) cancels every call
    not yet started and is raised here once the running ones have ended.
    """
    context = get_context("spawn")
    with ProcessPoolExecutor(max_workers=max(1, min(jobs, len(calls))), mp_context=context,
                             initializer=initializer, initargs=initargs) as pool:
        futures = {pool.submit(fn, *args): i for i, args in enumerate(calls)}
        try:
            for future in as_completed(futures):
                result = future.result()
                if on_done is not None:
                    on_done(futures[future], result)
        except BaseException:
            pool.shutdown(wait=False, cancel_futures=True)
            raise


# ------------------------------------------------------------------ data cache
def source_digest(source: Path, skip: Sequence[str] = ("processed",)) -> str:
    """SHA-256 over the relative paths, sizes and contents of every file under
    ``source`` (top-level folders named in ``skip`` left out)."""
    h = hashlib.sha256()
    source = Path(source)
    for path in sorted(p for p in source.rglob("*") if p.is_file()):
        rel = path.relative_to(source)
        if rel.parts[0] in skip:
            continue
        h.update(f"{rel.as_posix()}\0{path.stat().st_size}\0".encode())
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


@contextlib.contextmanager
def _cache_lock(path: Path) -> Iterator[None]:
    """An exclusive, blocking ``flock`` on ``path`` (created) for the block."""
    if fcntl is None:
        yield
        return
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # drops the lock


@contextlib.contextmanager
def dataset_copy(source: Path, cache_root: Path, what: str,
                 flag: str = "--cache-root") -> Iterator[Path]:
    """A writable copy of the dataset folder ``source`` (read-only shared data),
    where a PyG dataset class may write its ``processed/`` folder.

    The copy is keyed on the source's content (:func:`source_digest`):
    ``<cache_root>/<Name>-<digest[:16]>/<Name>/`` (``source.json`` beside it
    records the source path and the full digest). Another source folder with
    other files gets its own copy; the same files reuse one. The copy is made
    in a temporary folder and renamed into place, so a torn copy is never used.
    While the block runs the entry is locked (a blocking lock: another process
    waits), so two processes never build or process one copy at once.

    Yields:
        The folder to pass as ``root`` to the PyG dataset class (which reads
        ``root/<Name>/raw``).

    Exits 2 (one line) when ``source`` is not a folder or ``cache_root`` cannot
    be used.
    """
    source = Path(source)
    if not source.is_dir():
        fail(f"{what}: no folder {source} (check --data-dir and --dataset)")
    cache = Path(cache_root).expanduser()
    check_folder(cache, flag)
    stack = contextlib.ExitStack()
    try:
        cache.mkdir(parents=True, exist_ok=True)
        digest = source_digest(source)
        root = cache / f"{source.name}-{digest[:16]}"
        stack.enter_context(_cache_lock(cache / f".{root.name}.lock"))
        record = read_json(root / "source.json")
        if not (isinstance(record, dict) and record.get("sha256") == digest
                and (root / source.name).is_dir()):
            tmp = cache / f".{root.name}.{secrets.token_hex(4)}.partial"
            try:
                shutil.copytree(source, tmp / source.name,
                                ignore=shutil.ignore_patterns("processed"))
                write_json(tmp / "source.json", {"source": str(source.resolve()),
                                                 "sha256": digest})
                shutil.rmtree(root, ignore_errors=True)
                tmp.rename(root)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    except (OSError, shutil.Error) as err:
        stack.close()
        reason = _reason(err) if isinstance(err, OSError) else str(err)
        fail(f"{what}: cannot copy {source} into {flag} {cache}: {reason}")
    with stack:
        yield root
