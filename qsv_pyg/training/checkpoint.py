"""Crash-safe checkpoints and RNG state capture for bit-exact resumption.

A checkpoint is ``torch.save({"format_version": N, "state": state})``. Writes go
to a temporary file in the target directory, are fsync'ed and then atomically
renamed over ``path``, so a crash leaves either the previous checkpoint or the
new one, never a truncated file. ``torch.save`` writes a zip archive whose every
entry carries a CRC-32 of its bytes; :func:`load_checkpoint` verifies them all
before unpickling, so a damaged file raises :class:`CheckpointError` instead of
loading wrong weights.

Resuming a CPU run bit-identically::

    save_checkpoint(path, {"model": model.state_dict(), "optim": opt.state_dict(),
                           "sched": sched.state_dict(), "step": step,
                           "rng": capture_rng_state()})
    ...
    state = load_checkpoint(path)
    model.load_state_dict(state["model"]); opt.load_state_dict(state["optim"])
    sched.load_state_dict(state["sched"]); restore_rng_state(state["rng"])
"""
from __future__ import annotations

import contextlib
import os
import random
import warnings
import zipfile
from typing import Any, Dict, Union

import torch

from .run_files import atomic_write

try:
    import numpy as np
except ImportError:  # numpy is optional for RNG capture
    np = None

CHECKPOINT_FORMAT_VERSION = 1
_VERSION_KEY = "format_version"

PathLike = Union[str, "os.PathLike[str]"]


class CheckpointError(RuntimeError):
    """The file exists but is not a readable checkpoint of a supported format."""


def save_checkpoint(path: PathLike, state: Dict[str, Any]) -> None:
    """Atomically write ``state`` to ``path`` (parent directories are created).

    Args:
        path: destination file; an existing file is replaced only once the new
            one is completely on disk (:func:`~qsv_pyg.training.run_files.atomic_write`).
        state: dict of tensors, state dicts and plain Python values. Keep it to
            those types so :func:`load_checkpoint` can use ``weights_only=True``.

    Raises:
        TypeError: ``state`` is not a dict.
        OSError: an I/O failure (a :class:`~qsv_pyg.training.run_files.RunFolderError`
            naming the file); like any serialisation error it propagates after
            the temporary file is removed, leaving ``path`` untouched.
    """
    if not isinstance(state, dict):
        raise TypeError(f"checkpoint state must be a dict, got {type(state).__name__}")
    path = os.path.abspath(os.fspath(path))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    payload = {_VERSION_KEY: CHECKPOINT_FORMAT_VERSION, "state": state}
    with _crc32_on():
        atomic_write(path, lambda f: torch.save(payload, f), binary=True)


@contextlib.contextmanager
def _crc32_on():
    """Make torch.save write the CRC-32 of every archive entry (its default)."""
    config = getattr(getattr(torch.utils, "serialization", None), "config", None)
    save_config = getattr(config, "save", None)
    previous = getattr(save_config, "compute_crc32", None)
    if previous is None:  # a torch without the switch always writes them
        yield
        return
    save_config.compute_crc32 = True
    try:
        yield
    finally:
        save_config.compute_crc32 = previous


def _verify_checksums(path: str) -> None:
    """Check every entry of the checkpoint's zip archive against its stored CRC-32.

    ``torch.load`` does not: flipped bytes in tensor data would load silently.
    """
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except PermissionError:
        raise
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as err:
        raise CheckpointError(f"{path} is not a valid checkpoint (truncated or corrupt "
                              f"file?) ({type(err).__name__}: {err})") from err
    if bad is not None:
        raise CheckpointError(f"{path} is corrupt: the checksum (CRC-32) of its entry {bad!r} "
                              "does not match its bytes (damaged on disk or in transfer); "
                              "resume from another copy or start again")


