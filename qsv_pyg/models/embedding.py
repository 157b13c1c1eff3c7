"""Patch embedding of an image onto the outer level of a node hierarchy."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class LambertPatchEmbedding(nn.Module):
    r"""Embed a small image patch around every outer node's image location.

    Each node ``i`` has a location ``c_i`` in the image, in ``F.grid_sample``'s
    normalised convention (``x`` then ``y``, both in ``[-1, 1]``). For shells this
    is the Lambert equal-area image of the node's direction, so nodes spread
    uniformly over the sphere also sample the image uniformly. The node reads a
    ``p × p`` grid of points spaced one pixel apart and centred at ``c_i``
    (bilinear interpolation, ``align_corners=False``, zeros outside the image),
    flattens it to ``in_ch · p²`` values and projects it linearly to ``dim``; a
    learned per-node embedding is added (the node's identity, as a position
    embedding in a ViT).

    Args:
        image_coords: ``[N0, 2]`` sample centres in ``[-1, 1]``.
        patch_size: ``p``, the side of the sampled patch in pixels.
        image_size: side of the (square) input images in pixels; sets the pixel
            spacing ``2 / image_size`` of the sample points.
        in_ch: image channels.
        dim: output feature size.
        padding_mode: ``F.grid_sample`` padding for points outside the image.

    Shapes:
        - **input:** images ``[B, in_ch, image_size, image_size]``
        - **output:** ``[B, N0, dim]``
    """

    def __init__(self, image_coords: Tensor, patch_size: int = 4, image_size: int = 32,
                 in_ch: int = 3, dim: int = 64, padding_mode: str = "zeros"):
        super().__init__()
        if image_coords.dim() != 2 or image_coords.size(1) != 2:
            raise ValueError(f"image_coords must have shape [N0, 2], got "
                             f"{tuple(image_coords.shape)}")
        if patch_size < 1 or image_size < 1 or in_ch < 1 or dim < 1:
            raise ValueError("patch_size, image_size, in_ch and dim must be positive")
        self.num_nodes = image_coords.size(0)
        self.patch_size = patch_size
        self.image_size = image_size
        self.in_ch = in_ch
        self.dim = dim
        self.padding_mode = padding_mode

        # Pixel-spaced offsets: with align_corners=False one pixel is 2 / image_size
        # in normalised coordinates. (p - 1) / 2 centres the patch on the node.
        step = 2.0 / image_size
        ticks = (torch.arange(patch_size, dtype=torch.float32) - (patch_size - 1) / 2) * step
        dy, dx = torch.meshgrid(ticks, ticks, indexing="ij")
        offsets = torch.stack([dx, dy], dim=-1).reshape(1, patch_size * patch_size, 2)
        grid = image_coords.detach().to(torch.float32).unsqueeze(1) + offsets  # [N0, p*p, 2]
        self.register_buffer("offsets", offsets)
        self.register_buffer("grid", grid)

        self.proj = nn.Linear(in_ch * patch_size * patch_size, dim)
        self.node_embed = nn.Parameter(torch.empty(self.num_nodes, dim))
        nn.init.trunc_normal_(self.node_embed, std=0.02)

    def forward(self, images: Tensor) -> Tensor:
        if images.dim() != 4 or images.size(1) != self.in_ch:
            raise ValueError(f"expected images [B, {self.in_ch}, H, W], got "
                             f"{tuple(images.shape)}")
        if images.shape[-2:] != (self.image_size, self.image_size):
            raise ValueError(f"the patch offsets are spaced for {self.image_size}x"
                             f"{self.image_size} images, got {tuple(images.shape[-2:])}")
        B = images.size(0)
        # One grid_sample call for the whole batch: [B, N0, p*p, 2] -> [B, C, N0, p*p].
        grid = self.grid.to(images.dtype).unsqueeze(0).expand(B, -1, -1, -1)
        patches = F.grid_sample(images, grid, mode="bilinear",
                                padding_mode=self.padding_mode, align_corners=False)
        patches = patches.permute(0, 2, 1, 3).reshape(B, self.num_nodes, -1)
        return self.proj(patches) + self.node_embed

    def extra_repr(self) -> str:
        return (f"num_nodes={self.num_nodes}, patch_size={self.patch_size}, "
                f"image_size={self.image_size}, in_ch={self.in_ch}, dim={self.dim}")
