"""ResNet-20 baseline and the ImageClassifier defaults it inherits."""
import pytest
import torch

from qsv_pyg.models.base import ImageClassifier
from qsv_pyg.models.registry import available_models, build_model
from qsv_pyg.models.resnet import PadShortcut, ResNet20

# conv 432 + BN 32 | stage1 13,824 + 192 | stage2 50,688 + 384 | stage3 202,752 + 768 | fc 650
RESNET20_A_PARAMS = 269_722
# option B adds two 1×1 projections with BN: (512 + 64) + (2,048 + 128)
RESNET20_B_PARAMS = 272_474


def test_parameter_count_option_a():
    model = ResNet20()
    n = model.num_parameters()
    assert n == RESNET20_A_PARAMS
    assert 0.26e6 <= n <= 0.28e6
    assert "ResNet20" in model.summary() and "0.270M" in model.summary()


def test_parameter_count_option_b():
    assert ResNet20(shortcut="B").num_parameters() == RESNET20_B_PARAMS


def test_option_a_shortcut_is_parameter_free_zero_padding():
    shortcut = PadShortcut(16, 32, stride=2)
    assert not list(shortcut.parameters())
    x = torch.randn(2, 16, 8, 8)
    y = shortcut(x)
    assert y.shape == (2, 32, 4, 4)
    assert torch.equal(y[:, 8:24], x[:, :, ::2, ::2])
    assert not y[:, :8].any() and not y[:, 24:].any()


@pytest.mark.parametrize("shortcut", ["A", "B"])
def test_forward_backward_shapes(shortcut):
    torch.manual_seed(0)
    model = ResNet20(num_classes=10, shortcut=shortcut)
    images = torch.randn(2, 3, 32, 32)
    logits = model(images)
    assert logits.shape == (2, 10)
    logits.logsumexp(-1).sum().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.shape == p.shape, name
        assert torch.isfinite(p.grad).all(), name


def test_image_classifier_defaults():
    model = ResNet20()
    assert isinstance(model, ImageClassifier)
    aux = model.auxiliary_loss()
    assert aux.shape == () and aux.item() == 0.0 and aux.dtype == torch.float32
    assert model.betas() == {}
    assert model.sphere_parameters() == []


def test_registry_builds_resnet20():
    assert "resnet20" in available_models()
    model = build_model("resnet20", num_classes=100)
    assert isinstance(model, ResNet20)
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 100)
    assert build_model("resnet20", shortcut="B").num_parameters() == RESNET20_B_PARAMS


def test_unknown_kwarg_rejected():
    with pytest.raises(TypeError, match="depth"):
        build_model("resnet20", depth=56)


def test_bad_shortcut_rejected():
    with pytest.raises(ValueError, match="shortcut"):
        ResNet20(shortcut="C")
