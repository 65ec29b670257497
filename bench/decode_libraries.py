"""The JPEG libraries tried for data.decoder=nvimgcodec, as rows of bench/input_pipeline.py: each one's plain decode and
its best train / eval path (a DCT scale, or a region); NVIDIA DALI's CPU pipeline when it is installed.

    python bench/input_pipeline.py        # these rows beside ours (docs/benchmarks.md, "Decoders")

Every train row draws its crop box from the header's size and flips as the preset does, resizes to the crop size with
an antialiased uint8 resize and collates batches of 64; eval rows resize the short side and center-crop. Rows of a
library that is not installed are left out. PyTurboJPEG 2.x needs a libjpeg-turbo >= 3.0 system library (Debian 12
has 2.1.5), so it has no row: docs/benchmarks.md gives its one-off figure.
"""

import importlib.util
import io
import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from classifier_engine.data.partial_decode import EncodedJpeg, dct_scale, encoded_jpeg
from classifier_engine.data.transforms import CROP_RATIO
from PIL import Image
from torch.utils.data import default_collate
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as F

BATCH = 64
Scaled = Callable[[bytes, EncodedJpeg, int], torch.Tensor]  # (bytes, header, k) -> uint8 CHW at 1/k


def _chunks(paths: list[Path]):
    for start in range(0, len(paths), BATCH):
        yield [p.read_bytes() for p in paths[start : start + BATCH]]


def simplejpeg_at(data: bytes, header: EncodedJpeg, k: int) -> torch.Tensor:
    import simplejpeg

    return torch.from_numpy(simplejpeg.decode_jpeg(data, "RGB", min_height=math.ceil(header.height / k),
                                                   min_width=math.ceil(header.width / k))).permute(2, 0, 1)


def pil_draft_at(data: bytes, header: EncodedJpeg, k: int) -> torch.Tensor:
    with Image.open(io.BytesIO(data)) as image:
        image.draft("RGB", (math.ceil(header.width / k), math.ceil(header.height / k)))  # libjpeg's DCT scaling
        return F.pil_to_tensor(image.convert("RGB"))


def train_row(decode_at: Scaled, crop: int) -> Callable[[list[Path]], None]:
    """Box from the header, the whole decoded at the smallest DCT scale covering the box at `crop`, cut, resized."""
    draw = v2.RandomResizedCrop(crop, ratio=CROP_RATIO, antialias=True)

    def run(paths):
        for chunk in _chunks(paths):
            batch = []
            for data in chunk:
                header = encoded_jpeg(data, whole=None)
                box = draw.make_params([header.size_proxy()])
                top, left, height, width = box["top"], box["left"], box["height"], box["width"]
                scaled = decode_at(data, header, dct_scale(height, width, crop, crop))
                s = scaled.shape[1] / header.height
                rows, columns = slice(round(top * s), round((top + height) * s)), slice(round(left * s),
                                                                                         round((left + width) * s))
                region = scaled[:, rows, columns]
                image = F.resize(region, [crop, crop], antialias=True)
                batch.append((image.flip(-1) if torch.rand(1) < 0.5 else image, 0))
            default_collate(batch)

    return run


def region_row(crop: int) -> Callable[[list[Path]], None]:
    from classifier_engine.data.partial_decode import decode_box

    draw = v2.RandomResizedCrop(crop, ratio=CROP_RATIO)

    def run(paths):
        for chunk in _chunks(paths):
            for data in chunk:
                header = encoded_jpeg(data, whole=None)
                box = draw.make_params([header.size_proxy()])
                decode_box(header, box["top"], box["left"], box["height"], box["width"], (crop, crop))

    return run


def eval_row(decode_at: Scaled, resize: int, crop: int) -> Callable[[list[Path]], None]:
    def run(paths):
        for chunk in _chunks(paths):
            batch = []
            for data in chunk:
                header = encoded_jpeg(data, whole=None)
                short, long = sorted((header.height, header.width))
                size = [resize, int(resize * long / short)][:: 1 if header.height <= header.width else -1]
                image = decode_at(data, header, dct_scale(header.height, header.width, *size))
                batch.append((F.center_crop(F.resize(image, size, antialias=True), crop), 0))
            default_collate(batch)

    return run


