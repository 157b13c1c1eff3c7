"""ModelNet10 under rotations: QSV with geometric quaternions against GAT,
Transformer, DGCNN and PointNet++ controls (the legacy 16-unit table).

This is the former ``examples/modelnet.py``, kept unchanged so that
``docs/results/modelnet`` (and ``docs/results/modelnet-budget``) still rebuild:
``python benchmarks/modelnet_legacy.py --report-only``. The current table is
``python -m qsv_pyg.experiments.modelnet_table`` (equal CPU time per unit,
QSVGeometric and its ablations, VN-DGCNN); ``examples/modelnet.py`` is now a
short example of :class:`qsv_pyg.nn.models.QSVGeometric`.

Data: ``<data-dir>/<dataset>/`` holds one ``.npz`` (or name it with ``--npz``)
with ``pos_train [S, N, 3]``, ``y_train [S]``, ``pos_test``, ``y_test`` and
optionally ``classes`` (see the data folder's ``README.md``: ModelNet10 as 1,024
Poisson-disk points per shape, the official 3,991 / 908 split). Any npz with
those arrays runs unchanged (e.g. ModelNet40 in the same layout). The data
folder is only read.

Preprocessing (once per split, protocol and rotation, cached in memory):

* every shape is centred (mean of its points) and scaled to the unit sphere
  (largest norm 1), then subsampled to ``--points`` points (default 512) by a
  fixed seeded choice per shape -- the test shapes and, as well, the training
  shapes (one fixed subsample per training shape, no per-epoch resampling);
* a rotation, where the protocol asks for one, is applied to the centred
  points in float64; *then* the kNN graph (``torch_cluster.knn_graph``,
  ``k=16``, no self-loops) and the local PCA frames
  (:func:`qsv_pyg.geometry.local_frames`) are computed from the rotated points,
  so an invariance seen in the table is the model's, not the preprocessing's;
* inputs, one quaternion block each, as in ``examples/point_clouds.py``:
  ``xyz`` = ``(|p|, p)`` in the global axes, ``local`` = ``(|p|, R_i^T p)`` in the
  node's own frame; node quaternions are those of the frames (what
  :func:`qsv_pyg.geometry.frame_quaternions` returns, plus the tie-break below).

Frame tie-break (``--frames pca+centroid``, the default): ``local_frames``
orients the normal ``e3`` by the sign of ``<mean offset, e3>``, which is exactly
zero on a planar patch. CAD furniture is full of them: measured on 51 ModelNet10
test shapes (512 points, k=16) 1.1 % of the nodes (up to 16 % of one shape) get a
different frame after a random rotation than the rotated frame of the aligned
shape. Where ``|<mean offset, e3>| <= 1e-9 |mean offset|`` (2.4 % of the nodes)
this script orients ``e3`` away from the shape's centroid instead (``<p_i, e3>
>= 0``, a rotation-equivariant rule) and rebuilds ``e2 = e3 x e1``: no frame
changed on the same shapes. ``--frames pca`` uses the plain frames.

The vertical axis is ``z`` (``--up-axis``): after centring and scaling, the
tables' points are strongly skewed along ``z`` only (skewness -1.7: the top at
+z, thin legs below), beds and sofas are flattest along ``z`` and chairs are
tallest along it, while ``x`` is the left-right mirror axis (skewness ~0 for
every class).

Protocols (``train/test``; four table columns from two trainings per row):

* ``aligned/aligned``, ``aligned/z``, ``aligned/SO3``: trained on the shapes as
  given, tested as given, under a random rotation about the vertical axis, and
  under a uniformly random 3-D rotation (one fixed seeded rotation per test
  shape, the same for every row);
* ``SO3/SO3``: trained with a fresh uniformly random rotation of every shape in
  every epoch (kNN graph and frames recomputed from the rotated points each
  epoch; that encoding time is logged apart from the training time), tested on
  the SO3 test set.

There is no validation split in the official ModelNet protocol: every unit trains
a fixed number of epochs and is tested once, after the last epoch.

Rows (``--models`` selects by prefix):

* ``QSV-geometric``: ``local`` inputs, frame quaternions, ``routing="abs"``,
  sandwich transport: rotation-invariant by construction;
* ``QSV xyz``: QSV on ``xyz`` inputs with feature quaternions;
* ``GAT xyz|local``, ``Transformer xyz|local``: PyG's ``GAT`` and a
  TransformerConv ``BasicGNN`` (:mod:`qsv_pyg.experiments.compare`), widths matched to ``QSV xyz``'s
  parameter count by :func:`~qsv_pyg.experiments.compare.matched_control`;
* ``DGCNN``: two dynamic EdgeConv layers on the (rotated) coordinates, as in
  PyG's ``examples/dgcnn_classification.py`` but narrow (PyG 2.8's
  ``DynamicEdgeConv`` takes its kNN from pyg-lib, which PyPI lacks: the same
  layer is built here from ``EdgeConv`` and ``torch_cluster.knn_graph``);
* ``PointNet++``: two set-abstraction layers (``torch_cluster`` ``fps`` +
  ``radius``, ``PointNetConv``) and a global one, as in PyG's
  ``examples/pointnet2_classification.py`` but narrow. For both, one width
  ``w`` scales every layer and is chosen for the parameter count closest to
  ``QSV xyz``'s GNN (DGCNN ``w=13``: 4,729 parameters, PointNet++ ``w=7``:
  5,316).

The graph rows are 3 layers, hidden 32, 1 head, batch norm in the hidden layers,
mean-pooled with a linear head (:class:`~qsv_pyg.experiments.compare.PoolClassifier`): QSV-geometric
4,909 parameters, QSV xyz 5,193, GAT 5,275, Transformer 5,208. All rows train
with Adam (lr 0.01, cosine decay to 0 over the epochs), batch 32, cross-entropy.

Budget (``--epochs``, default 5). CPU seconds per training epoch over the 3,991
training shapes (512 points, k=16, batch 32, one thread; AMD EPYC, measured
while other jobs shared the two cores), and the per-epoch re-encoding of SO3
training (kNN graph, plus frames for the local rows):

    row                 params   s/epoch   + SO3 re-encoding
    QSV-geometric        4,909        17        32
    QSV xyz              5,193        24         7
    GAT xyz              5,275       123         7
    GAT local            5,275       137        32
    Transformer xyz      5,208        94         7
    Transformer local    5,208        91        32
    DGCNN                4,729        86         0
    PointNet++           5,316        79         0

One epoch of all 16 units (8 rows x 2 trainings) costs 2 x 651 + 117 = 1,419
CPU-s. On top come the tests (forward passes over 3 x 908 or 908 shapes, about
0.25 or 0.08 of a training epoch: ~200 s for all units) and, per worker, the
encoding of the aligned training set and the three test sets (~55 s) and the
imports. 5 epochs: 5 x 1,419 + ~350 = ~7,450 CPU-s = ~1.0 h on two cores with
``--jobs 2`` (longest unit first; the longest, GAT local SO3, is 5 x 169 s =
~14 min). 8 epochs (~1.6 h) was the first plan; the committed table was run in
one session beside the Cora and TU tables, so it got 5.

Every unit trains in its own run folder
``<out-root>/<dataset>/<row>/<aligned|so3>/seed<k>/`` (``config.json``, one
``log.jsonl`` line per epoch, ``metrics.json``); a rerun reuses finished units.
``--jobs N`` stops at the first failed unit (the queued ones are cancelled); a
unit that another process is training (its ``run.lock``) exits 2 naming it.
``--report-only`` rebuilds ``<out-root>/table.{md,csv,json}``,
``<out-root>/accuracy.png`` and ``<out-root>/published_modelnet40.md`` from the
folders (a damaged ``metrics.json`` is named and left out). A shape with
repeated points gets its kNN graph from ``qsv_pyg.geometry.knn_within``
(:func:`knn_table`). Run::

    python benchmarks/modelnet_legacy.py --jobs 2             # the full table (~1.0 h on 2 cores)
    python benchmarks/modelnet_legacy.py --small --out-root /tmp/mn   # a smoke test
    python benchmarks/modelnet_legacy.py --report-only
"""
from __future__ import annotations

