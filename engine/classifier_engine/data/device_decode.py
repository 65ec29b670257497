"""Device decoders: the workers read JPEG bytes and draw the train crops, the device decodes and augments the batch
(docs/data.md).

    python -m classifier_engine fit --config CONFIG --trainer.accelerator=gpu --data.root DIR --data.decoder nvjpeg
"""

import itertools
import logging
import math
from collections import defaultdict
from typing import Callable, NamedTuple, Optional

import torch
from torchvision import transforms as v1
from torchvision.ops import roi_align
from torchvision.transforms import v2

from classifier_engine.data.decoders import ImageReadMode, decode_jpeg, image_loader
from classifier_engine.data.partial_decode import HUFFMAN_8BIT, jpeg_header
from classifier_engine.data.transforms import CROP_RATIO
from classifier_engine.errors import ConfigError, UnreadableImageError

logger = logging.getLogger(__name__)

BUCKET_PIXELS = 1 << 24  # padded crop pixels per roi_align: ~0.65 GB of transient device memory (index, uint8, float)


class Crop(NamedTuple):
    """One image's RandomResizedCrop box and flip, the image size they were drawn for, and the seed they were drawn
    from, which the rest of the train preset draws from after them (plain ints: no tensors)."""

    top: int
    left: int
    height: int
    width: int
    flip: bool
    image_height: int
    image_width: int
    seed: int = 0


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
        return Crop(top, left, h, w, flip, height, width, torch.initial_seed())


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


def load_for_device(path: str, decode: Callable[[str], torch.Tensor]) -> tuple[torch.Tensor, tuple[int, int]]:
    """(the file's bytes, 1-D uint8, when nvJPEG can decode them, else the image `decode` made of it; its size)."""
    with open(path, "rb") as file:
        data = file.read()
    marker, bits, components, height, width, _ = jpeg_header(data) or (None, 0, 0, 0, 0, 1)
    if marker in HUFFMAN_8BIT and bits == 8 and components in (1, 3) and height > 0:
        return torch.frombuffer(bytearray(data), dtype=torch.uint8), (height, width)
    image = decode(path).contiguous()  # CHW in memory (decoders return HWC views): no copy on the device later
    return image, (image.shape[-2], image.shape[-1])


class EncodedBatch(NamedTuple):
    """A batch as the workers send it: one shared-memory block (an fd and a handshake each), not one per image."""

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
    """A batch's JPEG bytes decoded on `device` in one call by "nvjpeg" (torchvision.io) or "torchcodec-cuda", what
    the device cannot decode by the CPU decoder (the fallbacks: docs/data.md)."""

    def __init__(self, decoder: str = "nvjpeg", on_corrupt: str = "error"):
        self.cpu_decode = image_loader(decoder)  # also checks that the library is there
        self.decoder, self.on_corrupt = decoder, on_corrupt
        self.cpu_fallbacks = 0  # images the device could not decode, decoded on the CPU in the training process
        self._failed_batches = 0  # batches in a row the device decoded none of (and the CPU some)
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
        # training stream has finished with (record_stream below); why it waits for nothing: docs/data.md.
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

    def _try(self, payloads: list[torch.Tensor], device: torch.device) -> tuple[Optional[list[torch.Tensor]], str]:
        """(the images, "") or (None, why the device could not decode them)."""
        try:
            return self.decode_jpegs(payloads, device), ""
        except (RuntimeError, ValueError) as error:
            # torch's own, or the CUDA runtime's as a decoder reports it: never a file's fault, so never a CPU fallback
            if isinstance(error, torch.cuda.OutOfMemoryError) or "out of memory" in str(error).lower():
                raise
            return None, f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0][:160]}"

    def _one_by_one(self, payloads: list[torch.Tensor], paths: list[str],
                    device: torch.device) -> list[Optional[torch.Tensor]]:
        """Each image alone on the device, then on the CPU where the device failed (one bad file fails a batch)."""
        tried = [self._try([payload], device) for payload in payloads]
        images = [decoded[0] if decoded else None for decoded, _ in tried]
        failed = [i for i, image in enumerate(images) if image is None]
        reason = tried[failed[0]][1] if failed else ""
        if failed and self.cpu_fallbacks == 0:
            logger.warning("data.decoder=%s: %d of %d images of a batch did not decode on %s (%s; first %s): decoded "
                           "on the CPU in the training process, slowly; later fallbacks are counted "
                           "(DeviceDecoder.cpu_fallbacks), not logged", self.decoder, len(failed), len(payloads),
                           device, reason, paths[failed[0]])
        self.cpu_fallbacks += len(failed)
        for i in failed:
            try:  # the CPU decoders read more broken-but-usable files, and name the file when they cannot
                images[i] = self.cpu_decode(paths[i]).to(device)
            except UnreadableImageError as error:
                if self.on_corrupt == "error":
                    raise
                logger.warning("skipped unreadable %s (%s) [device decode]", error.path, error.reason)
        device_fault = len(failed) == len(payloads) and any(images[i] is not None for i in failed)
        self._failed_batches = self._failed_batches + 1 if device_fault else 0
        if self._failed_batches >= 2:
            raise ConfigError(f"data.decoder={self.decoder} decoded none of the images of two batches in a row on "
                              f"{device} ({reason}), which the CPU decodes: use data.decoder=auto (decode in the "
                              "workers), or a torchvision/torchcodec built with nvJPEG for this GPU")
        return images

    def __call__(self, payloads: list[torch.Tensor], paths: list[str],
                 device: torch.device) -> list[Optional[torch.Tensor]]:
        """load_for_device's payloads (bytes or decoded images) as images on `device`; None for a file skipped."""
        images: list[Optional[torch.Tensor]] = [p.to(device, non_blocking=True) if p.dim() == 3 else None
                                                for p in payloads]
        encoded = [i for i, p in enumerate(payloads) if p.dim() == 1]
        if encoded:
            decoded, _ = self._try([payloads[i] for i in encoded], device)
            if decoded is None:
                decoded = self._one_by_one([payloads[i] for i in encoded], [paths[i] for i in encoded], device)
            else:
                self._failed_batches = 0
            for i, image in zip(encoded, decoded):
                images[i] = image
        return images


