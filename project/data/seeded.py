"""Per-sample augmentation seeds: a sample's random crop and flip depend only on (run seed, epoch, index).

So a run resumed at any point, or split over any number of processes or DataLoader workers, augments every
image exactly as an uninterrupted single-process run does. (Reseeding the global RNG once per epoch is not
enough: Lightning creates the first epoch's iterator, and so fetches its first batch, before on_train_epoch_start.)
"""

import torch
from torch.utils.data import Dataset


def sample_seed(base_seed: int, epoch: int, index: int) -> int:
    """A reproducible seed per (run seed, epoch, sample index)."""
    return (base_seed * 1_000_003 + epoch * 2_147_483_647 + index * 7_919) % (2**63 - 1)


class PerSampleSeeded(Dataset):
    """Wraps a map-style dataset; its sampler yields (index, epoch) keys (see samplers.EpochKeyedSampler)."""

    def __init__(self, dataset: Dataset, base_seed: int):
        self.dataset = dataset
        self.base_seed = base_seed

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: tuple[int, int]):
        index, epoch = key
        # fork_rng restores the global CPU RNG afterwards: the model's own random stream is left untouched.
        # Only the CPU generator is seeded, the one the transforms draw from: torch.manual_seed would also seed
        # every CUDA device and costs ~0.3 ms, against ~2 us for this, per image.
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(sample_seed(self.base_seed, epoch, index))
            return self.dataset[index]
