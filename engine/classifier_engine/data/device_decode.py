"""Device decoders: the workers read JPEG bytes and draw the train crops; the training device decodes the batch and
runs the uint8 presets batch-wise, crops resized per size bucket (how and why: docs/imagenet.md).

    python -m classifier_engine fit --config CONFIG --trainer.accelerator=gpu --data.root DIR --data.decoder nvjpeg
"""

import itertools
import logging
import math
import struct
from collections import defaultdict
from typing import Callable, NamedTuple, Optional

import torch
from torchvision import transforms as v1
from torchvision.ops import roi_align
from torchvision.transforms import v2

from classifier_engine.data.decoders import image_loader
from classifier_engine.data.transforms import CROP_RATIO
from classifier_engine.errors import UnreadableImageError

try:
    from torchvision.io import ImageReadMode, decode_jpeg
except ImportError:  # a torchvision without image decoders: decoder=nvjpeg says so (decoders.unavailable)
    ImageReadMode = decode_jpeg = None

logger = logging.getLogger(__name__)

BUCKET_PIXELS = 1 << 24  # padded crop pixels per roi_align: ~0.65 GB of transient device memory (index, uint8, float)
NVJPEG_FRAMES = (0xC0, 0xC1, 0xC2)  # SOF0 baseline, SOF1 extended, SOF2 progressive (all Huffman-coded)


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
    """A batch as the workers send it: every payload end to end in one uint8 tensor, so a batch crosses from the
    workers as one shared-memory block (a file descriptor and a handshake each), not one per image."""

    data: torch.Tensor  # 1-D uint8: the payloads, end to end
    shapes: list[tuple[int, ...]]  # each payload's: (n,) JPEG bytes, or (3, H, W) an image the worker decoded
    targets: torch.Tensor
    paths: list[str]
    crops: list[Optional[Crop]]  # training: each image's box and flip; evaluation: None

    @classmethod
    def pack(cls, payloads: list[torch.Tensor], targets: torch.Tensor, paths: list[str],
             crops: list[Optional[Crop]]) -> "EncodedBatch":
        data = torch.cat([p.reshape(-1) for p in payloads]) if payloads else torch.empty(0, dtype=torch.uint8)
        return cls(data, [tuple(p.shape) for p in payloads], targets, list(paths), list(crops))

    def payloads(self) -> list[torch.Tensor]:
        """The payloads as load_for_device made them: views into `data`, no copy."""
        parts = self.data.split([math.prod(shape) for shape in self.shapes])
        return [part.view(shape) for part, shape in zip(parts, self.shapes)]


class DeviceDecoder:
    """A batch's JPEG bytes decoded on `device` in one call by "nvjpeg" (torchvision.io) or "torchcodec-cuda"; what the
    workers decoded is moved as it is, and a file the device cannot decode goes to the CPU decoder, which names it."""

    def __init__(self, decoder: str = "nvjpeg", on_corrupt: str = "error"):
        self.cpu_decode = image_loader(decoder)  # also checks that the library is there
        self.decoder, self.on_corrupt = decoder, on_corrupt
        self._side_streams: dict[torch.device, torch.cuda.Stream] = {}

    def _decode(self, payloads: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
        if self.decoder == "nvjpeg":
            return decode_jpeg(payloads, mode=ImageReadMode.RGB, device=device)
        from torchcodec.decoders import decode_jpeg as torchcodec_decode_jpeg

        return torchcodec_decode_jpeg(payloads, mode="RGB", device=device)

    def decode_jpegs(self, payloads: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
        """JPEG bytes (1-D uint8 each) -> uint8 RGB images (3 x H x W) on `device`, one batched call."""
        if device.type != "cuda":
            return self._decode(payloads, device)
        # A side stream: both libraries allocate the outputs on the current stream without ordering their writes
        # after the work queued there (torchvision writes from a private stream, pytorch/vision#9606; nvJPEG's hardware
        # engine ignores stream order, meta-pytorch/torchcodec#1634), so on the training stream they could overwrite
        # blocks freed there whose readers are still queued. The side stream's pool only gives back blocks the
        # training stream has finished with (record_stream below); why it waits for nothing: docs/benchmarks.md#gpu.
        main = torch.cuda.current_stream(device)
        if device not in self._side_streams:
            self._side_streams[device] = torch.cuda.Stream(device)
        side = self._side_streams[device]
        with torch.cuda.stream(side):
            images = self._decode(payloads, device)
        main.wait_stream(side)  # the decode's last work is on the side stream (torchvision: an event from its own)
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
        self.train_crop, self.eval_transform = train_crop, eval_transform

    def __call__(self, batch: EncodedBatch, device: torch.device, training: bool) -> tuple[torch.Tensor, torch.Tensor]:
        images = self.decoder(batch.payloads(), batch.paths, device)
        keep = [i for i, image in enumerate(images) if image is not None]
        if not keep:
            raise RuntimeError(f"all {len(images)} images of a batch were unreadable (see the warnings naming them)")
        targets = batch.targets if len(keep) == len(images) else batch.targets[keep]
        kept = [images[i] for i in keep]
        if not training:
            return eval_batch(kept, self.eval_transform), targets.to(device, non_blocking=True)
        crops = [batch.crops[i] for i in keep]  # drawn in the workers (EncodedImages of the training set)
        return resized_crops(kept, crops, self.train_crop.size), targets.to(device, non_blocking=True)
