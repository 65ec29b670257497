"""Pretrained weights load by torchvision name (offline from the hub cache) or from a file; the head is replaced.

    python -m pytest tests/test_weights.py
"""

import re
import urllib.request

import pytest
import torch
from torchvision import models

from project import ImageClassifier
from project.backbones import build_network
from project.weights import eval_sizes, fetch_weights, hub_file, load_pretrained

RESNET18_V1 = models.ResNet18_Weights.IMAGENET1K_V1


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """An empty torch hub cache, and no way out to the network: a download attempt fails at once."""
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    for proxy in ("https_proxy", "HTTPS_PROXY", "http_proxy", "HTTP_PROXY"):
        monkeypatch.setenv(proxy, "http://127.0.0.1:9")  # the discard port: connection refused
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.delenv("NO_PROXY", raising=False)
    # urllib builds its opener (and reads the proxy variables) once per process: make it read ours.
    monkeypatch.setattr(urllib.request, "_opener", None)
    return tmp_path / "torch" / "hub" / "checkpoints"


def imagenet_resnet18() -> dict[str, torch.Tensor]:
    """What torchvision's resnet18 file holds, in shape: a seeded, randomly initialised 1000-class state_dict."""
    torch.manual_seed(0)
    return models.resnet18(num_classes=1000).state_dict()


def test_a_weights_name_loads_offline_from_the_hub_cache_with_a_new_head(hub):
    saved = imagenet_resnet18()
    path = hub_file(RESNET18_V1)
    assert path == hub / "resnet18-f37072fd.pth"  # the name torchvision's URL gives
    path.parent.mkdir(parents=True)
    torch.save(saved, path)

    network = build_network("resnet18", 10)
    fresh_head = network.fc.weight.detach().clone()
    report = load_pretrained(network, "IMAGENET1K_V1", arch="resnet18", num_classes=10)

    state = network.state_dict()
    for key, tensor in saved.items():
        if not key.startswith("fc."):
            assert torch.equal(state[key], tensor), key
    assert network.fc.weight.shape == (10, 512) and torch.equal(network.fc.weight, fresh_head)
    assert report.new == ("fc.weight", "fc.bias") and report.loaded == len(saved) - 2
    summary = report.summary()
    assert str(path) in summary and "1000 -> 10 classes" in summary and "fc.weight, fc.bias" in summary
    assert "\n" not in summary
    assert sorted(p.name for p in hub.iterdir()) == ["resnet18-f37072fd.pth"]  # nothing else fetched


def test_default_names_the_entry_torchvision_marks_default(hub):
    path = hub_file(models.ResNet50_Weights.DEFAULT)
    assert path.name == "resnet50-11ad3fa6.pth"  # IMAGENET1K_V2's file, the 80.858 % weights
    path.parent.mkdir(parents=True)
    saved = models.resnet50(num_classes=1000).state_dict()
    torch.save(saved, path)
    network = build_network("resnet50", 3)
    report = load_pretrained(network, "DEFAULT", arch="resnet50", num_classes=3)
    assert report.new == ("fc.weight", "fc.bias") and report.loaded == len(saved) - 2
    assert torch.equal(network.conv1.weight, saved["conv1.weight"])


def test_a_failed_download_is_one_line_naming_the_url_file_and_folder(hub):
    for attempt in (lambda: load_pretrained(build_network("resnet18", 10), "IMAGENET1K_V1", arch="resnet18",
                                            num_classes=10),
                    lambda: fetch_weights("IMAGENET1K_V1", arch="resnet18")):
        with pytest.raises(FileNotFoundError) as error:
            attempt()
        message = str(error.value)
        assert "\n" not in message
        assert RESNET18_V1.url in message and "resnet18-f37072fd.pth" in message and f"into {hub} " in message


def test_fetch_weights_finds_a_cached_file_and_leaves_paths_alone(hub, tmp_path):
    hub_file(RESNET18_V1).parent.mkdir(parents=True)
    torch.save(imagenet_resnet18(), hub_file(RESNET18_V1))
    assert fetch_weights("IMAGENET1K_V1", arch="resnet18") == hub_file(RESNET18_V1)
    assert fetch_weights(str(tmp_path / "mine.pth"), arch="resnet18") is None
    assert fetch_weights("IMAGENET1K_V1", arch=None) is None  # a custom backbone takes files only


