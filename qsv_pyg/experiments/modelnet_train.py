r"""One unit of the ModelNet10 rotation table: its model (:func:`model_of`: QSVGeometric
or a parameter-matched control), its training within a process-clock CPU budget
(:func:`train_unit`, resumable from a :class:`~qsv_pyg.experiments.units.UnitCheckpoint`)
and its evaluation on the validation split and the test sets.
:mod:`qsv_pyg.experiments.modelnet_table` defines the rows and runs the units.
"""
from __future__ import annotations

import math
import platform
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from .modelnet_data import (AUGMENTATIONS, CLASS_WEIGHTS, ROTATION_SEED, TESTS,
                            VOTE_SEED, VOTE_TESTS, augment_shapes, base_sets,
                            class_accuracy, class_weights, confusion, encode, forward,
                            predictions, rotate, rotations, voted_probabilities)
from .units import UNIT_WEIGHTS, UnitCheckpoint

__all__ = ["FAMILIES", "TABLE_WIDTH", "TABLE_DEFAULTS", "model_of", "target_params",
           "train_unit", "vote_unit", "eval_rotations", "warm_up", "cosine"]

#: Model families: QSVGeometric, the Vector Neurons control, DGCNN, PointNet++.
FAMILIES = ("qsv", "vn", "dgcnn", "pointnet2")
#: Neighbours of the controls' kNN graphs (the field's k ~ 20).
CONTROL_K = 20
#: DGCNN / PointNet++ widths before matching (PyG's examples).
CONTROL_BASE_WIDTH = 64
#: QSVGeometric's ``hidden_channels`` in the table's rows that do not set it, and the
#: width the controls are matched to: 64, the model's default when the table was
#: run. The default became 128 after the width lever's rows; a row's ``model_kwargs``
#: (its ``config.json``) keep meaning what they meant when they were trained.
TABLE_WIDTH = 64
#: QSVGeometric's keywords in the table's rows unless a row sets them: the model's
#: defaults when the table was run. ``edge_message`` became ``"target"`` by default
#: after the edge-message lever's rows; the rows that do not name it keep it off, and
#: the controls stay matched to the model without it.
TABLE_DEFAULTS: Dict[str, Any] = {"hidden_channels": TABLE_WIDTH, "edge_message": False}


def target_params(num_classes: int) -> int:
    """The parameters of ``QSVGeometric(num_classes, **TABLE_DEFAULTS)``, which the
    controls match."""
    from qsv_pyg.models.matching import count_parameters
    from qsv_pyg.nn.models import QSVGeometric
    return count_parameters(QSVGeometric(num_classes, **TABLE_DEFAULTS))


def model_of(family: str, kw: Dict[str, Any], num_classes: int) -> torch.nn.Module:
    """A model of a family (:data:`FAMILIES`): ``QSVGeometric(num_classes, **kw)`` with
    :data:`TABLE_DEFAULTS` where ``kw`` does not set them, or a control
    parameter-matched to it (:func:`target_params`)."""
    from qsv_pyg.models import point_controls as pc
    from qsv_pyg.nn.models import QSVGeometric
    if family not in FAMILIES:
        raise ValueError(f"unknown model family {family!r}; choose from {FAMILIES}")
    if family == "qsv":
        return QSVGeometric(num_classes, **{**TABLE_DEFAULTS, **kw})
    target = target_params(num_classes)
    if family == "vn":
        return pc.matched_vn_dgcnn(num_classes, target, k=CONTROL_K)
    if family == "dgcnn":
        return pc.matched_width_model(lambda w: pc.DGCNN(num_classes, w, CONTROL_K),
                                      CONTROL_BASE_WIDTH, target)
    return pc.matched_width_model(lambda w: pc.PointNet2(num_classes, w),
                                  CONTROL_BASE_WIDTH, target)


def versions() -> Dict[str, str]:
    import torch_geometric

    import qsv_pyg
    try:
        import torch_cluster
        cluster = torch_cluster.__version__
    except ImportError:
        cluster = "absent"
    return {"python": platform.python_version(), "torch": torch.__version__,
            "torch_geometric": torch_geometric.__version__, "torch_cluster": cluster,
            "numpy": np.__version__, "qsv_pyg": getattr(qsv_pyg, "__version__", "?")}


def cosine(progress: float) -> float:
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, max(0.0, progress))))


