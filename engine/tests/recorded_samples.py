"""A user's map-style data module whose images carry their own index, and a callback that writes which indices each
optimizer step trained on (test_global_batch.py passes them by class_path to `python -m ... fit` subprocesses).

    --data.class_path=recorded_samples.NumberedImages --trainer.callbacks+='{"class_path":
        "recorded_samples.RecordSamples", "init_args": {"folder": "DIR"}}'
"""

import json
import os
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset


class NumberedImages(L.LightningDataModule):
    """`train_size` random 16 px images in 4 classes, image i's first pixel set to i; plain DataLoaders."""

    def __init__(self, batch_size: int = 8, train_size: int = 100, val_size: int = 10):
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        images = torch.rand(train_size + val_size, 3, 16, 16, generator=generator)
        labels = torch.randint(0, 4, (train_size + val_size,), generator=generator)
        images[:, 0, 0, 0] = torch.arange(train_size + val_size, dtype=torch.float32)
        self.train_set = TensorDataset(images[:train_size], labels[:train_size])
        self.val_set = TensorDataset(images[train_size:], labels[train_size:])
        self.num_classes, self.class_names = 4, ["a", "b", "c", "d"]
        self.batch_size = batch_size

    def train_dataloader(self):
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self):
        return DataLoader(self.val_set, batch_size=self.batch_size)


class RecordSamples(L.Callback):
    """Appends one JSON line per training batch to <folder>/<pid>.jsonl: step, epoch, rank and the images' indices
    (written and closed at once: a kill -9 loses no line)."""

    def __init__(self, folder: str):
        self.folder = Path(folder)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        ids = batch[0][:, 0, 0, 0].round().long().tolist()
        line = {"step": trainer.global_step, "epoch": trainer.current_epoch, "rank": trainer.global_rank, "ids": ids}
        self.folder.mkdir(parents=True, exist_ok=True)
        with open(self.folder / f"{os.getpid()}.jsonl", "a") as file:
            file.write(json.dumps(line) + "\n")


def read_records(folder: Path) -> list[dict]:
    return [json.loads(line) for path in sorted(folder.glob("*.jsonl")) for line in path.read_text().splitlines()]


class FixedBatches(NumberedImages):
    """The same images with no batch_size argument: --global_batch_size cannot set its batch."""

    def __init__(self, train_size: int = 100):
        super().__init__(8, train_size)