import argparse
import platform
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import Tensor

import sys

# This checkout's qsv_pyg (not another installed copy).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from qsv_pyg.experiments.compare import (  # noqa: E402
    NUMBER, PoolClassifier, QSV, Timer, add_data_args, check_folder, count_parameters, fail,
    finished_unit, matched_control, matched_width, mean_std, read_units, run_in_workers,
    run_unit, seed_all, selected, warm_up, write_table)
from torch_geometric.data import Data

from qsv_pyg.models import point_controls

try:  # only training needs it: --report-only runs without
    from torch_cluster import knn_graph
except ImportError:  # pragma: no cover - depends on the environment
    knn_graph = None

from qsv_pyg.geometry import local_frames, matrix_to_quaternion
from qsv_pyg.geometry.knn import knn_within
from qsv_pyg.utils import cpu_name

DATASET = "ModelNet10"
OUT_ROOT = "docs/results/modelnet"
#: The test rotations' seeds (one per protocol); the protocols (TESTS, COLUMNS) and
#: the seeds of which points and shapes are the table's (modelnet_data, imported below).
TEST_ROTATION_SEED = {"z": 31, "so3": 32}
HIDDEN, LAYERS, HEADS = 32, 3, 1
#: Every graph row (QSV, GAT, Transformer) normalises its hidden layers: on 400
#: shapes of 128 points, 15 epochs, batch norm took QSV-geometric's test accuracy
#: from 34 % to 53 %, QSV xyz from 61 % to 73 % and GAT xyz from 57 % to 75 %.
GNN_KW = {"norm": "batch_norm"}
#: Measured CPU seconds of one training epoch of each row at the default sizes
#: (see the docstring) and of re-encoding the training set each epoch under
#: SO3 training, per ``need``: the longest units start first with --jobs.
COST = {"QSV-geometric": 17, "QSV xyz": 24, "GAT xyz": 123, "GAT local": 137,
        "Transformer xyz": 94, "Transformer local": 91, "DGCNN": 86, "PointNet++": 79}
