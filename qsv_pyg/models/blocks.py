"""Residual graph blocks shared by QSV and its attention controls.

QSV and the controls differ only in the graph convolution that :func:`make_conv`
returns; everything else (normalisation, residuals, MLPs, width changes and the
graphs themselves) is this module's, so a comparison isolates the conv.
"""
from __future__ import annotations

from typing import Optional, Tuple, Union

from torch import Tensor, nn
from torch_geometric.nn import GATConv, GATv2Conv, TransformerConv

from ..nn import QSVConv
from ..nn.graph_cache import cached_batch_edge_index

CONV_KINDS = ("qsv", "gat", "gatv2", "transformer")

PairOrTensor = Union[Tensor, Tuple[Optional[Tensor], Optional[Tensor]], None]


def make_conv(kind: str, in_ch_src: int, in_ch_dst: Optional[int], width: int,
              heads: int, **qsv_kwargs) -> nn.Module:
    """Build a graph convolution with ``heads`` concatenated heads of ``width // heads``.

    Args:
        kind: ``"qsv"`` (:class:`~qsv_pyg.nn.QSVConv`), ``"gat"``, ``"gatv2"`` or
            ``"transformer"`` (PyG's ``GATConv``, ``GATv2Conv``, ``TransformerConv``).
        in_ch_src: source feature size.
        in_ch_dst: target feature size for a bipartite graph (two node sets), or
            ``None`` when sources and targets are the same nodes (the convs then
            share their source/target maps where they have that option).
        width: output feature size (``heads`` must divide it).
        heads: number of attention heads.
        **qsv_kwargs: extra :class:`QSVConv` arguments (``routing``, ``transport``,
            ``quat_source``, ``beta_init``, ...); only accepted for ``"qsv"``.

    Returns:
        The conv; self-loops are never added, so every conv sees exactly the
        edges it is given.
    """
    if kind not in CONV_KINDS:
        raise ValueError(f"conv={kind!r} is not supported; choose one of {CONV_KINDS}")
    if width % heads != 0:
        raise ValueError(f"width={width} must be divisible by heads={heads}")
    if kind != "qsv" and qsv_kwargs:
        raise TypeError(f"{sorted(qsv_kwargs)} are QSVConv arguments; conv={kind!r} "
                        f"does not take them")
    in_channels = in_ch_src if in_ch_dst is None else (in_ch_src, in_ch_dst)
    out = width // heads
    if kind == "qsv":
        return QSVConv(in_channels, out, heads=heads, concat=True, add_self_loops=False,
                       **qsv_kwargs)
    if kind == "gat":
        return GATConv(in_channels, out, heads=heads, concat=True, add_self_loops=False)
    if kind == "gatv2":
        return GATv2Conv(in_channels, out, heads=heads, concat=True, add_self_loops=False)
    return TransformerConv(in_channels, out, heads=heads, concat=True)


class GraphConvAdapter(nn.Module):
    """Run a graph conv on batched features ``[B, N, C]`` over one fixed graph.

    :class:`QSVConv` takes the 3-D tensors directly (its batched static-graph
    mode: the quaternion field and the routing are shared by the batch). PyG's
    convs take 2-D features, so the batch is flattened to ``[B * N, C]`` and the
    graph replicated ``B`` times with per-copy offsets; the replicated
    ``edge_index`` is the graph cache's (:func:`qsv_pyg.nn.graph_cache.cached_batch_edge_index`),
    built once per graph and batch size, not every step. Both paths therefore
    see exactly the same edges.

    Args:
        conv: a conv built by :func:`make_conv`.

    Shapes:
        - **input:** ``x_src [B, N_src, C_src]``, ``x_dst [B, N_dst, C_dst]`` or
          ``None`` (one node set), ``edge_index [2, E]`` over the ``N`` nodes
          (sources in ``[0, N_src)``, targets in ``[0, N_dst)``).
        - **output:** ``[B, N_dst, width]``.
    """

    def __init__(self, conv: nn.Module):
        super().__init__()
        self.conv = conv
        self.is_qsv = isinstance(conv, QSVConv)

    def flat_edge_index(self, edge_index: Tensor, batch_size: int, num_src: int,
                        num_dst: int) -> Tensor:
        """``edge_index`` replicated ``batch_size`` times for flattened features.

        Copy ``b`` has its sources shifted by ``b * num_src`` and its targets by
        ``b * num_dst``; copies are concatenated in batch order.

        Returns:
            Long tensor ``[2, batch_size * E]`` on ``edge_index``'s device (cached).
        """
        return cached_batch_edge_index(edge_index, batch_size, num_src, num_dst)

    def forward(self, x_src: Tensor, x_dst: Optional[Tensor], edge_index: Tensor,
                quat: PairOrTensor = None, pos: PairOrTensor = None) -> Tensor:
        if x_src.dim() != 3 or (x_dst is not None and x_dst.dim() != 3):
            raise ValueError("GraphConvAdapter expects features of shape [B, N, C]")
        x = x_src if x_dst is None else (x_src, x_dst)
        if self.is_qsv:
            return self.conv(x, edge_index, quat=quat, pos=pos)
        if quat is not None or pos is not None:
            raise ValueError(f"{type(self.conv).__name__} takes no quaternions or "
                             f"positions; they are QSV-only inputs")
        B, num_src = x_src.shape[:2]
        num_dst = num_src if x_dst is None else x_dst.size(1)
        flat_index = self.flat_edge_index(edge_index, B, num_src, num_dst)
        flat_src = x_src.reshape(B * num_src, -1)
        if x_dst is None:
            out = self.conv(flat_src, flat_index)
        else:
            out = self.conv((flat_src, x_dst.reshape(B * num_dst, -1)), flat_index)
        return out.view(B, num_dst, -1)