def eval_rotations(train: str, n_val: int, n_test: int,
                   tests: Optional[Sequence[str]] = None
                   ) -> Tuple[Optional[torch.Tensor], Dict[str, Optional[torch.Tensor]]]:
    """The fixed rotations of the evaluation: the validation shapes' (SO3 for an
    SO3-trained unit, none for an aligned one) and each test protocol's (``tests``,
    by default the unit's own, ``TESTS[train]``; a protocol's rotations do not
    depend on the training protocol)."""
    val_rot = None if train != "so3" else rotations(
        "so3", n_val, torch.Generator().manual_seed(ROTATION_SEED["val_so3"]))
    return val_rot, {protocol: rotations(protocol, n_test, torch.Generator().manual_seed(
        ROTATION_SEED.get(protocol, 0))) for protocol in (tests or TESTS[train])}


def train_unit(cfg: Dict[str, Any], path: str, log: Callable[[Dict[str, Any]], None],
               progress: bool = False, checkpoint: Optional[UnitCheckpoint] = None
               ) -> Dict[str, Any]:
    """Train one (row, train protocol, seed) unit within its CPU budget, then
    evaluate it once on the validation split and the test sets.

    With a ``checkpoint`` (:class:`~qsv_pyg.experiments.units.UnitCheckpoint`)
    the state is saved after every finished epoch (model, optimiser, the
    generators of order, rotations and augmentation, the global RNGs, the
    counters and the CPU time used), and a saved state is resumed: the unit
    continues with the next epoch, on the CPU clock where it stopped (the
    re-encoding of a resumed aligned unit's fixed inputs is not charged again)."""
    from tqdm.auto import tqdm

    from qsv_pyg.models.matching import count_parameters
    from qsv_pyg.training.checkpoint import capture_rng_state, restore_rng_state
    from qsv_pyg.utils import cpu_name

    sets = base_sets(path, cfg)  # common preprocessing: before the unit's clock
    start_cpu, start_wall = time.process_time(), time.time()
    budget = float(cfg["budget_cpu_s"])
    offset = 0.0  # CPU seconds used before a resume

    def used() -> float:
        return time.process_time() - start_cpu + offset

    torch.manual_seed(cfg["seed"])
    model = model_of(cfg["family"], cfg.get("model_kwargs", {}), cfg["num_classes"])
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg["lr"])
    order_gen = torch.Generator().manual_seed(cfg["seed"])
    rot_gen = torch.Generator().manual_seed(10_000 + cfg["seed"])
    augment = cfg.get("augment")
    if augment is not None and augment not in AUGMENTATIONS:
        raise ValueError(f"unknown augmentation {augment!r}; choose from {AUGMENTATIONS}")
    aug_gen = torch.Generator().manual_seed(20_000 + cfg["seed"])
    train_pos, train_y = sets["train"]
    count = train_y.numel()
    weighting = cfg.get("class_weights")
    if weighting is not None and weighting not in CLASS_WEIGHTS:
        raise ValueError(f"unknown class weighting {weighting!r}; choose from {CLASS_WEIGHTS}")
    loss_weight = None if weighting is None else class_weights(train_y, cfg["num_classes"])
    fixed = encode(model, train_pos, train_y) \
        if cfg["train"] == "aligned" and augment is None else None
    encode_seconds = used()
    planned_epochs: Optional[int] = None
    step = epoch = shapes_seen = resumes = 0
    prog = wall_before = 0.0
    epoch_seconds: List[float] = []
    stats: Dict[str, float] = {}
    generators = {"order": order_gen, "rot": rot_gen, "aug": aug_gen}
    saved = checkpoint.state if checkpoint is not None else None
    if saved is not None:
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        for name, gen in generators.items():
            gen.set_state(saved["generators"][name])
        restore_rng_state(saved["rng"])
        step, epoch, shapes_seen = saved["step"], saved["epoch"], saved["shapes_seen"]
        prog, planned_epochs = saved["progress"], saved["planned_epochs"]
        epoch_seconds, stats = list(saved["epoch_seconds"]), dict(saved["stats"])
        encode_seconds, wall_before = saved["encode_seconds"], saved["wall_seconds"]
        resumes = saved["resumes"] + 1
        offset = saved["used_cpu_seconds"] - (time.process_time() - start_cpu)
    bar = tqdm(desc=f"{cfg['row']} {cfg['train']} s{cfg['seed']}", total=int(budget),
               unit="cpu-s", leave=False, disable=not progress)
    stopped = False
    while not stopped:
        t0 = used()
        if fixed is None:  # fresh augmentation / SO3 rotations; the model re-encodes
            pos = train_pos if augment is None else \
                augment_shapes(sets["train_all"][0], cfg["points"], aug_gen, augment)
            rot = rotations(cfg["train"], count, rot_gen)
            train = {"pos": rotate(pos, rot).float(), "y": train_y}
        else:
            train = fixed
        model.train()
        order = torch.randperm(count, generator=order_gen)
        loss_sum = correct = seen = 0
        for i in range(0, count, cfg["batch_size"]):
            idx = order[i:i + cfg["batch_size"]]
            if idx.numel() < 2:  # batch norm needs two clouds
                continue
            prog = max(prog, used() / budget)
            for group in optimizer.param_groups:
                group["lr"] = cfg["lr"] * cosine(prog)
            optimizer.zero_grad()
            out = forward(model, train, idx)
            loss = torch.nn.functional.cross_entropy(out, train["y"][idx], weight=loss_weight)
            loss.backward()
            optimizer.step()
            step += 1
            loss_sum += float(loss.detach()) * idx.numel()
            correct += int((out.argmax(-1) == train["y"][idx]).sum())
            seen += idx.numel()
            if used() >= budget:
                stopped = True
                break
        epoch += 1
        shapes_seen += seen
        seconds = used() - t0
        partial = seen < count - 1 and stopped
        if not partial:
            epoch_seconds.append(seconds)
        if not partial:  # the epochs the budget holds, from the epochs' times so far
            planned_epochs = epoch + max(0, int((budget - used()) // statistics.fmean(
                epoch_seconds)))
        stats = {"loss": loss_sum / max(seen, 1), "acc": correct / max(seen, 1)}
        log({"epoch": epoch, "partial": partial, "shapes": seen,
             "train_loss": stats["loss"], "train_acc": stats["acc"], "cpu_seconds": seconds,
             "used_cpu_seconds": used(), "lr": optimizer.param_groups[0]["lr"],
             "progress": prog, "planned_epochs": planned_epochs})
        if checkpoint is not None and not stopped and used() < budget:
            checkpoint.save({
                "epoch": epoch, "step": step, "shapes_seen": shapes_seen, "progress": prog,
                "planned_epochs": planned_epochs, "epoch_seconds": epoch_seconds,
                "stats": stats, "encode_seconds": encode_seconds, "resumes": resumes,
                "used_cpu_seconds": used(), "wall_seconds": wall_before + time.time() - start_wall,
                "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "generators": {name: gen.get_state() for name, gen in generators.items()},
                "rng": capture_rng_state()})
        bar.n = min(int(used()), int(budget))
        bar.refresh()
        if used() >= budget:
            stopped = True
    bar.close()
    train_cpu = used()
    if checkpoint is not None:  # the final weights stay (model.pt) for later evaluations
        checkpoint.save_weights({"model": model.state_dict(), "epoch": epoch, "final": True,
                                 "used_cpu_seconds": train_cpu})
    t0 = time.process_time()
    val_pos, val_y = sets["val"]
    test_pos, test_y = sets["test"]
    val_rot, test_rots = eval_rotations(cfg["train"], val_y.numel(), test_y.numel())
    classes = cfg["num_classes"]

    def evaluate(pos: torch.Tensor, y: torch.Tensor, rot: Optional[torch.Tensor]):
        """(accuracy, confusion matrix, per-class accuracies, balanced accuracy)"""
        pred = predictions(model, encode(model, rotate(pos, rot), y))
        matrix = confusion(pred, y, classes)
        per, balanced = class_accuracy(matrix)
        return (int((pred == y).sum()) / y.numel() if y.numel() else float("nan"),
                matrix, per, balanced)

    val, val_confusion, val_per_class, val_balanced = evaluate(val_pos, val_y, val_rot)
    test, test_confusion, test_per_class, test_balanced = {}, {}, {}, {}
    for protocol, rot in test_rots.items():
        (test[protocol], test_confusion[protocol], test_per_class[protocol],
         test_balanced[protocol]) = evaluate(test_pos, test_y, rot)
    return {"row": cfg["row"], "train": cfg["train"], "seed": cfg["seed"], "test": test,
            "val": val, "classes": sets["classes"], "val_balanced": val_balanced, "val_per_class": val_per_class,
            "val_confusion": val_confusion, "test_balanced": test_balanced,
            "test_per_class": test_per_class, "test_confusion": test_confusion,
            "params": count_parameters(model),
            "epochs": len(epoch_seconds), "epochs_trained": shapes_seen / count,
            "epochs_run": epoch, "steps": step, "planned_epochs": planned_epochs,
            "cpu_seconds_train": train_cpu, "budget_cpu_s": budget,
            "encode_cpu_seconds": encode_seconds,
            # full epochs' mean; without one, the partial epoch extrapolated
            "cpu_seconds_per_epoch": statistics.fmean(epoch_seconds) if epoch_seconds
            else (train_cpu - encode_seconds) * count / max(shapes_seen, 1),
            "eval_cpu_seconds": time.process_time() - t0,
            "train_loss": stats.get("loss"), "train_acc": stats.get("acc"),
            "wall_seconds": wall_before + time.time() - start_wall, "resumes": resumes,
            "model": repr(model),
            "cpu": cpu_name(), "threads": torch.get_num_threads(), "versions": versions()}


