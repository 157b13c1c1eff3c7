"""Node geometry of the quaternion graph models: Fibonacci shells, flat
lattices, equal-area sphere/square maps and deterministic kNN graphs."""
from qsv_pyg.geometry.frames import (
    FRAME_RULES,
    OrientedFrames,
    check_finite_positions,
    frame_quaternions,
    local_frames,
    matrix_to_quaternion,
    oriented_frames,
)
from qsv_pyg.geometry import lambert
from qsv_pyg.geometry.hierarchy import Hierarchy
from qsv_pyg.geometry.knn import dense_neighbors, knn_cross, knn_within
from qsv_pyg.geometry.lambert import (
    disk_to_sphere,
    disk_to_square,
    sphere_to_disk,
    sphere_to_square,
    square_to_disk,
    square_to_sphere,
)
from qsv_pyg.geometry.lattice import LatticeSpec, build_lattice_hierarchy, lattice_grid
from qsv_pyg.geometry.sphere import (
    ShellSpec,
    build_shell_hierarchy,
    build_shells,
    fibonacci_sphere,
)

__all__ = [
    "Hierarchy",
    "ShellSpec",
    "LatticeSpec",
    "fibonacci_sphere",
    "build_shells",
    "build_shell_hierarchy",
    "lattice_grid",
    "build_lattice_hierarchy",
    "knn_within",
    "knn_cross",
    "dense_neighbors",
    *lambert.__all__,
    "matrix_to_quaternion",
    "local_frames",
    "frame_quaternions",
    "oriented_frames",
    "OrientedFrames",
    "FRAME_RULES",
    "check_finite_positions",
]
