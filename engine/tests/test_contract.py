"""The contract, from the user's side: a LightningModule written from scratch (not a subclass of the template's) and a
plain data module, in a temporary folder, importing only Lightning, torch and the engine's public API, run by
`python -m classifier_engine` alone (no template): they train with the data module's own batch size, keep the best
checkpoint by their own metric, resume mid-epoch to the uninterrupted weights, validate alike at 1 and 2 ranks,
predict a folder of images to a CSV with their class names, and export.

    python -m pytest engine/tests/test_contract.py --durations=0
"""

import csv
import json
import os
import re
import signal
import sys

import lightning as L
import pytest
import torch
import yaml
from PIL import Image

import classifier_engine
import warm_python
from classifier_engine import Monitor
from classifier_engine.errors import UserError
from conftest import TESTS, callback
from plain_model import TinyNet

MY_DATA = '''
import random

import lightning as L
import numpy as np
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch.utils.data import DataLoader, Dataset, TensorDataset
from torchvision.transforms import v2


class Digits(L.LightningDataModule):
    def __init__(self, batch_size: int = 12, train_size: int = 96, val_size: int = 101):
        super().__init__()
        x, y = load_digits(return_X_y=True)
        images = torch.tensor(x, dtype=torch.float32).reshape(-1, 1, 8, 8).div(16).expand(-1, 3, -1, -1)
        images, labels = F.interpolate(images, size=16), torch.tensor(y)
        self.train_set = TensorDataset(images[:train_size], labels[:train_size])
        self.val_set = TensorDataset(images[-val_size:], labels[-val_size:])
        self.num_classes, self.class_names = 10, ["zero", "one", "two", "three", "four", "five", "six", "seven",
                                                  "eight", "nine"]
        self.batch_size = batch_size

    def train_dataloader(self):
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self):
        return DataLoader(self.val_set, batch_size=self.batch_size)


class Augmented(Dataset):
    """Ordinary random augmentation: torchvision's v2 transforms (torch's generator), numpy's and random's."""

    def __init__(self, images, labels):
        self.images, self.labels = images, labels
        self.augment = v2.Compose([v2.RandomResizedCrop(16, scale=(0.5, 1.0)), v2.RandomHorizontalFlip()])

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        image = self.augment(self.images[index]) * float(np.random.uniform(0.8, 1.2))
        return (image.flip(1) if random.random() < 0.5 else image), self.labels[index]


class AugmentedDigits(Digits):
    def train_dataloader(self):
        return DataLoader(Augmented(*self.train_set.tensors), batch_size=self.batch_size, shuffle=True,
                          num_workers=2)
'''

LAST = "lightning_logs/version_0/checkpoints/last.ckpt"


@pytest.fixture(scope="module")
def code(tmp_path_factory):
    folder = tmp_path_factory.mktemp("my_code")
    (folder / "my_model.py").write_text((TESTS / "plain_model.py").read_text())
    (folder / "my_data.py").write_text(MY_DATA)
    sys.path.insert(0, str(folder))
    yield folder
    sys.path.remove(str(folder))
    for name in ("my_model", "my_data"):
        sys.modules.pop(name, None)


def args(run_dir, *extra: str) -> list[str]:
    """No --config and no template: the classes by class_path, the data module's own defaults."""
    return ["--model.class_path=my_model.TinyNet", "--data.class_path=my_data.Digits", "--trainer.accelerator=cpu",
            "--trainer.devices=1", "--trainer.max_epochs=2", "--trainer.enable_progress_bar=false",
            "--trainer.enable_model_summary=false", "--trainer.log_every_n_steps=1",
            f"--trainer.default_root_dir={run_dir}", *extra]


def engine(subcommand: str, *arguments: str):
    """`python -m classifier_engine SUBCOMMAND ...` in-process: the engine with no default classes."""
    return classifier_engine.cli_main([subcommand, *arguments])


def weights(path) -> dict[str, torch.Tensor]:
    checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    return {k: v for k, v in checkpoint["state_dict"].items() if v.is_floating_point()}


@pytest.fixture(scope="module")
def reference(code, tmp_path_factory):
    """Two epochs of 8 steps (96 images at the data module's own 12), uninterrupted."""
    run_dir = tmp_path_factory.mktemp("reference")
    cli = engine("fit", *args(run_dir))
    return run_dir, cli


