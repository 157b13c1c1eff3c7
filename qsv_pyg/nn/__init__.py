"""Graph layers: :class:`QSVConv`, its attention operator and its reference."""
from ..quaternion import unit_quaternion
from .csr import GraphCSR
from .graph_cache import cache_info, clear_cache, configure_cache, graph_csr
from .dispatch import choose_path
from .qsv_conv import PATHS, QSVConv
from .qsv_kernel import qsv_attend
from .quat_sources import QUAT_SOURCE_ALIASES, QUAT_SOURCES, QUAT_SOURCES_OF
from .reference import qsv_conv_reference

__all__ = ["QSVConv", "qsv_attend", "GraphCSR", "graph_csr", "cache_info", "clear_cache",
           "configure_cache", "PATHS", "choose_path", "QUAT_SOURCES", "QUAT_SOURCE_ALIASES",
           "QUAT_SOURCES_OF", "unit_quaternion", "qsv_conv_reference"]
