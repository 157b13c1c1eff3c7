"""A learned field of unit quaternions on the nodes of one graph level.

Each node carries ``heads`` unit quaternions, points of S³. QSV reads them as
the node's "orientation": the routing logit of an edge is the alignment
``<q_i, q_j>`` and the message is transported by ``q_i* ⊗ q_j``. The field is
optimised on the sphere: with geoopt it is a ``ManifoldParameter`` on
``geoopt.Sphere()`` (RiemannianAdam steps along S³), otherwise a plain
``nn.Parameter`` that the projected optimiser renormalises after each step.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from ..quaternion import normalize, random_unit_quaternion
from ..utils import import_geoopt, is_positive_int

FIELD_INITS = ("uniform", "identity")


class QuaternionField(nn.Module):
    r"""Per-node unit quaternions :math:`q_i^{(h)} \in S^3`, shape ``[N, heads, 4]``.

    Args:
        num_nodes: number of nodes ``N`` of the level.
        heads: quaternions per node (one per attention head).
        frozen: keep the initial field fixed: it is stored as a buffer (saved in
            the ``state_dict``, moved by ``.to()``, never optimised).
        init: ``"uniform"`` draws Haar-uniform rotations (normalised Gaussians);
            ``"identity"`` starts at ``(1, 0, 0, 0)`` plus Gaussian noise of
            standard deviation ``init_scale`` (then normalised).
        init_scale: noise scale of the ``"identity"`` initialisation.
        generator: optional ``torch.Generator`` for a reproducible draw.
        seed: shortcut for ``generator=torch.Generator().manual_seed(seed)``.

    Shapes:
        - **forward output:** ``[N, heads, 4]``, unit norm along the last dim.
        - **repulsion input:** neighbour indices ``[N, k]``.

    Attributes:
        backend: ``"geoopt"`` (``ManifoldParameter`` on ``geoopt.Sphere()``),
            ``"plain"`` (``nn.Parameter``) or ``"frozen"`` (buffer). Read from
            the stored tensor's type, so it stays correct when the optimiser
            factory converts a plain parameter to a ``ManifoldParameter``.
    """

    def __init__(
        self,
        num_nodes: int,
        heads: int = 1,
        frozen: bool = False,
        init: str = "uniform",
        init_scale: float = 0.1,
        generator: Optional[torch.Generator] = None,
        seed: Optional[int] = None,
    ):
        super().__init__()
        if not is_positive_int(num_nodes):
            raise ValueError(f"num_nodes must be a positive int, got {num_nodes!r}")
        if not is_positive_int(heads):
            raise ValueError(f"heads must be a positive int, got {heads!r}")
        if init not in FIELD_INITS:
            raise ValueError(f"init={init!r} is not supported; choose one of {FIELD_INITS}")
        if generator is not None and seed is not None:
            raise ValueError("pass either generator or seed, not both")
        if seed is not None:
            generator = torch.Generator().manual_seed(int(seed))
        self.num_nodes = num_nodes
        self.heads = heads
        self.frozen = frozen
        self.init = init

        if init == "uniform":
            data = random_unit_quaternion(num_nodes, heads, generator=generator)
        else:
            noise = torch.randn(num_nodes, heads, 4, generator=generator) * init_scale
            noise[..., 0] += 1.0
            data = normalize(noise)

        if frozen:
            self.register_buffer("quaternions", data)
            return
        geoopt = import_geoopt()
        if geoopt is not None:
            self.quaternions = geoopt.ManifoldParameter(data, manifold=geoopt.Sphere())
        else:
            self.quaternions = nn.Parameter(data)

    @property
    def backend(self) -> str:
        if self.frozen:
            return "frozen"
        manifold = getattr(self.quaternions, "manifold", None)
        return "geoopt" if manifold is not None else "plain"

    def forward(self) -> Tensor:
        """The normalised field ``[N, heads, 4]``.

        The optimiser keeps the stored tensor on S³; normalising again is cheap
        and makes the output exactly unit norm between steps (and for any
        optimiser that is not sphere-aware).
        """
        return normalize(self.quaternions)

    def repulsion(self, neighbors: Tensor) -> Tensor:
        r"""Mean squared alignment with nearby nodes of the same level.

        .. math::
            \mathcal{R} = \frac{1}{N k H} \sum_{i} \sum_{j \in \mathcal{N}(i)}
                \sum_h \langle q_i^{(h)}, q_j^{(h)} \rangle^2 .

        Squaring makes it sign-invariant (``q`` and ``-q`` are the same rotation).
        Minimising it spreads neighbouring quaternions apart, so that routing by
        alignment does not collapse to a constant field (where every logit is
        equal and the transport is the identity). A uniformly random field gives
        about ``1/4`` and a constant field ``1``.

        Args:
            neighbors: long tensor ``[N, k]``; row ``i`` lists the ``k`` nearest
                same-level neighbours of node ``i`` (not ``i`` itself).

        Returns:
            A scalar tensor.
        """
        if neighbors.dim() != 2 or neighbors.size(0) != self.num_nodes:
            raise ValueError(f"neighbors must have shape [{self.num_nodes}, k], got "
                             f"{tuple(neighbors.shape)}")
        q = self()
        if neighbors.size(1) == 0:
            return q.new_zeros(())
        dots = (q.unsqueeze(1) * q[neighbors]).sum(dim=-1)  # [N, k, H]
        return dots.pow(2).mean()

    def extra_repr(self) -> str:
        return (f"num_nodes={self.num_nodes}, heads={self.heads}, init={self.init}, "
                f"backend={self.backend}")
