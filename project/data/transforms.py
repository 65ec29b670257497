"""Transform presets named by role (torchvision transforms v2), ImageNet mean/std by default.

The train preset follows torchvision's references/classification/presets.py: crop, flip, auto-augment policy, float
conversion, normalization, random erasing (after normalization, value 0 = the mean colour). split_normalize
(device_normalize.py) turns it into the uint8 preset the workers run when the GPU normalizes the batch.
"""

from typing import Literal, Optional

import torch
from torchvision.transforms import v2

from project.errors import ConfigError

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

AutoAugmentName = Literal["trivialaugment_wide", "randaugment", "autoaugment"]  # the data module's option type
AUTO_AUGMENT_POLICIES = ("trivialaugment_wide", "randaugment", "autoaugment")


def auto_augment_transform(policy: str, *, num_ops: int = 2, magnitude: int = 9) -> v2.Transform:
    """A torchvision v2 auto-augment policy by name; "autoaugment" is the ImageNet policy."""
    # Bilinear, as torchvision's reference passes for every policy (v2's own default is nearest).
    interpolation = v2.InterpolationMode.BILINEAR
    if policy == "trivialaugment_wide":
        return v2.TrivialAugmentWide(interpolation=interpolation)
    if policy == "randaugment":
        return v2.RandAugment(num_ops=num_ops, magnitude=magnitude, interpolation=interpolation)
    if policy == "autoaugment":
        return v2.AutoAugment(v2.AutoAugmentPolicy.IMAGENET, interpolation=interpolation)
    raise ConfigError(f"unknown auto_augment policy {policy!r}: expected one of {', '.join(AUTO_AUGMENT_POLICIES)} or None")


def train_preset(
    *,
    crop_size: int = 224,
    scale: tuple[float, float] = (0.08, 1.0),
    hflip_prob: float = 0.5,
    auto_augment: Optional[str] = None,
    randaugment_num_ops: int = 2,
    randaugment_magnitude: int = 9,
    random_erase_prob: float = 0.0,
    mean: tuple[float, ...] = IMAGENET_MEAN,
    std: tuple[float, ...] = IMAGENET_STD,
) -> v2.Compose:
    """RandomResizedCrop + flip [+ auto-augment] + normalize [+ random erasing]; PIL images or uint8 CHW tensors.

    Every random draw comes from torch's global CPU generator, which SeededSamples seeds per image.
    """
    if not 0.0 <= random_erase_prob <= 1.0:
        raise ConfigError(f"random_erase_prob must be in [0, 1], got {random_erase_prob}")
    steps = [v2.ToImage(), v2.RandomResizedCrop(crop_size, scale=scale, antialias=True)]
    if hflip_prob > 0:
        steps.append(v2.RandomHorizontalFlip(hflip_prob))
    if auto_augment is not None:
        # On the uint8 crop: the policies' ops are defined on 0..255 images and cheapest at the crop size.
        steps.append(auto_augment_transform(auto_augment, num_ops=randaugment_num_ops, magnitude=randaugment_magnitude))
    # Crop and flip on uint8 (cheap), convert to float only for the final crop-sized image.
    steps += [v2.ToDtype(torch.float32, scale=True), v2.Normalize(mean=mean, std=std)]
    if random_erase_prob > 0:
        steps.append(v2.RandomErasing(p=random_erase_prob, value=0.0))
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
