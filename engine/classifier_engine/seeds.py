"""Every random draw of a run derives from the run seed and *where* it happens, never from how far a process got.

    python -m classifier_engine fit --config CONFIG --seed_everything 7    # the run seed

Which draw takes which seed: docs/how-it-works.md#seeds.
"""

import random
from collections.abc import Callable
from typing import Any, Optional

import lightning as L
import numpy as np
import torch
from torch.utils.data import Dataset

_MASK = (1 << 64) - 1


def _mix(*values: int) -> int:
    """A 63-bit hash of the values (splitmix64 rounds): nearby inputs give unrelated seeds."""
    state = 0x9E3779B97F4A7C15
    for value in values:
        state = (state ^ (value & _MASK)) & _MASK
        state = z = (state + 0x9E3779B97F4A7C15) & _MASK
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
        state = z ^ (z >> 31)
    return state >> 1  # torch generators take seeds below 2**63


def sample_seed(run_seed: int, epoch: int, index: int, repeat: int = 0) -> int:
    """Seed of one image's augmentation; `repeat` tells apart the copies of repeated augmentation (ra_reps)."""
    return _mix(1, run_seed, epoch, index, repeat)


def batch_seed(run_seed: int, epoch: int, batch_index: int) -> int:
    """Seed of one training batch's draws (MixUp/CutMix): the same on every rank at the same batch index."""
    return _mix(2, run_seed, epoch, batch_index)


def step_seed(run_seed: int, epoch: int, batch_index: int, rank: int) -> int:
    """Seed of the model's random stream for one training batch (each micro-batch its own) on one rank."""
    return _mix(3, run_seed, epoch, batch_index, rank)


def order_seed(run_seed: int, epoch: int) -> int:
    """Seed of one epoch's training order (the shuffle shared by all ranks)."""
    return _mix(4, run_seed, epoch)


class StepSeed(L.Callback):
    """Seeds torch's CPU (and CUDA) generator with step_seed(seed, epoch, batch, rank) at every training batch start."""

    def __init__(self, seed: int) -> None:
        self.seed = seed

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:
        seed = step_seed(self.seed, trainer.current_epoch, batch_idx, trainer.global_rank)
        torch.default_generator.manual_seed(seed)
        if pl_module.device.type == "cuda":
            torch.cuda.manual_seed(seed)


class SeededSamples(Dataset):
    """A map-style data set keyed (index, epoch, repeat) by ResumableSampler: each sample drawn with torch's CPU
    generator seeded from sample_seed(run seed, epoch, index, repeat), so an epoch resumed in its middle augments each
    sample as an uninterrupted run does, in any worker. `every_generator`: numpy's and random's too (a user's data set,
    engine/README.md#resuming-exactly). `transform_for_epoch(epoch)` transforms the image (None: the data set does)."""

    def __init__(self, dataset: Dataset, run_seed: int, transform_for_epoch: Optional[Callable[[int], Any]] = None,
                 every_generator: bool = False):
        self.dataset, self.run_seed, self.transform_for_epoch = dataset, run_seed, transform_for_epoch
        self.every_generator = every_generator

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: tuple[int, int, int]):
        index, epoch, repeat = key
        seed = sample_seed(self.run_seed, epoch, index, repeat)
        # Only the CPU generator the transforms draw from (not CUDA's), restored by fork_rng: the run's stream is kept.
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(seed)
            if self.every_generator:
                # numpy's and random's too, and left so: restoring numpy's costs ~0.15 ms a sample, and what draws from
                # them next (the next sample; with num_workers=0 the step) is then a function of the seed as well.
                np.random.seed(seed % 2**32)
                random.seed(seed)
            sample = self.dataset[index]
            if sample is None or self.transform_for_epoch is None:
                return sample
            image, *rest = sample
            return (self.transform_for_epoch(epoch)(image), *rest)

    def draws_elsewhere(self, key: tuple[int, int, int]) -> bool:
        """Whether the sample at `key` differs when drawn twice under the same seeds: its data set draws randomness
        from a generator of its own, which these seeds do not reach."""
        return not _equal(self[key], self[key])


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and bool(torch.equal(a, b))
    if isinstance(a, (tuple, list)):
        return isinstance(b, type(a)) and len(a) == len(b) and all(map(_equal, a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    return bool(np.array_equal(np.asarray(a), np.asarray(b)))
