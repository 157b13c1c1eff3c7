r"""The one graph cache: the CSR of an edge index and its batch copies, built
once per graph (:mod:`qsv_pyg.nn.csr` builds them) and reused while the tensor
holds the same values.

What the cache (:func:`graph_csr`) guarantees:

- **Never a stale graph on the host.** An entry is found by the tensor's
  identity (device, dtype, storage address, offset, shape, strides) and, for
  a CPU tensor, then *verified*: the entry keeps a copy of the edge index and
  every hit compares the tensor with it (:func:`torch.equal`). A write the
  version counter does not see (through ``.data``, ``.numpy()``, a
  ``torch.from_numpy`` buffer refilled in place, DLPack) therefore still
  rebuilds the CSR and checks the index ranges again. An exact compare was
  chosen over a checksum: it cannot collide and is no slower (a
  position-weighted sum, a multiply and a sum over the same bytes, took
  0.40 ms against 0.47 ms). Measured on a 16k-node kNN graph (k = 16, 262k
  edges, one thread of a shared CPU): a verified hit costs 0.44 ms (1.7 ns an
  edge), 4-6 % of a fast-path forward of ``QSVConv(16, 16)`` (7-12 ms) and
  about 1 % of ``QSVConv(64, 16, heads=4)`` (44-64 ms); an unverified hit
  costs 4 us, a miss (ranges, copy, CSR) 21 ms. On the host the compare reads
  host memory: it waits for no device.
- **No sync on a device hit.** On CUDA (and any device but the CPU) the
  compare would be a host sync per hit, so by default a hit there is not verified:
  the cache trusts the identity plus the tensor's version counter, which sees
  every in-place write through the tensor or its views (``copy_``,
  ``index_put_``, ``ei[...] = ...``) but not one through ``.data`` or DLPack;
  write a new graph into a new tensor (or call :func:`clear_cache`) there.
  ``configure_cache(verify=True)`` verifies device hits too (one sync each),
  ``verify=False`` trusts the version counter on the host as well.
- **Inference mode.** Inference tensors have no version counter; they are
  always verified by content, whatever ``verify`` says (on CUDA one sync a
  hit, in inference only). The cached arrays are built outside inference
  mode, so a graph first seen under :func:`torch.inference_mode` can later be
  trained on.
- **Bounded by bytes.** The entries' index arrays (the CSR arrays, batch
  copies, and the copies kept for verification) hold at most ``max_bytes`` (default :data:`MAX_BYTES`, 256 MiB) and
  there are at most ``max_entries`` graphs (default :data:`MAX_ENTRIES`, 32);
  the least recently used go first. An int64 graph of degree 16 takes 57
  bytes an edge (the copy 16, five ``[E]`` arrays 40, two row pointers), so
  the default holds about 4.7M edges. A tensor whose values changed replaces
  its entry. A single graph larger than ``max_bytes`` is not cached (a
  :class:`RuntimeWarning` says so; it is rebuilt on every call).
  :func:`cache_info` reports the bytes held.
- **One host sync per new graph.** A new graph's index ranges are checked by
  one ``aminmax`` reduction and one ``.tolist()``; a hit does no range check
  and, by default, no sync (a verified hit on the host reads host memory
  only; see :func:`_same_values`). Under :func:`torch.compile` nothing is
  checked and nothing syncs.
"""
from __future__ import annotations

import warnings
from collections import OrderedDict
from typing import Callable, Dict, Optional, Tuple, Union

import torch
from torch import Tensor
from torch_geometric import EdgeIndex, is_compiling

from .csr import (
    GraphCSR,
    _check_ranges,
    _index_ranges,
    batch_csr,
    batch_edge_index,
    batch_edge_index_of,
    build_csr,
    edge_index_csr,
    plain_edge_index,
    static_csr,
)


#: Default limit on the bytes the cache holds (its entries' index arrays).
MAX_BYTES = 256 * 2 ** 20
#: Default limit on the number of graphs the cache holds.
MAX_ENTRIES = 32


