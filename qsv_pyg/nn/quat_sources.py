"""The one vocabulary of ``quat_source``: where node quaternions come from.

Every layer and model that takes a ``quat_source`` accepts a subset of
:data:`QUAT_SOURCES`, named in :data:`QUAT_SOURCES_OF`, and resolves the value
with :func:`resolve_quat_source` (old spellings of :data:`QUAT_SOURCE_ALIASES`
are read there, with a :class:`DeprecationWarning`). :class:`QuatSourceMixin` is how
:class:`~qsv_pyg.nn.QSVConv` turns its source into the unit quaternions of a call: the
feature maps it learns, the given quaternions it checks, and their composition.
"""
from __future__ import annotations

import warnings
from typing import Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.parameter import UninitializedParameter

from torch_geometric.nn.dense.linear import Linear
from torch_geometric.typing import OptTensor

from ..quaternion import hamilton_product, unit_quaternion
from .checks import check_finite, check_float

#: Every name of ``quat_source`` in the package. ``"auto"``: ``"given"`` when
#: ``quat`` is passed, else ``"features"``; ``"features"``: a learned linear
#: map of the features; ``"given"``: the ``quat`` argument; ``"field"``: a
#: learned per-node field that a model holds (its convs get it as
#: ``"given"``); ``"composed"``: the given quaternions or the field, composed
#: with the feature quaternions (``quat ⊗ q(x)``).
QUAT_SOURCES = ("auto", "features", "given", "field", "composed")
#: Old spellings, read (with a :class:`DeprecationWarning`) wherever a source is
#: given: ``"both"``, the image model's (and ``--quat-source``'s) old name of
#: ``"composed"``. (The test-time intervention that turns routing and transport
#: off is ``"both-off"``, :data:`qsv_pyg.analysis.INTERVENTIONS`.)
QUAT_SOURCE_ALIASES = {"both": "composed"}
#: The sources each layer and model accepts (subsets of :data:`QUAT_SOURCES`).
QUAT_SOURCES_OF = {
    "QSVConv": ("auto", "features", "given", "composed"),
    "QSV": ("features", "field", "given", "composed"),  # qsv_pyg.nn.models.QSV
    "GraphNet": ("field", "features", "composed"),  # qsv_pyg.models.GraphNet
}


def resolve_quat_source(value: str, owner: str) -> str:
    """The canonical name of ``value`` (an alias of :data:`QUAT_SOURCE_ALIASES`
    is read, with a :class:`DeprecationWarning`) if ``owner`` (a key of :data:`QUAT_SOURCES_OF`) accepts it;
    else a :class:`ValueError` that names the accepted sources."""
    name = value
    if isinstance(value, str) and value in QUAT_SOURCE_ALIASES:
        name = QUAT_SOURCE_ALIASES[value]
        warnings.warn(f"quat_source={value!r} is an old spelling of {name!r}",
                      DeprecationWarning, stacklevel=3)
    accepted = QUAT_SOURCES_OF[owner]
    if name not in accepted:
        raise ValueError(f"quat_source={value!r} is not supported; choose one of "
                         f"{', '.join(repr(c) for c in accepted)}")
    return name


def conv_quat_source(name: str) -> str:
    """The :class:`~qsv_pyg.nn.QSVConv` ``quat_source`` that a model's source
    ``name`` asks of its convs: a model's field reaches them as given
    quaternions (``name``: a canonical source, see :func:`resolve_quat_source`)."""
    return "given" if name == "field" else name


