"""The training set as the sampler keys it: each image's augmentation seeded from (run seed, epoch, index, repeat), so
a resumed or distributed run augments every image as an uninterrupted one does (docs/imagenet.md).
"""

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import Dataset

from project.engine.seeds import sample_seed

Transform = Callable[[Any], Any]


class SeededSamples(Dataset):
    """Wraps a map-style data set of (image, target, ...) samples, keyed (index, epoch, repeat) by ResumableSampler.

    `transform_for_epoch(epoch)` gives the transform of that epoch (None: the wrapped data set transforms itself).
    A sample the wrapped data set skipped (None, data.on_corrupt=skip) stays None.
    """

    def __init__(self, dataset: Dataset, run_seed: int, transform_for_epoch: Callable[[int], Transform] | None = None):
        self.dataset = dataset
        self.run_seed = run_seed
        self.transform_for_epoch = transform_for_epoch

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: tuple[int, int, int]):
        index, epoch, repeat = key
        # fork_rng restores the global CPU RNG afterwards: the model's own random stream is left untouched. Only the
        # CPU generator is seeded, the one the transforms draw from (torch.manual_seed would seed every CUDA device).
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(sample_seed(self.run_seed, epoch, index, repeat))
            sample = self.dataset[index]
            if sample is None or self.transform_for_epoch is None:
                return sample
            image, *rest = sample
            return (self.transform_for_epoch(epoch)(image), *rest)