ENCODE_COST = {"frames": 32, "graph": 7, "points": 0}
# Published context (ModelNet40): one source of truth in the package.
from qsv_pyg.experiments.modelnet_report import PUBLISHED, PUBLISHED_NOTE, plot  # noqa: E402
# The npz, its checks and the shapes' normalisation: the table's own.
from qsv_pyg.experiments.modelnet_data import (  # noqa: E402
    COLUMNS, LABEL, SUBSAMPLE_SEED, SUBSET_SEED, TESTS, find_npz, load_arrays, normalise, rotate,
    rotations, subset)


# ------------------------------------------------------------------ data
def tie_break(frames: Tensor, pos: Tensor, edge_index: Tensor, tol: float = 1e-9
              ) -> Tensor:
    """Frames whose normal ``e3`` :func:`local_frames` could not orient (the mean
    neighbour offset is orthogonal to it: a planar patch) oriented away from the
    centroid (``pos`` is centred) instead; ``e2 = e3 x e1`` rebuilt."""
    src, dst = edge_index
    offset = torch.zeros_like(pos).index_add_(0, dst, pos[src] - pos[dst])
    e1, e3 = frames[..., 0], frames[..., 2]
    flat = (offset * e3).sum(-1).abs() <= tol * offset.norm(dim=-1)
    outward = torch.where((pos * e3).sum(-1) < 0, -1.0, 1.0).to(pos.dtype)
    e3 = torch.where(flat[:, None], e3 * outward[:, None], e3)
    return torch.stack([e1, torch.linalg.cross(e3, e1), e3], dim=-1)


NEEDS = ("points", "graph", "frames")


def knn_table(pos: Tensor, k: int) -> Tensor:
    """The ``k`` nearest other points of every point of shapes ``pos [S, P, 3]``,
    as ``[S, P, k]`` indices within the shape.

    ``torch_cluster.knn_graph`` (sorted by target) where it returns exactly ``k``
    sources per target; a shape with repeated points, where it can return
    ``k + 1``, takes :func:`qsv_pyg.geometry.knn_within` (exactly ``k``, nearest
    first, ties to the smaller index) instead."""
    b, n = pos.shape[:2]
    flat = pos.reshape(-1, 3)
    batch = torch.arange(b).repeat_interleave(n)
    src, dst = knn_graph(flat, k=k, batch=batch, loop=False)
    order = torch.sort(dst, stable=True).indices
    src, dst = src[order], dst[order]
    counts = torch.bincount(dst, minlength=b * n).view(b, n)
    regular = (counts == k).all(1)
    if bool(regular.all()):
        return (src - batch[src] * n).view(b, n, k)
    ends = counts.sum(1).cumsum(0)
    nbr = torch.empty(b, n, k, dtype=torch.long)
    for s in range(b):
        if regular[s]:
            start = int(ends[s]) - n * k
            nbr[s] = (src[start:int(ends[s])] - s * n).view(n, k)
        else:
            nbr[s] = knn_within(pos[s], k, loop=False)[0].view(n, k)
    return nbr