class QuatSourceMixin:
    """Where :class:`~qsv_pyg.nn.QSVConv`'s node quaternions come from.

    The layer sets ``heads`` and ``quat_source`` (resolved by
    :func:`resolve_quat_source`), calls :meth:`_make_quat_maps` once in its
    set-up, and :meth:`_node_quaternions` once per call (which asks the
    layer's ``_checks_finite`` whether to check the quaternions); the feature
    maps are its ``lin_quat`` (or ``lin_quat_src`` and ``lin_quat_dst``)
    submodules.
    """

    def _make_quat_maps(self, in_channels) -> None:
        """Feature -> quaternion maps (one per side for bipartite graphs, as in
        GATConv's ``lin_src``/``lin_dst``); none for ``quat_source="given"``."""
        self.lin_quat = self.lin_quat_src = self.lin_quat_dst = None
        if self.quat_source == "given":
            return
        out = self.heads * 4
        if isinstance(in_channels, int):
            self.lin_quat = Linear(in_channels, out, bias=True, weight_initializer="glorot")
        else:
            self.lin_quat_src = Linear(in_channels[0], out, bias=True,
                                       weight_initializer="glorot")
            self.lin_quat_dst = Linear(in_channels[1], out, bias=True,
                                       weight_initializer="glorot")

    def _feature_quat(self, x: Tensor, side: str) -> Tensor:
        lin = self.lin_quat
        if lin is None:
            lin = self.lin_quat_src if side == "src" else self.lin_quat_dst
        assert lin is not None
        if isinstance(lin.weight, UninitializedParameter):
            lin(x)  # PyG's lazy Linear materialises itself on its first call
            self._near_identity(lin)
        # In float32 (float64 for float64 features) whatever the features' dtype
        # and outside autocast: a bf16 quaternion is off the unit sphere by ~5e-3,
        # and the sandwich would rescale the kept channel by its squared norm.
        dt = torch.promote_types(x.dtype, torch.float32)
        with torch.autocast(x.device.type, enabled=False):
            q = F.linear(x.to(dt), lin.weight.to(dt),
                         None if lin.bias is None else lin.bias.to(dt))
        return q.view(*x.shape[:-1], self.heads, 4)

    def _near_identity(self, lin) -> None:
        """Start a feature map near the identity rotation, so the initial
        transport is mild and the normalisation well conditioned."""
        with torch.no_grad():
            lin.weight.mul_(0.5)
            lin.bias.zero_()
            lin.bias.view(self.heads, 4)[:, 0] = 1.0

    def _given_quat(self, quat: Tensor, num_nodes: int, side: str) -> Tensor:
        check_float(quat, f"{side} quaternions (quat)")
        if quat.dim() == 2 and quat.size(-1) == 4:
            quat = quat.unsqueeze(1).expand(-1, self.heads, 4)
        if quat.dim() not in (3, 4) or quat.size(-2) != self.heads or quat.size(-1) != 4:
            raise ValueError(
                f"{side} quaternions must have shape [num_nodes, heads={self.heads}, 4] "
                f"(or [num_nodes, 4] to share one across heads, or [batch, num_nodes, "
                f"heads, 4] for batched inputs); got {tuple(quat.shape)}")
        if quat.size(-3) != num_nodes:
            raise ValueError(f"{side} quaternions have {quat.size(-3)} rows but there "
                             f"are {num_nodes} {side} nodes")
        return quat

    def _node_quaternions(self, x_src: Tensor, x_dst: OptTensor,
                          quat: Union[Tensor, Tuple[OptTensor, OptTensor], None],
                          num_dst: int) -> Tuple[Tensor, OptTensor]:
        """Unit quaternions ``[N_src, H, 4]`` and ``[N_dst, H, 4]`` (or None);
        ``[B, N, H, 4]`` per batch item when they come from ``[B, N, C]``
        features."""
        src_q: OptTensor = None
        dst_q: OptTensor = None
        bipartite = x_dst is not x_src
        if quat is not None:
            if isinstance(quat, Tensor):
                src_q = dst_q = self._given_quat(quat, x_src.size(-2), "source")
                if bipartite:
                    raise ValueError("for bipartite inputs pass quat as a pair "
                                     "(quat_src, quat_dst)")
            else:
                q_s, q_d = quat
                if q_s is None:
                    raise ValueError("the source quaternions quat[0] are missing")
                src_q = self._given_quat(q_s, x_src.size(-2), "source")
                if q_d is not None:
                    dst_q = self._given_quat(q_d, num_dst, "target")
        source = self.quat_source
        if source == "auto":
            source = "features" if quat is None else "given"
        if source in ("given", "composed") and src_q is None:
            raise ValueError(f"quat_source={self.quat_source!r} needs the quat argument")
        if source == "features" and quat is not None:
            raise ValueError("quat_source='features' computes quaternions from the "
                             "features; do not pass quat (or use 'auto'/'composed')")

        if source in ("features", "composed"):
            f_src = self._feature_quat(x_src, "src")
            f_dst = f_src if not bipartite else (
                None if x_dst is None else self._feature_quat(x_dst, "dst"))
            if source == "features":
                src_q, dst_q = f_src, f_dst
            else:
                assert src_q is not None
                # Normalise the given field first, so that a zero quaternion
                # counts as the identity here too (identity ⊗ q(x) = q(x)).
                new_src = hamilton_product(unit_quaternion(src_q), unit_quaternion(f_src))
                if bipartite:
                    dst_q = None if (dst_q is None or f_dst is None) else \
                        hamilton_product(unit_quaternion(dst_q), unit_quaternion(f_dst))
                else:
                    dst_q = new_src
                src_q = new_src

        assert src_q is not None
        if self._checks_finite(src_q):
            check_finite(src_q, "source quaternions")
            check_finite(dst_q, "target quaternions")
        # Normalised in float32 (float64 for float64 input) also when given in
        # half precision or composed under autocast: the unit norm is exact to
        # float32 rounding when they reach the operator.
        unit_src = unit_quaternion(src_q.to(torch.promote_types(src_q.dtype, torch.float32)))
        if dst_q is None:
            return unit_src, None
        if dst_q is src_q:
            return unit_src, unit_src
        return unit_src, unit_quaternion(
            dst_q.to(torch.promote_types(dst_q.dtype, torch.float32)))

