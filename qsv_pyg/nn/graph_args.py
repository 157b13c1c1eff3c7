"""Graph arguments of :class:`~qsv_pyg.nn.QSVConv`: target count, self-loops,
and the offset copies a batch needs on the message-passing path."""
from __future__ import annotations

from typing import Tuple

import torch
from torch import Tensor
from torch_geometric.typing import Adj, OptTensor, Size, SparseTensor
from torch_geometric.utils import add_self_loops, is_torch_sparse_tensor, remove_self_loops


def num_targets(x_src: Tensor, x_dst: OptTensor, quat, edge_index: Adj, size: Size) -> int:
    """The number of target nodes implied by the call's arguments."""
    if size is not None:
        return int(size[1])
    if isinstance(edge_index, SparseTensor):
        return int(edge_index.size(0))
    if isinstance(edge_index, Tensor) and is_torch_sparse_tensor(edge_index):
        return int(edge_index.size(0))
    if x_dst is not None:
        return x_dst.size(-2)
    if isinstance(quat, (tuple, list)) and quat[1] is not None:
        return quat[1].size(-3) if quat[1].dim() >= 3 else quat[1].size(0)
    return x_src.size(-2)


def with_self_loops(edge_index: Adj, x_src: Tensor, x_dst: OptTensor, size: Size) -> Adj:
    """``edge_index`` with one self-loop per node present on both sides (as in
    GATConv); existing self-loops are replaced."""
    if isinstance(edge_index, SparseTensor):
        from torch_geometric.typing import torch_sparse
        return torch_sparse.set_diag(edge_index)
    if is_torch_sparse_tensor(edge_index):
        raise ValueError("add_self_loops=True is not supported for torch.sparse "
                         "adjacencies; add the diagonal before calling QSVConv")
    num_nodes = x_src.size(-2)
    if x_dst is not None:
        num_nodes = min(num_nodes, x_dst.size(-2))
    if size is not None:
        num_nodes = min(size)
    edge_index, _ = remove_self_loops(edge_index)
    edge_index, _ = add_self_loops(edge_index, num_nodes=num_nodes)
    return edge_index


def batch_edge_index(edge_index: Tensor, batch: int, num_src: int, num_dst: int) -> Tensor:
    """``batch`` copies of ``edge_index``, copy ``b`` offset by ``(b * num_src,
    b * num_dst)``, concatenated in batch order: ``[2, batch * E]``."""
    if type(edge_index) is not Tensor:  # EdgeIndex; as_subclass breaks compile
        edge_index = edge_index.as_subclass(Tensor)
    # From arange and Python scalars only: a tensor built from host data would be a
    # host-to-device copy (a sync on CUDA) on every call.
    b = torch.arange(batch, device=edge_index.device)
    offsets = torch.stack([b * num_src, b * num_dst], dim=1).view(batch, 2, 1)
    return (edge_index.unsqueeze(0) + offsets).transpose(0, 1).reshape(2, -1)


def batched_propagate(conv, v: Tensor, q_src: Tensor, q_dst: OptTensor,
                      pos: Tuple[OptTensor, OptTensor], edge_index: Adj,
                      num_dst: int) -> Tuple[Tensor, Tensor]:
    """``conv``'s message passing for a ``[B, N, H, C]`` batch (``v``, rotated):
    ``B`` offset copies of the graph. Returns ``z [B, N_dst, H, C]`` and alpha."""
    if not isinstance(edge_index, Tensor) or is_torch_sparse_tensor(edge_index):
        raise ValueError("batched [B, N, C] inputs need a plain [2, E] edge_index")
    B, num_src = v.size(0), v.size(1)
    flat_index = batch_edge_index(edge_index, B, num_src, num_dst)

    def flat(t: OptTensor) -> OptTensor:  # per item [B, n, H, 4] or shared [n, *]
        if t is None:
            return None
        t = t if t.dim() == 4 else t.unsqueeze(0).expand(B, *t.shape)
        return t.reshape(-1, *t.shape[2:])

    size = (B * num_src, B * num_dst)
    alpha = conv.edge_updater(flat_index, q=(flat(q_src), flat(q_dst)),
                              pos=(flat(pos[0]), flat(pos[1])), size=size)
    z = conv.propagate(flat_index, x=(v.reshape(B * num_src, *v.shape[2:]), None),
                       alpha=alpha, size=size)
    return z.view(B, num_dst, *z.shape[1:]), alpha.view(B, -1, conv.heads)