def encode(pos: Tensor, y: Tensor, k: int, need: str = "frames",
           frames: str = "pca+centroid", chunk: int = 128) -> Dict[str, Tensor]:
    """Graphs and inputs of shapes ``pos [S, P, 3]`` (centred, float64).

    ``need``: ``"points"`` (coordinates only: DGCNN, PointNet++), ``"graph"``
    (plus the kNN graph and ``xyz`` inputs) or ``"frames"`` (plus the frames'
    quaternions and ``local`` inputs). The kNN graph (:func:`knn_table`) has exactly
    ``k`` sources per target, also where a shape repeats a point, and is stored as
    ``nbr [S, P, k]`` (the sources' indices in the shape);
    inputs as in :func:`point_clouds.encode`: ``x_xyz = (|p|, p)``,
    ``x_local = (|p|, R_i^T p)``, ``quat`` of ``R_i``.
    """
    if need not in NEEDS:
        raise ValueError(f"need must be one of {NEEDS}, got {need!r}")
    count, n = pos.shape[:2]
    out: Dict[str, Tensor] = {"pos": pos.float(), "y": y}
    if need == "points":
        return out
    nbr_dtype = torch.int16 if n <= 2 ** 15 else torch.int32
    parts: Dict[str, List[Tensor]] = {"nbr": [], "x_xyz": [], "x_local": [], "quat": []}
    for start in range(0, count, chunk):
        p = pos[start:start + chunk]
        b = p.size(0)
        flat = p.reshape(-1, 3)
        nbr = knn_table(p, k)
        edge_index = torch.stack([(nbr + (torch.arange(b) * n).view(b, 1, 1)).reshape(-1),
                                  torch.arange(b * n).repeat_interleave(k)])
        parts["nbr"].append(nbr.to(nbr_dtype))
        radius_ = flat.norm(dim=1, keepdim=True)
        parts["x_xyz"].append(torch.cat([radius_, flat], 1).view(b, n, 4).float())
        if need == "frames":
            rot = local_frames(flat, edge_index)
            if frames == "pca+centroid":
                rot = tie_break(rot, flat, edge_index)
            local = (rot.transpose(1, 2) @ flat.unsqueeze(-1)).squeeze(-1)
            parts["x_local"].append(torch.cat([radius_, local], 1).view(b, n, 4).float())
            parts["quat"].append(matrix_to_quaternion(rot).view(b, n, 4).float())
    out.update({key: torch.cat(value) for key, value in parts.items() if value})
    return out


#: Row kind -> (what encode must compute, the input features).
KINDS = {"geometric": ("frames", "x_local"), "local": ("frames", "x_local"),
         "xyz": ("graph", "x_xyz"), "points": ("points", None)}


def make_batch(shapes: Dict[str, Tensor], idx: Tensor, kind: str) -> Data:
    """One mini-batch of shapes ``idx`` as a PyG ``Data`` (``batch`` vector set)."""
    b, n = idx.numel(), shapes["pos"].size(1)
    data = Data(y=shapes["y"][idx], pos=shapes["pos"][idx].reshape(-1, 3),
                batch=torch.arange(b).repeat_interleave(n), num_nodes=b * n)
    key = KINDS[kind][1]
    if key is not None:
        nbr = shapes["nbr"][idx].long() + (torch.arange(b) * n).view(b, 1, 1)
        k = nbr.size(2)
        data.edge_index = torch.stack([nbr.reshape(-1),
                                       torch.arange(b * n).repeat_interleave(k)])
        data.x = shapes[key][idx].reshape(-1, 4)
        if kind == "geometric":
            data.quat = shapes["quat"][idx].reshape(-1, 4)
    return data


# ------------------------------------------------------------------ models
# DGCNN and PointNet++ are qsv_pyg.models.point_controls' (the definitions that
# lived here), called on a batch ``Data`` as this table's rows are.
class DGCNN(point_controls.DGCNN):
    __doc__ = point_controls.DGCNN.__doc__

    def forward(self, data) -> Tensor:
        return super().forward(data.pos, data.batch)


class PointNet2(point_controls.PointNet2):
    __doc__ = point_controls.PointNet2.__doc__

    def forward(self, data) -> Tensor:
        return super().forward(data.pos, data.batch)


def _qsv_target() -> int:
    """The parameter count the controls match: ``QSV xyz``'s GNN."""
    return count_parameters(QSV(4, HIDDEN, LAYERS, heads=HEADS, **GNN_KW))


def _gnn_row(build: Callable[[], torch.nn.Module], kind: str):
    def classifier(num_classes: int, k: int) -> torch.nn.Module:
        inputs = (lambda b: {"quat": b.quat}) if kind == "geometric" else None
        return PoolClassifier(build(), num_classes, inputs)
    return classifier


def _control(name: str) -> Callable[[], torch.nn.Module]:
    return lambda: matched_control(name, 4, _qsv_target(), LAYERS, None, HEADS, **GNN_KW)