def vote_unit(folder: Path, cfg: Dict[str, Any], path: str, votes: int
              ) -> Optional[Dict[str, Any]]:
    """Test-time voting on a finished unit's kept weights (``model.pt``; None
    without them): the validation and test accuracies of one draw (the fixed
    subsample the unit was evaluated on) and of the mean softmax over ``votes``
    fresh draws of ``cfg["points"]`` (:func:`~qsv_pyg.experiments.modelnet_data.
    voted_probabilities`), paired on the same weights: the validation shapes under
    the unit's own rotations, the test shapes under every protocol of
    :data:`~qsv_pyg.experiments.modelnet_data.VOTE_TESTS` (the same fixed rotations
    as the table's columns, so the unit's own protocols reproduce its metrics)."""
    from qsv_pyg.training.checkpoint import load_checkpoint
    weights_path = Path(folder) / UNIT_WEIGHTS
    if not weights_path.is_file():
        return None
    t0 = time.process_time()
    weights = load_checkpoint(weights_path, map_location="cpu")
    model = model_of(cfg["family"], cfg.get("model_kwargs", {}), cfg["num_classes"])
    model.load_state_dict(weights["model"])
    model.eval()
    sets = base_sets(path, cfg)
    val_rot, test_rots = eval_rotations(cfg["train"], sets["val"][1].numel(),
                                        sets["test"][1].numel(), VOTE_TESTS)

    def both(split: str, rot: Optional[torch.Tensor]) -> Dict[str, float]:
        pos, y = sets[split]
        single = predictions(model, encode(model, rotate(pos, rot), y))
        voted = voted_probabilities(model, sets[f"{split}_all"][0], y, rot, cfg["points"],
                                    votes, VOTE_SEED[split]).argmax(-1)
        n = max(y.numel(), 1)
        return {"single": int((single == y).sum()) / n, "voted": int((voted == y).sum()) / n}

    return {"row": cfg["row"], "train": cfg["train"], "seed": cfg["seed"], "votes": votes,
            "points": cfg["points"], "draw_seeds": dict(VOTE_SEED),
            "weights": {k: weights.get(k) for k in ("epoch", "final", "used_cpu_seconds")},
            "val": both("val", val_rot),
            "test": {protocol: both("test", rot) for protocol, rot in test_rots.items()},
            "eval_cpu_seconds": time.process_time() - t0}


_WARM: List[bool] = []


def warm_up() -> None:
    """Once per process, outside every budget: one forward and backward of a
    tiny :class:`~qsv_pyg.nn.QSVConv`, so that building or loading its compiled
    kernel (a one-off of the process, minutes on a first build) is not charged
    to the first unit."""
    if _WARM:
        return
    from qsv_pyg.nn import QSVConv
    conv = QSVConv(8, 2, heads=4, quat_source="given")
    x = torch.randn(4, 8)
    q = torch.nn.functional.normalize(torch.randn(4, 4), dim=-1)
    ei = torch.tensor([[0, 1, 2, 3], [1, 2, 3, 0]])
    conv(x, ei, quat=q).sum().backward()
    _WARM.append(True)
