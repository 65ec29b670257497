"""README "Bring your own data": a plain LightningDataModule, written outside the project and importing nothing of it,
trains by `--data.class_path`, validates, resumes mid-epoch exactly and evaluates exactly under ddp.

    python -m pytest tests/test_any_data.py --durations=0
"""

import signal
import sys

import pytest
import torch

from conftest import QUICKSTART, callback, cli_main

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

# The same data module, broken one way at a time: what a user's module may hand the engine (issue 39, item 11).
BAD_DATA = '''
import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from my_data import Digits


class Stream(IterableDataset):
    def __init__(self, images, labels):
        self.images, self.labels = images, labels

    def __iter__(self):
        return zip(self.images, self.labels)


class Bad(Digits):
    def __init__(self, case: str, batch_size: int = 16):
        super().__init__(batch_size)
        self.case = case
        if case == "labels out of range":
            images, labels = self.val_set.tensors
            self.val_set = TensorDataset(images, labels + 3)
        if case == "no class_names":
            self.class_names = None

    def train_dataloader(self):
        images, labels = self.train_set.tensors
        if self.case.startswith("iterable"):
            return DataLoader(Stream(images, labels), batch_size=self.batch_size)
        if self.case == "(x, y, extra)":
            return DataLoader(TensorDataset(images, labels, labels), batch_size=self.batch_size)
        if self.case == "dicts":
            return DataLoader(self.train_set, batch_size=self.batch_size,
                              collate_fn=lambda samples: {"image": torch.stack([x for x, _ in samples])})
        return super().train_dataloader()

    def val_dataloader(self):
        return DataLoader(self.val_set, batch_size=self.batch_size, drop_last=self.case == "drop_last")
'''

LAST = "lightning_logs/version_0/checkpoints/last.ckpt"


@pytest.fixture(scope="module")
def my_data(tmp_path_factory):
    code = tmp_path_factory.mktemp("code")
    (code / "my_data.py").write_text(MY_DATA)
    (code / "bad_data.py").write_text(BAD_DATA)
    sys.path.insert(0, str(code))
    yield code
    sys.path.remove(str(code))
    sys.modules.pop("my_data", None)
    sys.modules.pop("bad_data", None)


def args(run_dir, *extra: str) -> list[str]:
    return ["--config", str(QUICKSTART), "--data.class_path=my_data.Digits", "--data.init_args.batch_size=16",
            "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false", "--trainer.max_epochs=2",
            "--trainer.log_every_n_steps=1", f"--trainer.default_root_dir={run_dir}", *extra]


def weights(path) -> dict[str, torch.Tensor]:
    checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    return {k: v for k, v in checkpoint["state_dict"].items() if v.is_floating_point()}


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


# A plain validation loader at 1 and 2 ranks (51 + 50 images, none twice, not Lightning's padded 51 + 51): the
# from-scratch model with this data module in test_contract.py (the exactness is the data side's).


BROKEN = {  # case: (extra arguments, what the one line says)
    "dicts": ((), "train_dataloader yields a dict (keys image), expected a pair (images, labels)"),
    "(x, y, extra)": ((), "train_dataloader yields a list of 3 (Tensor, Tensor, Tensor), expected a pair"),
    "labels out of range": ((), "val_dataloader yields label 12, outside 0..9 (num_classes is 10)"),
    "no class_names": ((), "class_names is NoneType, expected a list of the class names"),
    "iterable, no max_steps": ((), "train_dataloader has no length (an IterableDataset without __len__): the run's "
                                   "length in steps is unknown; set --trainer.max_steps"),
}


@pytest.mark.parametrize("case", BROKEN)
def test_a_data_module_that_breaks_the_contract_is_one_line_before_the_first_step(my_data, case, tmp_path,
                                                                                   monkeypatch, capsys):
    from conftest import project_in_process

    extra, expected = BROKEN[case]
    given = args(tmp_path, "--data.class_path=bad_data.Bad", "--trainer.max_epochs=1", f"--data.init_args.case={case}",
                 *extra)
    code, _, err = project_in_process(["fit", *given], monkeypatch, capsys)
    errors = [line for line in err.splitlines() if line.startswith("error")]
    assert code == 2 and "Traceback" not in err and len(errors) == 1, err[-3000:]
    assert errors[0].startswith("error: ") and expected in errors[0], errors[0]
    assert not list(tmp_path.rglob("*.ckpt"))  # not a step trained


def test_an_iterable_train_loader_trains_to_max_steps(my_data, tmp_path):
    cli_main(["fit", *args(tmp_path, "--data.class_path=bad_data.Bad", "--data.init_args.case=iterable",
                           "--trainer.max_steps=3")])
    assert torch.load(tmp_path / LAST, map_location="cpu", weights_only=True)["global_step"] == 3


@pytest.mark.parametrize("world_size", [1, 2])
def test_a_validation_loader_with_drop_last_still_evaluates_every_image(my_data, world_size):
    # 101 images in batches of 16: drop_last=True would evaluate 96 on one process and 80 (5 x 16) on two.
    from types import SimpleNamespace

    from bad_data import Bad

    from classifier_engine.samplers import ExactLoaders

    seen = 0
    for rank in range(world_size):
        data = Bad(case="drop_last")
        ExactLoaders(data, seed=0)
        data.trainer = SimpleNamespace(world_size=world_size, global_rank=rank, max_steps=-1)
        with pytest.warns(UserWarning, match="val_dataloader has drop_last=True: every image is evaluated"):
            loader = data.val_dataloader()
        seen += sum(len(labels) for _, labels in loader)
    assert seen == 101


def test_an_evaluation_loader_that_drops_images_in_its_own_batch_sampler_is_refused_in_one_line(my_data):
    from bad_data import Bad
    from torch.utils.data import BatchSampler, DataLoader, SequentialSampler

    from classifier_engine.errors import ConfigError
    from classifier_engine.samplers import ExactLoaders

    data = Bad(case="ok")
    loaders = ExactLoaders(data, seed=0)
    dropping = DataLoader(data.val_set, batch_sampler=BatchSampler(SequentialSampler(data.val_set), 16, True))
    with pytest.raises(ConfigError, match=r"val_dataloader drops its last partial batch \(drop_last\): exact "
                                          r"evaluation needs every image; build it with drop_last=False"):
        loaders.exact(dropping, "val_dataloader", None)
