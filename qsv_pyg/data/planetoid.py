"""Checking Planetoid's raw files (``ind.<name>.*``) without running code in them.

PyG's :class:`~torch_geometric.datasets.Planetoid` reads the raw files with a
plain :func:`pickle.load`, so a crafted ``ind.cora.x`` runs whatever it names.
:func:`check_planetoid_raw` reads every raw pickle first with an unpickler that
resolves only the globals those files hold (numpy arrays and dtypes, scipy's
``csr_matrix``, ``collections.defaultdict`` and ``list``) and checks what comes
out (numeric 2-D features and labels, consistent sparse matrices, a graph of
integer node lists, an integer ``test.index``). A file that passes holds
nothing but those objects, so PyG's own read of the same file then calls
nothing else either. Anything else raises :class:`~qsv_pyg.data.DataError`
with a one-line message naming the file.
"""
from __future__ import annotations

import pickle
import warnings
from pathlib import Path
from typing import Any, Dict

import numpy as np

from .dataset import DataError
from .pickles import _ITEMS_PER_BYTE, _check_expansion

__all__ = ["PLANETOID_PICKLES", "PLANETOID_RAW", "check_planetoid_raw",
           "read_planetoid_pickle"]

#: The pickled raw files of a Planetoid set, ``ind.<name>.<suffix>``.
PLANETOID_PICKLES = ("x", "tx", "allx", "y", "ty", "ally", "graph")
#: Every raw file PyG reads (``test.index`` is text: one node index a line).
PLANETOID_RAW = PLANETOID_PICKLES + ("test.index",)

_ADVICE = "Replace the file with the one PyG downloads."


def _sparse_csr() -> Any:
    from scipy.sparse import csr_matrix
    return csr_matrix


class _PlanetoidUnpickler(pickle.Unpickler):
    """Unpickler that resolves only the globals of Planetoid's raw files."""

    _NUMPY = {
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "scalar"),
        ("_codecs", "encode"),  # bytes pickled with protocol 2 by Python 3
    }

    def find_class(self, module: str, name: str) -> Any:
        # The files were written by numpy < 2 (numpy.core.*) and Python 2 (__builtin__).
        if module.startswith("numpy.core."):
            module = "numpy._core." + module[len("numpy.core."):]
        if (module, name) in self._NUMPY:
            return super().find_class(module, name)
        if module in ("scipy.sparse.csr", "scipy.sparse._csr", "scipy.sparse") \
                and name == "csr_matrix":
            return _sparse_csr()
        if (module, name) == ("collections", "defaultdict"):
            from collections import defaultdict
            return defaultdict
        if module in ("__builtin__", "builtins") and name == "list":
            return list
        raise pickle.UnpicklingError(
            f"refusing to load global {module}.{name} (Planetoid files hold only numpy "
            "arrays, scipy csr matrices and a dict of lists)")


def read_planetoid_pickle(path: Path) -> Any:
    """One raw Planetoid pickle, read with :class:`_PlanetoidUnpickler`.

    Raises:
        DataError: the file is missing, is not such a pickle (a global outside
            the allowed ones, a torn or corrupt file), or expands without bound.
    """
    path = Path(path)
    try:
        with open(path, "rb") as f, warnings.catch_warnings():
            warnings.simplefilter("ignore")  # scipy's deprecated-namespace warning
            obj = _PlanetoidUnpickler(f, encoding="latin1").load()
            size = f.tell()
    except Exception as exc:  # noqa: BLE001 - any failure: not a Planetoid pickle
        reason = " ".join(str(exc).split()) or type(exc).__name__
        raise DataError(f"{path}: not a Planetoid raw file ({type(exc).__name__}: "
                        f"{reason}). {_ADVICE}") from exc
    _check_expansion(obj, _ITEMS_PER_BYTE * size + 64, path, "a Planetoid raw file",
                     _ADVICE)
    return obj


