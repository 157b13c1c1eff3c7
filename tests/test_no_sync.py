"""No host-device sync inside a training step, for every model.

A step that reads a value back from the GPU (``.item()``, ``bool(tensor)``,
``.tolist()``, a data-dependent shape) or copies host data to it from pageable
memory waits for the device queue to drain; one such sync per step undoes the
one-step-late loss read of the training loop. On the CPU nothing really syncs,
so :class:`SyncChecker` checks the *calls* that would sync on CUDA:

* at the dispatcher (a :class:`TorchDispatchMode`): ``aten._local_scalar_dense``
  (``item``, ``bool``, ``int``, ``float`` of a tensor) and the ops whose output
  shape depends on the data (``nonzero``, boolean-mask indexing, ``unique``, ...);
* in Python: ``Tensor.item``, ``tolist``, ``__bool__``, ``cpu``, ``numpy``, and
  ``torch.tensor`` / ``torch.as_tensor`` of host data with a ``device`` (a
  host-to-device copy, synchronous from pageable memory).

Calls made by the functions in :data:`ALLOWED` are syncs by design (or reads of
host memory that only look like one on the CPU), each with its reason. The
loop's one-step-late metrics read is not among them: it reads a host buffer
(:class:`SyncChecker` is told which tensors are those buffers) after waiting
for the previous step's copy event, and
:func:`test_metrics_read_waits_for_the_previous_step_only` checks which event. The step is the real loop body (``trainer._train_epoch``: batch,
augmentation, stop check, forward, backward, optimiser, schedule), run for a
whole epoch after a warm-up epoch (caches of new graphs, optimiser state).

On CUDA, :func:`test_no_sync_cuda` runs the same epoch under
``torch.cuda.set_sync_debug_mode("error")``, which raises on every real sync.
"""
from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Dict, List, Tuple

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from qsv_pyg.data import BatchAugment
from qsv_pyg.training import readback, setup, stopping, trainer
from qsv_pyg.training.config import TrainConfig
from qsv_pyg.training.distributed import DistInfo
from qsv_pyg.training.state import LoopState

from tiny_cifar import write_tiny_cifar10  # noqa: E402

# Small models (tests/test_models.py SMALL): a whole epoch takes a second or so.
SHELLS = dict(shell_sizes=[16, 9, 4], k_cross=4, k_inner=3, heads=2)
WIDTHS = [16, 16, 16]
SMALL = {
    "qsv": dict(SHELLS, widths=WIDTHS),
    "lattice": dict(lattice_sides=[4, 3, 2], k_cross=4, k_inner=3, heads=2, widths=WIDTHS),
    "attention-gat": dict(SHELLS, qsv_widths=WIDTHS, qsv_heads=2, match_tol=0.25),
    "attention-gatv2": dict(SHELLS, qsv_widths=WIDTHS, qsv_heads=2, match_tol=0.25),
    "attention-transformer": dict(SHELLS, qsv_widths=WIDTHS, qsv_heads=2, match_tol=0.25),
    "resnet20": dict(),
}
N_TRAIN, N_TEST, BATCH = 32, 16, 8  # 4 steps per epoch

#: ``(module, function) -> why`` its syncs are by design. A sync counts as allowed
#: when one of these functions is on the Python stack.
ALLOWED: Dict[Tuple[str, str], str] = {
    ("qsv_pyg.training.distributed", "all_reduce_max_host"):
        "the per-step agreement of the ranks (stop, budget mark) reads a CPU tensor "
        "reduced over Gloo; nothing on the device is involved",
    ("qsv_pyg.nn.graph_cache", "_same_values"):
        "a verified hit of the CSR cache compares a CPU edge index with its copy in host "
        "memory; device hits are not verified by default, so they do not sync "
        "(test_csr_cache_hits_on_a_device_are_not_verified)",
    ("torch.optim.adam", "_multi_tensor_adam"):
        "torch's (projected backend's) Adam reads its step counters, which live on the "
        "host unless capturable/fused",
    ("torch.optim.adam", "_single_tensor_adam"):
        "torch's Adam step counters, host tensors (as above)",
    ("torch.optim.optimizer", "_get_value"):
        "torch's Adam step counters, host tensors (as above)",
}

#: Ops whose output shape depends on the data: a sync on CUDA.
_DATA_DEPENDENT = {
    "aten.nonzero.default", "aten.masked_select.default", "aten._unique2.default",
    "aten.unique_dim.default", "aten.unique_consecutive.default", "aten.bincount.default",
    "aten.equal.default", "aten.is_nonzero.default", "aten._local_scalar_dense.default",
}


def _allowed_frame() -> str | None:
    frame = sys._getframe(2)
    while frame is not None:
        key = (frame.f_globals.get("__name__", ""), frame.f_code.co_name)
        if key in ALLOWED:
            return ALLOWED[key]
        frame = frame.f_back
    return None


def _where() -> str:
    """The innermost qsv_pyg frame of the current stack (what to fix)."""
    frame = sys._getframe(2)
    first = None
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        text = f"{name}.{frame.f_code.co_name}:{frame.f_lineno}"
        first = first or text
        if name.startswith("qsv_pyg"):
            return text
        frame = frame.f_back
    return first or "?"