def test_the_data_modules_own_defaults_and_the_models_own_metric_decide(reference):
    run_dir, cli = reference
    saved = (run_dir / "lightning_logs" / "version_0" / "config.yaml").read_text()
    assert re.search(r"class_path: my_data\.Digits\n  init_args:\n    batch_size: 12\n", saved), saved
    assert cli.trainer.global_step == 16  # 8 steps an epoch: batches of 12, not a template's 256
    best = cli.trainer.checkpoint_callback
    assert best.monitor == "val/accuracy" and best.mode == "max"
    names = sorted(p.name for p in (run_dir / "lightning_logs" / "version_0" / "checkpoints").iterdir())
    assert "last.ckpt" in names and any(re.fullmatch(r"epoch00\d-val_accuracy=0\.\d{4}\.ckpt", n) for n in names)


def test_print_config_shows_the_models_own_metric_and_mode(code, tmp_path, capsys):
    # Fed back with --config, the printed options are the run's: a printed ModelCheckpoint default (mode: min) once
    # kept the worst accuracy as the best checkpoint.
    with pytest.raises(SystemExit):
        engine("fit", *args(tmp_path), "--print_config")
    printed = yaml.safe_load(capsys.readouterr().out)["checkpoint"]
    assert (printed["monitor"], printed["mode"]) == ("val/accuracy", "max")
    assert printed["filename"] == "epoch{epoch:03d}-val_accuracy={val/accuracy:.4f}"


def test_stopped_mid_epoch_it_resumes_to_the_uninterrupted_weights(reference, tmp_path):
    with pytest.raises(SystemExit) as stopped:  # SIGTERM as step 11 starts (epoch 1, batch 3): saved, exit 143
        engine("fit", *args(tmp_path, callback("stop_callbacks.SignalAtStep", step=11, signum=int(signal.SIGTERM))))
    assert stopped.value.code == 143
    engine("fit", *args(tmp_path), "--ckpt_path=last")
    resumed, uninterrupted = weights(tmp_path / LAST), weights(reference[0] / LAST)
    assert resumed.keys() == uninterrupted.keys()
    for key in uninterrupted:
        torch.testing.assert_close(resumed[key], uninterrupted[key], rtol=1e-6, atol=1e-6, msg=key)


def test_its_own_random_transforms_stopped_mid_epoch_resume_to_the_uninterrupted_weights(code, tmp_path):
    # A data set drawing from torch's, numpy's and random's global generators in 2 DataLoader workers: the library
    # seeds each sample's draws from (seed, epoch, index), so a resumed epoch augments each image as before.
    augmented = "--data.class_path=my_data.AugmentedDigits"
    engine("fit", *args(tmp_path / "uninterrupted", augmented))
    with pytest.raises(SystemExit) as stopped:
        engine("fit", *args(tmp_path / "run", augmented, callback("stop_callbacks.SignalAtStep", step=11,
                                                                  signum=int(signal.SIGTERM))))
    assert stopped.value.code == 143
    engine("fit", *args(tmp_path / "run", augmented), "--ckpt_path=last")
    resumed, uninterrupted = weights(tmp_path / "run" / LAST), weights(tmp_path / "uninterrupted" / LAST)
    distance = sum(float((resumed[k] - uninterrupted[k]).double().pow(2).sum()) for k in uninterrupted) ** 0.5
    norm = sum(float(uninterrupted[k].double().pow(2).sum()) for k in uninterrupted) ** 0.5
    print(json.dumps({"relative_distance": distance / norm}))
    assert distance <= 1e-6 * norm


def test_a_data_set_drawing_from_a_generator_of_its_own_is_named_in_one_line_at_resume(code):
    import warnings

    import my_data
    from torch.utils.data import DataLoader

    from classifier_engine.samplers import ExactLoaders

    class OwnGenerator(my_data.Augmented):  # a generator of its own: it goes on from wherever it stood
        def __init__(self, *tensors):
            super().__init__(*tensors)
            self.generator = torch.Generator().manual_seed(0)

        def __getitem__(self, index):
            image, label = super().__getitem__(index)
            return image + 0.1 * torch.rand(image.shape, generator=self.generator), label

    class OwnGeneratorDigits(my_data.Digits):
        def train_dataloader(self):
            return DataLoader(OwnGenerator(*self.train_set.tensors), batch_size=self.batch_size, shuffle=True)

    state = {"epoch": 1, "position": 24, "seed": 42, "world_size": 1, "batch_size": 12, "dataset_size": 96,
             "repeats": 1, "global_batch": None}  # a checkpoint's, 2 steps into epoch 1
    named = {}
    for module in (my_data.AugmentedDigits(), OwnGeneratorDigits()):
        loaders = ExactLoaders(module, seed=42)
        loaders.load_state_dict({"train_loader": state})
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            module.train_dataloader()
        named[type(module).__name__] = [str(w.message) for w in caught if "generator of its own" in str(w.message)]
    assert named == {"AugmentedDigits": [], "OwnGeneratorDigits": [
        "data module test_a_data_set_drawing_from_a_generator_of_its_own_is_named_in_one_line_at_resume.<locals>."
        "OwnGeneratorDigits: its training set gives sample 0 differently when drawn twice with the same seeds, so it "
        "draws randomness from a generator of its own and this resume is not the uninterrupted run; draw from "
        "torch's, numpy's or random's global generators (engine/README.md#resuming-exactly)"]}


