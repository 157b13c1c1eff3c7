"""Crash-safe checkpoints and RNG state capture for bit-exact resumption.

A checkpoint is ``torch.save({"format_version": N, "state": state})``. Writes go
to a temporary file in the target directory, are fsync'ed and then atomically
renamed over ``path``, so a crash leaves either the previous checkpoint or the
new one, never a truncated file.

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

import os
import random
import secrets
import warnings
from typing import Any, Dict, Union

import torch

try:
    import numpy as np
except ImportError:  # numpy is optional for RNG capture
    np = None

CHECKPOINT_FORMAT_VERSION = 1
_VERSION_KEY = "format_version"

PathLike = Union[str, "os.PathLike[str]"]


class CheckpointError(RuntimeError):
    """The file exists but is not a readable checkpoint of a supported format."""


def _fsync_dir(directory: str) -> None:
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


def save_checkpoint(path: PathLike, state: Dict[str, Any]) -> None:
    """Atomically write ``state`` to ``path`` (parent directories are created).

    Args:
        path: destination file; an existing file is replaced only once the new
            one is completely on disk.
        state: dict of tensors, state dicts and plain Python values. Keep it to
            those types so :func:`load_checkpoint` can use ``weights_only=True``.

    Raises:
        TypeError: ``state`` is not a dict.
        OSError: an I/O failure; like any serialisation error it propagates after
            the temporary file is removed, leaving ``path`` untouched.
    """
    if not isinstance(state, dict):
        raise TypeError(f"checkpoint state must be a dict, got {type(state).__name__}")
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    # Same directory as the target: os.replace is only atomic within one filesystem.
    # O_EXCL gives a fresh file; mode 0o666 lets the umask decide permissions as for
    # any ordinary file (tempfile.mkstemp would force 0600).
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{secrets.token_hex(6)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save({_VERSION_KEY: CHECKPOINT_FORMAT_VERSION, "state": state}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        # Also on KeyboardInterrupt: never leave a stray temp file behind.
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    _fsync_dir(directory)


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
        CheckpointError: the file is truncated/corrupt, is not a qsv_pyg
            checkpoint, or has an unsupported format version.
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"checkpoint file not found: {path}")
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
