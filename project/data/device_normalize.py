"""Where the input pipeline's work runs: uint8 crops in the DataLoader workers, float conversion and normalization of
the whole batch on the training device.

Workers that stop at uint8 skip the per-image float conversion and normalization (a quarter of their time per image
with the torchvision decoder) and copy 4x fewer bytes to the GPU; timm's prefetcher and FFCV do the same. The batch is
then normalized in one fused pass where it lands (ImageNetDataModule.on_after_batch_transfer).
"""

from typing import Any, Sequence

import torch
from torchvision.transforms import v2

from project.errors import ConfigError


class NormalizeBatch:
    """uint8 images (N, C, H, W) -> float32 (x / 255 - mean) / std, in one pass, on the device the batch is on."""

    def __init__(self, mean: Sequence[float], std: Sequence[float]):
        self.mean = torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1) * 255
        self.inv_std = 1 / (torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1) * 255)
        self._on_device: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        if images.dtype != torch.uint8:
            return images  # already converted (a float batch from a custom loader): leave it alone
        if images.device not in self._on_device:
            self._on_device[images.device] = (self.mean.to(images.device), self.inv_std.to(images.device))
        mean, inv_std = self._on_device[images.device]
        return images.to(torch.float32).sub_(mean).mul_(inv_std)

    def batch(self, batch: Any) -> Any:
        """Normalize the images of a batch: a tensor, or the first element of (images, targets, ...)."""
        if isinstance(batch, torch.Tensor):
            return self(batch)
        if isinstance(batch, (list, tuple)) and batch and isinstance(batch[0], torch.Tensor):
            converted = [self(batch[0]), *batch[1:]]
            return converted if isinstance(batch, list) else tuple(converted)
        return batch


def split_normalize(preset: v2.Compose) -> tuple[v2.Compose, NormalizeBatch]:
    """A preset cut before its ToDtype/Normalize (uint8 out), and the NormalizeBatch that finishes it on the device.

    The preset ends in one v2.Normalize, optionally followed by v2.RandomErasing (torchvision's order): each erasing
    moves before the cut and fills with the uint8 colour that normalizes to its value (value 0: round(255 * mean)),
    so it erases the same rectangle from the same random draws, to within half a grey level (< 0.01 after
    normalization with ImageNet's std).
    """
    steps = list(preset.transforms)
    normalize = [i for i, t in enumerate(steps) if isinstance(t, v2.Normalize)]
    tail = steps[normalize[-1] + 1 :] if normalize else []
    if len(normalize) != 1 or not all(isinstance(t, v2.RandomErasing) for t in tail):
        raise ConfigError(f"expected a preset ending in one v2.Normalize (then only v2.RandomErasing), got {preset}")
    mean, std = steps[normalize[0]].mean, steps[normalize[0]].std
    head = [t for t in steps[: normalize[0]] if not isinstance(t, v2.ToDtype)]
    head += [uint8_erasing(erasing, mean, std) for erasing in tail]
    return v2.Compose(head), NormalizeBatch(mean, std)


def uint8_erasing(erasing: v2.RandomErasing, mean: Sequence[float], std: Sequence[float]) -> v2.RandomErasing:
    """The v2.RandomErasing that, run on uint8 before Normalize(mean, std), erases as `erasing` does after it."""
    if erasing.value is None:
        raise ConfigError(
            "RandomErasing(value='random') draws float noise after normalization and cannot run on uint8 images: "
            "set data.normalize_on_device=false"
        )
    values = erasing.value if len(erasing.value) == len(mean) else erasing.value * len(mean)
    fill = [min(255.0, max(0.0, float(round(255 * (m + v * s))))) for v, m, s in zip(values, mean, std)]
    return v2.RandomErasing(p=erasing.p, scale=erasing.scale, ratio=erasing.ratio, value=fill, inplace=erasing.inplace)