def _matrix_rows(path: Path, obj: Any, labels: bool) -> tuple:
    """``(rows, columns)`` of a feature (csr or dense) or label (dense) matrix."""
    what = "a 2-D numeric label array" if labels else "a 2-D numeric feature matrix"
    csr = _sparse_csr()
    if not labels and isinstance(obj, csr):
        try:
            obj.check_format(full_check=True)  # before todense() trusts its indices
        except Exception as exc:  # noqa: BLE001
            raise DataError(f"{path}: an inconsistent sparse matrix ({exc}). "
                            f"{_ADVICE}") from exc
        if obj.dtype.kind not in "biuf":
            raise DataError(f"{path}: expected {what}, got a sparse matrix of "
                            f"dtype {obj.dtype}. {_ADVICE}")
        return obj.shape
    if not isinstance(obj, np.ndarray) or obj.ndim != 2 or obj.dtype.kind not in "biuf":
        got = (f"an array of shape {list(obj.shape)} and dtype {obj.dtype}"
               if isinstance(obj, np.ndarray) else type(obj).__name__)
        raise DataError(f"{path}: expected {what}, got {got}. {_ADVICE}")
    return obj.shape


def _check_graph(path: Path, graph: Any) -> None:
    if not isinstance(graph, dict) or getattr(graph, "default_factory", None) not in (None, list):
        raise DataError(f"{path}: expected a dict of node lists, got "
                        f"{type(graph).__name__}. {_ADVICE}")
    for node, neighbours in graph.items():
        if isinstance(node, bool) or not isinstance(node, (int, np.integer)) or node < 0:
            raise DataError(f"{path}: node {node!r} is not a non-negative integer. {_ADVICE}")
        if not isinstance(neighbours, list) or any(
                isinstance(j, bool) or not isinstance(j, (int, np.integer)) or j < 0
                for j in neighbours):
            raise DataError(f"{path}: the neighbours of node {node} are not a list of "
                            f"non-negative integers. {_ADVICE}")


def _check_test_index(path: Path) -> None:
    try:
        lines = path.read_text(encoding="ascii").split()
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"{path}: unreadable ({exc}). {_ADVICE}") from exc
    if not lines or not all(line.isdigit() for line in lines):
        raise DataError(f"{path}: expected one non-negative node index per line. {_ADVICE}")


def check_planetoid_raw(raw: Path, name: str) -> Dict[str, Any]:
    """Read and check every raw file of the Planetoid set ``name`` in ``raw``.

    Args:
        raw: the ``raw/`` folder.
        name: the set (``"Cora"``; files ``ind.cora.*``).

    Returns:
        The unpickled objects by suffix (``"x"``, ..., ``"graph"``).

    Raises:
        DataError: a file is missing, holds a global other than the allowed
            ones, is corrupt, or holds objects of the wrong kind or shape.
    """
    raw = Path(raw)
    prefix = f"ind.{name.lower()}."
    missing = [prefix + s for s in PLANETOID_RAW if not (raw / (prefix + s)).is_file()]
    if missing:
        raise DataError(f"{name}: {raw} lacks {', '.join(missing)}")
    objs = {s: read_planetoid_pickle(raw / (prefix + s)) for s in PLANETOID_PICKLES}
    shapes = {s: _matrix_rows(raw / (prefix + s), objs[s], labels=s in ("y", "ty", "ally"))
              for s in PLANETOID_PICKLES if s != "graph"}
    for features, labels in (("x", "y"), ("tx", "ty"), ("allx", "ally")):
        if shapes[features][0] != shapes[labels][0]:
            raise DataError(f"{raw}: {prefix}{features} has {shapes[features][0]} rows but "
                            f"{prefix}{labels} {shapes[labels][0]}. {_ADVICE}")
    for group in (("x", "tx", "allx"), ("y", "ty", "ally")):
        if len({shapes[s][1] for s in group}) != 1:
            raise DataError(f"{raw}: {', '.join(prefix + s for s in group)} have "
                            f"different column counts "
                            f"({', '.join(str(shapes[s][1]) for s in group)}). {_ADVICE}")
    _check_graph(raw / (prefix + "graph"), objs["graph"])
    _check_test_index(raw / (prefix + "test.index"))
    return objs
