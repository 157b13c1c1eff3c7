r"""ModelNet10 for the rotation table: the checked arrays, the validation split,
the normalised shapes, the rotation protocols, the training augmentation and the
encoding the models read (:mod:`qsv_pyg.experiments.modelnet_table` runs the table,
:mod:`qsv_pyg.experiments.modelnet_report` writes its report).

**Data.** ``<data-dir>/<dataset>/*.npz`` with ``pos_train [S, N, 3]``, ``y_train``,
``pos_test``, ``y_test`` (and ``classes``): ModelNet10 as 1,024 Poisson-disk points
per shape, the official 3,991 / 908 split. Every shape is centred and scaled to the
unit sphere, then subsampled to ``points`` (a fixed seeded choice,
:data:`SUBSAMPLE_SEED`). The official protocol has no validation split: a fixed
stratified 10 % of the training shapes is held out (:func:`stratified_split`).

**Protocols** (``train/test``, :data:`TESTS`): trained on the shapes as given
(``aligned``) and tested as given, under one fixed random rotation about ``z`` per
shape and under one fixed uniform 3-D rotation per shape (:data:`ROTATION_SEED`); or
trained with a fresh uniform rotation of every shape in every epoch (``so3``) and
tested under SO3.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import Tensor

from ..transforms import AXIS_SCALES
from .units import fail

__all__ = ["TESTS", "LABEL", "COLUMNS", "MAX_POINTS", "AUGMENTATIONS", "SCALE_RANGE",
           "find_npz", "load_arrays", "stratified_split", "unit_sphere", "normalise",
           "augment_shapes", "rotations", "rotate", "base_sets", "encode", "forward",
           "predictions", "probabilities", "voted_probabilities", "VOTE_SEED", "VOTE_TESTS",
           "accuracy",
           "confusion", "class_accuracy", "class_weights",
           "CLASS_WEIGHTS"]

REQUIRED = ("pos_train", "y_train", "pos_test", "y_test")
#: Train protocol -> its test protocols (the columns are train/test).
TESTS: Dict[str, Tuple[str, ...]] = {"aligned": ("aligned", "z", "so3"), "so3": ("so3",)}
#: The test rotations of test-time voting, whatever the unit was trained on: an
#: SO3-trained unit's weights are also evaluated on the aligned and z-rotated
#: test shapes (for an invariant model the three agree; for the others they
#: show what the augmentation left).
VOTE_TESTS: Tuple[str, ...] = TESTS["aligned"]
LABEL = {"aligned": "aligned", "z": "z", "so3": "SO3"}
COLUMNS = tuple(f"{LABEL[tr]}/{LABEL[te]}" for tr, tests in TESTS.items() for te in tests)
#: Seeds of the data choices (fixed for every unit): which points of a shape,
#: the validation split, --max-train/--max-test subsets, the fixed rotations.
SUBSAMPLE_SEED = {"train": 11, "test": 12}
SUBSET_SEED = {"train": 21, "test": 22}
VAL_SEED = 23
ROTATION_SEED = {"z": 31, "so3": 32, "val_so3": 33}
#: Seeds of the test-time voting draws (:func:`voted_probabilities`), per split.
VOTE_SEED = {"val": 41, "test": 42}
VAL_FRACTION = 0.1
MAX_POINTS = 1024


#: The training augmentations a row may use (``config.json``'s ``"augment"``;
#: rows without one see the same ``--points`` of every shape in every epoch).
#: ``"resample+scale"``: in every epoch, every training shape is scaled by a
#: factor drawn from :data:`SCALE_RANGE` per axis (the DGCNN recipe's
#: anisotropic scaling), centred and scaled to the unit sphere again, and
#: ``--points`` of its points are drawn afresh (PyG's examples resample through
#: ``SamplePoints`` on every access); then rotated as the protocol says.
#: ``"resample"``: the same without the scaling (PyG's examples' recipe): the
#: shapes keep their proportions, which separate classes such as dresser and
#: night_stand or desk and table.
AUGMENTATIONS = ("resample+scale", "resample")
SCALE_RANGE = AXIS_SCALES  # qsv_pyg.transforms.RandomAxisScale's default
#: The loss weightings a row may use (``config.json``'s ``"class_weights"``; rows
#: without one weight every shape alike): ``"balanced"`` (:func:`class_weights`).
#: ModelNet10's training split is imbalanced (889 chairs, 106 bathtubs) and its
#: official test split nearly balanced (50-100 shapes per class).
CLASS_WEIGHTS = ("balanced",)


def find_npz(data_root: Path, dataset: str, npz: Optional[str]) -> Path:
    folder = Path(data_root) / dataset
    if not folder.is_dir():
        fail(f"{dataset}: no folder {folder} (check --data-dir and --dataset)")
    if npz is not None:
        path = Path(npz) if Path(npz).is_absolute() else folder / npz
        if not path.is_file():
            fail(f"{dataset}: no file {path} (check --npz)")
        return path
    found = sorted(folder.glob("*.npz"))
    if not found:
        fail(f"{dataset}: no .npz file in {folder}")
    if len(found) > 1:
        fail(f"{dataset}: {len(found)} .npz files in {folder} "
             f"({', '.join(p.name for p in found)}); choose one with --npz")
    return found[0]


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split()) or type(error).__name__


def load_arrays(path: Path, points: int) -> Dict[str, Any]:
    """The checked arrays of a ModelNet-style npz; any problem is a
    :func:`~qsv_pyg.experiments.units.fail` (exit 2, one line)."""
    try:
        with np.load(path, allow_pickle=False) as f:
            missing = [name for name in REQUIRED if name not in f.files]
            if missing:
                fail(f"{path} lacks the array(s) {', '.join(missing)} (a ModelNet-style "
                     f"npz holds {', '.join(REQUIRED)} and optionally classes)")
            arrays = {name: f[name] for name in REQUIRED}
            classes = f["classes"] if "classes" in f.files else None
    except SystemExit:
        raise
    except Exception as error:  # not a zip, a pickled array, a torn file, ...
        fail(f"cannot read {path}: {_one_line(error)}")
    for split in ("train", "test"):
        pos, y = arrays[f"pos_{split}"], arrays[f"y_{split}"]
        if pos.ndim != 3 or pos.shape[2] != 3 or pos.shape[0] == 0:
            fail(f"{path}: pos_{split} has shape {list(pos.shape)}; expected "
                 f"[shapes, points, 3]")
        if not np.issubdtype(pos.dtype, np.floating) or not np.isfinite(pos).all():
            fail(f"{path}: pos_{split} must hold finite floats (dtype {pos.dtype})")
        if y.ndim != 1 or y.shape[0] != pos.shape[0]:
            fail(f"{path}: y_{split} has shape {list(y.shape)} but pos_{split} holds "
                 f"{pos.shape[0]} shapes")
        if not np.issubdtype(y.dtype, np.integer) or (y < 0).any():
            fail(f"{path}: y_{split} must hold non-negative integer labels "
                 f"(dtype {y.dtype})")
        if pos.shape[1] < points:
            fail(f"{path}: pos_{split} has {pos.shape[1]} points per shape, fewer than "
                 f"--points {points}")
    top = int(max(arrays["y_train"].max(), arrays["y_test"].max()))
    if classes is not None:
        if classes.ndim != 1 or len(classes) <= top:
            fail(f"{path}: classes has shape {list(classes.shape)} but the labels reach "
                 f"{top}")
        names = [str(c) for c in classes]
    else:
        names = [f"class {i}" for i in range(top + 1)]
    arrays["classes"] = names
    return arrays


def subset(count: int, limit: Optional[int], seed: int) -> Tensor:
    """Indices of ``limit`` shapes out of ``count`` (a fixed seeded choice, in
    file order), or all of them."""
    if limit is None or limit >= count:
        return torch.arange(count)
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(count, generator=g)[:limit].sort().values


def stratified_split(y: Tensor, fraction: float = VAL_FRACTION, seed: int = VAL_SEED
                     ) -> Tuple[Tensor, Tensor]:
    """``(train_idx, val_idx)``: ``round(fraction * n_c)`` shapes of every class
    ``c`` (at least one where the class has two or more) held out, a fixed
    seeded choice; both sorted."""
    g = torch.Generator().manual_seed(seed)
    val = []
    for c in torch.unique(y):
        idx = (y == c).nonzero().view(-1)
        n = int(round(fraction * idx.numel()))
        if idx.numel() >= 2:
            n = min(max(n, 1), idx.numel() - 1)
        else:
            n = 0
        val.append(idx[torch.randperm(idx.numel(), generator=g)[:n]])
    val_idx = torch.cat(val).sort().values if val else torch.empty(0, dtype=torch.long)
    mask = torch.ones(y.numel(), dtype=torch.bool)
    mask[val_idx] = False
    return mask.nonzero().view(-1), val_idx


def unit_sphere(p: Tensor) -> Tensor:
    """Every shape of ``[S, N, 3]`` centred (its points' mean) and scaled to the unit sphere."""
    p = p - p.mean(1, keepdim=True)
    return p / p.norm(dim=2).amax(1).clamp_min(1e-12)[:, None, None]


def normalise(pos: np.ndarray, points: int, seed: int) -> Tensor:
    """Centred, unit-sphere, subsampled shapes ``[S, points, 3]`` in float64."""
    p = unit_sphere(torch.from_numpy(np.ascontiguousarray(pos)).double())
    g = torch.Generator().manual_seed(seed)
    keep = torch.rand(p.shape[0], p.shape[1], generator=g).argsort(1)[:, :points]
    return torch.gather(p, 1, keep[..., None].expand(-1, -1, 3))


def augment_shapes(full: Tensor, points: int, g: torch.Generator,
                   augment: str = "resample+scale") -> Tensor:
    """``augment`` (one of :data:`AUGMENTATIONS`) of ``full`` ``[S, N, 3]`` (all of
    every shape's points): ``[S, points, 3]``, a fresh draw from ``g``."""
    if augment not in AUGMENTATIONS:
        raise ValueError(f"unknown augmentation {augment!r}; choose from {AUGMENTATIONS}")
    p = full
    if augment == "resample+scale":
        lo, hi = SCALE_RANGE
        scale = lo + (hi - lo) * torch.rand(full.size(0), 1, 3, generator=g, dtype=full.dtype)
        p = unit_sphere(full * scale)
    keep = torch.rand(full.size(0), full.size(1), generator=g).argsort(1)[:, :points]
    return torch.gather(p, 1, keep[..., None].expand(-1, -1, 3))


def rotations(protocol: str, count: int, g: torch.Generator, up_axis: str = "z"
              ) -> Optional[Tensor]:
    """``[count, 3, 3]`` float64 rotations: about the vertical axis ``up_axis``
    (``"z"``) or uniform on SO(3) (``"so3"``); None for ``"aligned"``."""
    from qsv_pyg.quaternion import quaternion_to_matrix, random_unit_quaternion
    if protocol == "aligned":
        return None
    if protocol == "so3":
        return quaternion_to_matrix(random_unit_quaternion(count, generator=g,
                                                           dtype=torch.float64))
    if protocol != "z":
        raise ValueError(f"unknown rotation protocol {protocol!r}")
    theta = torch.rand(count, generator=g, dtype=torch.float64) * (2 * math.pi)
    c, s = theta.cos(), theta.sin()
    a, b = [i for i in range(3) if i != "xyz".index(up_axis)]  # the horizontal plane
    rot = torch.eye(3, dtype=torch.float64).repeat(count, 1, 1)
    rot[:, a, a], rot[:, a, b], rot[:, b, a], rot[:, b, b] = c, -s, s, c
    return rot


def rotate(pos: Tensor, rot: Optional[Tensor]) -> Tensor:
    return pos if rot is None else pos @ rot.transpose(1, 2)


_ARRAYS: Dict[tuple, Dict[str, Tensor]] = {}


def base_sets(path: str, cfg: Dict[str, Any]) -> Dict[str, Tuple[Tensor, Tensor]]:
    """``{"train", "val", "test"}`` -> (centred, subsampled shapes float64, labels),
    ``"train_all"``, ``"val_all"``, ``"test_all"``: the same shapes with all their
    points (what :func:`augment_shapes` and :func:`voted_probabilities` draw
    from), and ``"classes"``: the class names; cached per process (the common
    preprocessing, outside the budget)."""
    key = (path, cfg["points"], cfg["max_train"], cfg["max_test"])
    if key not in _ARRAYS:
        _ARRAYS.clear()
        arrays = load_arrays(Path(path), cfg["points"])
        out = {}
        for split in ("train", "test"):
            keep = subset(len(arrays[f"y_{split}"]), cfg[f"max_{split}"], SUBSET_SEED[split])
            pos = normalise(arrays[f"pos_{split}"][keep.numpy()], cfg["points"],
                            SUBSAMPLE_SEED[split])
            y = torch.from_numpy(arrays[f"y_{split}"][keep.numpy()].astype(np.int64))
            out[split] = (pos, y)
            full = arrays[f"pos_{split}"][keep.numpy()]
            out[f"{split}_all"] = (unit_sphere(torch.from_numpy(
                np.ascontiguousarray(full)).double()), y)
        tr, va = stratified_split(out["train"][1])
        pos, y = out["train"]
        out["train"], out["val"] = (pos[tr], y[tr]), (pos[va], y[va])
        full = out["train_all"][0]
        out["train_all"], out["val_all"] = (full[tr], y[tr]), (full[va], y[va])
        out["classes"] = list(arrays["classes"])
        _ARRAYS[key] = out
    return _ARRAYS[key]


def encode(model: torch.nn.Module, pos: Tensor, y: Tensor, chunk: int = 64
           ) -> Dict[str, Tensor]:
    """Shapes as the model reads them: ``pos`` (float32) and, for QSVGeometric,
    the kNN graph and frames of :class:`qsv_pyg.transforms.KNNGraph` and
    :class:`~qsv_pyg.transforms.LocalFrames` (the model's ``k`` and frame rule),
    computed from ``pos`` as given."""
    out: Dict[str, Tensor] = {"pos": pos.float(), "y": y}
    if getattr(model, "frame_rule", None) is None:
        return out
    import torch_geometric.transforms as T
    from torch_geometric.data import Data

    import qsv_pyg.transforms as QT
    transform = T.Compose([QT.KNNGraph(k=model.k),
                           QT.LocalFrames(rule=model.frame_rule, tol=model.frame_tol)])
    n = pos.size(1)
    parts: Dict[str, List[Tensor]] = {"nbr": [], "frame": [], "amb": [], "eig": []}
    for start in range(0, pos.size(0), chunk):
        p = pos[start:start + chunk]
        b = p.size(0)
        batch = torch.arange(b).repeat_interleave(n)
        data = transform(Data(pos=p.reshape(-1, 3).double(), batch=batch))
        src, dst = data.edge_index
        order = torch.sort(dst, stable=True).indices
        src = src[order]
        parts["nbr"].append((src - batch[src] * n).view(b, n, model.k).to(torch.int32))
        parts["frame"].append(data.frame.view(b, n, 3, 3))
        parts["amb"].append(data.frame_ambiguous.view(b, n))
        parts["eig"].append(data.frame_eigenvalues.view(b, n, 3))
    out.update({key: torch.cat(value) for key, value in parts.items()})
    return out


def forward(model: torch.nn.Module, shapes: Dict[str, Tensor], idx: Tensor
            ) -> Tensor:
    """Logits of the shapes ``idx`` (one mini-batch)."""
    b, n = idx.numel(), shapes["pos"].size(1)
    pos = shapes["pos"][idx].reshape(-1, 3)
    batch = torch.arange(b).repeat_interleave(n)
    if "nbr" not in shapes:
        return model(pos, batch)
    nbr = shapes["nbr"][idx].long() + (torch.arange(b) * n).view(b, 1, 1)
    k = nbr.size(2)
    edge_index = torch.stack([nbr.reshape(-1), torch.arange(b * n).repeat_interleave(k)])
    return model(pos, batch, edge_index=edge_index,
                 frame=shapes["frame"][idx].reshape(-1, 3, 3),
                 frame_ambiguous=shapes["amb"][idx].reshape(-1),
                 frame_eigenvalues=shapes["eig"][idx].reshape(-1, 3))


@torch.no_grad()
def predictions(model: torch.nn.Module, shapes: Dict[str, Tensor], batch_size: int = 64
                ) -> Tensor:
    """The predicted class of every shape (eval mode)."""
    model.eval()
    count = shapes["y"].numel()
    out = [forward(model, shapes, torch.arange(start, min(start + batch_size, count))
                   ).argmax(-1) for start in range(0, count, batch_size)]
    return torch.cat(out) if out else shapes["y"].new_empty(0)


@torch.no_grad()
def probabilities(model: torch.nn.Module, shapes: Dict[str, Tensor], batch_size: int = 64
                  ) -> Tensor:
    """``[shapes, classes]`` softmax of every shape's logits (eval mode)."""
    model.eval()
    count = shapes["y"].numel()
    if count == 0:
        return torch.empty(0, 0)
    return torch.cat([forward(model, shapes, torch.arange(start, min(start + batch_size, count))
                              ).softmax(-1) for start in range(0, count, batch_size)])


def voted_probabilities(model: torch.nn.Module, full: Tensor, y: Tensor,
                        rot: Optional[Tensor], points: int, votes: int, seed: int
                        ) -> Tensor:
    """Test-time voting: the mean softmax over ``votes`` fresh draws of ``points``
    of every shape's points (``full`` ``[S, N, 3]``, drawn as the ``"resample"``
    augmentation does, from a generator seeded ``seed``), each draw rotated by the
    shape's ``rot`` and encoded as the model reads it."""
    if votes < 1:
        raise ValueError(f"votes must be at least 1, got {votes}")
    g = torch.Generator().manual_seed(seed)
    total = None
    for _ in range(votes):
        draw = augment_shapes(full, points, g, "resample")
        p = probabilities(model, encode(model, rotate(draw, rot), y))
        total = p if total is None else total + p
    return total / votes


def accuracy(model: torch.nn.Module, shapes: Dict[str, Tensor], batch_size: int = 64
             ) -> float:
    """The fraction of ``shapes`` classified correctly (NaN for none)."""
    count = shapes["y"].numel()
    if count == 0:
        return float("nan")
    return int((predictions(model, shapes, batch_size) == shapes["y"]).sum()) / count


def confusion(pred: Tensor, y: Tensor, num_classes: int) -> List[List[int]]:
    """``[true class][predicted class]`` counts."""
    flat = torch.bincount(y.long() * num_classes + pred.long(),
                          minlength=num_classes * num_classes)
    return flat.view(num_classes, num_classes).tolist()


def class_accuracy(matrix: Sequence[Sequence[int]]) -> Tuple[List[float], float]:
    """Per-class accuracy (recall; NaN for a class without shapes) of a
    :func:`confusion` matrix, and their mean over the classes present (the
    balanced accuracy, which a class-balanced test set's accuracy approaches)."""
    per = [row[i] / sum(row) if sum(row) else float("nan") for i, row in enumerate(matrix)]
    present = [a for a in per if not math.isnan(a)]
    return per, (sum(present) / len(present) if present else float("nan"))


def class_weights(y: Tensor, num_classes: int) -> Tensor:
    """``"balanced"`` loss weights (:data:`CLASS_WEIGHTS`): ``n / (C n_c)`` per class
    of the training labels ``y`` (scikit-learn's "balanced"), so every class
    contributes equally to the expected loss; 0 for a class without shapes."""
    counts = torch.bincount(y.long(), minlength=num_classes).double()
    w = y.numel() / (num_classes * counts.clamp_min(1))
    return torch.where(counts > 0, w, torch.zeros_like(w)).float()