#: (row name, kind, builder(num_classes, k) -> classifier), in table order.
ROWS: List[Tuple[str, str, Callable[[int, int], torch.nn.Module]]] = [
    ("QSV-geometric", "geometric", _gnn_row(
        lambda: QSV(4, HIDDEN, LAYERS, quat_source="given", routing="abs", heads=HEADS,
                    **GNN_KW), "geometric")),
    ("QSV xyz", "xyz", _gnn_row(lambda: QSV(4, HIDDEN, LAYERS, heads=HEADS, **GNN_KW),
                                "xyz")),
    ("GAT xyz", "xyz", _gnn_row(_control("GAT"), "xyz")),
    ("GAT local", "local", _gnn_row(_control("GAT"), "local")),
    ("Transformer xyz", "xyz", _gnn_row(_control("Transformer"), "xyz")),
    ("Transformer local", "local", _gnn_row(_control("Transformer"), "local")),
    ("DGCNN", "points", lambda c, k: matched_width(lambda w: DGCNN(c, w, k),
                                                   _qsv_target())),
    ("PointNet++", "points", lambda c, k: matched_width(lambda w: PointNet2(c, w),
                                                        _qsv_target())),
]
ROW_NAMES = [name for name, _, _ in ROWS]


def slug(name: str) -> str:
    return (name.replace("++", "-pp").replace(" ", "-").lower())


# ------------------------------------------------------------------ one unit
_CACHE: Dict[tuple, Dict[str, Tensor]] = {}
_ARRAYS: Dict[str, Dict[str, Any]] = {}


def _arrays(path: str, points: int) -> Dict[str, Any]:
    if path not in _ARRAYS:
        _ARRAYS.clear()
        _ARRAYS[path] = load_arrays(Path(path), points)
    return _ARRAYS[path]


def base_shapes(path: str, cfg: Dict[str, Any], split: str) -> Tuple[Tensor, Tensor]:
    """The centred, subsampled shapes of a split (float64) and their labels."""
    key = ("base", path, split, cfg[f"max_{split}"], cfg["points"])
    if key not in _CACHE:
        arrays = _arrays(path, cfg["points"])
        keep = subset(len(arrays[f"y_{split}"]), cfg[f"max_{split}"], SUBSET_SEED[split])
        pos = normalise(arrays[f"pos_{split}"][keep.numpy()], cfg["points"],
                        SUBSAMPLE_SEED[split])
        y = torch.from_numpy(arrays[f"y_{split}"][keep.numpy()].astype(np.int64))
        _CACHE[key] = {"pos": pos, "y": y}
    return _CACHE[key]["pos"], _CACHE[key]["y"]


def shape_set(path: str, cfg: Dict[str, Any], split: str, protocol: str
              ) -> Dict[str, Tensor]:
    """The encoded (``need="frames"``: every kind's inputs) shapes of a split under
    a fixed rotation protocol, cached per process."""
    key = ("set", path, split, protocol, cfg[f"max_{split}"], cfg["points"], cfg["k"],
           cfg["frames"], cfg["up_axis"])
    if key not in _CACHE:
        pos, y = base_shapes(path, cfg, split)
        g = torch.Generator().manual_seed(TEST_ROTATION_SEED.get(protocol, 0))
        rot = rotations(protocol, pos.size(0), g, cfg["up_axis"])
        _CACHE[key] = encode(rotate(pos, rot), y, cfg["k"], "frames", cfg["frames"])
    return _CACHE[key]


def versions() -> Dict[str, str]:
    import torch_cluster
    import torch_geometric

    import qsv_pyg
    return {"python": platform.python_version(), "torch": torch.__version__,
            "torch_geometric": torch_geometric.__version__,
            "torch_cluster": torch_cluster.__version__, "numpy": np.__version__,
            "qsv_pyg": qsv_pyg.__version__}


@torch.no_grad()
def accuracy(model: torch.nn.Module, shapes: Dict[str, Tensor], kind: str,
             batch_size: int = 64) -> float:
    model.eval()
    correct = 0
    count = shapes["y"].numel()
    for start in range(0, count, batch_size):
        idx = torch.arange(start, min(start + batch_size, count))
        correct += int((model(make_batch(shapes, idx, kind)).argmax(-1)
                        == shapes["y"][idx]).sum())
    return correct / count


def build_model(row: str, num_classes: int, k: int) -> torch.nn.Module:
    return dict((name, build) for name, _, build in ROWS)[row](num_classes, k)