class CroppedBatch(NamedTuple):
    """A training batch decoded, cropped, resized and flipped on the device; the rest of the preset still to run."""

    images: torch.Tensor  # (N, 3, size, size) uint8
    targets: torch.Tensor
    crops: list[Crop]


class DevicePipeline:
    """An EncodedBatch decoded on the device, then the workers' crops and flips and `augment` per image (training) or
    the uint8 `eval_transform`; `size_at(epoch)`: the train crop side (progressive resizing)."""

    def __init__(self, train_crop: Optional[TrainCrop], eval_transform: v2.Compose, *, decoder: str = "nvjpeg",
                 on_corrupt: str = "error", augment: Optional[Callable] = None,
                 size_at: Optional[Callable[[int], int]] = None):
        self.decoder = DeviceDecoder(decoder, on_corrupt)
        self.train_crop, self.eval_transform, self.augment, self.size_at = train_crop, eval_transform, augment, size_at

    def _decoded(self, batch: EncodedBatch, device: torch.device) -> tuple[list[int], list[torch.Tensor], torch.Tensor]:
        images = self.decoder(batch.payloads(), batch.paths, device)
        keep = [i for i, image in enumerate(images) if image is not None]
        if not keep:
            raise RuntimeError(f"all {len(images)} images of a batch were unreadable (see the warnings naming them)")
        targets = batch.targets if len(keep) == len(images) else batch.targets[keep]
        return keep, [images[i] for i in keep], targets.to(device, non_blocking=True)

    def crop(self, batch: EncodedBatch, device: torch.device, epoch: int = 0) -> CroppedBatch:
        """The training batch decoded, cropped to the epoch's size and flipped; no random draw (the prefetching
        loader's thread runs this; the global generator is the training loop's)."""
        keep, images, targets = self._decoded(batch, device)
        crops = [batch.crops[i] for i in keep]  # drawn in the workers (EncodedImages of the training set)
        size = (self.size_at(epoch),) * 2 if self.size_at is not None else self.train_crop.size
        return CroppedBatch(resized_crops(images, crops, size), targets, crops)

    def finish(self, batch: CroppedBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """The rest of the train preset per image, drawn as the CPU preset draws it after the crop and flip."""
        if self.augment is None:
            return batch.images, batch.targets
        augmented = []
        with torch.random.fork_rng(devices=[]):  # the CPU generator only: v2 draws there, whatever the images' device
            for image, crop in zip(batch.images, batch.crops):
                torch.default_generator.manual_seed(crop.seed)
                self.train_crop.draw(crop.image_height, crop.image_width)  # the crop's and flip's draws, again
                augmented.append(self.augment(image))
        return torch.stack(augmented), batch.targets

    def __call__(self, batch: EncodedBatch | CroppedBatch, device: torch.device, training: bool, epoch: int = 0):
        if isinstance(batch, CroppedBatch):
            return self.finish(batch)
        if training:
            return self.finish(self.crop(batch, device, epoch))
        _, images, targets = self._decoded(batch, device)
        return eval_batch(images, self.eval_transform), targets