class MLP(nn.Sequential):
    """``Linear(d, r·d) → GELU → Linear(r·d, d)``."""

    def __init__(self, dim: int, ratio: float = 2.0):
        hidden = max(1, int(round(dim * ratio)))
        super().__init__(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))


def mlp_branch(dim: int, ratio: float) -> Tuple[Optional[nn.LayerNorm], Optional[MLP]]:
    """The ``(LayerNorm, MLP)`` of a block's MLP branch, or ``(None, None)`` when
    ``ratio == 0`` (no MLP: the block is its conv and residual only)."""
    if ratio == 0:
        return None, None
    return nn.LayerNorm(dim), MLP(dim, ratio)


def add_mlp(x: Tensor, norm: Optional[nn.LayerNorm], mlp: Optional[MLP]) -> Tensor:
    """``x + MLP(LN(x))``, or ``x`` for a block without an MLP."""
    if norm is None or mlp is None:
        return x
    return x + mlp(norm(x))


class CrossBlock(nn.Module):
    r"""Pre-norm residual block from one level (sources) to the next (targets).

    .. math::
        s &= \mathrm{Proj}(\mathrm{LN}(x_{src})), \qquad
        x_{dst} \leftarrow x_{dst} + \mathrm{Conv}(s, \mathrm{LN}(x_{dst})),\\
        x_{dst} &\leftarrow x_{dst} + \mathrm{MLP}(\mathrm{LN}(x_{dst})),

    where ``Proj`` is a ``Linear`` when the source width differs from the target
    width (else the identity), so the conv always maps ``width → width``.

    Args:
        kind: conv kind, see :func:`make_conv`.
        in_src: source (previous level) width.
        width: target level width.
        heads: attention heads.
        mlp_ratio: hidden size of the MLP relative to ``width`` (``0``: no MLP).
        **qsv_kwargs: forwarded to :class:`QSVConv` (``kind="qsv"`` only).

    Shapes:
        - **input:** ``x_src [B, N_src, in_src]``, ``x_dst [B, N_dst, width]``,
          ``edge_index [2, E]`` (sources index level ``s``, targets level ``s+1``)
        - **output:** ``[B, N_dst, width]``
    """

    def __init__(self, kind: str, in_src: int, width: int, heads: int,
                 mlp_ratio: float = 2.0, **qsv_kwargs):
        super().__init__()
        self.norm_src = nn.LayerNorm(in_src)
        self.proj = nn.Linear(in_src, width) if in_src != width else nn.Identity()
        self.norm_dst = nn.LayerNorm(width)
        self.conv = GraphConvAdapter(make_conv(kind, width, width, width, heads, **qsv_kwargs))
        self.norm_mlp, self.mlp = mlp_branch(width, mlp_ratio)

    def forward(self, x_src: Tensor, x_dst: Tensor, edge_index: Tensor,
                quat: PairOrTensor = None, pos: PairOrTensor = None) -> Tensor:
        src = self.proj(self.norm_src(x_src))
        x_dst = x_dst + self.conv(src, self.norm_dst(x_dst), edge_index, quat=quat, pos=pos)
        return add_mlp(x_dst, self.norm_mlp, self.mlp)


class WithinBlock(nn.Module):
    r"""Pre-norm residual block on one level's graph.

    .. math::
        x \leftarrow x + \mathrm{Conv}(\mathrm{LN}(x)), \qquad
        x \leftarrow x + \mathrm{MLP}(\mathrm{LN}(x)).

    Args:
        kind: conv kind, see :func:`make_conv`.
        width: feature size.
        heads: attention heads.
        mlp_ratio: hidden size of the MLP relative to ``width`` (``0``: no MLP).
        **qsv_kwargs: forwarded to :class:`QSVConv` (``kind="qsv"`` only).

    Shapes:
        - **input:** ``x [B, N, width]``, ``edge_index [2, E]`` within the level
        - **output:** ``[B, N, width]``
    """

    def __init__(self, kind: str, width: int, heads: int, mlp_ratio: float = 2.0,
                 **qsv_kwargs):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.conv = GraphConvAdapter(make_conv(kind, width, None, width, heads, **qsv_kwargs))
        self.norm_mlp, self.mlp = mlp_branch(width, mlp_ratio)

    def forward(self, x: Tensor, edge_index: Tensor, quat: Optional[Tensor] = None,
                pos: Optional[Tensor] = None) -> Tensor:
        x = x + self.conv(self.norm(x), None, edge_index, quat=quat, pos=pos)
        return add_mlp(x, self.norm_mlp, self.mlp)
