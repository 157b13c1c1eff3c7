"""Reading dataset pickles safely: no code runs, and nothing expands without bound."""
from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

from .dataset import DataError

__all__ = ["read_pickle"]

# Items a pickle may expand to, per byte of file: without shared references every
# list/dict item costs at least one byte, so only sharing can exceed this.
_ITEMS_PER_BYTE = 4


class _NumpyOnlyUnpickler(pickle.Unpickler):
    """Unpickler that only resolves the globals numpy arrays need.

    CIFAR pickles hold dicts, lists, bytes and numpy arrays; refusing every other
    global means a tampered or mis-downloaded file cannot execute code.
    """

    _ALLOWED = {
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "scalar"),
        ("numpy._core.numeric", "_frombuffer"),
        ("_codecs", "encode"),  # bytes pickled with protocol 2 by Python 3
    }

    def find_class(self, module: str, name: str) -> Any:
        # Pickles written by numpy < 2 (the official files) name numpy.core.*.
        if module.startswith("numpy.core."):
            module = "numpy._core." + module[len("numpy.core."):]
        if (module, name) in (("__builtin__", "bytes"), ("builtins", "bytes")):
            # Protocol 2 writes an empty bytes object (the buffer of an array of
            # 0 images) as a call of bytes() without arguments.
            return _empty_bytes
        if (module, name) not in self._ALLOWED:
            raise pickle.UnpicklingError(
                f"refusing to load global {module}.{name} (CIFAR files only contain "
                "dicts, lists, bytes and numpy arrays)")
        return super().find_class(module, name)


def _empty_bytes(*args: Any) -> bytes:
    """``bytes()`` for protocol-2 pickles: only the empty call (``bytes(n)`` would let a
    file of a few bytes allocate ``n``)."""
    if args:
        raise pickle.UnpicklingError(
            "refusing to call builtins.bytes with arguments (protocol-2 CIFAR files only "
            "call it without, for an empty bytes object)")
    return b""


def read_pickle(path: Path, expected: str) -> Any:
    """Unpickle a dataset file with :class:`_NumpyOnlyUnpickler`, bounded in size.

    Args:
        path: the file.
        expected: what it should hold, for the error messages.

    Raises:
        FileNotFoundError: ``path`` is missing.
        DataError: it is not a pickle of dicts, lists, bytes and numpy arrays, or
            its containers expand to more than a few items per byte of file.
    """
    if not path.is_file():
        raise FileNotFoundError(
            f"{path}: missing; expected {expected}. The layout in {path.parent} is "
            "incomplete: re-extract the archive or pass --download.")
    try:
        with open(path, "rb") as f:
            obj = _NumpyOnlyUnpickler(f, encoding="bytes").load()
            size = f.tell()
    except Exception as exc:  # any failure here means the file is not a CIFAR pickle
        raise DataError(
            f"{path}: expected {expected}; unpickling failed ({type(exc).__name__}: {exc}). "
            "The file is corrupt or truncated: delete it and re-download (--download).") from exc
    _check_expansion(obj, _ITEMS_PER_BYTE * size + 64, path, expected)
    return obj


def _check_expansion(obj: Any, budget: int, path: Path, expected: str,
                     advice: str = "Delete it and re-download (--download).") -> None:
    """Refuse ``obj`` if its lists, tuples and dicts, walked as trees, exceed ``budget`` items.

    A shared list is counted once per reference, as numpy would copy it; the walk
    stops as soon as the budget is spent, so it is cheap either way.
    """
    stack, items = [obj], 0
    while stack:
        item = stack.pop()
        if not isinstance(item, (dict, list, tuple)):
            continue
        items += len(item)
        if items > budget:
            raise DataError(
                f"{path}: expected {expected}; its lists expand to more than {budget:,} items "
                f"through shared references (a crafted file?). {advice}")
        stack.extend(item.values() if isinstance(item, dict) else item)
