"""Ready-made GNN models built from :class:`~qsv_pyg.nn.QSVConv`."""
from .qsv import MODEL_QUAT_SOURCES, QSV

__all__ = ["QSV", "MODEL_QUAT_SOURCES"]
