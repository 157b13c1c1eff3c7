"""The one place that chooses how :class:`~qsv_pyg.nn.QSVConv` aggregates.

:func:`choose_path` looks at the layer and its inputs and returns one of
:data:`PATHS`:

- ``"attend_shared"``: the registered operator
  :func:`~qsv_pyg.nn.qsv_kernel.qsv_attend` over the cached CSR of the graph,
  with a routing shared by every batch item (2-D input, or ``[B, N, C]`` input
  with per-node quaternions ``[N, H, 4]``): the batch rides along as extra
  channels, so the weights are computed once.
- ``"attend_per_item"``: the same operator over ``B`` disjoint copies of the
  graph, for ``[B, N, C]`` input whose routing differs per item (quaternions
  computed from the features).
- ``"message_passing"``: PyG's ``propagate`` with the literal softmax; for
  what the operator does not do (attention dropout while training, explainer
  and message hooks, ``SparseTensor``/``torch.sparse`` adjacencies) and for
  ``dense_path="never"``.

Which kernel runs the operator (C++ on CPU, PyTorch elsewhere) is the
operator's own choice (:func:`qsv_pyg.nn.qsv_kernel._ext`).
"""
from __future__ import annotations

from typing import Optional

from torch import Tensor
from torch_geometric.utils import is_torch_sparse_tensor

PATHS = ("attend_shared", "attend_per_item", "message_passing")


def choose_path(conv, x_src: Tensor, q_src: Optional[Tensor], edge_index) -> str:
    """The aggregation for one call of ``conv`` (a :class:`QSVConv`).

    Args:
        conv: the layer (its options, training mode and hooks are read).
        x_src: source features ``[N, C]`` or ``[B, N, C]``.
        q_src: the unit source quaternions (``[N, H, 4]`` shared by a batch,
            ``[B, N, H, 4]`` per item) or :obj:`None`.
        edge_index: the adjacency as passed to the layer.
    """
    if conv.dense_path == "never" or not isinstance(edge_index, Tensor) \
            or is_torch_sparse_tensor(edge_index):
        return "message_passing"
    if conv.training and conv.dropout > 0:
        return "message_passing"
    # Explainers hook into `message`; keep them on the message-passing path.
    if conv.explain or len(conv._message_forward_hooks) > 0 \
            or len(conv._edge_update_forward_hooks) > 0 \
            or len(conv._propagate_forward_hooks) > 0:
        return "message_passing"
    if x_src.dim() == 3 and q_src is not None and q_src.dim() == 4:
        return "attend_per_item"
    return "attend_shared"
