"""Transform presets named by role (torchvision transforms v2), ImageNet mean/std by default."""

import torch
from torchvision.transforms import v2

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def train_preset(
    *,
    crop_size: int = 224,
    scale: tuple[float, float] = (0.08, 1.0),
    hflip_prob: float = 0.5,
    mean: tuple[float, ...] = IMAGENET_MEAN,
    std: tuple[float, ...] = IMAGENET_STD,
) -> v2.Compose:
    """RandomResizedCrop + horizontal flip + normalize; accepts PIL images or uint8 CHW tensors."""
    steps = [v2.ToImage(), v2.RandomResizedCrop(crop_size, scale=scale, antialias=True)]
    if hflip_prob > 0:
        steps.append(v2.RandomHorizontalFlip(hflip_prob))
    # Crop and flip on uint8 (cheap), convert to float only for the final crop-sized image.
    steps += [v2.ToDtype(torch.float32, scale=True), v2.Normalize(mean=mean, std=std)]
    return v2.Compose(steps)


def eval_preset(
    *,
    resize_size: int = 256,
    crop_size: int = 224,
    mean: tuple[float, ...] = IMAGENET_MEAN,
    std: tuple[float, ...] = IMAGENET_STD,
) -> v2.Compose:
    """Resize the short side + center crop + normalize; accepts PIL images or uint8 CHW tensors."""
    return v2.Compose(
        [
            v2.ToImage(),
            v2.Resize(resize_size, antialias=True),
            v2.CenterCrop(crop_size),
            v2.ToDtype(torch.float32, scale=True),
            v2.Normalize(mean=mean, std=std),
        ]
    )
