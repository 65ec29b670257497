"""Fine-tuning through the CLI: configs/recipe/finetune.yaml from a locally saved torchvision resnet18 (1000 classes)
onto the 10-class digits, offline; the weights' evaluation sizes become the defaults; a mismatching file is one line;
and `python -m project export` round-trips the trained network.

    python -m pytest tests/test_finetune.py
"""

import json
import os
import sys
from unittest import mock

import lightning as L
import pytest
import torch
from classifier_engine.errors import exit_on_user_error
from classifier_engine.export import main as export_main
from torchvision import models

from conftest import CONFIGS, QUICKSTART, SHRINK, callback, tiny_args
from project import cli_main, main
from project.weights import hub_file
from test_weights import hub, imagenet_resnet18  # noqa: F401  (the offline torch hub fixture)

FINETUNE = CONFIGS / "recipe" / "finetune.yaml"


class HeadAtStart(L.Callback):
    """Keeps a copy of the classifier head's weight as training starts (after pretrained weights were loaded)."""

    def __init__(self, attribute: str = "fc"):
        self.attribute = attribute
        self.weight = None

    def on_train_start(self, trainer, pl_module):
        self.weight = getattr(pl_module.network, self.attribute).weight.detach().clone()


@pytest.mark.usefixtures("hub")
def test_finetune_recipe_loads_the_backbone_keeps_it_frozen_for_epoch_0_and_trains_a_new_head(tmp_path, caplog):
    saved = imagenet_resnet18()
    path = hub_file(models.ResNet18_Weights.IMAGENET1K_V1)
    path.parent.mkdir(parents=True)
    torch.save(saved, path)
    # The digits (10 classes) at 32 px, one shrunk epoch: the epoch in which only the head trains.
    args = ["fit", "--config", str(QUICKSTART), "--config", str(FINETUNE), *SHRINK,
            "--model.finetune.weights=IMAGENET1K_V1",
            "--trainer.limit_train_batches=3", "--trainer.limit_val_batches=1",
            f"--trainer.default_root_dir={tmp_path}",
            callback("test_finetune.HeadAtStart")]
    cli = cli_main(args)
    network = cli.model.network
    state = network.state_dict()
    # BatchNorm layers go on training (Lightning's train_bn default): every other backbone tensor is the file's.
    norms = {f"{name}." for name, module in network.named_modules() if isinstance(module, torch.nn.BatchNorm2d)}
    frozen = [key for key in saved if not key.startswith("fc.") and not key.startswith(tuple(norms))]
    assert len(frozen) == 20  # resnet18's 17 convolutions and 3 downsample convolutions
    for key in frozen:
        assert torch.equal(state[key], saved[key]), f"{key} moved while the backbone was frozen"
    assert network.fc.weight.shape == (10, 512)
    (head,) = [c for c in cli.trainer.callbacks if type(c).__name__ == "HeadAtStart"]
    assert not torch.equal(network.fc.weight, head.weight)  # the new head trained while the backbone waited
    assert f"loaded {len(saved) - 2} tensors from resnet18 IMAGENET1K_V1 ({path})" in caplog.text
    assert "newly initialised (1000 -> 10 classes): fc.weight, fc.bias" in caplog.text
    groups = {g["name"]: g["initial_lr"] for g in cli.trainer.optimizers[0].param_groups}
    assert groups["backbone"] == pytest.approx(0.1 * groups["head"])  # backbone_lr_factor 0.1


def test_torchvision_weights_set_the_eval_sizes_unless_the_config_sets_them(tiny_root, tmp_path):
    base = [f"--data.root={tiny_root}", f"--trainer.default_root_dir={tmp_path}", "--trainer.accelerator=cpu",
            "--model.arch=resnet50", "--model.finetune.weights=IMAGENET1K_V2"]
    cli = cli_main(base, run=False)  # building does not read the weights: they are loaded when fit sets up
    assert (cli.datamodule.hparams.eval_resize_size, cli.datamodule.hparams.eval_crop_size) == (232, 224)
    cli = cli_main([*base, "--data.eval_resize_size=256"], run=False)
    assert (cli.datamodule.hparams.eval_resize_size, cli.datamodule.hparams.eval_crop_size) == (256, 224)


def test_a_weights_file_of_another_architecture_is_one_line_naming_the_key_and_both_shapes(tiny_root, tmp_path,
                                                                                          monkeypatch, capsys):
    other = tmp_path / "wide.pth"
    torch.save(models.wide_resnet50_2(num_classes=3).state_dict(), other)
    monkeypatch.setattr(sys, "argv", ["python -m project", "fit", *tiny_args(tiny_root, tmp_path / "run"),
                                      "--model.arch=resnet50", f"--model.finetune.weights={other}"])
    with pytest.raises(SystemExit) as exited:
        main()
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert exited.value.code == 2 and last.startswith("error: ") and str(other) in last
    assert "layer1.0.conv1.weight" in last and "(128, 64, 1, 1)" in last and "(64, 64, 1, 1)" in last


def test_export_of_a_trained_run_gives_the_checkpoints_logits(tiny_root, tmp_path):
    checkpoint = tmp_path / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt"
    # `python -m project export ARGS` as project/__main__.py runs it, in-process (a user error would exit 2 here);
    # tests/test_add_your_model.py runs the export as a real process.
    argv = [f"--ckpt_path={checkpoint}", f"--out_dir={tmp_path / 'export'}"]
    with mock.patch.dict(os.environ):  # the CLI sets PL_GLOBAL_SEED: keep it out of the tests that follow
        cli = cli_main(["fit", *tiny_args(tiny_root, tmp_path)])
        exit_on_user_error(lambda: export_main(argv))
    program = torch.export.load(tmp_path / "export" / "model.pt2").module()
    meta = json.loads((tmp_path / "export" / "model.json").read_text())
    assert meta["class_names"] == ["cat", "dog", "fox"] and meta["preprocessing"]["crop"] == 32
    images = torch.randn(5, 3, 32, 32)
    network = cli.model.network.eval()
    with torch.no_grad():
        torch.testing.assert_close(program(images), network(images), rtol=0, atol=1e-5)
