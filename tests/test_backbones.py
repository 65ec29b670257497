"""Every torchvision ResNet-family arch builds and classifies; bad names fail with the valid ones listed.

    python -m pytest tests/test_backbones.py
"""

import pytest
import torch
from torch import nn
from torchvision.models.resnet import BasicBlock, Bottleneck

from conftest import tiny_args
from project import ImageClassifier
from project.backbones import RESNET_ARCHS, build_resnet
from project.cli import cli_main

# The family the README promises; RESNET_ARCHS must offer exactly these (and the tests below run each).
PROMISED_ARCHS = {
    "resnet18", "resnet34", "resnet50", "resnet101", "resnet152",
    "wide_resnet50_2", "wide_resnet101_2",
    "resnext50_32x4d", "resnext101_32x8d", "resnext101_64x4d",
}


def test_arch_list_is_the_promised_resnet_family():
    assert set(RESNET_ARCHS) == PROMISED_ARCHS


@pytest.mark.parametrize("arch", RESNET_ARCHS)
def test_every_arch_gives_batch_by_num_classes_logits(arch):
    model = ImageClassifier(num_classes=7, arch=arch).eval()
    assert isinstance(model.network, nn.Module) and type(model.network).__module__.startswith("torchvision.")
    with torch.no_grad():
        logits = model(torch.randn(3, 3, 32, 32))
    assert logits.shape == (3, 7)
    assert torch.isfinite(logits).all()


def test_unknown_arch_error_lists_every_valid_name():
    with pytest.raises(ValueError, match="unknown arch 'resnet9'") as error:
        ImageClassifier(num_classes=3, arch="resnet9")
    for name in RESNET_ARCHS:
        assert name in str(error.value)


def test_unknown_arch_on_the_command_line_fails_before_training(tiny_root, tmp_path):
    with pytest.raises(ValueError, match="unknown arch 'resnet9'; expected one of: resnet18"):
        cli_main(["fit", *tiny_args(tiny_root, tmp_path, "--model.arch=resnet9")])
    assert not (tmp_path / "lightning_logs").exists()


def _last_residual_norms(network: nn.Module) -> list[torch.Tensor]:
    """The BN closing each residual branch: the one zero_init_residual zeroes."""
    norms = []
    for block in network.modules():
        if isinstance(block, Bottleneck):
            norms.append(block.bn3.weight)
        elif isinstance(block, BasicBlock):
            norms.append(block.bn2.weight)
    return norms


@pytest.mark.parametrize("arch", ["resnet18", "resnet50"])  # one BasicBlock net, one Bottleneck net
def test_zero_init_residual_zeroes_each_residual_branch(arch):
    zeroed = _last_residual_norms(build_resnet(arch, 5, zero_init_residual=True))
    default = _last_residual_norms(build_resnet(arch, 5))
    assert len(zeroed) == len(default) > 0
    assert all(torch.count_nonzero(w) == 0 for w in zeroed)
    assert all(torch.count_nonzero(w) == w.numel() for w in default)


def test_zero_init_residual_reaches_the_model_from_the_command_line(tiny_root, tmp_path):
    cli = cli_main([*tiny_args(tiny_root, tmp_path, "--model.zero_init_residual=true")], run=False)
    norms = _last_residual_norms(cli.model.network)
    assert norms and all(torch.count_nonzero(w) == 0 for w in norms)
