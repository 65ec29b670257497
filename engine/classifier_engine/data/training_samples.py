"""Progressive resizing's train crop size per epoch (FFCV's rule), and the train preset it picks for each epoch (the
training set itself, each image augmented from (run seed, epoch, index, repeat): classifier_engine.seeds). docs/data.md.

    python -m classifier_engine fit ... --data.progressive_resizing '{start_size: 160, end_size: 192, ...}'
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from classifier_engine.data.transforms import train_preset
from classifier_engine.errors import ConfigError

Transform = Callable[[Any], Any]


@dataclass(frozen=True)
class ProgressiveResizing:
    """Train crop size per epoch: start_size until start_epoch, a linear ramp, end_size from end_epoch on.

    Args:
        start_size: crop side up to and including start_epoch (a multiple of `multiple`).
        end_size: crop side from end_epoch on (a multiple of `multiple`).
        start_epoch: last epoch (0-based, as trainer.current_epoch) at start_size.
        end_epoch: first epoch at end_size (>= start_epoch).
        multiple: every size of the ramp is rounded to a multiple of this (FFCV: 32).
    """

    start_size: int
    end_size: int
    start_epoch: int
    end_epoch: int
    multiple: int = 32

    def __post_init__(self) -> None:
        flag = "--data.progressive_resizing"
        if self.multiple < 1:
            raise ConfigError(f"{flag}: multiple must be >= 1, got {self.multiple}")
        for name in ("start_size", "end_size"):
            size = getattr(self, name)
            if size < self.multiple or size % self.multiple:
                raise ConfigError(f"{flag}: {name}={size} is not a positive multiple of multiple={self.multiple}: "
                                 f"round it, or set multiple to a divisor of both sizes")
        if not 0 <= self.start_epoch <= self.end_epoch:
            raise ConfigError(f"{flag}: expected 0 <= start_epoch <= end_epoch, got start_epoch={self.start_epoch}, "
                             f"end_epoch={self.end_epoch}")

    def size_at(self, epoch: int) -> int:
        """The crop side of a (0-based) epoch."""
        if epoch <= self.start_epoch:
            return self.start_size
        if epoch >= self.end_epoch:
            return self.end_size
        fraction = (epoch - self.start_epoch) / (self.end_epoch - self.start_epoch)
        interpolated = self.start_size + fraction * (self.end_size - self.start_size)
        return round(interpolated / self.multiple) * self.multiple  # halves to even, as FFCV's np.round


# Checkpoints keep the data module's init arguments (hyper_parameters) and load with weights_only=True.
torch.serialization.add_safe_globals([ProgressiveResizing])


class TrainPresetPerEpoch:
    """SeededSamples' transform_for_epoch: train_preset(**preset_kwargs) at each epoch's size, built once per size
    (plain data, so it pickles into spawned DataLoader workers, each building its own presets)."""

    def __init__(self, schedule: ProgressiveResizing, **preset_kwargs: Any):
        train_preset(crop_size=schedule.start_size, **preset_kwargs)  # bad options fail here, not in a worker
        self.schedule, self.preset_kwargs = schedule, preset_kwargs
        self._presets: dict[int, Transform] = {}

    def __call__(self, epoch: int) -> Transform:
        size = self.schedule.size_at(epoch)
        if size not in self._presets:
            self._presets[size] = train_preset(crop_size=size, **self.preset_kwargs)
        return self._presets[size]