class SyncChecker(TorchDispatchMode):
    """Records every call that would sync with a CUDA device (see the module doc).

    Use as a context manager; :attr:`found` lists ``(what, where)`` pairs.
    """

    def __init__(self) -> None:
        super().__init__()
        self.found: List[Tuple[str, str]] = []
        self._patches = contextlib.ExitStack()
        #: Returns the tensors that are host memory by design (the training
        #: loop's metrics buffers): reading them is no sync.
        self.host_buffers = lambda: ()

    def _record(self, what: str) -> None:
        if _allowed_frame() is None:
            self.found.append((what, _where()))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func)
        if name in _DATA_DEPENDENT:
            self._record(name)
        elif name == "aten.repeat_interleave.Tensor" and kwargs.get("output_size") is None:
            self._record(name + " without output_size")
        elif name in ("aten.index.Tensor", "aten.index_put.default", "aten.index_put_.default"):
            indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
            if any(t is not None and t.dtype == torch.bool for t in indices):
                self._record(name + " with a boolean mask")
        return func(*args, **kwargs)

    def _wrap(self, owner, attr: str, what: str, when=None) -> None:
        original = getattr(owner, attr)
        checker = self

        def wrapped(*args, **kwargs):
            if when is None or when(*args, **kwargs):
                checker._record(what)
            return original(*args, **kwargs)

        self._patches.callback(setattr, owner, attr, original)
        setattr(owner, attr, wrapped)

    def __enter__(self):
        def device_data(t, *args, **kwargs):
            return not any(t is b for b in self.host_buffers())

        for attr in ("item", "tolist", "__bool__", "cpu", "numpy"):
            self._wrap(torch.Tensor, attr, f"Tensor.{attr}", device_data)

        def from_host(data=None, *args, device=None, **kwargs):
            return device is not None and not torch.is_tensor(data)

        self._wrap(torch, "tensor", "torch.tensor(host data, device=...)", from_host)
        self._wrap(torch, "as_tensor", "torch.as_tensor(host data, device=...)", from_host)
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._patches.close()


# --------------------------------------------------------------------------- the checker


def test_checker_catches_what_it_should():
    x = torch.ones(3)
    with SyncChecker() as checker:
        x.sum().item()
        bool(x.any())
        x.tolist()
        x[x > 0]
        torch.tensor([1.0, 2.0], device=x.device)
        torch.tensor([1.0, 2.0])  # a host tensor that stays on the host: fine
        x * 2 + 1  # plain device work: fine
    whats = [what for what, _ in checker.found]
    assert any("item" in w for w in whats) and any("__bool__" in w for w in whats)
    assert any("tolist" in w for w in whats) and any("boolean mask" in w for w in whats)
    assert sum("torch.tensor" in w for w in whats) == 1, whats


def test_old_augment_sync_is_caught():
    """The per-batch check of std on the device, as augment.normalize did it."""
    images = torch.zeros(2, 3, 4, 4, dtype=torch.uint8)
    with SyncChecker() as checker:
        std_t = torch.as_tensor((0.2, 0.2, 0.2), device=images.device)
        bool((std_t <= 0).any())
    assert len(checker.found) >= 2, checker.found
    augment = BatchAugment.for_dataset("cifar10", train=True)
    augment(images, torch.Generator())  # the first batch on a device copies mean/std there
    with SyncChecker() as checker:
        augment(images, torch.Generator())
        BatchAugment.for_dataset("cifar10", train=True)(images, torch.Generator())  # cached too
    assert checker.found == []


# --------------------------------------------------------------------------- one epoch


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("data")
    write_tiny_cifar10(root, N_TRAIN, N_TEST)
    return root


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models, shared cores


def _run(model: str, data_dir: Path, out: Path, device: str, stack: contextlib.ExitStack,
         **extra):
    cfg = TrainConfig(model=model, model_args=SMALL[model], data_dir=str(data_dir),
                      out_dir=str(out), epochs=3, batch_size=BATCH, eval_batch_size=N_TEST,
                      device=device, progress=False, warmup_epochs=1.0, **extra).validate()
    run, state = setup.build_run(cfg, None, torch.device(device), DistInfo(),
                                 stopping.wall_clock(), stack)
    return run, state


def _epoch(run, state: LoopState, checker=None) -> None:
    """One training epoch through the real loop body (``trainer._train_epoch``)."""
    progress = trainer._Progress()
    if checker is not None:
        checker.host_buffers = lambda: (progress.readback.buffers
                                        if getattr(progress, "readback", None) else ())
    with stopping.InterruptFlag(distributed=False) as interrupt:
        with checker if checker is not None else contextlib.nullcontext():
            assert trainer._train_epoch(run, state, progress, interrupt) is None
    assert state.batch == run.steps_per_epoch and progress.pending is None
    state.epoch, state.batch = state.epoch + 1, 0


