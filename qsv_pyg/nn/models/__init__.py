"""Ready-made GNN models built from :class:`~qsv_pyg.nn.QSVConv`."""
from .qsv import MODEL_QUAT_SOURCES, QSV
from .qsv_geometric import QSVGeometric

__all__ = ["QSV", "MODEL_QUAT_SOURCES", "QSVGeometric"]