def train_unit(cfg: Dict[str, Any], path: str, log: Callable[[Dict[str, Any]], None],
               progress: bool = False) -> Dict[str, Any]:
    """Train one (row, train protocol, seed) unit and test it after the last epoch."""
    from tqdm.auto import tqdm

    start_wall = time.time()
    kind = cfg["kind"]
    need = KINDS[kind][0]
    num_classes = cfg["num_classes"]
    seed_all(cfg["seed"])
    model = build_model(cfg["row"], num_classes, cfg["k"])
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg["lr"])
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, cfg["epochs"])
    order_gen = torch.Generator().manual_seed(cfg["seed"])
    rot_gen = torch.Generator().manual_seed(10_000 + cfg["seed"])
    timer = Timer()
    encode_seconds: List[float] = []
    if cfg["train"] == "aligned":
        fixed = shape_set(path, cfg, "train", "aligned")
    base_pos, base_y = base_shapes(path, cfg, "train")
    count = base_y.numel()
    stats: Dict[str, float] = {}
    warmed = False
    for epoch in tqdm(range(cfg["epochs"]), desc=f"{cfg['row']} {cfg['train']}",
                      leave=False, disable=not progress):
        t0 = time.process_time()
        if cfg["train"] == "so3":  # a fresh rotation of every shape, re-encoded
            train = encode(rotate(base_pos, rotations("so3", count, rot_gen)), base_y,
                           cfg["k"], need, cfg["frames"])
        else:
            train = fixed
        encode_seconds.append(time.process_time() - t0)
        order = torch.randperm(count, generator=order_gen)
        batches = [order[i:i + cfg["batch_size"]] for i in range(0, count, cfg["batch_size"])]
        if not warmed:  # one-off costs (kernel builds) stay out of the epoch time
            warm_up(lambda: model(make_batch(train, batches[0], kind)).sum(), model)
            warmed = True

        def one_epoch() -> None:
            model.train()
            loss_sum = correct = 0.0
            for idx in batches:
                batch = make_batch(train, idx, kind)
                optimizer.zero_grad()
                out = model(batch)
                loss = torch.nn.functional.cross_entropy(out, batch.y)
                loss.backward()
                optimizer.step()
                loss_sum += float(loss.detach()) * idx.numel()
                correct += int((out.argmax(-1) == batch.y).sum())
            stats.update(loss=loss_sum / count, acc=correct / count)

        lr = optimizer.param_groups[0]["lr"]
        timer.epoch(one_epoch)
        scheduler.step()
        log({"epoch": epoch + 1, "train_loss": stats["loss"], "train_acc": stats["acc"],
             "seconds": timer.seconds[-1], "encode_seconds": encode_seconds[-1], "lr": lr})
    t0 = time.process_time()
    test = {protocol: accuracy(model, shape_set(path, cfg, "test", protocol), kind)
            for protocol in TESTS[cfg["train"]]}
    return {"row": cfg["row"], "train": cfg["train"], "seed": cfg["seed"], "test": test,
            "params": count_parameters(model), "time_per_epoch": timer.per_epoch,
            "epoch_seconds": timer.seconds,
            "encode_seconds_per_epoch": statistics.fmean(encode_seconds)
            if encode_seconds else 0.0,
            "test_seconds": time.process_time() - t0,
            "train_loss": stats.get("loss"), "train_acc": stats.get("acc"),
            "wall_seconds": time.time() - start_wall, "epochs": cfg["epochs"],
            "cpu": cpu_name(), "versions": versions()}


def run_job(folder: str, cfg: Dict[str, Any], path: str, threads: int,
            progress: bool = False) -> Tuple[str, Dict[str, Any]]:
    """One unit in its run folder (also the entry point of a worker process)."""
    torch.set_num_threads(threads)
    metrics = run_unit(Path(folder), cfg,
                       lambda log: train_unit(cfg, path, log, progress))
    return folder, metrics


def _worker_init(threads: int) -> None:
    torch.set_num_threads(threads)
    torch.set_num_interop_threads(1)


# ------------------------------------------------------------------ report
#: What the report reads of every unit (a unit lacking one is named and left out).
CONFIG_FIELDS = {"row": str, "train": str, "seed": int, "epochs": int, "num_classes": int}
METRICS_FIELDS = {"params": int, "time_per_epoch": NUMBER, "test": dict}


def _unit_problem(cfg: Dict[str, Any], metrics: Dict[str, Any]) -> Optional[str]:
    if cfg["train"] not in TESTS:
        return f"unknown train protocol {cfg['train']!r} in its config.json"
    if cfg["num_classes"] < 1:
        return f"num_classes {cfg['num_classes']} in its config.json"
    for protocol, acc in metrics["test"].items():
        if protocol not in LABEL:
            return f"field 'test' holds an unknown protocol {protocol!r}"
        if isinstance(acc, bool) or not isinstance(acc, (int, float)):
            return f"field 'test.{protocol}' is not a number ({type(acc).__name__})"
    return None


