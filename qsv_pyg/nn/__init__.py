"""Graph layers: :class:`QSVConv`, its fused kernel and its reference implementation."""
from .fixed_degree import fixed_degree_neighbors, weighted_neighbor_sum
from .qsv_conv import QSVConv, unit_quaternion
from .qsv_kernel import qsv_aggregate
from .reference import qsv_conv_reference

__all__ = ["QSVConv", "fixed_degree_neighbors", "weighted_neighbor_sum", "qsv_aggregate",
           "unit_quaternion", "qsv_conv_reference"]