class _Entry:
    """One graph: a copy of its edge index when its hits are verified (else
    the tensor itself and its version, pinned so that its address is not
    reused), its index ranges, and what is derived from it (``csrs``): its
    CSRs by ``("csr", num_src, num_dst, batch)`` and its batch copies by
    ``("copies", num_src, num_dst, batch)`` (as 1-tuples), all tuples of tensors."""
    __slots__ = ("ref", "copied", "version", "ranges", "csrs", "nbytes")

    def __init__(self, edge_index: Tensor, copied: bool):
        self.copied = copied
        self.ref = edge_index.clone(memory_format=torch.contiguous_format) if copied \
            else edge_index
        self.version = None if copied else edge_index._version
        self.ranges = _index_ranges(edge_index)  # the one host sync of a new graph
        self.csrs: Dict[tuple, Tuple[Tensor, ...]] = {}
        self.nbytes = self.ref.numel() * self.ref.element_size()

    def holds(self, edge_index: Tensor) -> bool:
        """Whether ``edge_index`` (same identity) still has the entry's values."""
        if self.copied:
            return _same_values(edge_index, self.ref)
        return not edge_index.is_inference() and edge_index._version == self.version

    def add(self, sub: tuple, arrays: Tuple[Tensor, ...]):
        self.csrs[sub] = arrays
        self.nbytes += sum(t.nbytes for t in arrays)
        return arrays


_CACHE: "OrderedDict[tuple, _Entry]" = OrderedDict()
_CONFIG = {"max_bytes": MAX_BYTES, "max_entries": MAX_ENTRIES, "verify": "auto"}
_HELD = [0]  # bytes held by _CACHE's entries


def _same_values(edge_index: Tensor, copy: Tensor) -> bool:
    """Whether a verified hit still has its entry's values: the one read of a
    hit, of host memory for a CPU tensor (on CUDA only with ``verify=True`` or
    an inference tensor: a host sync)."""
    return torch.equal(edge_index, copy)


def _verifies(edge_index: Tensor) -> bool:
    """Whether the hits of ``edge_index`` are verified by content."""
    verify = _CONFIG["verify"]
    if verify == "auto":
        verify = edge_index.device.type == "cpu"
    return bool(verify) or edge_index.is_inference()


def configure_cache(max_bytes: Optional[int] = None, max_entries: Optional[int] = None,
                    verify: Union[str, bool, None] = None) -> dict:
    """Set the CSR cache's limits and hit verification; returns the previous
    settings (``configure_cache(**old)`` restores them).

    Args:
        max_bytes: the most bytes of index arrays the cached graphs may hold
            (default :data:`MAX_BYTES`, 256 MiB); ``0`` turns caching off.
        max_entries: the most graphs held (default :data:`MAX_ENTRIES`).
        verify: ``"auto"`` (default): compare every hit of a CPU edge index
            with the entry's copy of it (host memory, no sync), and trust the
            identity and version counter of a device tensor (a compare there
            is a host sync per hit). :obj:`True`: compare on every device.
            :obj:`False`: compare on none (saves the copy): the edge index must
            then not be written through ``.data``, ``.numpy()``, shared numpy
            buffers or DLPack. Inference tensors are compared either way.
            Changing it empties the cache.
    """
    old = dict(_CONFIG)
    for name, value in (("max_bytes", max_bytes), ("max_entries", max_entries)):
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
            _CONFIG[name] = value
    if verify is not None:
        if not (verify is True or verify is False or verify == "auto"):
            raise ValueError(f"verify must be 'auto', True or False, got {verify!r}")
        if verify != _CONFIG["verify"]:
            clear_cache()
            _CONFIG["verify"] = "auto" if isinstance(verify, str) else verify
    _evict(None)
    return old


def clear_cache() -> None:
    """Drop every cached graph."""
    _CACHE.clear()
    _HELD[0] = 0


def cache_info() -> dict:
    """``entries``, ``nbytes`` (the index arrays held, copies included) and
    the settings of :func:`configure_cache`."""
    return {"entries": len(_CACHE), "nbytes": sum(e.nbytes for e in _CACHE.values()),
            **_CONFIG}


def _drop(key: tuple) -> None:
    _HELD[0] -= _CACHE.pop(key).nbytes


def _evict(current: Optional[tuple]) -> None:
    """Evict least recently used entries until within the limits; ``current``
    (the most recent) goes last, and only if it alone exceeds them."""
    max_bytes, max_entries = _CONFIG["max_bytes"], _CONFIG["max_entries"]
    while _CACHE and (_HELD[0] > max_bytes or len(_CACHE) > max_entries):
        key = next(iter(_CACHE))
        if key == current and max_bytes > 0 and max_entries > 0:
            warnings.warn(
                f"a graph's index arrays (CSR, batch copies) need "
                f"{_CACHE[key].nbytes / 2 ** 20:.1f} MiB, more than the graph cache's "
                f"limit of {max_bytes / 2 ** 20:.1f} MiB: it is not cached and is "
                f"rebuilt on every call (raise the limit with "
                f"qsv_pyg.nn.configure_cache(max_bytes=...))", RuntimeWarning,
                stacklevel=5)
        _drop(key)


