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
    """The model's random stream (dropout, stochastic depth) then depends only on the seed and the epoch.

    Data augmentation does not rely on it: Lightning fetches the first epoch's first batch before this hook,
    so the data module seeds each sample itself (data/seeded.py).
    """

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        seed = epoch_seed(int(os.environ.get("PL_GLOBAL_SEED", 0)), trainer.current_epoch, trainer.global_rank)
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)
