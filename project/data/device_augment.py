"""The uint8 presets batch-wise on the training device, for the device decoders' images of different sizes: crops
drawn in the workers, resized per size bucket (how and why: docs/imagenet.md).
"""

import itertools
from collections import defaultdict
from typing import NamedTuple

import torch
from torchvision import transforms as v1
from torchvision.ops import roi_align
from torchvision.transforms import v2

from project.data.transforms import CROP_RATIO

BUCKET_PIXELS = 1 << 24  # padded crop pixels per roi_align: ~0.65 GB of transient device memory (index, uint8, float)


class Crop(NamedTuple):
    """One image's RandomResizedCrop box and flip, and the image size they were drawn for (plain ints: no tensors)."""

    top: int
    left: int
    height: int
    width: int
    flip: bool
    image_height: int
    image_width: int


class TrainCrop(NamedTuple):
    """The random part of the train preset (RandomResizedCrop, horizontal flip), drawn per image in the workers."""

    size: tuple[int, int]
    scale: tuple[float, float]
    ratio: tuple[float, float]
    hflip_prob: float

    @classmethod
    def for_options(cls, *, crop_size: int, scale: tuple[float, float] = (0.08, 1.0),
                    hflip_prob: float = 0.5) -> "TrainCrop":
        """The crop train_preset draws with these options (built from the options, never read out of a preset)."""
        return cls((crop_size, crop_size), tuple(scale), CROP_RATIO, hflip_prob)

    def draw(self, height: int, width: int) -> Crop:
        """Box and flip from the CPU generator, in the order the v2 preset draws them (SeededSamples seeds it)."""
        # get_params reads only the size of its image argument: a zero-stride view stands in for the pixels.
        top, left, h, w = v1.RandomResizedCrop.get_params(torch.empty(1, 1, 1).expand(1, height, width),
                                                          list(self.scale), list(self.ratio))
        flip = self.hflip_prob > 0 and torch.rand(1).item() < self.hflip_prob
        return Crop(top, left, h, w, flip, height, width)


def _fit(crop: Crop, height: int, width: int) -> tuple[int, int, int, int]:
    """The box for the decoded size; a decoder that applied an EXIF rotation swapped it (torchcodec does)."""
    if (height, width) == (crop.image_height, crop.image_width):
        return crop.top, crop.left, crop.height, crop.width
    if (height, width) == (crop.image_width, crop.image_height):  # transposed: a box of the same distribution
        return crop.left, crop.top, crop.width, crop.height
    top, left = min(crop.top, height - 1), min(crop.left, width - 1)
    return top, left, min(crop.height, height - top), min(crop.width, width - left)


def _buckets(boxes: list[tuple[int, int, int, int]], budget: int) -> list[list[int]]:
    """Indices grouped largest crop first, each group's padded size (count x max h x max w) within budget."""
    groups: list[list[int]] = []
    high = wide = 0
    for i in sorted(range(len(boxes)), key=lambda i: boxes[i][2] * boxes[i][3], reverse=True):
        h, w = boxes[i][2], boxes[i][3]
        if groups and (len(groups[-1]) + 1) * max(high, h) * max(wide, w) <= budget:
            groups[-1].append(i)
            high, wide = max(high, h), max(wide, w)
        else:
            groups.append([i])
            high, wide = h, w
    return groups


def _to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    host = torch.tensor(values, dtype=dtype)
    # Pinned, so the copy is queued without waiting; pageable memory would also work but staged synchronously.
    return host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host


def resized_crops(images: list[torch.Tensor], crops: list[Crop], size: tuple[int, int],
                  budget: int = BUCKET_PIXELS) -> torch.Tensor:
    """(N, 3, *size) uint8: each image's crop box resized to `size`, flipped where drawn (images: 3 x H x W uint8)."""
    device = images[0].device
    boxes = [_fit(crop, *image.shape[-2:]) for crop, image in zip(crops, images)]
    flat = torch.cat([image.reshape(-1) for image in images])
    starts = list(itertools.accumulate((image.numel() for image in images[:-1]), initial=0))  # offsets in `flat`
    output = torch.empty((len(images), 3, *size), dtype=torch.float32, device=device)
    channel = torch.arange(3, device=device)
    for group in _buckets(boxes, budget):
        high, wide = max(boxes[i][2] for i in group), max(boxes[i][3] for i in group)
        rows = [[starts[i], images[i].shape[-2] * images[i].shape[-1], images[i].shape[-1], *boxes[i]] for i in group]
        start, plane, stride, top, left, h, w = _to_device(rows, torch.int64, device).unbind(1)
        # Row and column of every padded pixel in its image: past the crop's edge, the edge repeats.
        y = top[:, None] + torch.minimum(torch.arange(high, device=device), (h - 1)[:, None])
        x = left[:, None] + torch.minimum(torch.arange(wide, device=device), (w - 1)[:, None])
        index = ((start[:, None] + channel * plane[:, None])[:, :, None] + (y * stride[:, None])[:, None, :])[..., None]
        padded = torch.take(flat, index + x[:, None, None, :]).float()  # (group, 3, high, wide)
        rois = _to_device([[j, 0, 0, boxes[i][3], boxes[i][2]] for j, i in enumerate(group)], torch.float32, device)
        resized = roi_align(padded, rois, output_size=size, spatial_scale=1.0, sampling_ratio=-1, aligned=True)
        output[_to_device(group, torch.int64, device)] = resized
    batch = output.round_().to(torch.uint8)
    flips = [crop.flip for crop in crops]
    if any(flips):
        batch = torch.where(_to_device(flips, torch.bool, device)[:, None, None, None], batch.flip(-1), batch)
    return batch


def eval_batch(images: list[torch.Tensor], transform: v2.Compose) -> torch.Tensor:
    """The eval preset over a batch, one call per distinct image size: the CPU path's result, image for image."""
    by_size: dict[tuple[int, ...], list[int]] = defaultdict(list)
    for i, image in enumerate(images):
        by_size[tuple(image.shape)].append(i)
    parts, order = [], []
    for indices in by_size.values():
        group = images[indices[0]][None] if len(indices) == 1 else torch.stack([images[i] for i in indices])  # a view
        parts.append(transform(group).as_subclass(torch.Tensor))
        order += indices
    if len(parts) == 1:
        return parts[0]
    inverse = sorted(range(len(order)), key=order.__getitem__)  # position in the concatenation of each image
    return torch.cat(parts)[_to_device(inverse, torch.int64, images[0].device)]