@pytest.mark.parametrize("model", list(SMALL))
def test_training_step_does_not_sync(model, data_dir, tmp_path):
    with contextlib.ExitStack() as stack:
        run, state = _run(model, data_dir, tmp_path / "run", "cpu", stack)
        # Warm-up: graph caches (nn/csr.py checks a new graph's index range once,
        # by design) and the optimiser's state are built on the first steps.
        _epoch(run, state)
        checker = SyncChecker()
        _epoch(run, state, checker)
    assert checker.found == [], "\n".join(f"{what} at {where}"
                                          for what, where in checker.found)


class _FakeEvent:
    """A CUDA event's stand-in on the CPU: notes the last queued step when it is
    recorded, and ``(that step, the last queued step)`` when it is waited for."""

    def __init__(self, waits: list, queued: list):
        self.waits, self.queued, self.step = waits, queued, None

    def record(self):
        self.step = self.queued[0]

    def synchronize(self):
        self.waits.append((self.step, self.queued[0]))

    def query(self):
        self.synchronize()
        return True


def test_metrics_read_waits_for_the_previous_step_only(data_dir, tmp_path, monkeypatch):
    """The loop reads step t's loss after step t + 1 is queued and waits for step
    t's copy event only; only the read after the epoch's last step waits for it."""
    waits: list = []
    queued = [0]
    monkeypatch.setattr(readback, "copy_event", lambda device: _FakeEvent(waits, queued))
    with contextlib.ExitStack() as stack:
        run, state = _run("qsv", data_dir, tmp_path / "run", "cpu", stack)
        step = run.scheduler.step

        def counted_step(*args, **kwargs):  # once per optimiser step, after it is queued
            queued[0] += 1
            return step(*args, **kwargs)

        monkeypatch.setattr(run.scheduler, "step", counted_step)
        _epoch(run, state)
    n = run.steps_per_epoch
    assert waits == [(t, t + 1) for t in range(1, n)] + [(n, n)], waits


def test_readback_copies_into_its_own_buffers():
    """Two host buffers: a push never overwrites values still to be read."""
    rb = readback.Readback(torch.device("cpu"))
    a = rb.push(torch.tensor([1.0, 2.0]))
    b = rb.push(torch.tensor([3.0, 4.0]))
    assert a != b and rb.read(a) == [1.0, 2.0] and rb.read(b) == [3.0, 4.0]


def test_csr_cache_hits_on_a_device_are_not_verified():
    """What makes the ``_same_values`` exclusion safe: by default only host (CPU)
    edge indices are compared on a hit; on a device the hit reads nothing back."""
    from qsv_pyg.nn import graph_cache as csr

    assert csr._verifies(torch.zeros(2, 4, dtype=torch.long))
    assert not csr._verifies(torch.zeros(2, 4, dtype=torch.long, device="meta"))


def test_batched_edge_index_builds_nothing_from_host_data():
    from qsv_pyg.nn.csr import batch_edge_index

    ei = torch.tensor([[0, 1, 2], [1, 2, 0]])
    with SyncChecker() as checker:
        out = batch_edge_index(ei, 3, 3, 5)
    assert checker.found == []
    want = torch.cat([ei + torch.tensor([[3 * b], [5 * b]]) for b in range(3)], dim=1)
    assert torch.equal(out, want)


def test_distributed_stop_agreement_is_on_the_host(monkeypatch):
    """With several ranks the per-step agreements reduce a CPU tensor over Gloo
    (nothing is created on, or read from, the training device)."""
    import torch.distributed as dist
    from qsv_pyg.training import distributed

    seen = []

    def fake_all_reduce(tensor, op=None, group=None):
        seen.append((tensor.device.type, group))
        tensor.fill_(2)  # another rank was interrupted
    monkeypatch.setattr(distributed, "_active", lambda: True)
    monkeypatch.setattr(distributed, "_host_group", lambda: "gloo-group")
    monkeypatch.setattr(dist, "all_reduce", fake_all_reduce)
    budget = stopping.TimeBudget(None, "wall", stopping.wall_clock())
    interrupt = stopping.InterruptFlag(distributed=True)
    with SyncChecker() as checker:
        # A CUDA device: a tensor created there would fail on this machine.
        reason = stopping.stop_requested(interrupt, budget, torch.device("cuda"), True)
    assert reason == "interrupt" and seen == [("cpu", "gloo-group")]
    assert checker.found == []


@pytest.mark.cuda
@pytest.mark.parametrize("model", list(SMALL))
def test_no_sync_cuda(model, data_dir, tmp_path):
    """On a GPU: a whole epoch under ``set_sync_debug_mode("error")`` (real syncs raise).

    The metrics read is not exempted: a non-blocking copy into pinned memory and
    an event wait are no syncs to that mode (a ``.tolist()`` of a device tensor,
    the old read, is). Which event it waits for is checked on the CPU
    (:func:`test_metrics_read_waits_for_the_previous_step_only`)."""
    with contextlib.ExitStack() as stack:
        run, state = _run(model, data_dir, tmp_path / "run", "cuda", stack)
        _epoch(run, state)
        torch.cuda.synchronize()

        class Strict:
            def __enter__(self):
                torch.cuda.set_sync_debug_mode("error")

            def __exit__(self, *exc):
                torch.cuda.set_sync_debug_mode(0)

        _epoch(run, state, Strict())
