"""Every torchvision classifier builds by name with its head found; bad names fail with the valid ones listed.

    python -m pytest tests/test_backbones.py
"""

import pytest
import torch
import yaml
from torch import nn
from torchvision import models
from torchvision.models.resnet import BasicBlock, Bottleneck

from conftest import CONFIGS, project_in_process, tiny_args
from project import ImageClassifier, cli_main
from project.backbones import (
    ARCHS,
    FAMILIES,
    RESNET_ARCHS,
    build_network,
    classifier_head,
    family_of,
    head_outputs,
)

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
    # meta (shapes only, no initialisation) but resnet18: the big ones' random init took 3 s each on 2 cores
    with torch.device("cpu" if arch == "resnet18" else "meta"):
        model = ImageClassifier(num_classes=7, arch=arch).eval()
        assert isinstance(model.network, nn.Module) and type(model.network).__module__.startswith("torchvision.")
        with torch.no_grad():
            logits = model(torch.randn(3, 3, 32, 32))
    assert logits.shape == (3, 7)
    assert arch != "resnet18" or torch.isfinite(logits).all()


def test_unknown_arch_error_lists_every_valid_name_and_the_closest_one():
    with pytest.raises(ValueError, match=r"unknown arch 'convnext_tin' \(did you mean 'convnext_tiny'\?\)") as error:
        ImageClassifier(num_classes=3, arch="convnext_tin")
    for name in ARCHS:
        assert name in str(error.value)
    assert "--model.backbone" in str(error.value) and "\n" not in str(error.value)


def test_unknown_arch_on_the_command_line_fails_before_training(tiny_root, tmp_path):
    with pytest.raises(ValueError, match="unknown arch 'resnet9'"):
        cli_main(["fit", *tiny_args(tiny_root, tmp_path, "--model.arch=resnet9")])
    assert not (tmp_path / "lightning_logs").exists()


def test_unknown_arch_ends_python_m_project_with_one_line_exit_2_and_nothing_written(tiny_root, tmp_path, monkeypatch,
                                                                                     capsys):
    run_root = tmp_path / "runs"
    code, _, err = project_in_process(["fit", *tiny_args(tiny_root, run_root), "--model.arch=resnet9"], monkeypatch,
                                      capsys)
    assert code == 2, err[-2000:]
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: ") and "unknown arch 'resnet9'" in last, last
    assert not run_root.exists() or not [p for p in run_root.rglob("*") if p.is_file()]


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
    zeroed = _last_residual_norms(build_network(arch, 5, zero_init_residual=True))
    default = _last_residual_norms(build_network(arch, 5))
    assert len(zeroed) == len(default) > 0
    assert all(torch.count_nonzero(w) == 0 for w in zeroed)
    assert all(torch.count_nonzero(w) == w.numel() for w in default)


def test_zero_init_residual_reaches_the_model_from_the_command_line(tiny_root, tmp_path):
    cli = cli_main([*tiny_args(tiny_root, tmp_path, "--model.zero_init_residual=true")], run=False)
    norms = _last_residual_norms(cli.model.network)
    assert norms and all(torch.count_nonzero(w) == 0 for w in norms)


def test_archs_are_every_torchvision_classifier_and_nothing_else():
    # independently of how backbones.py lists them: the builders defined in torchvision.models.<family> itself
    top_level = {name for name in models.list_models() if models.get_model_builder(name).__module__.count(".") == 2}
    assert set(ARCHS) == top_level
    assert {"efficientnet_b0", "efficientnet_v2_s", "convnext_tiny", "regnet_y_400mf", "mobilenet_v3_large",
            "vit_b_16", "swin_t", *RESNET_ARCHS} <= set(ARCHS)
    everything = set(models.list_models())  # detection, segmentation, video, optical flow, quantized too
    for other in ("fasterrcnn_resnet50_fpn", "deeplabv3_resnet50", "r3d_18", "raft_small", "quantized_resnet18"):
        assert other in everything and other not in ARCHS


