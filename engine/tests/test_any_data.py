"""README "Bring your own data": a plain LightningDataModule, written outside the project and importing nothing of it,
trains by `--data.class_path`, validates, resumes mid-epoch exactly and evaluates exactly under ddp.

    python -m pytest tests/test_any_data.py --durations=0
"""

import re
import signal
import sys

import pytest
import torch
from project import cli_main

from conftest import CONFIGS, QUICKSTART, callback, run_project

# What a user writes: digits as tensors (no files), plain DataLoaders; 101 validation images, which no world size
# of 2 or 3 divides.
MY_DATA = '''
import lightning as L
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch.utils.data import DataLoader, TensorDataset


class Digits(L.LightningDataModule):
    def __init__(self, batch_size: int = 16, train_size: int = 96, val_size: int = 101):
        super().__init__()
        x, y = load_digits(return_X_y=True)
        images = torch.tensor(x, dtype=torch.float32).reshape(-1, 1, 8, 8).div(16).expand(-1, 3, -1, -1)
        images, labels = F.interpolate(images, size=32), torch.tensor(y)
        self.train_set = TensorDataset(images[:train_size], labels[:train_size])
        self.val_set = TensorDataset(images[-val_size:], labels[-val_size:])
        self.num_classes, self.class_names = 10, [str(i) for i in range(10)]
        self.batch_size = batch_size

    def train_dataloader(self):
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self):
        return DataLoader(self.val_set, batch_size=self.batch_size)
'''

LAST = "lightning_logs/version_0/checkpoints/last.ckpt"


@pytest.fixture(scope="module")
def my_data(tmp_path_factory):
    code = tmp_path_factory.mktemp("code")
    (code / "my_data.py").write_text(MY_DATA)
    sys.path.insert(0, str(code))
    yield code
    sys.path.remove(str(code))
    sys.modules.pop("my_data", None)


def args(run_dir, *extra: str) -> list[str]:
    return ["--config", str(QUICKSTART), "--data.class_path=my_data.Digits", "--data.init_args.batch_size=16",
            "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false", "--trainer.max_epochs=2",
            "--trainer.log_every_n_steps=1", f"--trainer.default_root_dir={run_dir}", *extra]


def weights(path) -> dict[str, torch.Tensor]:
    checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    return {k: v for k, v in checkpoint["state_dict"].items() if v.is_floating_point()}


def val_acc1(output: str) -> float:
    return float(re.search(r"val/acc1\s+([0-9.]+)", output).group(1))


@pytest.fixture(scope="module")
def reference(my_data, tmp_path_factory):
    """Two epochs of 6 steps, uninterrupted (in-process)."""
    run_dir = tmp_path_factory.mktemp("reference")
    cli_main(["fit", *args(run_dir)])
    return run_dir


def test_a_plain_data_module_stopped_mid_epoch_resumes_to_the_uninterrupted_weights(reference, tmp_path):
    # SIGTERM as step 8 starts (epoch 1, batch 2): saved, exit 143; then --ckpt_path last continues that epoch.
    with pytest.raises(SystemExit) as stopped:
        cli_main(["fit", *args(tmp_path, callback("stop_callbacks.SignalAtStep", step=8, signum=int(signal.SIGTERM)))])
    assert stopped.value.code == 143
    cli_main(["fit", *args(tmp_path), "--ckpt_path=last"])
    resumed, uninterrupted = weights(tmp_path / LAST), weights(reference / LAST)
    assert resumed.keys() == uninterrupted.keys()
    for key in uninterrupted:
        torch.testing.assert_close(resumed[key], uninterrupted[key], rtol=1e-6, atol=1e-6, msg=key)


@pytest.mark.slow
def test_a_plain_validation_loader_gives_the_same_accuracy_at_one_and_two_ranks(my_data, reference, capsys):
    checkpoint = reference / LAST
    cli_main(["validate", *args(reference), f"--ckpt_path={checkpoint}"])
    one = val_acc1(capsys.readouterr().out)
    result = run_project(["validate", *args(reference), "--config", str(CONFIGS / "cpu_ddp.yaml"),
                          f"--ckpt_path={checkpoint}"], env={"PYTHONPATH": f"{my_data}"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert val_acc1(result.stdout) == one  # 51 and 50 images, none twice: not Lightning's padded 51 + 51