def library_rows(crop: int, small_crop: int, resize: int) -> dict[str, dict[str, Callable]]:
    """{preset: {row: run(paths)}} of every library here that ours does not already time."""
    rows = {"decode": {}, "train": {}, "train small": {}, "eval": {}}
    libraries = {"PIL draft()": pil_draft_at}
    if importlib.util.find_spec("simplejpeg"):
        libraries["simplejpeg"] = simplejpeg_at
        # At 1/8 libjpeg keeps only each block's DC term: ~the entropy decoding alone, which no region or scale skips
        # (a region skips the rows below it only).
        for k, name in ((1, "decode: simplejpeg"), (8, "decode: simplejpeg at 1/8: the entropy-decoding floor")):
            rows["decode"][name] = lambda paths, k=k: [simplejpeg_at(d, encoded_jpeg(d, None), k)
                                                       for chunk in _chunks(paths) for d in chunk]
    rows["decode"][f"decode: nvimgcodec, the {crop}-px train crop's region alone"] = region_row(crop)
    for name, decode_at in libraries.items():
        rows["train"][f"{name}: DCT-scaled whole, cut"] = train_row(decode_at, crop)
        rows["train small"][f"{name}: DCT-scaled whole, cut"] = train_row(decode_at, small_crop)
        rows["eval"][f"{name}: DCT-scaled whole"] = eval_row(decode_at, resize, crop)
    if importlib.util.find_spec("nvidia") and importlib.util.find_spec("nvidia.dali"):
        for preset, run in dali_rows(crop, small_crop, resize).items():
            rows[preset]["DALI CPU pipeline"] = run
    return rows


def dali_rows(crop: int, small_crop: int, resize: int) -> dict[str, Callable]:
    """DALI's CPU pipelines (decoders.image_slice: its region decode), fed our batches and our crop boxes."""
    from nvidia.dali import fn, pipeline_def, types

    def build(kind: str, size: int):
        @pipeline_def(batch_size=BATCH, num_threads=1, device_id=None, prefetch_queue_depth=1, exec_dynamic=True)
        def pipeline():
            jpegs = fn.external_source(name="jpegs")
            if kind == "decode":
                return fn.decoders.image(jpegs, device="cpu", output_type=types.RGB)
            if kind == "eval":
                images = fn.decoders.image(jpegs, device="cpu", output_type=types.RGB)
                return fn.crop(fn.resize(images, resize_shorter=resize, antialias=True), crop=(crop, crop))
            anchor, shape = fn.external_source(name="anchor"), fn.external_source(name="shape")
            images = fn.decoders.image_slice(jpegs, anchor, shape, device="cpu", output_type=types.RGB,
                                             axis_names="HW")
            return fn.flip(fn.resize(images, size=(size, size), antialias=True),
                           horizontal=fn.external_source(name="flip"))

        built = pipeline()
        built.build()
        draw = v2.RandomResizedCrop(size, ratio=CROP_RATIO)

        def run(paths):
            for chunk in _chunks(paths):
                built.feed_input("jpegs", [np.frombuffer(d, np.uint8) for d in chunk])
                if kind == "train":
                    boxes = [draw.make_params([encoded_jpeg(d, None).size_proxy()]) for d in chunk]
                    built.feed_input("anchor", [np.array([b["top"], b["left"]], np.int32) for b in boxes])
                    built.feed_input("shape", [np.array([b["height"], b["width"]], np.int32) for b in boxes])
                    built.feed_input("flip", [np.array(int(torch.rand(1) < 0.5), np.int32) for _ in chunk])
                (images,) = built.run()
                tensors = [torch.from_numpy(np.asarray(image)).permute(2, 0, 1) for image in images]
                if kind != "decode":  # decode rows stop at the images, as ours do
                    default_collate([(image, 0) for image in tensors])

        return run

    return {"decode": build("decode", crop), "train": build("train", crop), "train small": build("train", small_crop),
            "eval": build("eval", crop)}