# (family, arch the family is checked on, qualified name of its head): the generic finder must land on these.
HEADS = [
    ("resnet", "resnet18", "fc"), ("efficientnet", "efficientnet_b0", "classifier.1"),
    ("convnext", "convnext_tiny", "classifier.2"), ("mobilenetv3", "mobilenet_v3_large", "classifier.3"),
    ("vision_transformer", "vit_b_16", "heads.head"), ("swin_transformer", "swin_t", "head"),
    ("regnet", "regnet_y_400mf", "fc"), ("squeezenet", "squeezenet1_0", "classifier.1"),
    ("maxvit", "maxvit_t", "classifier.5"), ("vgg", "vgg11", "classifier.6"), ("densenet", "densenet121", "classifier"),
]


@pytest.mark.parametrize(("family", "arch", "head"), HEADS, ids=[h[0] for h in HEADS])
def test_classifier_head_is_the_layer_giving_the_logits(family, arch, head):
    assert family_of(arch) == family
    with torch.device("cpu" if family == "regnet" else "meta"):  # meta: shapes only, no initialisation
        network = build_network(arch, 7)
    name, module = classifier_head(network)
    assert name == head and network.get_submodule(name) is module and head_outputs(module) == 7


# RegNet computes its stage widths with tensor ops the meta device cannot run; its two smallest build on the CPU.
META_ARCHS = [arch for arch in ARCHS if family_of(arch) != "regnet"]
SIZES = {"vision_transformer": 224, "maxvit": 224, "inception": 75, "alexnet": 63}  # the rest runs at 32 px


@pytest.mark.parametrize("arch", [*META_ARCHS, "regnet_x_400mf", "regnet_y_400mf"])
def test_every_arch_builds_with_num_classes_and_its_head_gives_them(arch):
    device = "cpu" if family_of(arch) == "regnet" else "meta"  # meta: shapes only, no memory, no initialisation
    with torch.device(device):
        network = build_network(arch, 7).eval()
        size = SIZES.get(family_of(arch), 32)
        logits = network(torch.zeros(2, 3, size, size))
    assert logits.shape == (2, 7)
    assert head_outputs(classifier_head(network)[1]) == 7


def test_families_cover_every_arch_once():
    assert sorted(arch for names in FAMILIES.values() for arch in names) == sorted(ARCHS)
    assert next(iter(FAMILIES)) == "resnet"


def test_zero_init_residual_outside_the_resnet_family_names_the_flag_to_drop():
    with pytest.raises(ValueError, match="zero_init_residual applies to the ResNet family.*drop --model.zero_init"):
        build_network("convnext_tiny", 3, zero_init_residual=True)


def test_auxiliary_heads_are_left_out_so_training_mode_returns_plain_logits():
    for arch, size in (("googlenet", 32), ("inception_v3", 75)):
        network = build_network(arch, 3).train()
        assert network.aux_logits is False
        assert isinstance(network(torch.zeros(2, 3, size, size)), torch.Tensor)


def test_torchvision_weights_names_shape_the_network_they_fit():
    with torch.device("meta"):
        swag = build_network("vit_b_16", 3, weights="IMAGENET1K_SWAG_E2E_V1")  # trained at 384 px
        plain = build_network("vit_b_16", 3, weights="/some/file.pth")  # a path changes nothing
    assert swag.image_size == 384 and plain.image_size == 224
    assert build_network("googlenet", 3, weights="IMAGENET1K_V1").transform_input is True
    assert build_network("googlenet", 3).transform_input is False


CONFIG_ARCHS = sorted({
    (yaml.safe_load(path.read_text())["model"] or {}).get("arch", "resnet50")
    for path in (CONFIGS / "model").glob("*.yaml")
} - set(RESNET_ARCHS))


@pytest.mark.parametrize("arch", CONFIG_ARCHS)
def test_each_model_config_arch_trains_a_step_on_the_cpu(arch):
    # The ImageClassifier-level check is tests/test_model_configs.py; this one needs the network alone.
    torch.manual_seed(0)
    network = build_network(arch, 3).train()
    size = SIZES.get(family_of(arch), 32)
    loss = nn.functional.cross_entropy(network(torch.randn(2, 3, size, size)), torch.tensor([0, 2]))
    loss.backward()
    assert torch.isfinite(loss)
    assert [name for name, p in network.named_parameters() if p.grad is None] == []