def load_checkpoint(
    path: PathLike,
    map_location: Any = "cpu",
    *,
    weights_only: bool = True,
) -> Dict[str, Any]:
    """Load a checkpoint written by :func:`save_checkpoint`.

    Args:
        path: checkpoint file.
        map_location: forwarded to :func:`torch.load`.
        weights_only: use torch's restricted unpickler (safe for untrusted files).
            Pass ``False`` only for trusted files that store arbitrary objects.

    Returns:
        The ``state`` dict given to :func:`save_checkpoint`.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        CheckpointError: the file is truncated/corrupt (a checksum does not
            match), is not a qsv_pyg checkpoint, or has an unsupported format
            version.
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"checkpoint file not found: {path}")
    if not os.path.isdir(path):
        _verify_checksums(path)
    try:
        payload = torch.load(path, map_location=map_location, weights_only=weights_only)
    except (PermissionError, IsADirectoryError):
        raise
    except Exception as err:
        first_line = (str(err).strip().splitlines() or [""])[0]  # torch messages run long
        reason = f"{type(err).__name__}: {first_line}"
        if weights_only and "weights only load failed" in str(err).lower():
            # torch cannot tell garbage bytes from disallowed objects in this case.
            raise CheckpointError(
                f"{path} is not a valid checkpoint for weights_only loading: the file is "
                "corrupt, or it stores non-tensor objects (pass weights_only=False only if "
                f"you trust it) ({reason})") from err
        raise CheckpointError(
            f"{path} is not a valid checkpoint (truncated or corrupt file?) ({reason})") from err
    if not isinstance(payload, dict) or _VERSION_KEY not in payload or "state" not in payload:
        raise CheckpointError(f"{path} is not a valid checkpoint: missing {_VERSION_KEY!r} key "
                              "(not written by qsv_pyg.training.checkpoint.save_checkpoint)")
    version = payload[_VERSION_KEY]
    if version != CHECKPOINT_FORMAT_VERSION:
        raise CheckpointError(f"{path} has checkpoint format version {version!r}; this version of "
                              f"qsv_pyg reads version {CHECKPOINT_FORMAT_VERSION}")
    return payload["state"]


def capture_rng_state() -> Dict[str, Any]:
    """Snapshot every global RNG that training touches.

    Captures torch CPU, all CUDA devices (when CUDA is available), Python's
    :mod:`random` and NumPy's legacy global generator (``np.random.*``).
    Explicit ``torch.Generator`` / ``np.random.Generator`` objects are not
    global; save their ``get_state()`` / ``bit_generator.state`` yourself.

    Returns:
        A dict of tensors and plain Python values (loadable with
        ``weights_only=True``).
    """
    state: Dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "python": random.getstate(),
    }
    if np is not None:
        np_state = np.random.get_state(legacy=False)
        if np_state["bit_generator"] != "MT19937":
            raise RuntimeError(f"unexpected numpy global bit generator {np_state['bit_generator']}")
        state["numpy"] = {
            # uint32 key stored as int64 tensor: numpy arrays are not weights_only-loadable.
            "key": torch.from_numpy(np_state["state"]["key"].astype(np.int64)),
            "pos": int(np_state["state"]["pos"]),
            "has_gauss": int(np_state["has_gauss"]),
            "gauss": float(np_state["gauss"]),
        }
    return state


def restore_rng_state(state: Dict[str, Any]) -> None:
    """Restore RNGs captured by :func:`capture_rng_state`.

    CUDA states are restored only when CUDA is available; a mismatch in the
    number of devices restores the common prefix and warns.
    """
    torch.set_rng_state(state["torch"].cpu())
    cuda_states = state.get("cuda") or []
    if cuda_states:
        if not torch.cuda.is_available():
            warnings.warn("checkpoint has CUDA RNG state but CUDA is unavailable; not restored")
        else:
            n = torch.cuda.device_count()
            if n != len(cuda_states):
                warnings.warn(f"checkpoint has CUDA RNG state for {len(cuda_states)} device(s), "
                              f"{n} visible; restoring the first {min(n, len(cuda_states))}")
            for i, s in enumerate(cuda_states[:n]):
                torch.cuda.set_rng_state(s.cpu(), device=i)
    python_state = state["python"]
    # Tuples can come back as lists from some serialisers; random.setstate needs tuples.
    random.setstate((python_state[0], tuple(python_state[1]), python_state[2]))
    if "numpy" in state:
        if np is None:
            warnings.warn("checkpoint has NumPy RNG state but numpy is not installed; not restored")
        else:
            s = state["numpy"]
            np.random.set_state(("MT19937", s["key"].cpu().numpy().astype(np.uint32),
                                 s["pos"], s["has_gauss"], s["gauss"]))
