"""Write a fake ImageNet (ImageFolder layout) of JPEGs sized like the real ones, for input-pipeline throughput runs.

    python bench/fake_imagenet.py /tmp/fake_imagenet --classes 100 --train 30720 --val 500     # ~3 GB, 500x375 px
    python bench/fake_imagenet.py /tmp/fake_imagenet --size mixed     # ImageNet's usual shapes, +-15 % (mean ~475x430)

The pixels are smooth random blobs plus grain, so files come out near ImageNet's average (~110 KB at 500x375, q90)
and cost about as much to decode; the labels carry no signal. An existing folder with the same counts is reused.
"""

import argparse
import os
import sys
from multiprocessing import Pool
from pathlib import Path

import numpy as np
from PIL import Image


def fake_photo(seed: int, width: int, height: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    coarse = rng.integers(0, 256, size=(max(2, height // 48), max(2, width // 48), 3), dtype=np.uint8)
    smooth = np.asarray(Image.fromarray(coarse).resize((width, height), Image.BICUBIC), dtype=np.int16)
    grain = rng.normal(0, 20, size=(height, width, 3))
    return Image.fromarray(np.clip(smooth + grain, 0, 255).astype(np.uint8))


# ImageNet's commonest shapes (landscape and portrait 4:3, 3:2), for --size mixed.
SHAPES = [(500, 375), (375, 500), (500, 333), (500, 400), (333, 500), (640, 480)]


def _write(job: tuple[str, int, int, int]) -> None:
    path, seed, width, height = job
    if width == 0:  # mixed: one of SHAPES, jittered, from the image's seed
        rng = np.random.default_rng(seed)
        base_width, base_height = SHAPES[seed % len(SHAPES)]
        jitter = rng.uniform(0.85, 1.15)
        width, height = int(base_width * jitter), int(base_height * jitter)
    fake_photo(seed, width, height).save(path, quality=90)


def write_fake_imagenet(root: Path, *, classes: int, train: int, val: int, width: int, height: int,
                        workers: int) -> Path:
    """root/{train,val}/cNNNN/*.JPEG, images spread evenly over the classes; returns root."""
    jobs = []
    for split, count, offset in (("train", train, 0), ("val", val, 10**9)):
        for index in range(count):
            folder = root / split / f"c{index % classes:04d}"
            jobs.append((str(folder / f"{split}_{index:07d}.JPEG"), offset + index, width, height))
    if sum(1 for _ in root.glob("*/*/*.JPEG")) == len(jobs) and sum(1 for _ in root.glob("train/*")) == classes:
        return root
    for job in jobs:
        Path(job[0]).parent.mkdir(parents=True, exist_ok=True)
    with Pool(workers) as pool:
        pool.map(_write, jobs, chunksize=64)
    return root


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", type=Path)
    parser.add_argument("--classes", type=int, default=100)
    parser.add_argument("--train", type=int, default=30720, help="training images in total")
    parser.add_argument("--val", type=int, default=500, help="validation images in total")
    parser.add_argument("--size", default="500x375", help="WIDTHxHEIGHT (ImageNet's most common shape), or mixed")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args(argv)
    width, height = (0, 0) if args.size == "mixed" else (int(v) for v in args.size.lower().split("x"))
    if args.train < args.classes or args.val < args.classes:
        parser.error(f"--train and --val need at least one image per class ({args.classes}), got "
                     f"{args.train}, {args.val}")
    write_fake_imagenet(args.root, classes=args.classes, train=args.train, val=args.val, width=width, height=height,
                        workers=args.workers)
    print(f"fake ImageNet: {args.root} ({args.train} train, {args.val} val, {args.classes} classes, {args.size})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
