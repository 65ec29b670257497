"""SyntheticDataModule: random batches made once and replayed: a benchmark measures the model and the loop, not JPEGs.

Like ImageNetDataModule's default pipeline the batches are uint8 and normalized on the training device, so the
host-to-device copy and the normalization cost the same as with real data; only decoding and augmentation are gone.

    python bench/gpu_bench.py --tiny        # the "synthetic" rows;  python bench/overhead.py --quick
"""

from collections.abc import Iterator

import lightning as L
import torch
from classifier_engine.data.transforms import IMAGENET_MEAN, IMAGENET_STD, NormalizeBatch
from torch.utils.data import DataLoader, IterableDataset


def synthetic_batches(
    *, batch_size: int, image_size: int, num_classes: int, distinct: int, seed: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`distinct` (uint8 images, targets) batches of random pixels, reproducible from `seed`."""
    generator = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randint(256, (batch_size, 3, image_size, image_size), generator=generator, dtype=torch.uint8),
            torch.randint(num_classes, (batch_size,), generator=generator),
        )
        for _ in range(distinct)
    ]


class ReplayedBatches(IterableDataset):
    """Yields `length` batches cycling over a few fixed ones; iterable: Lightning adds no sampler, never re-batches."""

    def __init__(self, batches: list[tuple[torch.Tensor, torch.Tensor]], length: int):
        self.batches = batches
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for index in range(self.length):
            yield self.batches[index % len(self.batches)]


class SyntheticDataModule(L.LightningDataModule):
    """Training batches of random uint8 images, normalized on the device as ImageNetDataModule's are."""

    def __init__(
        self,
        num_classes: int = 1000,
        batch_size: int = 256,
        image_size: int = 224,
        batches_per_epoch: int = 100,
        distinct_batches: int = 2,
        seed: int = 0,
        pin_memory: bool = True,
    ):
        """
        Args:
            num_classes: number of target classes.
            batch_size: images per batch per process (the model scales its LR from it, as with real data).
            image_size: side of the square images.
            batches_per_epoch: length of one epoch in batches.
            distinct_batches: how many different batches are generated and cycled over (memory: each is
                batch_size x 3 x image_size^2 bytes).
            seed: base seed; each process adds its global rank, so ddp ranks see different images.
            pin_memory: page-lock the batches once, when a GPU is present, so the copies are asynchronous.
        """
        super().__init__()
        if batch_size < 1 or image_size < 1 or batches_per_epoch < 1 or distinct_batches < 1:
            raise ValueError(
                "batch_size, image_size, batches_per_epoch and distinct_batches must all be >= 1, got "
                f"{batch_size}, {image_size}, {batches_per_epoch}, {distinct_batches}"
            )
        self.save_hyperparameters()
        self.num_classes = num_classes
        self.batch_size = batch_size
        self.batches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.normalize_batch = NormalizeBatch(IMAGENET_MEAN, IMAGENET_STD)

    def setup(self, stage: str) -> None:
        rank = self.trainer.global_rank if self.trainer is not None else 0
        hp = self.hparams
        self.batches = synthetic_batches(
            batch_size=self.batch_size,
            image_size=hp.image_size,
            num_classes=self.num_classes,
            distinct=hp.distinct_batches,
            seed=hp.seed + rank,
        )
        if hp.pin_memory and torch.cuda.is_available():
            # Pinned once here rather than by the DataLoader, which would copy every batch into pinned memory.
            self.batches = [(images.pin_memory(), targets.pin_memory()) for images, targets in self.batches]

    def train_dataloader(self) -> DataLoader:
        return DataLoader(ReplayedBatches(self.batches, self.hparams.batches_per_epoch), batch_size=None)

    def on_after_batch_transfer(self, batch, dataloader_idx: int):
        batch = self.normalize_batch.batch(batch)
        # "16-true"/"bf16-true" convert inputs before the transfer, when they were still uint8.
        return self.trainer.precision_plugin.convert_input(batch) if self.trainer is not None else batch
