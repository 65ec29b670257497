"""The uint8 batch converted to float and normalized on the training device, in one pass (docs/imagenet.md)."""

from typing import Any, Sequence

import torch

from project.data.transforms import IMAGENET_MEAN, IMAGENET_STD


class NormalizeBatch:
    """uint8 images (N, C, H, W) -> float32 (x / 255 - mean) / std, in one pass, on the device the batch is on."""

    def __init__(self, mean: Sequence[float] = IMAGENET_MEAN, std: Sequence[float] = IMAGENET_STD):
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