def collect_rows(dataset_root: Path) -> Tuple[Dict[str, Dict[str, Any]], List[dict]]:
    """Per row: params, accuracies per column (one value per seed), CPU s/epoch."""
    rows: Dict[str, Dict[str, Any]] = {}
    configs = []
    for cfg, metrics in read_units(dataset_root, CONFIG_FIELDS, METRICS_FIELDS,
                                   keep=lambda c: "row" in c and "train" in c,
                                   check=_unit_problem):
        configs.append(cfg)
        row = rows.setdefault(cfg["row"], {"params": metrics["params"], "time": [],
                                           "columns": {c: [] for c in COLUMNS},
                                           "seeds": set(), "epochs": set()})
        row["time"].append(metrics["time_per_epoch"])
        row["epochs"].add(cfg["epochs"])
        row["seeds"].add(cfg["seed"])
        for protocol, acc in metrics["test"].items():
            row["columns"][f"{LABEL[cfg['train']]}/{LABEL[protocol]}"].append(acc)
    order = {name: i for i, name in enumerate(ROW_NAMES)}
    rows = dict(sorted(rows.items(), key=lambda kv: order.get(kv[0], len(order))))
    return rows, configs


def settings_note(configs: List[dict]) -> str:
    keys = ("n_train", "n_test", "points", "k", "epochs", "batch_size", "lr", "frames")
    parts = []
    for key in keys:
        values = sorted({str(c.get(key)) for c in configs})
        parts.append(f"{key} {'/'.join(values)}")
    return ", ".join(parts)


def report(out_root: Path, dataset: str, quiet: bool = False) -> Dict[str, Dict[str, Any]]:
    """Table (``out_root/table.{md,csv,json}``), figure (``out_root/accuracy.png``)
    and the published ModelNet40 context from the finished units of ``dataset``."""
    rows, configs = collect_rows(out_root / dataset)
    if not rows:
        fail(f"no finished units under {out_root / dataset} (run without --report-only)")
    num_classes = max(c["num_classes"] for c in configs)
    cpu = sorted({m for m in (c.get("cpu") for c in configs) if m})
    title = (f"{dataset} under rotations: test accuracy (%) after the last epoch, "
             f"mean ± std over seeds; {settings_note(configs)}; chance "
             f"{100 / num_classes:.1f} %")
    table_rows = []
    for name, row in rows.items():
        cells = {"model": name, "params": f"{row['params']:,}",
                 "CPU s/epoch": f"{statistics.fmean(row['time']):.1f}",
                 "seeds": str(len(row["seeds"]))}
        for c in COLUMNS:
            cells[c] = mean_std(row["columns"][c]) if row["columns"][c] else "–"
        table_rows.append(cells)
    columns = ["model", "params", *COLUMNS, "CPU s/epoch", "seeds"]
    if len({e for row in rows.values() for e in row["epochs"]}) > 1:
        # Rows trained for different numbers of epochs (e.g. an equal-CPU-budget
        # table): each row says its own.
        columns.insert(-1, "epochs")
        for cells, row in zip(table_rows, rows.values()):
            cells["epochs"] = "/".join(map(str, sorted(row["epochs"])))
    text = write_table(out_root / "table", columns, table_rows, title)
    published = write_table(out_root / "published_modelnet40",
                            ["model", "z/z", "z/SO3", "SO3/SO3", "I/SO3"], PUBLISHED,
                            "Published context: " + PUBLISHED_NOTE)
    plot(out_root / "accuracy.png", rows, 1 / num_classes, f"{dataset}: "
         f"{settings_note(configs)}", figsize=(11, 4.8), legend_columns=5)
    if not quiet:
        print("\n" + text + "\n" + published)
    return rows


