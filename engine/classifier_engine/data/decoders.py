"""CPU decoders by `data.decoder` name: uint8 RGB, or UnreadableImageError naming the file (why each: docs/data.md).

    python -m classifier_engine.data.decoders /datasets/imagenet  # the files a run would fail on, before it starts
"""

import argparse
import functools
import importlib.util
import os
import re
import signal
import sys
from multiprocessing import Pool
from pathlib import Path
from typing import Any, Callable, Literal, Optional

import torch
from lightning.pytorch.utilities import rank_zero_info
from PIL import Image
from torchvision.datasets.folder import IMG_EXTENSIONS
from torchvision.transforms.v2.functional import pil_to_tensor, to_dtype

from classifier_engine.data.layout import is_data
from classifier_engine.data.partial_decode import encoded_jpeg, nvimgcodec_decode
from classifier_engine.errors import ConfigError, UnreadableImageError, install_extra

try:  # torchvision 0.29 deprecates its image decoders for TorchCodec's; a later release removes them
    from torchvision.io import ImageReadMode, decode_image, decode_jpeg
except ImportError:  # decoder=torchvision and nvjpeg say so (unavailable)
    ImageReadMode = decode_image = decode_jpeg = None

Decoder = Literal["auto", "nvimgcodec", "torchcodec", "torchvision", "pil", "nvjpeg", "torchcodec-cuda"]
OnCorrupt = Literal["error", "skip"]
CPU_DECODERS = ("nvimgcodec", "torchcodec", "torchvision", "pil")  # the order "auto" tries them in
DEVICE_DECODERS = {"nvjpeg": "torchvision", "torchcodec-cuda": "torchcodec"}  # each with its CPU stand-in


def _unreadable(path: str, reason: str) -> UnreadableImageError:
    error = UnreadableImageError(
        f"cannot decode {path} ({reason}); expected a complete JPEG/PNG/WebP/GIF or another format PIL reads. "
        "Replace or delete the file (python -m classifier_engine.data.decoders ROOT lists them all), or set "
        "data.on_corrupt=skip"
    )
    error.path, error.reason = path, reason  # attributes, not args: OSError gives extra args errno meanings
    return error


def _reason(error: Exception) -> str:
    # C++ errors start with "function, /path/file.cpp:123, "; keep the first sentence after it.
    text = re.sub(r"^.*?\.(?:cpp|h|hpp):\d+, ", "", str(error).strip())
    return text.split(". ")[0].rstrip(".")


def decode_pil(path: str, failed_before: str = "") -> Image.Image:
    """The stock torchvision loader (PIL, RGB), with an error that names the file (and what failed before PIL)."""
    try:
        with Image.open(path) as image:
            return as_rgb(image)  # convert() decodes the pixels, so truncation raises here and not later
    except (OSError, ValueError, Image.DecompressionBombError) as error:
        raise _unreadable(path, f"{failed_before}PIL: {error}") from error


def as_rgb(image: Image.Image) -> Image.Image:
    """The image in RGB; 16-bit gray scaled to 8 bits (convert() clips it at 255: all white)."""
    if image.mode.startswith("I;16"):
        return image.convert("I").point(lambda value: value / 257).convert("RGB")
    return image.convert("RGB")


def _read(path: str) -> bytes:
    data = Path(path).read_bytes()
    if not data:
        raise _unreadable(path, "empty file")
    return data


def _decode_tensor(path: str, library: str, decode: Callable[[bytes], torch.Tensor], data: bytes) -> torch.Tensor:
    """uint8 RGB (3, H, W) from `decode` (the file's bytes -> an image tensor), PIL for what it does not read."""
    try:
        image = decode(data)
    except (RuntimeError, ValueError) as error:
        return pil_to_tensor(decode_pil(path, failed_before=f"{library}: {_reason(error)}; "))
    if image.dim() == 4:  # an animated GIF/WebP: its first frame, as PIL gives
        image = image[0]
    # 16-bit PNGs decode to uint16; the pipeline works on uint8 like every other image.
    return image if image.dtype == torch.uint8 else to_dtype(image, torch.uint8, scale=True)


def decode_torchvision(path: str) -> torch.Tensor:
    """uint8 RGB tensor (3, H, W): torchvision.io (libjpeg-turbo, libpng, libwebp), PIL for the other formats."""
    return _decode_tensor(path, "torchvision.io", lambda data: decode_image(
        torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.RGB), _read(path))


def decode_torchcodec(path: str) -> torch.Tensor:
    """uint8 RGB tensor (3, H, W): TorchCodec (libjpeg-turbo, libpng, libwebp; no FFmpeg needed), PIL for the others."""
    from torchcodec.decoders import decode_image as torchcodec_decode  # the optional extra, checked in resolve_decoder

    return _decode_tensor(path, "torchcodec", lambda data: torchcodec_decode(data, mode="RGB"), _read(path))


