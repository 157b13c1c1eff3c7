"""Where :class:`~qsv_pyg.nn.QSVConv`'s node quaternions come from.

``quat_source`` picks a given field (``quat``), a learned linear map of the
features, or their composition; this mixin resolves it to unit quaternions
``[N, H, 4]`` (or ``[B, N, H, 4]`` per batch item) for sources and targets.
"""
from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
from torch import Tensor
from torch.nn.parameter import UninitializedParameter
from torch_geometric import is_compiling
from torch_geometric.nn.dense.linear import Linear
from torch_geometric.typing import OptTensor

from ..quaternion import hamilton_product
from .inputs import check_finite, check_float, unit_quaternion

QUAT_SOURCES = ("auto", "features", "given", "composed")


class NodeQuaternions:
    """Mixin of :class:`QSVConv` (uses ``heads``, ``quat_source``,
    ``check_finite`` and the ``lin_quat*`` maps)."""

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
        return lin(x).view(*x.shape[:-1], self.heads, 4)

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

    def _node_quaternions(
        self,
        x_src: Tensor,
        x_dst: Optional[Tensor],
        quat: Union[Tensor, Tuple[OptTensor, OptTensor], None],
        num_dst: int,
    ) -> Tuple[Tensor, Optional[Tensor]]:
        """Unit quaternions ``[N_src, H, 4]`` and ``[N_dst, H, 4]`` (or None)."""
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
        if self.check_finite and not is_compiling():
            check_finite(src_q, "source quaternions")
            check_finite(dst_q, "target quaternions")
        unit_src = unit_quaternion(src_q)
        if dst_q is None:
            return unit_src, None
        if dst_q is src_q:
            return unit_src, unit_src
        return unit_src, unit_quaternion(dst_q)
