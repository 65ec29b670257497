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

import pytest
import torch
import yaml
from PIL import Image

import classifier_engine
import warm_python
from conftest import TESTS, callback

MY_DATA = '''
import lightning as L
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch.utils.data import DataLoader, TensorDataset


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