def decode_nvimgcodec(path: str, *, partial: bool = False) -> Any:
    """uint8 RGB tensor (3, H, W): nvImageCodec on the CPU, PIL for the others; partial: a JPEG as an EncodedJpeg."""
    data = _read(path)
    if partial and (jpeg := encoded_jpeg(data, functools.partial(decode_nvimgcodec, path))) is not None:
        return jpeg
    return _decode_tensor(path, "nvImageCodec", nvimgcodec_decode, data)


LOADERS: dict[str, Callable[[str], Any]] = {"nvimgcodec": decode_nvimgcodec, "torchcodec": decode_torchcodec,
                                            "torchvision": decode_torchvision, "pil": decode_pil}


def unavailable(decoder: str) -> Optional[str]:
    """Why a CPU decoder cannot run here, with the fix; None when it can."""
    found = importlib.util.find_spec
    if decoder == "nvimgcodec" and not (found("simplejpeg") and found("nvidia") and found("nvidia.nvimgcodec")):
        return (f"data.decoder=nvimgcodec needs nvImageCodec and simplejpeg: {install_extra('nvimgcodec')}; or choose "
                "torchcodec/torchvision/pil")
    if decoder == "torchcodec" and found("torchcodec") is None:
        return f"data.decoder=torchcodec needs TorchCodec: {install_extra('torchcodec')}; or choose pil/torchvision"
    if decoder == "torchvision" and decode_image is None:
        import torchvision

        return (f"data.decoder=torchvision needs torchvision.io.decode_image, which torchvision "
                f"{torchvision.__version__} no longer has: {install_extra('torchcodec')} and set data.decoder="
                "torchcodec (or auto), or use pil")
    return None


@functools.cache
def resolve_decoder(decoder: str) -> str:
    """The decoder a `data.decoder` name stands for here: "auto" becomes the first available CPU decoder (logged)."""
    if decoder == "auto":
        chosen = next(name for name in CPU_DECODERS if unavailable(name) is None)  # PIL is always there
        # Lightning's logger prints at INFO (ours would need logging configured): the choice shows in every run.
        rank_zero_info(f"data.decoder=auto: decoding with {chosen} (the first installed of {', '.join(CPU_DECODERS)})")
        return chosen
    names = ("auto", *CPU_DECODERS, *DEVICE_DECODERS)
    if decoder not in names:
        raise ConfigError(f"data.decoder must be one of {', '.join(names)}; got {decoder!r}")
    problem = unavailable(DEVICE_DECODERS.get(decoder, decoder))
    if problem is not None:
        raise ConfigError(problem if decoder in CPU_DECODERS else f"data.decoder={decoder}: {problem}")
    return decoder


def image_loader(decoder: str, partial: bool = False) -> Callable[[str], Any]:
    """The CPU loader (path -> RGB image) of a `data.decoder` name (of a device decoder: its CPU stand-in's);
    partial: JPEGs as EncodedJpeg where the decoder decodes in part (the presets of transforms.py take them)."""
    decoder = resolve_decoder(decoder)
    if partial and decoder == "nvimgcodec":
        return functools.partial(decode_nvimgcodec, partial=True)
    return LOADERS[DEVICE_DECODERS.get(decoder, decoder)]


def _check(path: str, decode: Callable[[str], Any]) -> Optional[str]:
    try:
        decode(path)
    except UnreadableImageError as error:
        return f"{error.path}: {error.reason}"
    except OSError as error:  # (a dangling link: a fit's loader names it the same way)
        return f"{path}: {error.strerror or error}"
    return None


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m classifier_engine.data.decoders",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("root", type=Path, help="folder to check (all image files below it)")
    parser.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)),
                        help="decoding processes (default: the cores this process may use)")
    parser.add_argument("--decoder", default="auto", help="as data.decoder (a device decoder checks with its CPU one)")
    args = parser.parse_args(argv)
    try:
        if not args.root.is_dir():
            raise ConfigError(f"{args.root} is not a folder: pass the data's root (or any folder of images)")
        if args.workers < 1:
            raise ConfigError(f"--workers {args.workers}: expected a number of processes >= 1")
        decoder = resolve_decoder(args.decoder)
    except ValueError as error:  # (a ConfigError is one)
        print(f"{parser.prog}: error: {error}", file=sys.stderr)
        return 2
    decoder = DEVICE_DECODERS.get(decoder, decoder)
    paths = sorted(str(Path(d) / f) for d, _, files in os.walk(args.root, followlinks=True) for f in files
                   if f.lower().endswith(IMG_EXTENSIONS) and all(map(is_data, Path(d, f).relative_to(args.root).parts)))
    # A forked worker inherits the caller's SIGTERM handler (a notebook's or a test's): Pool.terminate's SIGTERM would
    # then leave a worker waiting on the task queue's lock, and the exit wait for it forever (seen once in CI).
    with Pool(args.workers, initializer=signal.signal, initargs=(signal.SIGTERM, signal.SIG_DFL)) as pool:
        checked = pool.imap(functools.partial(_check, decode=LOADERS[decoder]), paths, chunksize=64)
        failures = [reason for reason in checked if reason]
    for reason in failures:
        print(reason)
    print(f"{len(paths)} images checked under {args.root} with {decoder}, {len(failures)} unreadable", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
