"""Image loading for the data module: torchvision.io decoding, PIL only where needed, always 3-channel RGB.

    python -m project.data.decoders /datasets/imagenet        # list the files training would fail on, before a long run

ImageNet's train set holds a PNG saved as .JPEG, 22 CMYK JPEGs and grayscale JPEGs: decode_image reads the real format
from the bytes (not the name) and converts CMYK (Adobe-inverted included) and gray to RGB; formats torchvision.io does
not read (BMP, TIFF, ...) go to PIL. A truncated or corrupt file raises UnreadableImageError naming it, or, with
on_corrupt="skip", is left out of its batch and counted in a warning.
"""

import argparse
import logging
import os
import sys
from multiprocessing import Pool
from pathlib import Path
from typing import Any, Callable, Literal, Optional

import torch
from PIL import Image
from torch.utils.data import default_collate, get_worker_info
from torchvision.datasets import ImageFolder
from torchvision.datasets.folder import IMG_EXTENSIONS
from torchvision.io import ImageReadMode, decode_image
from torchvision.transforms.v2.functional import pil_to_tensor, to_dtype

Decoder = Literal["pil", "torchvision"]
OnCorrupt = Literal["error", "skip"]
logger = logging.getLogger(__name__)


class UnreadableImageError(OSError):
    """A file that neither torchvision.io nor PIL can decode (truncated, corrupt, not an image)."""


def _unreadable(path: str, reason: str) -> UnreadableImageError:
    error = UnreadableImageError(
        f"cannot decode {path} ({reason}); expected a complete JPEG/PNG/WebP/GIF or another format PIL reads. "
        "Replace or delete the file (python -m project.data.decoders ROOT lists them all), or set data.on_corrupt=skip"
    )
    error.path, error.reason = path, reason  # attributes, not args: OSError gives extra args errno meanings
    return error


def _pil_rgb(path: str) -> Image.Image:
    with Image.open(path) as image:
        return image.convert("RGB")  # convert() decodes the pixels, so truncation raises here and not later


def decode_pil(path: str) -> Image.Image:
    """The stock torchvision loader (PIL, RGB), with an error that names the file."""
    try:
        return _pil_rgb(path)
    except (OSError, ValueError, Image.DecompressionBombError) as error:
        raise _unreadable(path, f"PIL: {error}") from error


def decode_torchvision(path: str) -> torch.Tensor:
    """uint8 RGB tensor (3, H, W): torchvision.io (libjpeg-turbo, libpng, libwebp), PIL for the other formats."""
    with open(path, "rb") as file:
        data = file.read()
    if not data:
        raise _unreadable(path, "empty file")
    try:
        image = decode_image(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.RGB)
    except RuntimeError as tv_error:
        try:
            return pil_to_tensor(_pil_rgb(path))
        except (OSError, ValueError, Image.DecompressionBombError) as pil_error:
            # torchvision's message starts with the C++ source location; its last clause is the reason.
            reason = str(tv_error).rsplit(", ", 1)[-1]
            raise _unreadable(path, f"torchvision.io: {reason}; PIL: {pil_error}") from pil_error
    # 16-bit PNGs decode to uint16; the pipeline works on uint8 like every other image.
    return image if image.dtype == torch.uint8 else to_dtype(image, torch.uint8, scale=True)


DECODERS: dict[str, Callable[[str], Any]] = {"pil": decode_pil, "torchvision": decode_torchvision}


class DecodedImageFolder(ImageFolder):
    """ImageFolder with the decoder chosen by name; unreadable files stop with their path, or are skipped and counted."""

    def __init__(self, root: str, transform: Optional[Callable] = None, *, decoder: Decoder = "torchvision",
                 on_corrupt: OnCorrupt = "error"):
        if decoder not in DECODERS:
            raise ValueError(f"decoder must be one of {sorted(DECODERS)}, got {decoder!r}")
        if on_corrupt not in ("error", "skip"):
            raise ValueError(f"on_corrupt must be 'error' or 'skip', got {on_corrupt!r}")
        super().__init__(root, transform=transform, loader=DECODERS[decoder])
        self.on_corrupt = on_corrupt
        self.skipped = 0  # per process: each DataLoader worker counts its own

    def __getitem__(self, index: int):
        try:
            return super().__getitem__(index)
        except UnreadableImageError as error:
            if self.on_corrupt == "error":
                raise
            self.skipped += 1
            worker = get_worker_info()
            where = f"DataLoader worker {worker.id}" if worker is not None else "the main process"
            logger.warning("skipped unreadable %s (%s) [%d skipped so far by %s]", error.path, error.reason, self.skipped, where)
            return None


def collate_readable(batch: list):
    """default_collate over the samples that decoded (DecodedImageFolder returns None for skipped ones)."""
    readable = [sample for sample in batch if sample is not None]
    if not readable:
        raise UnreadableImageError(f"all {len(batch)} images of a batch were unreadable (see the warnings naming them): "
                                   "the data set is damaged; check it with python -m project.data.decoders ROOT")
    return default_collate(readable)


def _check(path: str) -> Optional[str]:
    try:
        decode_torchvision(path)
    except UnreadableImageError as error:
        return f"{error.path}: {error.reason}"
    return None


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m project.data.decoders", description=__doc__.split("\n")[0])
    parser.add_argument("root", type=Path, help="folder to check (all image files below it)")
    parser.add_argument("--workers", type=int, default=os.cpu_count(), help="decoding processes")
    args = parser.parse_args(argv)
    paths = sorted(str(Path(d) / f) for d, _, files in os.walk(args.root) for f in files if f.lower().endswith(IMG_EXTENSIONS))
    with Pool(args.workers) as pool:
        failures = [reason for reason in pool.imap(_check, paths, chunksize=64) if reason is not None]
    for reason in failures:
        print(reason)
    print(f"{len(paths)} images checked under {args.root}, {len(failures)} unreadable", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
