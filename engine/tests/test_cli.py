"""`python -m project` in-process: metrics, checkpoints, saved config, reloads, --print_config, --help, composition.

    python -m pytest tests/test_cli.py
"""

import shutil
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
import yaml
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningArgumentParser
from torch import nn

from classifier_engine import ImageFolderDataModule
from conftest import TEMPLATE, cli_main, model_class, read_scalars, run_project, tiny_args

TRAIN_KEYS = {"train/loss", "train/lr", "val/loss", "val/acc1", "val/acc5"}
TEST_KEYS = {"test/loss", "test/acc1", "test/acc5"}


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


@pytest.mark.template
def test_fit_logs_every_metric_key_to_tensorboard(run):
    scalars = read_scalars(run.version_dir)
    assert TRAIN_KEYS <= scalars.keys()
    assert len(scalars["train/loss"]) == 5  # 40 images / batch 8, logged every step
    assert scalars["val/acc1"][-1][1] == pytest.approx(run.metrics["val/acc1"])
    assert 0.0 <= scalars["val/acc1"][-1][1] <= scalars["val/acc5"][-1][1] <= 1.0
    # The LR after scaling: quickstart's lr_per_256 0.2 x batch 8 / 256.
    assert [v for _, v in scalars["train/effective_lr"]] == pytest.approx([0.2 * 8 / 256])


def test_fit_keeps_last_and_best_by_val_acc1_checkpoints_and_the_config(run):
    names = sorted(p.name for p in run.checkpoints.iterdir())
    best = f"epoch000-val_acc1={run.metrics['val/acc1']:.4f}.ckpt"
    assert names == sorted(["last.ckpt", best])
    saved = yaml.safe_load((run.version_dir / "config.yaml").read_text())
    assert saved["checkpoint"]["monitor"] == "val/acc1" and saved["checkpoint"]["mode"] == "max"
    assert saved["data"]["init_args"]["batch_size"] == 8
    assert not TEMPLATE or saved["model"]["init_args"]["arch"] == "resnet18"


@pytest.mark.template
def test_test_subcommand_logs_test_metrics_equal_to_val(run, tmp_path):
    # Without a ROOT/test/ folder `test` evaluates val/: the same images as fit's last validation.
    cli = cli_main(["test", *run.args, f"--trainer.default_root_dir={tmp_path}", f"--ckpt_path={run.last}"])
    scalars = read_scalars(Path(cli.trainer.log_dir))
    assert TEST_KEYS <= scalars.keys()
    assert scalars["test/acc1"][-1][1] == pytest.approx(run.metrics["val/acc1"])
    assert scalars["test/loss"][-1][1] == pytest.approx(run.metrics["val/loss"], rel=1e-5)


def test_reloaded_checkpoint_and_validate_ckpt_path_give_the_same_val_acc1(run, tmp_path):
    model = model_class().load_from_checkpoint(run.last)
    datamodule = ImageFolderDataModule.load_from_checkpoint(run.last)
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False)
    (reloaded,) = trainer.validate(model, datamodule=datamodule)

    cli = cli_main(["validate", *run.args, f"--trainer.default_root_dir={tmp_path}", f"--ckpt_path={run.last}"])
    validated = float(cli.trainer.callback_metrics["val/acc1"])
    assert reloaded["val/acc1"] == pytest.approx(run.metrics["val/acc1"])
    assert validated == pytest.approx(run.metrics["val/acc1"])


def opens_of(path: Path, trace: Path) -> list[str]:
    """The open/openat calls of `path` in an `strace -f` output (every process, Python's and C++'s opens alike)."""
    return [line for line in trace.read_text().splitlines() if f'"{path}"' in line and "open" in line]


