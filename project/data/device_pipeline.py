"""The device decoders' half of the input pipeline: an EncodedBatch becomes (uint8 images, targets) on the device.

    python -m project fit --config configs/gpu.yaml --data.root /datasets/imagenet --data.decoder nvjpeg
"""

from typing import Optional

import torch
from torchvision.transforms import v2

from project.data.device_augment import TrainCrop, eval_batch, resized_crops
from project.data.device_decode import DeviceDecoder
from project.data.image_folders import EncodedBatch


class DevicePipeline:
    """Decodes an EncodedBatch on the device, then applies the crops and flips the workers drew from `train_crop`
    (training) or the uint8 `eval_transform` (eval_preset(normalize=False)); decoder: "nvjpeg" or "torchcodec-cuda"."""

    def __init__(self, train_crop: Optional[TrainCrop], eval_transform: v2.Compose, *, decoder: str = "nvjpeg",
                 on_corrupt: str = "error"):
        self.decoder = DeviceDecoder(decoder, on_corrupt)
        self.train_crop = train_crop
        self.eval_transform = eval_transform

    def __call__(self, batch: EncodedBatch, device: torch.device, training: bool) -> tuple[torch.Tensor, torch.Tensor]:
        images = self.decoder(batch.payloads, batch.paths, device)
        keep = [i for i, image in enumerate(images) if image is not None]
        if not keep:
            raise RuntimeError(f"all {len(images)} images of a batch were unreadable (see the warnings naming them)")
        targets = batch.targets if len(keep) == len(images) else batch.targets[keep]
        kept = [images[i] for i in keep]
        if not training:
            return eval_batch(kept, self.eval_transform), targets.to(device, non_blocking=True)
        crops = [batch.crops[i] for i in keep]  # drawn in the workers (EncodedImages of the training set)
        return resized_crops(kept, crops, self.train_crop.size), targets.to(device, non_blocking=True)
