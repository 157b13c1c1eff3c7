"""ResNet-20 for CIFAR (He et al., "Deep Residual Learning for Image Recognition", 2016, §4.2).

Layout: 3×3 conv (16) → three stages of 3 basic blocks with 16/32/64 channels
(stride 2 at the start of stages 2 and 3) → global average pool → linear.

Shortcut options when the shape changes between stages:

* ``"A"`` (paper's CIFAR choice, default): parameter-free identity that
  subsamples spatially and zero-pads the new channels. 269,722 parameters
  for 10 classes (≈0.27M, the figure in the paper's Table 6).
* ``"B"``: 1×1 strided conv + BN projection. 272,474 parameters (0.272M).
"""
from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from .base import ImageClassifier
from .registry import register_model

_SHORTCUTS = ("A", "B")


class PadShortcut(nn.Module):
    """Option-A shortcut: ``x[:, :, ::s, ::s]`` then zero-pad channels on both sides.

    Args:
        in_channels: channels of the input.
        out_channels: channels of the output (``>= in_channels``, even difference).
        stride: spatial subsampling factor.
    """

    def __init__(self, in_channels: int, out_channels: int, stride: int):
        super().__init__()
        if out_channels < in_channels or (out_channels - in_channels) % 2:
            raise ValueError("option-A shortcut needs out_channels >= in_channels with an even difference")
        self.stride = stride
        self.pad = (out_channels - in_channels) // 2

    def forward(self, x: Tensor) -> Tensor:
        # [B, C, H, W] -> [B, C + 2*pad, ceil(H/s), ceil(W/s)]; matches the strided 3×3 conv.
        x = x[:, :, :: self.stride, :: self.stride]
        return F.pad(x, (0, 0, 0, 0, self.pad, self.pad))


class BasicBlock(nn.Module):
    """Two 3×3 conv-BN layers with a residual connection (post-activation, as in the paper).

    Args:
        in_channels: input channels.
        out_channels: output channels.
        stride: stride of the first conv (2 at a stage transition, else 1).
        shortcut: ``"A"`` or ``"B"``, used only when the shape changes.
    """

    def __init__(self, in_channels: int, out_channels: int, stride: int, shortcut: str):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        if stride == 1 and in_channels == out_channels:
            self.shortcut: nn.Module = nn.Identity()
        elif shortcut == "A":
            self.shortcut = PadShortcut(in_channels, out_channels, stride)
        else:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )

    def forward(self, x: Tensor) -> Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet20(ImageClassifier):
    """CIFAR ResNet-20 (depth 6n+2 with n=3).

    Args:
        num_classes: number of output logits.
        shortcut: ``"A"`` (zero-padding identity, parameter-free; default) or
            ``"B"`` (1×1 projection) for the two stage transitions.

    Shapes:
        input ``[B, 3, H, W]`` (any H, W; 32×32 for CIFAR) → logits ``[B, num_classes]``.
    """

    def __init__(self, num_classes: int = 10, shortcut: str = "A"):
        super().__init__()
        if shortcut not in _SHORTCUTS:
            raise ValueError(f"shortcut must be one of {_SHORTCUTS}, got {shortcut!r}")
        self.num_classes = num_classes
        self.shortcut_option = shortcut
        self.stem = nn.Sequential(
            nn.Conv2d(3, 16, 3, stride=1, padding=1, bias=False),
            nn.BatchNorm2d(16),
            nn.ReLU(inplace=True),
        )
        blocks, in_ch = [], 16
        for out_ch, stride in ((16, 1), (32, 2), (64, 2)):
            for i in range(3):
                blocks.append(BasicBlock(in_ch, out_ch, stride if i == 0 else 1, shortcut))
                in_ch = out_ch
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(64, num_classes)
        self._init_weights()

    def _init_weights(self) -> None:
        # He et al. (2015) init for convs, as the paper does; BN starts as identity.
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def forward(self, images: Tensor) -> Tensor:
        x = self.blocks(self.stem(images))  # [B, 64, H/4, W/4]
        x = x.mean(dim=(2, 3))  # global average pool -> [B, 64]
        return self.head(x)  # [B, num_classes]


@register_model("resnet20")
def resnet20(num_classes: int = 10, **kwargs) -> ResNet20:
    """Registry constructor for :class:`ResNet20`.

    Args:
        num_classes: number of output logits.
        **kwargs: only ``shortcut`` (``"A"`` or ``"B"``) is accepted.

    Raises:
        TypeError: for any other keyword argument, so a typo in an override
            (e.g. from the CLI) fails loudly instead of being ignored.
    """
    unknown = sorted(set(kwargs) - {"shortcut"})
    if unknown:
        raise TypeError(
            f"resnet20() got unexpected keyword argument(s) {', '.join(map(repr, unknown))}; "
            "accepted: num_classes, shortcut")
    return ResNet20(num_classes=num_classes, **kwargs)
