"""Image classifiers: QSV's GraphNet, its controls, ResNet-20, and the registry.

Importing this package registers every model, so ``build_model(name)`` works for
each name in ``available_models()``.
"""
from . import resnet, zoo  # noqa: F401  (populate the registry)
from .base import ImageClassifier, format_count
from .blocks import CrossBlock, GraphConvAdapter, WithinBlock, make_conv
from .embedding import LambertPatchEmbedding
from .field import QuaternionField
from .graph_net import DEFAULT_WIDTHS, GraphNet
from .matching import count_parameters, match_width, scale_widths
from .registry import available_models, build_model, register_model
from .resnet import ResNet20

__all__ = [
    "build_model",
    "available_models",
    "register_model",
    "ImageClassifier",
    "format_count",
    "GraphNet",
    "DEFAULT_WIDTHS",
    "QuaternionField",
    "LambertPatchEmbedding",
    "make_conv",
    "GraphConvAdapter",
    "CrossBlock",
    "WithinBlock",
    "match_width",
    "scale_widths",
    "count_parameters",
    "ResNet20",
]
