"""Why the ModelNet10 table's validation accuracy runs above its test accuracy: a
model-free check of the splits.

The table holds out a stratified 10 % of the official training split for validation
(``qsv_pyg.experiments.modelnet_data.stratified_split``), so validation keeps the
training split's class mix (889 chairs, 106 bathtubs), while the official test split is
nearly balanced (50-100 shapes per class). Every trained row scores 2-5 points lower on
test than on validation. This script asks whether a classifier that learns nothing shows
the same gap, and how much of it the class mix explains: a 1-nearest-neighbour
classifier on a rotation-invariant global descriptor of each shape (the histogram of
its pairwise point distances, D2 of Osada et al. 2002, and of its points' distances to
the centroid), with the training split (minus validation) as the reference set. For
validation and test it reports the accuracy, the per-class accuracy, the balanced
(mean per-class) accuracy, the validation accuracy re-weighted to the test split's class
mix, and the distance to the nearest training shape (near-duplicates would show as
distances near 0).

Example::

    python benchmarks/modelnet_split_check.py --data-dir ../shared/data \\
        --out docs/results/modelnet_table/split_check.json
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch
from torch import Tensor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine_info, write_json  # noqa: E402

from qsv_pyg.experiments import modelnet_data as md  # noqa: E402
from qsv_pyg.experiments.modelnet_table import DATASET  # noqa: E402

#: Bins of the pairwise-distance histogram (over [0, 2]: shapes on the unit sphere)
#: and of the distance-to-centroid histogram (over [0, 1]).
D2_BINS, RADIAL_BINS = 32, 16


def descriptor(pos: Tensor) -> Tensor:
    """``[S, D2_BINS + RADIAL_BINS]`` rotation- and translation-invariant descriptors
    of ``S`` clouds ``[S, n, 3]``: the normalised histograms of the pairwise distances
    and of the distances to the cloud's centroid."""
    centred = pos.double() - pos.double().mean(1, keepdim=True)
    iu = torch.triu_indices(pos.size(1), pos.size(1), 1)
    out = []
    for cloud in centred:
        pair = torch.cdist(cloud, cloud)[iu[0], iu[1]]
        h_pair = torch.histc(pair, D2_BINS, 0.0, 2.0)
        h_rad = torch.histc(cloud.norm(dim=-1), RADIAL_BINS, 0.0, 1.0)
        out.append(torch.cat([h_pair / h_pair.sum().clamp_min(1),
                              h_rad / h_rad.sum().clamp_min(1)]))
    return torch.stack(out)


def nearest_neighbour(reference: Tensor, ref_y: Tensor, query: Tensor, y: Tensor,
                      num_classes: int, mix: Optional[Tensor] = None) -> Dict[str, Any]:
    """1-NN predictions of ``query`` from ``reference`` (Euclidean on the
    descriptors): accuracy, per-class and balanced accuracy, the accuracy re-weighted
    to the class shares ``mix`` (when given), and the nearest distances' quantiles."""
    dist = torch.cdist(query, reference).min(1)
    pred = ref_y[dist.indices]
    per, balanced = md.class_accuracy(md.confusion(pred, y, num_classes))
    out: Dict[str, Any] = {
        "shapes": int(y.numel()), "accuracy": float((pred == y).double().mean()),
        "per_class": per, "balanced": balanced,
        "class_share": (torch.bincount(y, minlength=num_classes).double() / y.numel()).tolist(),
        "nearest_distance_quantiles": {
            str(q): float(torch.quantile(dist.values, q)) for q in (0.01, 0.1, 0.5)}}
    if mix is not None:
        out["accuracy_at_mix"] = float(sum(m * a for m, a in zip(mix.tolist(), per)
                                           if a == a))
    return out


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", default=os.environ.get("QSV_DATA_DIR", "../shared/data"))
    parser.add_argument("--dataset", default=DATASET)
    parser.add_argument("--points", type=int, default=512)
    parser.add_argument("--out", default=None, help="JSON file for the results")
    args = parser.parse_args(argv)
    path = md.find_npz(Path(args.data_dir), args.dataset, None)
    sets = md.base_sets(str(path), {"points": args.points, "max_train": None,
                                    "max_test": None})
    classes = sets["classes"]
    (tr, ytr), (va, yva), (te, yte) = sets["train"], sets["val"], sets["test"]
    C = len(classes)
    ref = descriptor(tr)
    test_mix = torch.bincount(yte, minlength=C).double() / yte.numel()
    result = {"val": nearest_neighbour(ref, ytr, descriptor(va), yva, C, test_mix),
              "test": nearest_neighbour(ref, ytr, descriptor(te), yte, C)}
    payload = {"dataset": args.dataset, "points": args.points, "classes": classes,
               "reference_shapes": int(ytr.numel()), "descriptor": {
                   "pairwise_distance_bins": D2_BINS, "radial_bins": RADIAL_BINS},
               "machine": machine_info(torch.device("cpu")), "command": " ".join(sys.argv),
               **result}
    val, test = result["val"], result["test"]
    print(f"1-NN on D2 + radial histograms ({ytr.numel()} reference shapes)")
    print(f"{'':<6} {'acc':>6} {'balanced':>9} {'at test mix':>12} {'median NN dist':>15}")
    for name, r in (("val", val), ("test", test)):
        at_mix = f"{100 * r['accuracy_at_mix']:.1f}" if "accuracy_at_mix" in r else "–"
        print(f"{name:<6} {100 * r['accuracy']:>6.1f} {100 * r['balanced']:>9.1f} "
              f"{at_mix:>12} {r['nearest_distance_quantiles']['0.5']:>15.4f}")
    print("per class (val / test):")
    for c, name in enumerate(classes):
        print(f"  {name:<12} {100 * val['per_class'][c]:5.1f} / "
              f"{100 * test['per_class'][c]:5.1f}  shares {100 * val['class_share'][c]:4.1f}% / "
              f"{100 * test['class_share'][c]:4.1f}%")
    if args.out:
        write_json(args.out, payload)
    return payload


if __name__ == "__main__":
    main()
