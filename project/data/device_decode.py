"""Device decoders: the workers read JPEG bytes, the training device decodes and augments the batch (docs/imagenet.md).

    python -m project fit --config configs/gpu.yaml --data.root /datasets/imagenet --data.decoder nvjpeg
"""

import logging
import struct
from typing import Callable, NamedTuple, Optional

import torch
from torchvision.transforms import v2

from project.data.decoders import image_loader
from project.data.device_augment import Crop, TrainCrop, eval_batch, resized_crops
from project.engine.errors import UnreadableImageError

try:
    from torchvision.io import ImageReadMode, decode_jpeg
except ImportError:  # a torchvision without image decoders: decoder=nvjpeg says so (decoders.unavailable)
    ImageReadMode = decode_jpeg = None

logger = logging.getLogger(__name__)

NVJPEG_FRAMES = (0xC0, 0xC1, 0xC2)  # SOF0 baseline, SOF1 extended, SOF2 progressive (all Huffman-coded)


def jpeg_frame(data: bytes) -> Optional[tuple[int, int, int, int]]:
    """(SOF marker, colour components, height, width) from a JPEG's frame header; None when the bytes are not a JPEG."""
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
            # FF Cn, length (2), precision (1), height (2), width (2), components
            height, width = struct.unpack(">HH", data[i + 5 : i + 9])
            return marker, data[i + 9], height, width
        elif marker == 0xDA:  # scan data before any frame header
            return None
        else:
            i += 2 + int.from_bytes(data[i + 2 : i + 4], "big")
    return None


def load_for_device(path: str, decode: Callable[[str], torch.Tensor]) -> tuple[torch.Tensor, tuple[int, int]]:
    """(the file's bytes, 1-D uint8, when nvJPEG can decode them, else the image `decode` made of it; its size)."""
    with open(path, "rb") as file:
        data = file.read()
    marker, components, height, width = jpeg_frame(data) or (None, 0, 0, 0)
    if marker in NVJPEG_FRAMES and components in (1, 3) and height > 0:
        return torch.frombuffer(bytearray(data), dtype=torch.uint8), (height, width)
    image = decode(path).contiguous()  # CHW in memory (decoders return HWC views): no copy on the device later
    return image, (image.shape[-2], image.shape[-1])


class EncodedBatch(NamedTuple):
    payloads: list[torch.Tensor]  # 1-D JPEG bytes, or 3 x H x W images the workers decoded; sizes vary
    targets: torch.Tensor
    paths: list[str]
    crops: list[Optional[Crop]]  # training: each image's box and flip; evaluation: None


class DeviceDecoder:
    """A batch's JPEG bytes decoded on `device` in one call by "nvjpeg" (torchvision.io) or "torchcodec-cuda"; what the
    workers decoded is moved as it is, and a file the device cannot decode goes to the CPU decoder, which names it."""

    def __init__(self, decoder: str = "nvjpeg", on_corrupt: str = "error"):
        self.cpu_decode = image_loader(decoder)  # also checks that the library is there
        self.decoder, self.on_corrupt = decoder, on_corrupt
        self._side_streams: dict[torch.device, torch.cuda.Stream] = {}

    def decode_jpegs(self, payloads: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
        """JPEG bytes (1-D uint8 each) -> uint8 RGB images (3 x H x W) on `device`, one batched call."""
        if self.decoder == "nvjpeg":
            return decode_jpeg(payloads, mode=ImageReadMode.RGB, device=device)
        from torchcodec.decoders import decode_jpeg as torchcodec_decode_jpeg

        if device.type != "cuda":
            return torchcodec_decode_jpeg(payloads, mode="RGB", device=device)
        # torchcodec synchronizes the current stream: a side stream, so it never waits for the training step.
        main = torch.cuda.current_stream(device)
        if device not in self._side_streams:
            self._side_streams[device] = torch.cuda.Stream(device)
        side = self._side_streams[device]
        with torch.cuda.stream(side):
            images = torchcodec_decode_jpeg(payloads, mode="RGB", device=device)
        main.wait_stream(side)  # on the device, not the host: kernels queued after its last sync (EXIF rotations)
        for image in images:
            image.record_stream(main)  # allocated on the side stream, used and freed on the training stream
        return images

    def _decode_one(self, payload: torch.Tensor, path: str, device: torch.device) -> Optional[torch.Tensor]:
        try:
            return self.decode_jpegs([payload], device)[0]
        except (RuntimeError, ValueError):
            try:  # the CPU decoders read more broken-but-usable files, and name the file when they cannot
                return self.cpu_decode(path).to(device)
            except UnreadableImageError as error:
                if self.on_corrupt == "error":
                    raise
                logger.warning("skipped unreadable %s (%s) [device decode]", error.path, error.reason)
                return None

    def __call__(self, payloads: list[torch.Tensor], paths: list[str],
                 device: torch.device) -> list[Optional[torch.Tensor]]:
        """load_for_device's payloads (bytes or decoded images) as images on `device`; None for a file skipped."""
        images: list[Optional[torch.Tensor]] = [p.to(device, non_blocking=True) if p.dim() == 3 else None
                                                for p in payloads]
        encoded = [i for i, p in enumerate(payloads) if p.dim() == 1]
        if encoded:
            try:
                decoded = self.decode_jpegs([payloads[i] for i in encoded], device)
            except (RuntimeError, ValueError):  # one bad file fails the whole batched call: find it
                decoded = [self._decode_one(payloads[i], paths[i], device) for i in encoded]
            for i, image in zip(encoded, decoded):
                images[i] = image
        return images


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