def test_it_predicts_a_folder_to_a_csv_with_its_class_names_and_exports(reference, tmp_path):
    run_dir = reference[0]
    images = tmp_path / "images"
    for i in range(5):
        (images / f"sub{i % 2}").mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (16, 16), (40 * i, 255 - 40 * i, 128)).save(images / f"sub{i % 2}" / f"{i}.png")
    out = tmp_path / "predictions.csv"
    engine("predict", *args(run_dir), f"--ckpt_path={run_dir / LAST}", f"--predictions.images={images}",
           f"--predictions.output={out}")
    rows = list(csv.reader(out.open()))
    assert len(rows) == 6 and rows[1][0].endswith("sub0/0.png")
    assert {rows[r][c] for r in range(1, 6) for c in (1, 3, 5)} <= set(MY_DATA_NAMES)
    # Another size beside them: this module offers no eval_preprocessing() (no resize), so they make no batch.
    Image.new("RGB", (20, 12), (0, 0, 0)).save(images / "wide.png")
    versions = sorted(run_dir.glob("lightning_logs/*"))
    with pytest.raises(UserError, match=r"^--predictions.images: .*sub0/0.png is 16x16 pixels, .*wide.png 20x12: a "
                       r"batch holds images of one size, .* or pass --predictions.batch_size 1$"):
        engine("predict", *args(run_dir), f"--ckpt_path={run_dir / LAST}", f"--predictions.images={images}",
               f"--predictions.output={out}")
    assert len(list(csv.reader(out.open()))) == 6 and sorted(run_dir.glob("lightning_logs/*")) == versions
    engine("predict", *args(run_dir), f"--ckpt_path={run_dir / LAST}", f"--predictions.images={images}",
           f"--predictions.output={out}", "--predictions.batch_size=1")
    assert len(list(csv.reader(out.open()))) == 7
    from classifier_engine.export import main as export_main

    config = run_dir / "lightning_logs" / "version_0" / "config.yaml"
    files = export_main(["--ckpt_path", str(run_dir / LAST), "--config", str(config), "--out_dir",
                         str(tmp_path / "export"), "--no-onnx"])
    meta = json.loads(files["json"].read_text())
    assert meta["class_names"] == MY_DATA_NAMES and meta["module"] == "torch.nn.modules.container.Sequential"
    assert meta["input"]["checked_size"] == [16, 16] and meta["preprocessing"]["mean"] == [0.0, 0.0, 0.0]
    program = torch.export.load(files["pt2"]).module()
    assert program(torch.rand(3, 3, 16, 16)).shape == (3, 10)


MY_DATA_NAMES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]


@pytest.mark.slow
def test_it_validates_alike_at_one_and_two_ranks(code, reference, capsys):
    run_dir, checkpoint = reference[0], reference[0] / LAST
    capsys.readouterr()
    engine("validate", *args(run_dir), f"--ckpt_path={checkpoint}")
    one = float(re.search(r"val/accuracy\s+([0-9.]+)", capsys.readouterr().out).group(1))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(code), os.environ.get("PYTHONPATH", "")])}
    two = warm_python.run(["validate", *args(run_dir), "--trainer.strategy=ddp_fork", "--trainer.devices=2",
                           f"--ckpt_path={checkpoint}"], module="classifier_engine", cwd=os.getcwd(), env=env,
                          timeout=600)
    assert two.returncode == 0, two.stderr[-3000:]
    assert float(re.search(r"val/accuracy\s+([0-9.]+)", two.stdout).group(1)) == one  # 51 + 50 images, none twice


# -- The model contract checked as written, before the first step ------------------------------------------------------

class RenamedMetric(TinyNet):  # its Monitor kept the old name of what it logs
    monitor = Monitor("val/accuracy", "max")
    metric = "val/acc"


class MonitorAsText(TinyNet):
    monitor = "val/loss"


