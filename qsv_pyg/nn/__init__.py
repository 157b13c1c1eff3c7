"""Graph layers: :class:`QSVConv`, its attention operator and its reference."""
from .csr import GraphCSR, cache_info, clear_cache, configure_cache, graph_csr
from .dispatch import PATHS, choose_path
from .inputs import unit_quaternion
from .qsv_conv import QSVConv
from .qsv_kernel import qsv_attend
from .reference import qsv_conv_reference

__all__ = ["QSVConv", "qsv_attend", "GraphCSR", "graph_csr", "cache_info", "clear_cache",
           "configure_cache", "PATHS", "choose_path",
           "unit_quaternion", "qsv_conv_reference"]