# ------------------------------------------------------------------ main
def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_data_args(parser, DATASET, OUT_ROOT)
    parser.add_argument("--npz", default=None,
                        help="the npz file in the dataset folder (default: its only .npz)")
    parser.add_argument("--models", default=None,
                        help="comma-separated prefixes of the rows to run (e.g. 'QSV,GAT')")
    parser.add_argument("--protocols", default="aligned,so3",
                        help="train protocols to run: aligned, so3 (default both)")
    parser.add_argument("--seeds", type=int, default=1, help="seeds per unit (default 1)")
    parser.add_argument("--epochs", type=int, default=None,
                        help=f"training epochs (default {DEFAULTS['epochs']}; "
                             f"--small {SMALL['epochs']})")
    parser.add_argument("--points", type=int, default=None,
                        help=f"points per shape (default {DEFAULTS['points']})")
    parser.add_argument("--max-train", type=int, default=None,
                        help="use this many training shapes (a fixed seeded subset)")
    parser.add_argument("--max-test", type=int, default=None,
                        help="use this many test shapes (a fixed seeded subset)")
    parser.add_argument("--k", type=int, default=16, help="kNN neighbours (default 16)")
    parser.add_argument("--batch-size", type=int, default=32, help="default 32")
    parser.add_argument("--lr", type=float, default=0.01, help="Adam lr (default 0.01)")
    parser.add_argument("--frames", choices=("pca+centroid", "pca"), default="pca+centroid",
                        help="local frames: with the planar-patch tie-break (default) or "
                             "plain local_frames")
    parser.add_argument("--up-axis", choices=("x", "y", "z"), default="z",
                        help="vertical axis of the z protocol (default z)")
    parser.add_argument("--small", action="store_true",
                        help=f"tiny sizes for tests: {SMALL}")
    parser.add_argument("--jobs", type=int, default=1,
                        help="units trained at once, each in a worker process")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads per unit (default 1)")
    args = parser.parse_args(argv)
    sizes = SMALL if args.small else DEFAULTS
    for key, value in sizes.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    for key in ("epochs", "points", "k", "batch_size", "seeds", "jobs", "threads"):
        if getattr(args, key) < 1:
            fail(f"--{key.replace('_', '-')} must be at least 1")
    for key in ("max_train", "max_test"):
        if getattr(args, key) is not None and getattr(args, key) < 1:
            fail(f"--{key.replace('_', '-')} must be at least 1")
    if args.points <= args.k:
        fail(f"--points ({args.points}) must exceed --k ({args.k})")
    return args


DEFAULTS = {"epochs": 5, "points": 512, "max_train": None, "max_test": None}
SMALL = {"epochs": 3, "points": 128, "max_train": 100, "max_test": 50}


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Dict[str, Any]]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    specs = selected(ROWS, args.models)
    protocols = [p.strip() for p in args.protocols.split(",") if p.strip()]
    unknown = [p for p in protocols if p not in TESTS]
    if unknown or not protocols:
        fail(f"--protocols {args.protocols!r}: choose from {', '.join(TESTS)}")
    check_folder(args.out_root, "--out-root")
    if args.report_only:
        return report(args.out_root, args.dataset)
    path = find_npz(args.data_dir, args.dataset, args.npz)
    arrays = _arrays(str(path), args.points)
    n_train = len(subset(len(arrays["y_train"]), args.max_train, 0))
    n_test = len(subset(len(arrays["y_test"]), args.max_test, 0))
    units = []
    for name, kind, _ in specs:
        for train in protocols:
            for seed in range(args.seeds):
                cfg = {"row": name, "kind": kind, "train": train, "tests": list(TESTS[train]),
                       "seed": seed, "dataset": args.dataset, "npz": path.name,
                       "n_train": n_train, "n_test": n_test,
                       "num_classes": len(arrays["classes"]), "max_train": args.max_train,
                       "max_test": args.max_test, "points": args.points, "k": args.k,
                       "frames": args.frames, "up_axis": args.up_axis,
                       "epochs": args.epochs, "batch_size": args.batch_size,
                       "lr": args.lr, "hidden": HIDDEN, "layers": LAYERS, "heads": HEADS,
                       "norm": GNN_KW["norm"]}
                folder = args.out_root / args.dataset / slug(name) / train / f"seed{seed}"
                units.append((str(folder), cfg))
    todo = [(f, c) for f, c in units if finished_unit(Path(f), c) is None]
    todo.sort(key=lambda u: -(COST.get(u[1]["row"], 100) + (
        ENCODE_COST[KINDS[u[1]["kind"]][0]] if u[1]["train"] == "so3" else 0)))
    from tqdm.auto import tqdm
    bar = tqdm(total=len(todo), desc="units", disable=args.no_progress)
    if args.jobs == 1 or len(todo) <= 1:
        for folder, cfg in todo:
            run_job(folder, cfg, str(path), args.threads, not args.no_progress)
            bar.update()
    else:
        # The first failed unit (or ^C) cancels the queued ones.
        run_in_workers(run_job, [(folder, cfg, str(path), args.threads) for folder, cfg in todo],
                       args.jobs, _worker_init, (args.threads,),
                       lambda _index, _result: bar.update())
    bar.close()
    return report(args.out_root, args.dataset)


if __name__ == "__main__":
    main()
