"""`python -m project` in-process on the room's quickstart: its model's metrics, learning-rate scaling and saved
options, --help, config composition, and the ImageClassifier's channels_last and compile options.

    python -m pytest tests/test_cli.py
"""

from pathlib import Path

import lightning as L
import pytest
import torch
import yaml
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from conftest import cli_main, read_scalars, tiny_args

TRAIN_KEYS = {"train/loss", "train/lr", "val/loss", "val/acc1", "val/acc5"}


class Run:
    """One finished `fit` on the tiny data: its arguments, directories and final metrics."""

    def __init__(self, args: list[str], root_dir: Path, metrics: dict[str, float]):
        self.args, self.root_dir, self.metrics = args, root_dir, metrics
        self.version_dir = root_dir / "lightning_logs" / "version_0"
        self.checkpoints = self.version_dir / "checkpoints"
        self.last = self.checkpoints / "last.ckpt"


@pytest.fixture(scope="module")
def run(tiny_root, tmp_path_factory) -> Run:
    root_dir = tmp_path_factory.mktemp("fit")
    args = tiny_args(tiny_root, root_dir)
    cli = cli_main(["fit", *args])
    metrics = {k: float(v) for k, v in cli.trainer.callback_metrics.items()}
    return Run(args, root_dir, metrics)


def test_fit_logs_every_metric_key_to_tensorboard(run):
    scalars = read_scalars(run.version_dir)
    assert TRAIN_KEYS <= scalars.keys()
    assert len(scalars["train/loss"]) == 5  # 40 images / batch 8, logged every step
    assert scalars["val/acc1"][-1][1] == pytest.approx(run.metrics["val/acc1"])
    assert 0.0 <= scalars["val/acc1"][-1][1] <= scalars["val/acc5"][-1][1] <= 1.0
    # The LR after scaling: quickstart's lr_per_256 0.2 x batch 8 / 256.
    assert [v for _, v in scalars["train/effective_lr"]] == pytest.approx([0.2 * 8 / 256])


def test_fit_saves_the_quickstarts_arch_in_the_runs_config(run):
    saved = yaml.safe_load((run.version_dir / "config.yaml").read_text())
    assert saved["model"]["init_args"]["arch"] == "resnet18"

def test_help_names_python_m_project_and_the_subcommands(capsys):
    with pytest.raises(SystemExit):
        cli_main(["--help"])
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m project ")
    assert all(sub in out for sub in ("fit", "validate", "test", "predict"))
    with pytest.raises(SystemExit):
        cli_main(["fit", "--help"])
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m project [options] fit") and "--model.help" in out and "--data.help" in out
    with pytest.raises(SystemExit):  # the class's own options: by class_path, the defaults' by name
        cli_main(["fit", "--model.help", "ImageClassifier"])
    assert "--model.arch" in capsys.readouterr().out

def test_repeated_configs_compose_and_the_later_wins(tiny_root, tmp_path):
    first, second = tmp_path / "first.yaml", tmp_path / "second.yaml"
    first.write_text("trainer:\n  max_epochs: 3\nmodel:\n  loss:\n    label_smoothing: 0.1\n")
    second.write_text("trainer:\n  max_epochs: 2\n")
    cli = cli_main(tiny_args(tiny_root, tmp_path, "--config", str(first), "--config", str(second)), run=False)
    assert cli.trainer.max_epochs == 2  # second.yaml over first.yaml over the shrink flags before them
    assert cli.model.loss.label_smoothing == 0.1  # only first.yaml sets it
    assert cli.model.hparams.arch == "resnet18"  # from configs/quickstart.yaml
    assert cli.datamodule.batch_size == 8  # from the shrink flags
    assert cli.model.hparams.num_classes == 3  # linked from the data, never typed

def test_channels_last_network_gives_the_same_logits():
    from project import ImageClassifier

    torch.manual_seed(0)
    plain = ImageClassifier(num_classes=4, arch="resnet18").eval()
    nhwc = ImageClassifier(num_classes=4, arch="resnet18", channels_last=True).eval()
    nhwc.load_state_dict(plain.state_dict())
    nhwc.configure_model()
    assert nhwc.network.conv1.weight.is_contiguous(memory_format=torch.channels_last)
    images = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(nhwc(images), plain(images), rtol=1e-4, atol=1e-4)

class TinyNet(nn.Sequential):
    """A two-layer network (with BN buffers): compiling it takes seconds where a ResNet takes minutes on 2 cores."""

    def __init__(self, num_classes: int):
        super().__init__(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(8, num_classes))


@pytest.mark.slow
def test_compiled_model_checkpoint_loads_into_an_uncompiled_model(tiny_root, tmp_path):
    from project import ImageClassifier, ImageNetDataModule

    model = ImageClassifier(num_classes=3, backbone=TinyNet, compile=True, channels_last=True, batch_size=8)
    datamodule = ImageNetDataModule(root=str(tiny_root), batch_size=8, num_workers=0, pin_memory=False,
                                    train_crop_size=32, eval_resize_size=32, eval_crop_size=32)
    trainer = L.Trainer(accelerator="cpu", max_steps=2, limit_val_batches=0, default_root_dir=tmp_path, logger=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[ModelCheckpoint(dirpath=tmp_path, save_last=True)])
    trainer.fit(model, datamodule)
    assert model.runner.compiled is not None  # the steps above ran the compiled graph

    state = torch.load(tmp_path / "last.ckpt", map_location="cpu", weights_only=True)["state_dict"]
    assert [k for k in state if "_orig_mod" in k] == []
    plain = ImageClassifier.load_from_checkpoint(tmp_path / "last.ckpt", backbone=TinyNet, compile=False,
                                                 channels_last=False).eval()
    assert plain.runner.compiled is None
    images = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(plain(images), model.network.eval()(images), rtol=1e-5, atol=1e-5)
