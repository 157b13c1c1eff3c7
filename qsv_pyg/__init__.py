"""qsv_pyg: quaternion graph attention (Quat-Sphere-Vision) for PyTorch Geometric.

Pipeline, one subpackage per stage:
``quaternion`` (algebra) → ``nn`` (QSVConv) → ``geometry`` (shells, lattices, kNN,
Lambert maps) → ``models`` (QSVNet, controls, ResNet-20) → ``data``/``training``.
"""
from . import quaternion
from .nn import QSVConv

__version__ = "0.1.0"
__all__ = ["quaternion", "QSVConv", "__version__"]
