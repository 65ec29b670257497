"""The room's model with a user's own data module, and a user's own model chosen over the room's default: each starts
from its own defaults, and what the room's model needs of the data is said in one line before the first step.

    python -m pytest tests/test_your_data_and_model.py
"""

import sys

import pytest

from conftest import QUICKSTART, cli_main, project_in_process

# What a user writes: digits as tensors (no files), plain DataLoaders; a variant whose train loader has no length.
MY_DATA = '''
import lightning as L
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch.utils.data import DataLoader, IterableDataset, TensorDataset


class Digits(L.LightningDataModule):
    def __init__(self, batch_size: int = 12, train_size: int = 96, val_size: int = 101):
        super().__init__()
        x, y = load_digits(return_X_y=True)
        images = torch.tensor(x, dtype=torch.float32).reshape(-1, 1, 8, 8).div(16).expand(-1, 3, -1, -1)
        images, labels = F.interpolate(images, size=16), torch.tensor(y)
        self.train_set = TensorDataset(images[:train_size], labels[:train_size])
        self.val_set = TensorDataset(images[-val_size:], labels[-val_size:])
        self.num_classes, self.class_names = 10, [str(i) for i in range(10)]
        self.batch_size = batch_size

    def train_dataloader(self):
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self):
        return DataLoader(self.val_set, batch_size=self.batch_size)


class Stream(IterableDataset):
    def __init__(self, images, labels):
        self.images, self.labels = images, labels

    def __iter__(self):
        return zip(self.images, self.labels)


class IterableDigits(Digits):
    def train_dataloader(self):
        return DataLoader(Stream(*self.train_set.tensors), batch_size=self.batch_size)
'''


@pytest.fixture(scope="module")
def code(tmp_path_factory):
    folder = tmp_path_factory.mktemp("my_code")
    (folder / "my_data.py").write_text(MY_DATA)
    sys.path.insert(0, str(folder))
    yield folder
    sys.path.remove(str(folder))
    sys.modules.pop("my_data", None)


def args(run_dir, *extra: str) -> list[str]:
    """No --config: the classes by class_path, the data module's own defaults."""
    return ["--model.class_path=plain_model.TinyNet", "--data.class_path=my_data.Digits", "--trainer.accelerator=cpu",
            "--trainer.devices=1", "--trainer.max_epochs=2", "--trainer.enable_progress_bar=false",
            "--trainer.enable_model_summary=false", "--trainer.log_every_n_steps=1",
            f"--trainer.default_root_dir={run_dir}", *extra]


def test_a_class_chosen_over_the_templates_default_starts_from_its_own_defaults(code, tmp_path, monkeypatch, capsys):
    cli = cli_main([*args(tmp_path / "run"), "--model.class_path=project.ImageClassifier",
                    "--model.init_args.arch=resnet18", "--trainer.max_epochs=1", "--trainer.limit_train_batches=1",
                    "--trainer.limit_val_batches=1"], run=False)
    assert cli.datamodule.batch_size == 12 and cli.model.hparams.batch_size == 12  # not ImageNetDataModule's 256
    code_, _, err = project_in_process(["fit", "--data.root=/nowhere", *args(tmp_path / "refused")], monkeypatch,
                                       capsys)  # the flag before the switch was meant for the class before it
    line = err.strip().splitlines()[-1]
    assert code_ == 2 and line.startswith("error: --data.root was given for ImageNetDataModule, and my_data.Digits "
                                          "takes no root"), line
    assert not (tmp_path / "refused").exists()
    # A model naming no metric gets ModelCheckpoint's own defaults, not the template model's val/acc1.
    cli = cli_main([*args(tmp_path / "plain"), "--model.class_path=plain_model.Unmonitored"], run=False)
    assert cli.trainer.checkpoint_callback.monitor is None


def test_an_iterable_train_loader_with_warmup_in_epochs_is_one_line_before_the_first_step(code, tmp_path, monkeypatch,
                                                                                           capsys):
    given = ["--config", str(QUICKSTART), "--data.class_path=my_data.IterableDigits", "--data.init_args.batch_size=16",
             "--trainer.enable_progress_bar=false", "--trainer.max_epochs=1", "--trainer.max_steps=3",
             f"--trainer.default_root_dir={tmp_path}"]
    code_, _, err = project_in_process(["fit", *given], monkeypatch, capsys)
    errors = [line for line in err.splitlines() if line.startswith("error")]
    assert code_ == 2 and "Traceback" not in err and len(errors) == 1, err[-3000:]
    assert errors[0].startswith("error: ") and ("warmup (and a step schedule's milestones) are counted in epochs: set "
                                                "--model.optim.warmup_epochs=0") in errors[0], errors[0]
    assert not list(tmp_path.rglob("*.ckpt"))  # not a step trained
