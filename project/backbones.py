"""Networks as plain nn.Modules, built by torchvision from a name; the training logic lives in model.py."""

from torch import nn
from torchvision import models

# Variants are data: every name here is a torchvision builder taking num_classes and zero_init_residual.
RESNET_ARCHS = (
    "resnet18",
    "resnet34",
    "resnet50",
    "resnet101",
    "resnet152",
    "wide_resnet50_2",
    "wide_resnet101_2",
    "resnext50_32x4d",
    "resnext101_32x8d",
    "resnext101_64x4d",
)


def build_resnet(arch: str, num_classes: int, *, zero_init_residual: bool = False) -> nn.Module:
    """Build a randomly initialised torchvision ResNet-family network by name."""
    if arch not in RESNET_ARCHS:
        raise ValueError(
            f"unknown arch {arch!r}; expected one of: {', '.join(RESNET_ARCHS)} "
            "(or pass your own network with --model.backbone, see README 'Add your model')"
        )
    if num_classes < 1:
        raise ValueError(f"num_classes must be >= 1, got {num_classes}")
    builder = getattr(models, arch)
    return builder(weights=None, num_classes=num_classes, zero_init_residual=zero_init_residual)