def _key(edge_index: Tensor) -> tuple:
    return (edge_index.device, edge_index.dtype, edge_index.untyped_storage().data_ptr(),
            edge_index.storage_offset(), tuple(edge_index.shape), tuple(edge_index.stride()))


def graph_csr(edge_index: Tensor, num_src: int, num_dst: int, batch: int = 0) -> GraphCSR:
    """The cached :class:`GraphCSR` of ``edge_index`` (of ``batch`` copies when
    ``batch > 0``).

    Found by the tensor's identity (device, dtype, storage address, offset,
    shape, strides) and, on the host (and for inference tensors), verified
    against the entry's copy of its values, so a change of values, however it
    was written, rebuilds the CSR; a device tensor's hit trusts its version
    counter instead (no sync; see the module docstring for the costs and
    :func:`configure_cache` for the choice). Index ranges are checked once per
    graph, with one host sync, when its entry is built; a hit costs no range
    check. The arrays are normal (not inference) tensors, also when built
    under :func:`torch.inference_mode`. Under :func:`torch.compile` the CSR
    attached to a static graph (:func:`attach_static_csr`) is used when there
    is one, else it is built in the graph. An
    :class:`~torch_geometric.EdgeIndex` bypasses the cache
    (:func:`edge_index_csr`, from its own cached CSC / CSR).
    """
    if isinstance(edge_index, EdgeIndex):
        return edge_index_csr(edge_index, num_src, num_dst, batch)
    if is_compiling():
        g = static_csr(edge_index, num_src, num_dst)
        if g is None:
            g = build_csr(edge_index, num_src, num_dst)
        return batch_csr(g, batch, num_src, num_dst) if batch else g
    return _cached(edge_index, ("csr", num_src, num_dst, batch), _make_csr)


def cached_batch_edge_index(edge_index: Tensor, batch: int, num_src: int,
                            num_dst: int) -> Tensor:
    """:func:`batch_edge_index`, cached with the graph's CSRs (the same
    identity, verification, range check and limits as :func:`graph_csr`).
    An :class:`~torch_geometric.EdgeIndex` is not cached here: its copies are
    an :class:`~torch_geometric.EdgeIndex` again (:func:`batch_edge_index_of`)."""
    if isinstance(edge_index, EdgeIndex):
        return batch_edge_index_of(edge_index, batch, num_src, num_dst)
    if is_compiling():
        return batch_edge_index(edge_index, batch, num_src, num_dst)
    edge_index = plain_edge_index(edge_index)
    return _cached(edge_index, ("copies", num_src, num_dst, batch), _make_copies)[0]


def _make_csr(entry: _Entry, edge_index: Tensor, num_src: int, num_dst: int,
              batch: int) -> GraphCSR:
    base = entry.csrs.get(("csr", num_src, num_dst, 0))
    if base is None:
        base = entry.add(("csr", num_src, num_dst, 0), build_csr(edge_index, num_src, num_dst))
    if not batch:
        return base
    return entry.add(("csr", num_src, num_dst, batch),
                     batch_csr(base, batch, num_src, num_dst))


def _make_copies(entry: _Entry, edge_index: Tensor, num_src: int, num_dst: int,
                 batch: int) -> Tuple[Tensor]:
    return entry.add(("copies", num_src, num_dst, batch),
                     (batch_edge_index(edge_index, batch, num_src, num_dst), ))


def _cached(edge_index: Tensor, sub: tuple, make: Callable) -> tuple:
    """The arrays ``sub = (kind, num_src, num_dst, batch)`` of ``edge_index``:
    from its entry, or made (``make(entry, edge_index, num_src, num_dst,
    batch)``, which adds them to the entry) after the entry's range check."""
    key = _key(edge_index)
    entry = _CACHE.get(key)
    if entry is not None and not entry.holds(edge_index):
        _drop(key)  # the same tensor (or address) with other values
        entry = None
    if entry is not None:
        hit = entry.csrs.get(sub)
        if hit is not None:
            _CACHE.move_to_end(key)
            return hit
    with torch.inference_mode(False), torch.no_grad():
        new = entry is None
        if new:
            entry = _Entry(edge_index, _verifies(edge_index))
        _check_ranges(entry.ranges, sub[1], sub[2])
        before = entry.nbytes
        out = make(entry, edge_index, *sub[1:])
    if new:
        _CACHE[key] = entry
        _HELD[0] += entry.nbytes
    else:
        _HELD[0] += entry.nbytes - before
    _CACHE.move_to_end(key)
    _evict(key)
    return out
