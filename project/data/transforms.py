"""Transform presets named by role (torchvision transforms v2), ImageNet mean/std by default.

The train preset follows torchvision's references/classification/presets.py: crop, flip, auto-augment policy, float
conversion, normalization, random erasing (after normalization, value 0 = the mean colour). `normalize=False` builds
the same preset stopping at uint8, for workers whose batches are normalized on the training device (NormalizeBatch,
device_normalize.py): random erasing then fills with the uint8 mean colour, the value that normalizes to 0.
"""

from typing import Literal, Optional, Sequence

import torch
from torchvision.transforms import v2

from project.engine.errors import ConfigError
from project.engine.options import number_type

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
# RandomResizedCrop's aspect-ratio range (torchvision's default); the device crops (device_augment.py) draw from it too.
CROP_RATIO = (3 / 4, 4 / 3)

AutoAugmentName = Literal["trivialaugment_wide", "randaugment", "autoaugment"]  # the data module's option type
AUTO_AUGMENT_POLICIES = ("trivialaugment_wide", "randaugment", "autoaugment")
# torchvision's RandAugment indexes 31 magnitude bins: 31 raises IndexError in a worker, -1 silently means 30.
RandAugmentMagnitude = number_type("RandAugmentMagnitude", int, "an int in [0, 30] (RandAugment's 31 bins)",
                                   lambda v: 0 <= v <= 30)


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
    raise ConfigError(f"unknown auto_augment policy {policy!r}: expected one of {', '.join(AUTO_AUGMENT_POLICIES)} "
                      "or None")


def uint8_mean_colour(mean: Sequence[float]) -> list[float]:
    """The uint8 colour that normalizes to 0 with `mean` (to within half a grey level: < 0.01 with ImageNet's std)."""
    return [float(round(255 * m)) for m in mean]


def _to_float(normalize: bool, mean: Sequence[float], std: Sequence[float]) -> list[v2.Transform]:
    return [v2.ToDtype(torch.float32, scale=True), v2.Normalize(mean=mean, std=std)] if normalize else []


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
    normalize: bool = True,
) -> v2.Compose:
    """RandomResizedCrop + flip [+ auto-augment] + normalize [+ random erasing]; PIL images or uint8 CHW tensors.

    normalize=False: uint8 out (no ToDtype/Normalize), the same random draws, erasing with the uint8 mean colour.
    Every random draw comes from torch's global CPU generator, which SeededSamples seeds per image.
    """
    steps = [v2.ToImage(), v2.RandomResizedCrop(crop_size, scale=scale, ratio=CROP_RATIO, antialias=True)]
    if hflip_prob > 0:
        steps.append(v2.RandomHorizontalFlip(hflip_prob))
    if auto_augment is not None:
        # On the uint8 crop: the policies' ops are defined on 0..255 images and cheapest at the crop size.
        steps.append(auto_augment_transform(auto_augment, num_ops=randaugment_num_ops, magnitude=randaugment_magnitude))
    # Crop and flip on uint8 (cheap), convert to float only for the final crop-sized image.
    steps += _to_float(normalize, mean, std)
    if random_erase_prob > 0:
        # Erasing draws its box from the image's shape only: the same rectangle on uint8 and on float images.
        steps.append(v2.RandomErasing(p=random_erase_prob, value=0.0 if normalize else uint8_mean_colour(mean)))
    return v2.Compose(steps)


def eval_preset(
    *,
    resize_size: int = 256,
    crop_size: int = 224,
    mean: tuple[float, ...] = IMAGENET_MEAN,
    std: tuple[float, ...] = IMAGENET_STD,
    normalize: bool = True,
) -> v2.Compose:
    """Resize the short side + center crop [+ normalize]; accepts PIL images or uint8 CHW tensors.

    normalize=False: uint8 out, for batches normalized on the training device (and the device decoders' eval batches).
    """
    steps = [v2.ToImage(), v2.Resize(resize_size, antialias=True), v2.CenterCrop(crop_size)]
    return v2.Compose(steps + _to_float(normalize, mean, std))
