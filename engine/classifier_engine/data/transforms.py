"""Transform presets (torchvision v2, as its references/classification/presets.py); NormalizeBatch on the device."""

from typing import Any, Literal, Optional, Sequence, get_args

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as F

from classifier_engine.data.partial_decode import EncodedJpeg, dct_scale, decode_at, decode_box
from classifier_engine.errors import ConfigError
from classifier_engine.options import number_type

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
# RandomResizedCrop's aspect-ratio range (torchvision's default); the device crops (device_decode.py) draw from it too.
CROP_RATIO = (3 / 4, 4 / 3)

AutoAugmentName = Literal["trivialaugment_wide", "randaugment", "autoaugment"]  # the data module's option type
AUTO_AUGMENT_POLICIES = get_args(AutoAugmentName)
# torchvision's RandAugment indexes 31 magnitude bins: 31 raises IndexError in a worker, -1 silently means 30.
RandAugmentMagnitude = number_type("RandAugmentMagnitude", int, "an int in [0, 30] (RandAugment's 31 bins)",
                                   lambda v: 0 <= v <= 30)


def auto_augment_transform(policy: str, *, num_ops: int = 2, magnitude: int = 9) -> v2.Transform:
    """A torchvision v2 auto-augment policy by name; "autoaugment" is the ImageNet policy."""
    interpolation = v2.InterpolationMode.BILINEAR  # as torchvision's reference passes (v2's own default: nearest)
    if policy == "trivialaugment_wide":
        return v2.TrivialAugmentWide(interpolation=interpolation)
    if policy == "randaugment":
        return v2.RandAugment(num_ops=num_ops, magnitude=magnitude, interpolation=interpolation)
    if policy == "autoaugment":
        return v2.AutoAugment(v2.AutoAugmentPolicy.IMAGENET, interpolation=interpolation)
    raise ConfigError(f"unknown auto_augment policy {policy!r}: expected one of {', '.join(AUTO_AUGMENT_POLICIES)} "
                      "or None")


class DecodingResizedCrop(v2.RandomResizedCrop):
    """RandomResizedCrop that also takes an EncodedJpeg: the same draws from its header's size, only the box decoded."""

    def forward(self, *inputs: Any) -> Any:
        if not (len(inputs) == 1 and isinstance(inputs[0], EncodedJpeg)):
            return super().forward(*inputs)
        box = self.make_params([inputs[0].size_proxy()])
        region = decode_box(inputs[0], box["top"], box["left"], box["height"], box["width"], tuple(self.size))
        # A plain tensor, which v2 takes for the image: a tv_tensors.Image costs every later op a dispatch (4 % here).
        return F.resize(region, self.size, interpolation=self.interpolation, antialias=self.antialias)


class DecodingResize(v2.Resize):
    """Resize that also takes an EncodedJpeg, decoded at the smallest DCT scale that still covers the resized size."""

    def forward(self, *inputs: Any) -> Any:
        if not (len(inputs) == 1 and isinstance(inputs[0], EncodedJpeg)):
            return super().forward(*inputs)
        if self.max_size is not None:  # torchvision's size rule with a cap: decoded whole
            return super().forward(decode_at(inputs[0], 1))
        height, width = inputs[0].height, inputs[0].width
        size = self.size if len(self.size) == 2 else (  # torchvision's: the short side to size, the long one truncated
            [self.size[0], int(self.size[0] * width / height)] if height <= width
            else [int(self.size[0] * height / width), self.size[0]])
        image = decode_at(inputs[0], dct_scale(height, width, *size))
        return F.resize(image, size, interpolation=self.interpolation, antialias=self.antialias)


def _to_float(normalize: bool, mean: Sequence[float], std: Sequence[float]) -> list[v2.Transform]:
    return [v2.ToDtype(torch.float32, scale=True), v2.Normalize(mean=mean, std=std)] if normalize else []


def train_preset(*, crop_size: int = 224, scale: tuple[float, float] = (0.08, 1.0), hflip_prob: float = 0.5,
                 auto_augment: Optional[str] = None, randaugment_num_ops: int = 2, randaugment_magnitude: int = 9,
                 random_erase_prob: float = 0.0, mean: tuple[float, ...] = IMAGENET_MEAN,
                 std: tuple[float, ...] = IMAGENET_STD, normalize: bool = True) -> v2.Compose:
    """RandomResizedCrop + flip [+ auto-augment] [+ normalize] [+ random erasing]; every draw from torch's global CPU
    generator (which SeededSamples seeds per image: a resume draws the same augmentations)."""
    steps = [v2.ToImage(), DecodingResizedCrop(crop_size, scale=scale, ratio=CROP_RATIO, antialias=True)]
    if hflip_prob > 0:
        steps.append(v2.RandomHorizontalFlip(hflip_prob))
    if auto_augment is not None:
        # On the uint8 crop: the policies' ops are defined on 0..255 images and cheapest at the crop size.
        steps.append(auto_augment_transform(auto_augment, num_ops=randaugment_num_ops, magnitude=randaugment_magnitude))
    # Crop and flip on uint8 (cheap), convert to float only for the final crop-sized image.
    steps += _to_float(normalize, mean, std)
    if random_erase_prob > 0:
        # Its box is drawn from the image's shape only: the same rectangle on uint8 and float images, filled with the
        # colour that normalizes to 0 (on uint8, to within half a grey level: < 0.01 with ImageNet's std).
        mean_colour = 0.0 if normalize else [float(round(255 * m)) for m in mean]
        steps.append(v2.RandomErasing(p=random_erase_prob, value=mean_colour))
    return v2.Compose(steps)


def eval_preset(*, resize_size: int = 256, crop_size: int = 224, mean: tuple[float, ...] = IMAGENET_MEAN,
                std: tuple[float, ...] = IMAGENET_STD, normalize: bool = True) -> v2.Compose:
    """Resize the short side + center crop [+ normalize]."""
    steps = [v2.ToImage(), DecodingResize(resize_size, antialias=True), v2.CenterCrop(crop_size)]
    return v2.Compose(steps + _to_float(normalize, mean, std))


class NormalizeBatch:
    """uint8 images (N, C, H, W) -> float32 (x / 255 - mean) / std, in one pass on the batch's device."""

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
        """Normalize the uint8 images of a batch (a tensor, or inside a tuple, list or dict); the rest passes."""
        return apply_to_collection(batch, torch.Tensor, self)

