"""Reseed every RNG at each training epoch from (seed, epoch, rank), so resuming at an epoch boundary is exact."""

import os
import random

import lightning as L
import numpy as np
import torch


def epoch_seed(base_seed: int, epoch: int, rank: int) -> int:
    """A distinct, reproducible seed per (run seed, epoch, global rank)."""
    return (base_seed * 1_000_003 + epoch * 10_007 + rank) % (2**31)


class ReseedEachEpoch(L.Callback):
    """Augmentations and dropout then depend only on the seed and the epoch, not on how many epochs ran in this process.

    DataLoader workers draw their base seed from the main process's RNG when an epoch's iterator is created,
    so their augmentations follow too (non-persistent workers; persistent ones keep their own streams).
    """

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        seed = epoch_seed(int(os.environ.get("PL_GLOBAL_SEED", 0)), trainer.current_epoch, trainer.global_rank)
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)