class LossWithoutMode(TinyNet):
    monitor = Monitor("val/loss")


class FixedHead(L.LightningModule):  # takes no num_classes: a 10-way head whatever the data
    monitor = Monitor("val/accuracy", "max")

    def __init__(self, lr: float = 0.05):
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 16 * 16, 10))


def main_lines(arguments: list[str], monkeypatch, capsys) -> tuple[int, list[str]]:
    """`python -m APP fit ARGUMENTS` in-process: its exit code and the lines it wrote."""
    from conftest import project_in_process

    code_, out, err = project_in_process(["fit", *arguments], monkeypatch, capsys)
    return code_, [line.strip() for line in (out + err).splitlines()]


def test_a_monitor_the_model_never_logs_is_one_line_at_the_sanity_check_or_after_last_ckpt_is_saved(
        code, tmp_path, monkeypatch, capsys):
    renamed = "--model.class_path=test_contract.RenamedMetric"
    line = ("error: the best checkpoint's metric 'val/accuracy' is not one the model logs at validation (it logs {}): "
            "log it, or name one of those in the model's Monitor or --checkpoint.monitor")
    exit_code, lines = main_lines(args(tmp_path / "sanity", renamed), monkeypatch, capsys)
    assert (exit_code, lines[-1]) == (2, line.format("val/acc"))  # before a step: the start leaves nothing behind
    assert not (tmp_path / "sanity").exists()
    # Without a sanity check the first validation ends epoch 0: last.ckpt first, then the line.
    exit_code, lines = main_lines(args(tmp_path / "epoch", renamed, "--trainer.num_sanity_val_steps=0"), monkeypatch,
                                  capsys)
    last = tmp_path / "epoch" / LAST
    assert (exit_code, lines[-1]) == (2, line.format("lr-SGD, train/loss, val/acc") + f"; saved {last} at global "
                                      "step 8: the same command with --ckpt_path last continues there")
    assert torch.load(last, weights_only=True)["global_step"] == 8


def test_a_monitor_that_is_not_a_monitor_none_or_a_loss_without_a_mode_is_said_in_the_plan(code, tmp_path,
                                                                                           monkeypatch, capsys):
    said = {}
    for model in ("MonitorAsText", "LossWithoutMode", "my_model.Unmonitored"):
        path = model if "." in model else f"test_contract.{model}"
        exit_code, lines = main_lines([*args(tmp_path, f"--model.class_path={path}"), "--plan"], monkeypatch, capsys)
        assert exit_code == 0
        said[model] = next(line for line in lines if line.startswith("monitor: "))
    assert said == {
        "MonitorAsText": "monitor: none (test_contract.MonitorAsText.monitor is 'val/loss', not a Monitor: ignored; "
                         "\"best\" is the latest epoch's checkpoint)",
        "LossWithoutMode": "monitor: metric val/loss, mode min (LossWithoutMode.monitor, no mode given: min for a loss "
                           "or an error)",
        "my_model.Unmonitored": "monitor: none (my_model.Unmonitored names no Monitor; \"best\" is the latest epoch's "
                                "checkpoint)"}
    assert (Monitor("val/err1").mode, Monitor("val/acc").mode, Monitor("val/loss", "max").mode) == ("min", "max", "max")


def test_a_model_that_takes_no_num_classes_is_refused_in_one_line(code, tmp_path, monkeypatch, capsys):
    exit_code, lines = main_lines(args(tmp_path, "--model.class_path=test_contract.FixedHead"), monkeypatch, capsys)
    assert (exit_code, lines[-1]) == (2, "error: model FixedHead takes no num_classes: its head cannot follow the "
                                         "data's 10 classes; take `num_classes: int` in its __init__, build the head "
                                         "with it and call self.save_hyperparameters() (see engine/README.md)")
    assert not tmp_path.exists() or not any(tmp_path.iterdir())


def test_the_contract_imports_without_the_cli_s_parser():
    # A model module imports Monitor where only torch and Lightning are installed (the GPU machine has no jsonargparse).
    import subprocess

    from conftest import project_env

    script = """if True:
        import sys

        class NoParser:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] == "jsonargparse":
                    raise ImportError(f"no {name} here")

        sys.meta_path.insert(0, NoParser())
        from classifier_engine.contract import ClassificationModel, Monitor, monitor_of
        print(monitor_of("plain_model.TinyNet").metric)
    """
    done = subprocess.run([sys.executable, "-c", script], env=project_env(), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "val/accuracy", done.stderr[-2000:]