def test_same_class_count_loads_the_head_too(tmp_path):
    saved = imagenet_resnet18()
    torch.save(saved, tmp_path / "resnet18.pth")
    network = build_network("resnet18", 1000)
    report = load_pretrained(network, str(tmp_path / "resnet18.pth"), arch="resnet18", num_classes=1000)
    assert report.new == () and report.loaded == len(saved) and torch.equal(network.fc.weight, saved["fc.weight"])


def test_an_architecture_mismatch_is_one_line_naming_the_first_key_and_both_shapes(tmp_path):
    torch.save(models.resnet50(num_classes=1000).state_dict(), tmp_path / "resnet50.pth")
    with pytest.raises(ValueError) as error:
        load_pretrained(build_network("resnet18", 10), str(tmp_path / "resnet50.pth"), arch="resnet18", num_classes=10)
    message = str(error.value)
    assert "'layer1.0.conv1.weight' has shape (64, 64, 1, 1) in the file but (64, 64, 3, 3) in the network" in message
    assert str(tmp_path / "resnet50.pth") in message and "\n" not in message


def test_missing_and_unexpected_tensors_are_named(tmp_path):
    torch.save(models.resnet34(num_classes=1000).state_dict(), tmp_path / "resnet34.pth")
    torch.save(imagenet_resnet18(), tmp_path / "resnet18.pth")
    with pytest.raises(ValueError, match=r"has a tensor 'layer1\.2\.conv1\.weight' \(shape \(64, 64, 3, 3\)\) the "):
        load_pretrained(build_network("resnet18", 10), str(tmp_path / "resnet34.pth"), arch="resnet18", num_classes=10)
    with pytest.raises(ValueError, match=r"has no tensor 'layer1\.2\.conv1\.weight' \(shape \(64, 64, 3, 3\) in"):
        load_pretrained(build_network("resnet34", 10), str(tmp_path / "resnet18.pth"), arch="resnet34", num_classes=10)


@pytest.mark.parametrize("arch", ["resnet18", "mnasnet0_5"])  # MNASNet's load hook needs the module versions kept
def test_one_of_our_checkpoints_loads_its_network_part(tmp_path, arch):
    torch.manual_seed(0)
    trained = ImageClassifier(num_classes=1000, arch=arch)
    # What Lightning writes: the LightningModule's state_dict (keys `network.*`, metrics' states) plus trainer state.
    torch.save({"state_dict": trained.state_dict(), "epoch": 3, "optimizer_states": []}, tmp_path / "last.ckpt")
    network = build_network(arch, 10)
    report = load_pretrained(network, str(tmp_path / "last.ckpt"), arch=arch, num_classes=10)
    expected = {k.removeprefix("network."): v for k, v in trained.state_dict().items() if k.startswith("network.")}
    for key, tensor in network.state_dict().items():
        if key not in report.new:
            assert torch.equal(tensor, expected[key]), key
    assert len(report.new) == 2 and report.loaded == len(expected) - 2


def test_googlenet_weights_load_without_the_auxiliary_heads(hub):
    entry = models.GoogLeNet_Weights.IMAGENET1K_V1
    hub_file(entry).parent.mkdir(parents=True)
    # torchvision's file holds aux1/aux2, which a network trained here (aux_logits=False) does not have
    torch.save(models.googlenet(num_classes=1000, aux_logits=True, init_weights=False).state_dict(), hub_file(entry))
    network = build_network("googlenet", 5, weights="IMAGENET1K_V1")
    report = load_pretrained(network, "IMAGENET1K_V1", arch="googlenet", num_classes=5)
    assert report.dropped and all(k.startswith(("aux1.", "aux2.")) for k in report.dropped)
    assert report.new == ("fc.weight", "fc.bias") and "ignored" in report.summary()


