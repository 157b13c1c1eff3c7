"""Graph layers: :class:`QSVConv` and its reference implementation."""
from .qsv_conv import QSVConv, fixed_degree_neighbors, unit_quaternion
from .reference import qsv_conv_reference

__all__ = ["QSVConv", "fixed_degree_neighbors", "unit_quaternion", "qsv_conv_reference"]
