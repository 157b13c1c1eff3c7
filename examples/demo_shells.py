"""Build the five Fibonacci shells and run QSVConv inward over them.

A two-minute tour of the package: geometry (shells, cross-shell kNN graphs, the
Lambert map), a learned-free quaternion field, and one QSVConv per shell
transition, with the routing statistics printed per layer.

    python examples/demo_shells.py
"""
import math

import torch

from qsv_pyg.geometry import ShellSpec, build_shell_hierarchy
from qsv_pyg.nn import QSVConv
from qsv_pyg.quaternion import random_unit_quaternion


def main() -> None:
    torch.manual_seed(0)
    hier = build_shell_hierarchy(ShellSpec(), k_cross=8, k_inner=8)
    print(f"shells: sizes {hier.sizes}, k_cross={hier.k_cross}, k_inner={hier.k_inner}")
    print(f"outer shell -> image (Lambert + Shirley-Chiu): coords in "
          f"[{hier.image_coords.min():.3f}, {hier.image_coords.max():.3f}]")
    print(hier.to_hetero_data())

    width, heads = 32, 2
    quats = [random_unit_quaternion(n, heads) for n in hier.sizes]
    x = torch.randn(hier.sizes[0], width)
    for s, edges in enumerate(hier.cross_edges):
        conv = QSVConv(width, width // heads, heads=heads, quat_source="given")
        x_dst = torch.zeros(hier.sizes[s + 1], width)
        x, (_, alpha) = conv((x, x_dst), edges, quat=(quats[s], quats[s + 1]),
                             return_attention_weights=True)
        k = hier.k_cross
        a = alpha.view(-1, k, heads)
        entropy = -(a * a.clamp_min(1e-12).log()).sum(1).mean().item()
        print(f"shell {s} -> {s + 1}: out {tuple(x.shape)}, routing entropy "
              f"{entropy:.3f} (uniform = log k = {math.log(k):.3f}), "
              f"finite={bool(torch.isfinite(x).all())}")


if __name__ == "__main__":
    main()
