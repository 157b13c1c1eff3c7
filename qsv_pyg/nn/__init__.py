"""Graph layers: :class:`QSVConv`, its attention operator and its reference."""
from .csr import GraphCSR, graph_csr
from .dispatch import PATHS, choose_path
from .inputs import unit_quaternion
from .qsv_conv import QSVConv
from .qsv_kernel import qsv_attend
from .reference import qsv_conv_reference

__all__ = ["QSVConv", "qsv_attend", "GraphCSR", "graph_csr", "PATHS", "choose_path",
           "unit_quaternion", "qsv_conv_reference"]