@pytest.mark.slow  # another process, under strace
@pytest.mark.parametrize("subcommand", ["validate", "fit"])
def test_a_start_reads_its_checkpoint_once_and_hands_it_along(run, tmp_path, subcommand):
    # The plan maps the file once (a memory-mapped, weights-only load: 2 opens); the fit checks, LightningCLI's
    # hyperparameters and Lightning's restore use that load. Before: 9 opens for `validate --ckpt_path FILE`.
    strace = shutil.which("strace")
    # --seccomp-bpf stops the process only at the traced calls (3x faster than stopping at every call; strace >= 5.3)
    tracer = [strace, "--seccomp-bpf", "-f", "-qq", "-e", "trace=open,openat,openat2"]
    if strace is None or subprocess.run([*tracer, "-o", "/dev/null", "true"], capture_output=True).returncode != 0:
        pytest.skip("needs a working strace (>= 5.3, with seccomp-bpf)")
    root = tmp_path / "root"
    checkpoint = root / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt"
    checkpoint.parent.mkdir(parents=True)
    shutil.copy(run.last, checkpoint)  # fit continues that run: it rewrites last.ckpt (a new file, not an open of it)
    trace = tmp_path / "trace.txt"
    args = [subcommand, *run.args, f"--trainer.default_root_dir={root}", "--trainer.max_epochs=2",
            f"--ckpt_path={checkpoint}"]
    result = run_project(args, launcher=[*tracer, "-o", str(trace), sys.executable])
    assert result.returncode == 0, result.stderr[-3000:]
    opens = opens_of(checkpoint, trace)
    assert 1 <= len(opens) <= 2, "\n".join(opens)


def test_print_config_fed_back_reproduces_the_run_into_the_same_dir(run, capsys, tmp_path):
    with pytest.raises(SystemExit) as exited:
        cli_main(["fit", *run.args, "--print_config"])
    assert exited.value.code == 0
    printed = tmp_path / "printed.yaml"
    printed.write_text(capsys.readouterr().out)

    # The printed config names the same default_root_dir: this rerun lands next to the first one, not over it.
    before = {p: p.stat().st_mtime_ns for p in run.version_dir.rglob("*") if p.is_file()}
    cli = cli_main(["fit", "--config", str(printed)])
    rerun_dir = Path(cli.trainer.log_dir)
    assert rerun_dir == run.root_dir / "lightning_logs" / "version_1"
    assert {p: p.stat().st_mtime_ns for p in run.version_dir.rglob("*") if p.is_file()} == before
    first, second = (yaml.safe_load((d / "config.yaml").read_text()) for d in (run.version_dir, rerun_dir))
    # Each run's config names its own version dir (the logger is pinned to it); everything else is the same.
    assert [c["trainer"].pop("logger")["init_args"]["version"] for c in (first, second)] == [0, 1]
    assert second == first
    assert float(cli.trainer.callback_metrics["val/acc1"]) == pytest.approx(run.metrics["val/acc1"])


@pytest.mark.template
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


@pytest.mark.template
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


def test_a_batch_limit_of_1_is_one_batch_and_1_0_all_of_them(tiny_root, tmp_path):
    # Lightning types these Union[float, int]: parsed float-first, `1` used to arrive as 1.0 = every batch.
    LightningArgumentParser().add_lightning_class_args(L.Trainer, "trainer")  # a stock Trainer parser built first
    limits = tmp_path / "limits.yaml"
    limits.write_text("trainer:\n  limit_val_batches: 1\n")
    cli = cli_main(["fit", *tiny_args(tiny_root, tmp_path, "--trainer.limit_train_batches=1", "--config", str(limits))])
    assert cli.trainer.global_step == 1  # 40 images at batch 8 would be 5 steps
    assert cli.trainer.num_val_batches == [1]  # 17 val images at batch 8 would be 3
    cli = cli_main(tiny_args(tiny_root, tmp_path, "--trainer.limit_train_batches=1.0",
                             "--trainer.limit_val_batches=0.5"),
                   run=False)
    assert (cli.trainer.limit_train_batches, cli.trainer.limit_val_batches) == (1.0, 0.5)


@pytest.mark.template
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


@pytest.mark.template
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
