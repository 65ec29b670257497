"""The data-bound verdict: a fit whose data set sleeps 50 ms an image is called data-bound with a fix, at each epoch's
end (log and TensorBoard) and over the run; the same fit without the sleep is not.

    python -m pytest engine/tests/test_data_bound.py
"""

import logging
import os
import time
from unittest import mock

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from classifier_engine.callbacks.data_bound import WorkerCost, best_fix, worker_cost
from classifier_engine.summary import verdict_line
from conftest import cli_main, read_scalars, tiny_args


class Sleepy(Dataset):
    """32-px images of 3 classes, each taking `delay` seconds to load (a slow disk, a costly decode)."""

    def __init__(self, count: int, delay: float):
        self.count, self.delay = count, delay

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int):
        time.sleep(self.delay)
        image = torch.rand(3, 32, 32, generator=torch.Generator().manual_seed(index))
        return image + index % 3, index % 3


class SleepyImages(L.LightningDataModule):
    """A user's data module (the contract's num_classes and class_names), its training images slowed by `delay`."""

    def __init__(self, delay: float = 0.0, batch_size: int = 8):
        super().__init__()
        self.delay, self.batch_size = delay, batch_size
        self.num_classes, self.class_names = 3, ["a", "b", "c"]

    def train_dataloader(self) -> DataLoader:
        return DataLoader(Sleepy(40, self.delay), batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(Sleepy(8, 0.0), batch_size=self.batch_size)


def fit(tmp_path, delay: float, caplog):
    args = tiny_args(None, tmp_path, f"--data.class_path={__name__}.SleepyImages", f"--data.init_args.delay={delay}",
                     "--trainer.max_epochs=2", "--model.init_args.width=128")  # a step of ~50 ms: the plain
    # model's default one is ~1 ms, shorter than even the fast pipeline's batch
    with mock.patch.dict(os.environ), caplog.at_level(logging.INFO):  # the CLI sets PL_GLOBAL_SEED
        cli = cli_main(["fit", *args])
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("epoch ")]
    return cli, lines


@pytest.mark.slow  # two short fits
def test_a_slowed_pipeline_is_data_bound_with_a_fix_and_a_fast_one_is_not(tmp_path, caplog):
    slow, slow_lines = fit(tmp_path / "slow", 0.05, caplog)
    caplog.clear()
    fast, fast_lines = fit(tmp_path / "fast", 0.0, caplog)
    cores = len(os.sched_getaffinity(0))
    print("\n".join([*slow_lines, verdict_line(slow.trainer), *fast_lines, verdict_line(fast.trainer)]))
    assert [line.split(":")[0] for line in slow_lines] == ["epoch 0", "epoch 1"] == [
        line.split(":")[0] for line in fast_lines]
    for line in [*slow_lines, verdict_line(slow.trainer)]:
        assert "data-bound: the step waited " in line and "in the main process: data.num_workers=0" in line
        fix = line.split("; the fix that would help most here: ")[1]
        assert fix.startswith(f"more workers (--data.num_workers={cores}" if cores > 1 else "none of more workers")
    for line in [*fast_lines, verdict_line(fast.trainer)]:
        assert "data-bound:" not in line and "input keeps up: the step waited " in line and "fix" not in line
    # The share the line says is the one TensorBoard holds, per epoch, and far apart for the two pipelines
    slow_waits = [value for _, value in read_scalars(slow.trainer.log_dir)["perf/epoch_data_wait"]]
    fast_waits = [value for _, value in read_scalars(fast.trainer.log_dir)["perf/epoch_data_wait"]]
    assert [f"waited {100 * w:.0f} %" in line for w, line in zip(slow_waits, slow_lines)] == [True, True]
    assert min(slow_waits) > 0.3 > 0.1 > max(fast_waits)
    # The worker's cost per image: the sleep, measured, in the slowed pipeline only
    slow_cost = read_scalars(slow.trainer.log_dir)["perf/worker_ms_per_image"]
    fast_cost = read_scalars(fast.trainer.log_dir)["perf/worker_ms_per_image"]
    assert min(v for _, v in slow_cost) >= 50 > 10 > max(v for _, v in fast_cost)


def test_a_worker_cost_splits_decode_and_augment_for_an_image_folder_and_leaves_the_random_streams(tiny_root):
    from classifier_engine import ImageFolderDataModule

    module = ImageFolderDataModule(str(tiny_root), batch_size=8, num_workers=0, pin_memory=False, train_crop_size=24)
    module.setup("fit")
    torch.manual_seed(3)
    cost = worker_cost(module.train_dataloader(), epoch=0)
    after = torch.rand(1)
    torch.manual_seed(3)
    assert torch.equal(after, torch.rand(1))  # the probe drew nothing from the run's stream
    assert cost is not None and 0 < cost.decode < cost.load and cost.collate > 0 and cost.side == 32
    assert cost.parts().startswith("decode ") and ", augment " in cost.parts()


DECODE_BOUND = WorkerCost(load=0.004, collate=0.0001, decode=0.003, side=400)  # 400-px JPEGs, a light preset
AUGMENT_BOUND = WorkerCost(load=0.010, collate=0.0001, decode=0.001, side=300)  # RandAugment on a large crop


@pytest.mark.parametrize("cost, setting, fix", [
    (DECODE_BOUND, dict(workers=0), "more workers (--data.num_workers=8; 8 cores a process)"),
    (DECODE_BOUND, dict(workers=2), "more workers (--data.num_workers=8; 8 cores a process)"),
    (DECODE_BOUND, dict(workers=8, gpu=True), "GPU decode (--data.decoder=nvjpeg)"),
    (DECODE_BOUND, dict(workers=8), "shards of 256 px (python -m classifier_engine.data.make_shards)"),
    (AUGMENT_BOUND, dict(workers=8, gpu=True), "a smaller crop (--data.train_crop_size=192)"),
    (AUGMENT_BOUND, dict(workers=8, decoder=None), "none of more workers, GPU decode, shards or a smaller crop"),
])
def test_the_fix_named_is_the_one_that_would_speed_the_pipeline_most(cost, setting, fix):
    setting = {"cores": 8, "decoder": "torchvision", "crop": 224, **setting}
    assert best_fix(cost, images_per_sec=3000, **setting).startswith(fix)