def test_a_value_that_is_neither_a_name_nor_a_file_lists_the_names(tmp_path):
    with pytest.raises(ValueError, match="neither a file nor a torchvision weights name of resnet50 "
                                         r"\(one of: IMAGENET1K_V1, IMAGENET1K_V2, DEFAULT\)"):
        load_pretrained(build_network("resnet50", 3), "IMAGENET_V2", arch="resnet50", num_classes=3)
    with pytest.raises(ValueError, match="with --model.backbone it takes the path"):
        load_pretrained(build_network("resnet18", 3), "IMAGENET1K_V1", arch=None, num_classes=3)


def test_files_that_are_not_state_dicts_say_how_to_save_one(tmp_path):
    torch.save(models.resnet18(num_classes=3), tmp_path / "module.pth")  # a pickled nn.Module: code on load
    refused = r"a pickled torchvision\.models\.resnet\.ResNet, which .*torch\.save\(network\.state_dict\(\), path\)"
    with pytest.raises(ValueError, match=refused):
        load_pretrained(build_network("resnet18", 3), str(tmp_path / "module.pth"), arch="resnet18", num_classes=3)
    torch.save([1, 2, 3], tmp_path / "list.pth")
    with pytest.raises(ValueError, match="holds a list, not a state_dict"):
        load_pretrained(build_network("resnet18", 3), str(tmp_path / "list.pth"), arch="resnet18", num_classes=3)
    (tmp_path / "text.pth").write_text("not a checkpoint")
    with pytest.raises(ValueError, match="is not a torch checkpoint"):
        load_pretrained(build_network("resnet18", 3), str(tmp_path / "text.pth"), arch="resnet18", num_classes=3)


def test_eval_sizes_come_from_the_weights_entry():
    assert eval_sizes("resnet50", "IMAGENET1K_V1") == (256, 224)
    assert eval_sizes("resnet50", "IMAGENET1K_V2") == (232, 224)
    assert eval_sizes("vit_b_16", "IMAGENET1K_SWAG_E2E_V1") == (384, 384)
    assert eval_sizes("efficientnet_v2_s", "DEFAULT") == (384, 384)
    with pytest.raises(ValueError, match="resnet18 has no torchvision weights 'IMAGENET1K_V2'"):
        eval_sizes("resnet18", "IMAGENET1K_V2")


def test_files_older_than_batchnorms_step_counter_load_as_torchvision_loads_them(hub):
    # torchvision's 2017 files (resnet18-f37072fd.pth) predate num_batches_tracked and module version metadata.
    saved = {k: v for k, v in imagenet_resnet18().items() if not k.endswith("num_batches_tracked")}
    hub_file(RESNET18_V1).parent.mkdir(parents=True)
    torch.save(saved, hub_file(RESNET18_V1))
    network = build_network("resnet18", 10)
    report = load_pretrained(network, "IMAGENET1K_V1", arch="resnet18", num_classes=10)
    assert report.new == ("fc.weight", "fc.bias") and report.loaded == len(network.state_dict()) - 2
    assert torch.equal(network.layer4[1].bn2.running_var, saved["layer4.1.bn2.running_var"])


def test_densenet_files_with_the_old_layer_names_load(hub):
    # torchvision's DenseNet files name a dense layer's parts 'norm.1', 'conv.2'...; its builder renames them.
    state = models.densenet121(num_classes=1000).state_dict()
    old = {re.sub(r"(denselayer\d+\.(?:norm|conv))([12])\.", r"\1.\2.", k): v for k, v in state.items()}
    assert "features.denseblock1.denselayer1.norm.1.weight" in old
    entry = models.DenseNet121_Weights.IMAGENET1K_V1
    hub_file(entry).parent.mkdir(parents=True)
    torch.save(old, hub_file(entry))
    network = build_network("densenet121", 4)
    report = load_pretrained(network, "IMAGENET1K_V1", arch="densenet121", num_classes=4)
    assert report.new == ("classifier.weight", "classifier.bias")
    assert torch.equal(network.features.denseblock1.denselayer1.norm1.weight,
                       state["features.denseblock1.denselayer1.norm1.weight"])
