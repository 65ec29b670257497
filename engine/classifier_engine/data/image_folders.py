"""The data sets over a data module's (path, label) samples: decoded in the workers, or read as bytes for a device."""

import functools
import logging
from collections.abc import Sequence
from typing import Callable, Optional

import torch
from torch.utils.data import DataLoader, Dataset, default_collate, get_worker_info

from classifier_engine.data.decoders import Decoder, OnCorrupt, image_loader
from classifier_engine.data.device_decode import EncodedBatch, TrainCrop, load_for_device
from classifier_engine.errors import UnreadableImageError, shown

logger = logging.getLogger(__name__)


class DecodedImages(Dataset):
    """(image, label) of each (path, label) sample, with the decoder chosen by name; a file that cannot be read
    (corrupt, vanished, a dangling link, no permission) stops with its path, or is skipped (None) and counted.
    partial: JPEGs reach the transform undecoded (a preset of transforms.py), which decodes only what it keeps."""

    def __init__(self, samples: Sequence[tuple[str, int]], transform: Optional[Callable] = None, *,
                 decoder: Decoder = "auto", on_corrupt: OnCorrupt = "error", partial: bool = False):
        self.samples, self.transform = list(samples), transform
        self.loader = image_loader(decoder, partial=partial)
        self.on_corrupt = on_corrupt
        self.skipped = 0  # per process: each DataLoader worker counts its own

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int):
        path, target = self.samples[index]
        try:
            image = self.loader(path)
            image = self.transform(image) if self.transform is not None else image  # a partial decode reads here
        except OSError as error:
            if not isinstance(error, UnreadableImageError):  # the decoders report bad bytes; this is a missing file
                reason = error.strerror or str(error)
                error = UnreadableImageError(f"cannot read {shown(path)} ({reason}); fix or delete it, or set "
                                             "data.on_corrupt=skip")
                error.path, error.reason = str(path), reason
            if self.on_corrupt == "error":
                raise error
            self.skipped += 1
            worker = get_worker_info()
            where = f"DataLoader worker {worker.id}" if worker is not None else "the main process"
            logger.warning("skipped unreadable %s (%s) [%d skipped so far by %s]", shown(error.path), error.reason,
                           self.skipped, where)
            return None
        return image, target


def collate_readable(batch: list, training: bool = False):
    """default_collate over the samples that decoded (DecodedImages returns None for skipped ones). An evaluation batch
    none of which decoded is None (EvaluationLoader leaves it out); a training batch keeps 2 (as drop_last does, for
    BatchNorm), and none can be left out (under ddp every rank takes the same steps)."""
    readable = [sample for sample in batch if sample is not None]
    check = "check the data with python -m classifier_engine.data.decoders ROOT"
    if not readable and training:
        raise UnreadableImageError(f"all {len(batch)} images of a training batch were unreadable (see the warnings "
                                   f"naming them): the data set is damaged; {check}")
    if training and len(readable) < min(2, len(batch)):
        raise UnreadableImageError(f"a training batch kept 1 of its {len(batch)} images (the others were unreadable, "
                                   f"see the warnings naming them): a batch of 1 may fail BatchNorm; remove them "
                                   f"({check})")
    return default_collate(readable) if readable else None


class EvaluationLoader(DataLoader):
    """An evaluation DataLoader that leaves out a batch none of whose images decoded (on_corrupt="skip")."""

    def __iter__(self):
        return (batch for batch in super().__iter__() if batch is not None)


class EncodedImages(DecodedImages):
    """Samples are (JPEG bytes or an image the worker decoded, target, path, Crop or None): DevicePipeline's input;
    with `crop` (training) each box and flip is drawn here, from the generator SeededSamples seeded with its key."""

    def __init__(self, samples: Sequence[tuple[str, int]], *, crop: Optional[TrainCrop] = None,
                 decoder: str = "nvjpeg", on_corrupt: OnCorrupt = "error"):
        super().__init__(samples, decoder=decoder, on_corrupt=on_corrupt)  # self.loader: the CPU stand-in
        self.loader = functools.partial(load_for_device, decode=self.loader)
        self.crop = crop

    def __getitem__(self, index: int):
        if (sample := super().__getitem__(index)) is None:
            return None
        (payload, (height, width)), target = sample
        crop = self.crop.draw(height, width) if self.crop is not None else None
        return payload, target, self.samples[index][0], crop


def collate_encoded(batch: list) -> EncodedBatch:
    """Samples of EncodedImages as one EncodedBatch, payloads packed; samples a worker skipped (None) are left out."""
    readable = [sample for sample in batch if sample is not None]
    payloads, targets, paths, crops = zip(*readable) if readable else ((), (), (), ())
    return EncodedBatch.pack(list(payloads), torch.tensor(targets, dtype=torch.long), list(paths), list(crops))
