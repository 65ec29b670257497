"""Classify images with an exported model, preprocessed exactly as the training run evaluated its images.

    python tools/preprocess.py RUN/export cat.jpg [more.jpg ...]     # the top-5 classes of each image

Standalone (torch, torchvision and Pillow; not this package, not Lightning): copy it next to the model.pt2 and
model.json that `python -m project export` wrote. `preprocess` gives the same floats as the project's evaluation
transform (classifier_engine.data.transforms.eval_preset), bit for bit: torchvision's own resize of the short side
(the long side truncated, as torchvision rounds it; bilinear, antialiased, on uint8) and center crop, then /255, mean
and std. Rounding the long side or the crop offset another way moves pixels by several uint8 levels. Use it for
model.onnx too: `onnxruntime.InferenceSession("model.onnx").run(None, {"images": batch.numpy()})[0]` gives the logits.
Images are read with Pillow, without EXIF rotation, as data.decoder=pil and torchvision read them (torchcodec, the
default when installed, applies a file's EXIF orientation: rotate such images first, PIL.ImageOps.exif_transpose).
"""

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Optional

import torch
from PIL import Image
from torchvision.transforms.v2 import InterpolationMode
from torchvision.transforms.v2 import functional as F


def load_rgb(path: str | Path) -> torch.Tensor:
    """A 3 x H x W uint8 RGB tensor (gray, palette, CMYK and RGBA images converted, as the project's decoders do)."""
    with Image.open(path) as image:
        return F.pil_to_tensor(image.convert("RGB"))


def resize_and_crop(image: torch.Tensor | Image.Image, *, resize: int, crop: int,
                    interpolation: str = "bilinear") -> torch.Tensor:
    """The 3 x crop x crop uint8 crop of a uint8 RGB tensor (3 x H x W) or a PIL image: short side to `resize`."""
    x = F.pil_to_tensor(image.convert("RGB")) if isinstance(image, Image.Image) else image
    if x.dtype != torch.uint8 or x.ndim != 3 or x.shape[0] != 3:
        raise ValueError(f"expected a 3 x H x W uint8 RGB tensor, got {x.dtype} of shape {tuple(x.shape)}")
    x = F.resize(x, [resize], interpolation=InterpolationMode(interpolation), antialias=True)
    return F.center_crop(x, [crop, crop])


def preprocess(image: torch.Tensor | Image.Image, *, resize: int, crop: int, mean: Sequence[float],
               std: Sequence[float], interpolation: str = "bilinear") -> torch.Tensor:
    """The 3 x crop x crop float32 input of the exported model (model.json's "preprocessing" as keyword arguments)."""
    x = resize_and_crop(image, resize=resize, crop=crop, interpolation=interpolation)
    return F.normalize(F.to_dtype(x, torch.float32, scale=True), mean=list(mean), std=list(std))


def read_export(folder: str | Path) -> tuple[torch.nn.Module, dict]:
    """model.pt2 as a callable module, and model.json (class names, preprocessing)."""
    folder = Path(folder)
    meta = json.loads((folder / "model.json").read_text())
    return torch.export.load(folder / "model.pt2").module(), meta


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python tools/preprocess.py", description=__doc__.splitlines()[0])
    parser.add_argument("export", type=Path, help="folder holding model.pt2 and model.json (RUN/export)")
    parser.add_argument("images", type=Path, nargs="+", help="image files")
    parser.add_argument("--top", type=int, default=5, help="classes to print per image")
    args = parser.parse_args(argv)
    try:
        if not (args.export / "model.json").is_file():
            raise ValueError(f"{args.export}: no model.json there: pass the folder `python -m project export` wrote "
                             "(RUN/export)")
        model, meta = read_export(args.export)
        images = []
        for path in args.images:
            try:
                images.append(load_rgb(path))
            except OSError as error:
                raise ValueError(f"{path}: not an image Pillow reads ({error.strerror or error})") from None
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    batch = torch.stack([preprocess(image, **meta["preprocessing"]) for image in images])
    with torch.no_grad():
        probs = model(batch).softmax(dim=1)
    names = meta["class_names"]
    for path, row in zip(args.images, probs):
        print(os.fsencode(path).decode("utf-8", "backslashreplace"))  # a name that is not UTF-8 prints escaped
        for p, index in zip(*row.topk(min(args.top, len(names)))):
            print(f"  {names[index]}: {p:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
