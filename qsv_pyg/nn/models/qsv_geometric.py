r"""``QSVGeometric``: a rotation-invariant point-cloud classifier and encoder
built from :class:`~qsv_pyg.nn.QSVConv` layers on local frames."""
from __future__ import annotations

import numbers
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor
from torch_geometric.nn import MLP, global_max_pool, global_mean_pool

from qsv_pyg.geometry.frames import FRAME_RULES, matrix_to_quaternion, oriented_frames
from qsv_pyg.transforms.functional import (
    EDGE_FEATURES,
    NODE_FEATURES,
    farthest_point_sampling,
    invariant_node_features,
    knn_bipartite,
    knn_graph,
    point_pair_features,
)

from ..qsv_conv import QSVConv

__all__ = ["QSVGeometric", "GEOMETRIC_ROUTINGS", "DEFAULT_HIERARCHY"]

#: Routings that keep the model invariant: ``"abs"`` (learned temperature times
#: :math:`|\mathrm{Re}\, r_{ij}|`, a function of the relative rotation only),
#: ``"uniform"`` (mean over the neighbours) and ``"geometric"``
#: (:math:`-\beta\lVert\mathbf{p}_i - \mathbf{p}_j\rVert^2`). ``"learned"``
#: reads the sign of :math:`\mathrm{Re}\, r_{ij}`, which a frame's quaternion
#: does not fix, so it is refused.
GEOMETRIC_ROUTINGS = ("abs", "uniform", "geometric")
#: ``hierarchy=True``: RIConv++'s levels, as fractions of the input points kept
#: (farthest point sampling) and the neighbours each kept point aggregates:
#: 512 -> 256 -> 128 points with k = 8 -> 16 -> 32 for a 512-point input.
DEFAULT_HIERARCHY: Tuple[Tuple[float, int], ...] = ((1.0, 8), (0.5, 16), (0.25, 32))


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"QSVGeometric: {name} must be a positive integer, got {value!r}")
    return int(value)


