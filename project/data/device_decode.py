"""decoder="nvjpeg": the workers only read JPEG bytes; the batch is decoded and augmented on the training device.

    python -m project fit --config configs/gpu.yaml --data.root /datasets/imagenet --data.decoder nvjpeg

nvJPEG decodes baseline and progressive JPEGs with 1 or 3 components. Everything else (CMYK, PNG named .JPEG,
lossless or arithmetic JPEGs) is decoded on the CPU in the worker, so the device only ever sees what it handles.
"""

import logging
from typing import NamedTuple

import torch
from torchvision.io import ImageReadMode, decode_jpeg

from project.data.decoders import DecodedImageFolder, UnreadableImageError, decode_torchvision

logger = logging.getLogger(__name__)

NVJPEG_FRAMES = (0xC0, 0xC1, 0xC2)  # SOF0 baseline, SOF1 extended, SOF2 progressive (all Huffman-coded)


def jpeg_frame(data: bytes) -> tuple[int, int] | None:
    """(SOF marker, colour components) from a JPEG's frame header; None when the bytes are not a JPEG."""
    if data[:2] != b"\xff\xd8":
        return None
    i = 2
    while i + 9 < len(data):
        if data[i] != 0xFF:
            return None
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte before a marker
            i += 1
        elif marker == 0x01 or 0xD0 <= marker <= 0xD8:  # markers without a length field
            i += 2
        elif 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):  # a frame header, not DHT/JPG/DAC
            return marker, data[i + 9]  # FF Cn, length (2), precision (1), height (2), width (2), components
        elif marker == 0xDA:  # scan data before any frame header
            return None
        else:
            i += 2 + int.from_bytes(data[i + 2 : i + 4], "big")
    return None


def load_for_device(path: str) -> torch.Tensor:
    """The file's bytes (1-D uint8) when nvJPEG can decode them, else the image decoded here (uint8, 3 x H x W)."""
    with open(path, "rb") as file:
        data = file.read()
    frame = jpeg_frame(data)
    if frame is not None and frame[0] in NVJPEG_FRAMES and frame[1] in (1, 3):
        return torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return decode_torchvision(path)


class EncodedImageFolder(DecodedImageFolder):
    """Samples are (JPEG bytes or an image the worker decoded, target, path): the input of DeviceDecoder."""

    def __init__(self, root: str, *, on_corrupt: str = "error"):
        super().__init__(root, decoder="torchvision", on_corrupt=on_corrupt)
        self.loader = load_for_device

    def __getitem__(self, index: int):
        sample = super().__getitem__(index)
        return None if sample is None else (*sample, self.samples[index][0])


class EncodedBatch(NamedTuple):
    payloads: list[torch.Tensor]  # 1-D JPEG bytes, or 3 x H x W images the workers decoded; sizes vary
    targets: torch.Tensor
    paths: list[str]


def collate_encoded(batch: list) -> EncodedBatch:
    """Samples of EncodedImageFolder as one EncodedBatch; samples a worker skipped (None) are left out."""
    readable = [sample for sample in batch if sample is not None]
    payloads, targets, paths = zip(*readable) if readable else ((), (), ())
    return EncodedBatch(list(payloads), torch.tensor(targets, dtype=torch.long), list(paths))


class DeviceDecoder:
    """Decodes a batch's JPEG bytes on the training device in one batched call, then runs the uint8 preset there."""

    def __init__(self, train_transform, eval_transform, on_corrupt: str = "error"):
        self.transforms = {True: train_transform, False: eval_transform}
        self.on_corrupt = on_corrupt

    def _decode_one(self, payload: torch.Tensor, path: str, device: torch.device) -> torch.Tensor | None:
        try:
            return decode_jpeg(payload, mode=ImageReadMode.RGB, device=device)
        except RuntimeError:
            try:  # the CPU decoders read more broken-but-usable files, and name the file when they cannot
                return decode_torchvision(path).to(device)
            except UnreadableImageError as error:
                if self.on_corrupt == "error":
                    raise
                logger.warning("skipped unreadable %s (%s) [device decode]", error.path, error.reason)
                return None

    def __call__(self, batch: EncodedBatch, device: torch.device, training: bool) -> tuple[torch.Tensor, torch.Tensor]:
        payloads, targets, paths = batch
        images: list[torch.Tensor | None] = [p.to(device, non_blocking=True) if p.dim() == 3 else None for p in payloads]
        encoded = [i for i, p in enumerate(payloads) if p.dim() == 1]
        if encoded:
            try:
                decoded = decode_jpeg([payloads[i] for i in encoded], mode=ImageReadMode.RGB, device=device)
            except RuntimeError:  # one bad file fails the whole batched call: find it
                decoded = [self._decode_one(payloads[i], paths[i], device) for i in encoded]
            for i, image in zip(encoded, decoded):
                images[i] = image
        keep = [i for i, image in enumerate(images) if image is not None]
        if not keep:
            raise RuntimeError(f"all {len(images)} images of a batch were unreadable (see the warnings naming them)")
        transform = self.transforms[training]
        batch_images = torch.stack([transform(images[i]) for i in keep])
        return batch_images, targets[keep].to(device, non_blocking=True)
