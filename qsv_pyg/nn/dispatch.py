"""Old home of the path choice, kept for imports of ``choose_path`` and
``PATHS``: the choice is :meth:`QSVConv.choose_path
<qsv_pyg.nn.QSVConv.choose_path>` (with its reason, :meth:`QSVConv.path_reason
<qsv_pyg.nn.QSVConv.path_reason>`)."""
from .qsv_conv import PATHS, QSVConv

__all__ = ["PATHS", "choose_path"]


def choose_path(conv: QSVConv, x_src, q_src, edge_index) -> str:
    """``conv.choose_path(x_src, q_src, edge_index)``."""
    return conv.choose_path(x_src, q_src, edge_index)
