"""Common interface shared by every image classifier in :mod:`qsv_pyg.models`.

The training loop, the optimiser factory and the benchmarks only talk to models
through :class:`ImageClassifier`, so a baseline CNN and a quaternion graph
attention network are interchangeable::

    logits = model(images)                       # [B, 3, H, W] -> [B, C]
    loss = F.cross_entropy(logits, labels) + model.auxiliary_loss()
    opt = build_optimizer(model, lr=1e-3, weight_decay=5e-2)   # uses sphere_parameters()
"""
from __future__ import annotations

from typing import Dict, List

import torch
from torch import Tensor, nn


def format_count(n: int) -> str:
    """Format a parameter count in millions with three decimals, e.g. ``"0.272M"``."""
    return f"{n / 1e6:.3f}M"


class ImageClassifier(nn.Module):
    """Mixin base class fixing the model interface used across the project.

    Subclasses implement :meth:`forward` and override the hooks they need:

    * :meth:`auxiliary_loss` for regularisers that are added to the task loss,
    * :meth:`betas` to expose routing temperatures for logging,
    * :meth:`sphere_parameters` to declare parameters living on the unit
      sphere S³ (unit quaternions). The optimiser keeps exactly these on the
      sphere and never applies weight decay to them.

    No ``__init__`` is defined: subclasses call ``super().__init__()`` exactly as
    for a plain :class:`torch.nn.Module`.
    """

    def forward(self, images: Tensor) -> Tensor:
        """Classify a batch of images.

        Args:
            images: float tensor of shape ``[B, 3, H, W]``.

        Returns:
            Logits of shape ``[B, num_classes]``.
        """
        raise NotImplementedError(f"{type(self).__name__} must implement forward(images)")

    def _reference_tensor(self) -> Tensor | None:
        """First floating parameter or buffer, used to pick device and dtype."""
        for t in self.parameters():
            if t.is_floating_point():
                return t
        for t in self.buffers():
            if t.is_floating_point():
                return t
        return None

    def auxiliary_loss(self) -> Tensor:
        """Extra loss term added to the task loss (regularisers).

        Returns:
            A scalar tensor. The default is ``0`` on the model's device and in
            its floating dtype, so ``loss + model.auxiliary_loss()`` never moves
            data between devices or promotes dtypes.
        """
        ref = self._reference_tensor()
        if ref is None:
            return torch.zeros(())
        return torch.zeros((), device=ref.device, dtype=ref.dtype)

    def betas(self) -> Dict[str, Tensor]:
        """Routing temperatures by name, each a per-head tensor ``[num_heads]``.

        Models without attention routing return an empty dict.
        """
        return {}

    def sphere_parameters(self) -> List[nn.Parameter]:
        """Parameters constrained to the unit sphere S³, normalised along the last dim.

        Each returned parameter must be a registered attribute of some submodule
        (not only a reference held in a Python list): the Riemannian optimiser
        backend may replace it in place by a ``geoopt.ManifoldParameter`` and then
        calls this method again to find the new object.
        """
        return []

    def num_parameters(self, trainable_only: bool = False) -> int:
        """Number of scalar parameters (shared parameters counted once).

        Args:
            trainable_only: count only parameters with ``requires_grad=True``.
        """
        return sum(p.numel() for p in self.parameters() if p.requires_grad or not trainable_only)

    def summary(self) -> str:
        """One-line description, e.g. ``"ResNet20: 0.270M parameters (269,722)"``."""
        n = self.num_parameters()
        text = f"{type(self).__name__}: {format_count(n)} parameters ({n:,})"
        sphere = self.sphere_parameters()
        if sphere:
            n_sphere = sum(p.numel() for p in sphere)
            text += f", {n_sphere:,} on S^3 in {len(sphere)} tensor(s)"
        return text