class QSVGeometric(torch.nn.Module):
    r"""Rotation- and translation-invariant point-cloud network of
    :class:`~qsv_pyg.nn.QSVConv` layers whose node quaternions are the points'
    local frames.

    Every point :math:`i` gets a frame :math:`R_i` from its :obj:`k` nearest
    neighbours (:func:`~qsv_pyg.geometry.oriented_frames`: rotating the cloud
    by :math:`G` turns it into :math:`G R_i`) and invariant features
    (:func:`~qsv_pyg.transforms.functional.invariant_node_features`). A layer
    aggregates over the kNN edges :math:`j \to i` with the relative rotation
    :math:`r_{ij} = q_i^* \otimes q_j` of the frames' quaternions, which is
    invariant: it routes (``routing="abs"``: :math:`\beta |\mathrm{Re}\,
    r_{ij}|`) and transports (``transport="sandwich"``: each block of four
    channels of :math:`\mathbf{x}_j`, read as a scalar and a vector in
    :math:`j`'s frame, is rotated into :math:`i`'s frame: :math:`R_i^\top R_j`).
    Because every hidden feature is an invariant (written in the node's own
    frame), and :math:`R_i^\top R_j` is too, every layer's output is invariant;
    the point-pair features of each edge
    (:func:`~qsv_pyg.transforms.functional.point_pair_features`) enter the
    attention logits through QSVConv's ``edge_dim`` and, embedded, the messages
    in the target's frame (``edge_message="target"``). Max- and mean-pooling per
    cloud of every layer's output feed an MLP head.

    Nodes whose frame is ambiguous (no equivariant frame exists: symmetric
    neighbourhoods, collinear points, a cloud of duplicates, see
    :func:`~qsv_pyg.geometry.oriented_frames`) keep the output invariant by
    not using their frames: their frame-dependent features are zero, and the
    edges into and out of them are left out of the frame-transported
    aggregation (such a node is updated from its own features, through the
    layers' root weight, and is pooled like any other).

    The model computes its graphs and frames itself from ``pos`` and
    ``batch``. A batch prepared by :class:`qsv_pyg.transforms.KNNGraph` and
    :class:`qsv_pyg.transforms.LocalFrames` (``edge_index``, ``frame``,
    ``frame_ambiguous``, ``frame_eigenvalues``) is used as it is: call
    ``model(data)`` (the frames then define the features; the kNN graph is the
    layers' graph without hierarchy). The node and edge features are always
    derived inside (cheap), so their layout matches the model's switches.

    Args:
        out_channels (int): Output size (classes, or an embedding size).
        hidden_channels (int, optional): Width of every layer; a multiple of
            ``4 * heads`` (whole quaternion blocks per head). The default is the
            width that validation chose on ModelNet10 (docs/real_benchmarks.md,
            "The width lever"); 64 costs about 0.7x the time per step.
            (default: :obj:`128`)
        heads (int, optional): Attention heads per layer (all read the frame's
            quaternion). (default: :obj:`4`)
        num_layers (int, optional): Layers without hierarchy (default: 3); with
            one, the number of levels (it must match if given).
        k (int, optional): Neighbours of the frames' neighbourhoods and (without
            hierarchy) of the layers' kNN graph. (default: :obj:`20`)
        hierarchy (bool or sequence, optional): :obj:`None`/:obj:`False`: every
            layer on the full cloud. :obj:`True`: :data:`DEFAULT_HIERARCHY`. A
            sequence of ``(fraction, k_level)``: layer :math:`s` runs from level
            :math:`s-1`'s points (the input for :math:`s = 0`) to the fraction
            of the input that tie-robust farthest point sampling
            (:func:`~qsv_pyg.transforms.functional.farthest_point_sampling`)
            keeps, each kept point aggregating its ``k_level`` nearest
            points of level :math:`s-1` (fractions non-increasing, in
            :math:`(0, 1]`). Kept points keep their frames. (default: :obj:`None`)
        pair_features (bool, optional): Feed the point-pair features as edge
            features (QSVConv's ``edge_dim``). (default: :obj:`True`)
        edge_message (bool or str, optional): Also add the edge features into
            the messages (QSVConv's ``edge_message``): ``"target"`` (embedded and
            added in the target's frame after the transport; about 1.13x the
            time per step), :obj:`True` or ``"source"`` (embedded in the
            source's frame and transported with it; about 11x), or
            :obj:`False`. :obj:`None`: ``"target"`` with ``pair_features``, off
            without, the choice of validation on ModelNet10
            (docs/real_benchmarks.md, "The edge-message lever").
            (default: :obj:`None`)
        source_logit (bool, optional): Add GAT's per-source score
            :math:`\mathbf{a}_h^\top \mathbf{x}_j` to the logits (QSVConv's
            ``source_logit``). (default: :obj:`False`)
        transport (str, optional): ``"sandwich"`` (the frames' relative
            rotations) or ``"identity"`` (ablation). (default: :obj:`"sandwich"`)
        routing (str, optional): One of :data:`GEOMETRIC_ROUTINGS`.
            (default: :obj:`"abs"`)
        frame_rule (str, optional): One of :data:`~qsv_pyg.geometry.FRAME_RULES`;
            only ``"robust"`` marks ambiguous nodes (the others are for
            ablations and are not invariant on flat or symmetric shapes).
            (default: :obj:`"robust"`)
        frame_tol (float, optional): The rule's relative tolerance.
            (default: :obj:`1e-6`)
        dropout (float, optional): Dropout of the head MLP. (default: :obj:`0.5`)

    Shapes:
        - **input:** positions :math:`(|\mathcal{V}|, 3)`, batch vector
          :math:`(|\mathcal{V}|)` (optional: one cloud), or a
          :class:`~torch_geometric.data.Data`/``Batch`` with ``pos`` (and
          ``batch``)
        - **output:** :math:`(\text{num\_clouds}, \text{out\_channels})`
    """

    def __init__(
        self,
        out_channels: int,
        hidden_channels: int = 128,
        heads: int = 4,
        num_layers: Optional[int] = None,
        k: int = 20,
        hierarchy: Union[bool, Sequence[Tuple[float, int]], None] = None,
        pair_features: bool = True,
        edge_message: Union[bool, str, None] = None,
        source_logit: bool = False,
        transport: str = "sandwich",
        routing: str = "abs",
        frame_rule: str = "robust",
        frame_tol: float = 1e-6,
        dropout: float = 0.5,
    ) -> None:
        super().__init__()
        self.out_channels = _positive_int("out_channels", out_channels)
        self.hidden_channels = _positive_int("hidden_channels", hidden_channels)
        self.heads = _positive_int("heads", heads)
        if hidden_channels % (4 * heads) != 0:
            raise ValueError(f"QSVGeometric: hidden_channels={hidden_channels} must be a "
                             f"multiple of 4 * heads = {4 * heads} (whole quaternion "
                             f"blocks per head)")
        self.k = _positive_int("k", k)
        if hierarchy is True:
            hierarchy = DEFAULT_HIERARCHY
        if hierarchy is False:
            hierarchy = None
        if hierarchy is not None:
            levels = []
            last = 1.0
            for s, level in enumerate(hierarchy):
                try:
                    fraction, k_level = level
                except (TypeError, ValueError):
                    raise ValueError(f"QSVGeometric: hierarchy[{s}] must be a pair "
                                     f"(fraction, k), got {level!r}") from None
                if not (isinstance(fraction, numbers.Real) and 0 < fraction <= last):
                    raise ValueError(f"QSVGeometric: hierarchy[{s}] fraction {fraction!r} "
                                     f"must be in (0, {last}] (non-increasing)")
                levels.append((float(fraction), _positive_int(f"hierarchy[{s}] k", k_level)))
                last = float(fraction)
            if not levels:
                raise ValueError("QSVGeometric: hierarchy needs at least one level")
            hierarchy = tuple(levels)
            if num_layers is not None and num_layers != len(hierarchy):
                raise ValueError(f"QSVGeometric: num_layers={num_layers} but the hierarchy "
                                 f"has {len(hierarchy)} levels (one layer per level)")
            num_layers = len(hierarchy)
        self.hierarchy = hierarchy
        self.num_layers = _positive_int("num_layers", 3 if num_layers is None else num_layers)
        if routing not in GEOMETRIC_ROUTINGS:
            raise ValueError(f"QSVGeometric: routing={routing!r} is not one of "
                             f"{GEOMETRIC_ROUTINGS} (\"learned\" reads the quaternions' "
                             f"signs and would not be invariant)")
        if frame_rule not in FRAME_RULES:
            raise ValueError(f"QSVGeometric: frame_rule={frame_rule!r} is not one of "
                             f"{FRAME_RULES}")
        if edge_message is None:
            edge_message = "target" if pair_features else False
        if edge_message and not pair_features:
            raise ValueError(f"QSVGeometric: edge_message={edge_message!r} needs "
                             f"pair_features=True")
        self.pair_features = pair_features
        self.edge_message = edge_message
        self.source_logit = source_logit
        self.transport = transport
        self.routing = routing
        self.frame_rule = frame_rule
        self.frame_tol = float(frame_tol)
        self.dropout = float(dropout)

        h = hidden_channels
        self.lin_in = torch.nn.Linear(len(NODE_FEATURES), h)
        conv_kw: Dict[str, Any] = dict(heads=heads, routing=routing, transport=transport,
                                       quat_source="given", source_logit=source_logit)
        if pair_features:
            conv_kw["edge_dim"] = len(EDGE_FEATURES)
            if edge_message:
                conv_kw["edge_message"] = edge_message
        self.convs = torch.nn.ModuleList(
            [QSVConv(h, h // heads, **conv_kw) for _ in range(self.num_layers)])
        self.norms = torch.nn.ModuleList(
            [torch.nn.BatchNorm1d(h) for _ in range(self.num_layers)])
        self.act = torch.nn.LeakyReLU(0.2)
        self.head = MLP([2 * h * self.num_layers, 4 * h, 2 * h, out_channels],
                        dropout=dropout, norm="batch_norm", act="leaky_relu",
                        act_kwargs={"negative_slope": 0.2})

    def reset_parameters(self) -> None:
        self.lin_in.reset_parameters()
        for conv, norm in zip(self.convs, self.norms):
            conv.reset_parameters()
            norm.reset_parameters()
        self.head.reset_parameters()

    # ------------------------------------------------------------ geometry
    @torch.no_grad()
    def geometry(self, pos: Tensor, batch: Optional[Tensor] = None,
                 edge_index: Optional[Tensor] = None, frame: Optional[Tensor] = None,
                 frame_ambiguous: Optional[Tensor] = None,
                 frame_eigenvalues: Optional[Tensor] = None) -> List[Dict[str, Tensor]]:
        r"""The levels the layers run on (float64), computed from ``pos`` or
        taken from the given graph and frames.

        Returns:
            One dict per layer with ``src`` / ``dst`` (node indices into the
            input of the layer's sources and targets), ``edge_index`` (into
            ``src`` and ``dst``, ambiguous endpoints left out), ``edge_attr``
            (pair features), and per input node ``x`` (node features),
            ``quat``, ``pos`` (centred per cloud), ``batch``.
        """
        n = pos.size(0)
        if batch is None:
            batch = torch.zeros(n, dtype=torch.long, device=pos.device)
        batch = batch.long()
        if frame is None or frame_ambiguous is None or frame_eigenvalues is None:
            if edge_index is None:
                edge_index = knn_graph(pos, self.k, batch)
            frames = oriented_frames(pos, edge_index, batch, rule=self.frame_rule,
                                     tol=self.frame_tol)
            frame, amb, eig = frames.frame, frames.ambiguous, frames.eigenvalues
        else:
            frame, amb, eig = frame.double(), frame_ambiguous.bool(), frame_eigenvalues.double()
        if edge_index is None and self.hierarchy is None:
            edge_index = knn_graph(pos, self.k, batch)
        p = pos.detach().double()
        size = torch.zeros(int(batch.max()) + 1 if n else 0, dtype=p.dtype,
                           device=p.device).index_add_(0, batch, torch.ones_like(p[:, 0]))
        centre = torch.zeros(size.numel(), 3, dtype=p.dtype, device=p.device).index_add_(
            0, batch, p) / size.clamp_min(1)[:, None]
        p = p - centre[batch]
        common = {"x": invariant_node_features(p, frame, amb, eig, batch),
                  "quat": matrix_to_quaternion(frame), "pos": p, "batch": batch,
                  "frame": frame, "ambiguous": amb}
        all_nodes = torch.arange(n, device=pos.device)
        layers: List[Dict[str, Tensor]] = []
        if self.hierarchy is None:
            assert edge_index is not None
            layer = self._layer(common, all_nodes, all_nodes, edge_index)
            layers = [layer] * self.num_layers
        else:
            current, fraction = all_nodes, 1.0
            for frac, k_level in self.hierarchy:
                if frac == fraction:
                    kept = current
                    ei = knn_graph(p[current], k_level, batch[current])
                else:
                    sub = farthest_point_sampling(p[current], frac / fraction,
                                                  batch[current])
                    kept = current[sub]
                    ei = knn_bipartite(p[current], p[kept], k_level, batch[current],
                                       batch[kept])
                layers.append(self._layer(common, current, kept, ei))
                current, fraction = kept, frac
        return layers

    def _layer(self, common: Dict[str, Tensor], src: Tensor, dst: Tensor,
               edge_index: Tensor) -> Dict[str, Tensor]:
        amb = common["ambiguous"]
        keep = ~(amb[src][edge_index[0]] | amb[dst][edge_index[1]])
        ei = edge_index[:, keep]
        layer = {"src": src, "dst": dst, "edge_index": ei, "common": common}
        if self.pair_features:
            layer["edge_attr"] = point_pair_features(
                common["pos"][src], ei, common["frame"][src], amb[src],
                common["pos"][dst], common["frame"][dst], amb[dst])
        return layer

    # ------------------------------------------------------------- forward
    def forward(self, pos: Any, batch: Optional[Tensor] = None, *,
                edge_index: Optional[Tensor] = None, frame: Optional[Tensor] = None,
                frame_ambiguous: Optional[Tensor] = None,
                frame_eigenvalues: Optional[Tensor] = None) -> Tensor:
        r"""Logits ``[num_clouds, out_channels]``.

        Args:
            pos (Tensor or Data): Positions ``[N, 3]``, or a ``Data``/``Batch``
                with ``pos`` and optionally ``batch``, ``edge_index``,
                ``frame``, ``frame_ambiguous``, ``frame_eigenvalues`` (from
                :class:`qsv_pyg.transforms.LocalFrames`).
            batch (Tensor, optional): ``[N]`` cloud index (PyG's ``batch``).
            edge_index, frame, frame_ambiguous, frame_eigenvalues: a
                precomputed kNN graph and frames (else computed here).
        """
        if not isinstance(pos, Tensor):
            data = pos
            if getattr(data, "pos", None) is None:
                raise ValueError("QSVGeometric: the data object has no pos")
            pos = data.pos
            batch = getattr(data, "batch", None) if batch is None else batch
            edge_index = getattr(data, "edge_index", None)
            frame = getattr(data, "frame", None)
            frame_ambiguous = getattr(data, "frame_ambiguous", None)
            frame_eigenvalues = getattr(data, "frame_eigenvalues", None)
        if pos.dim() != 2 or pos.size(1) != 3 or not pos.is_floating_point():
            raise ValueError(f"QSVGeometric: pos must be a float tensor [num_points, 3], "
                             f"got {tuple(pos.shape)} {pos.dtype}")
        if pos.size(0) == 0:
            raise ValueError("QSVGeometric: pos holds no points")
        if batch is not None and (batch.dim() != 1 or batch.numel() != pos.size(0)):
            raise ValueError(f"QSVGeometric: batch must have shape [{pos.size(0)}], got "
                             f"{tuple(batch.shape)}")
        layers = self.geometry(pos, batch, edge_index, frame, frame_ambiguous,
                               frame_eigenvalues)
        common = layers[0]["common"]
        dtype = self.lin_in.weight.dtype
        num_clouds = int(common["batch"].max()) + 1
        h = self.act(self.lin_in(common["x"].to(dtype)))
        quat = common["quat"].to(dtype)
        pos_c = common["pos"].to(dtype)
        node_batch = common["batch"]
        # h lives on the nodes of `current` (indices into the input).
        current = layers[0]["src"]
        index_of = None  # position of every input node in `current`
        pooled = []
        for conv, norm, layer in zip(self.convs, self.norms, layers):
            src, dst, ei = layer["src"], layer["dst"], layer["edge_index"]
            if src is not current and not torch.equal(src, current):
                raise RuntimeError("QSVGeometric: levels out of order")
            same = dst is src or (dst.numel() == src.numel() and torch.equal(dst, src))
            kw: Dict[str, Any] = {}
            if self.pair_features:
                kw["edge_attr"] = layer["edge_attr"].to(dtype)
            if self.routing == "geometric":
                kw["pos"] = pos_c[src] if same else (pos_c[src], pos_c[dst])
            if same:
                out = conv(h, ei, quat=quat[src], **kw)
                residual = h
            else:
                if index_of is None or index_of.numel() != pos.size(0):
                    index_of = torch.full((pos.size(0),), -1, dtype=torch.long,
                                          device=pos.device)
                index_of[src] = torch.arange(src.numel(), device=pos.device)
                h_dst = h[index_of[dst]]
                out = conv((h, h_dst), ei, quat=(quat[src], quat[dst]), **kw)
                residual = h_dst
            h = self.act(norm(out)) + residual
            current = dst
            b = node_batch[dst]
            pooled += [global_max_pool(h, b, num_clouds), global_mean_pool(h, b, num_clouds)]
        return self.head(torch.cat(pooled, dim=-1))

    def __repr__(self) -> str:
        extra = f", hierarchy={self.hierarchy}" if self.hierarchy else ""
        return (f"{self.__class__.__name__}({self.out_channels}, hidden_channels="
                f"{self.hidden_channels}, heads={self.heads}, num_layers={self.num_layers}, "
                f"k={self.k}{extra}, pair_features={self.pair_features}, "
                + (f"edge_message={self.edge_message!r}, " if self.pair_features else "")
                + ("source_logit=True, " if self.source_logit else "")
                + f"transport={self.transport!r}, routing={self.routing!r}, "
                f"frame_rule={self.frame_rule!r})")
