"""The quickstart's data set: scikit-learn's 1,797 real handwritten digits (in its wheel: no download), written once
as JPEGs in ImageFolder layout, so the quickstart runs the path ImageNet runs."""

import shutil
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np
from PIL import Image

from classifier_engine.errors import ConfigError
from classifier_engine.storage.cache import cache_dir

DIGITS = "embedded:digits"  # the one embedded data set
DIGITS_SIZE = 32  # px; the 8x8 originals upscaled so a torchvision ResNet's 32x downsampling still fits
DIGITS_VERSION = "v1"  # bump when the materialized files change, so stale caches are not reused
VAL_EVERY = 5  # every 5th image of each class goes to val/: 1,442 train / 355 val


def resolve_root(root: str) -> Path:
    """'embedded:digits' as its folder in the library's cache (storage/cache.py), written once; others as given."""
    if not root.startswith("embedded:"):
        return Path(root).expanduser()
    if root != DIGITS:
        raise ConfigError(f"unknown embedded data set {root!r}; available: {DIGITS}")
    return materialize_digits(cache_dir() / f"digits-{DIGITS_SIZE}px-{DIGITS_VERSION}")


def materialize_digits(target: Path) -> Path:
    """Write the digits as target/{train,val}/<digit>/<index>.jpg, deterministically; reuse a finished folder."""
    if (target / ".complete").exists():
        return target
    from sklearn.datasets import load_digits  # imported here: only the embedded data set needs it

    digits = load_digits()
    target.parent.mkdir(parents=True, exist_ok=True)
    # Written aside and renamed into place: ranks racing here, or a killed run, never leave a half-written set.
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        seen: Counter[int] = Counter()
        for index, (pixels, label) in enumerate(zip(digits.images, digits.target.tolist())):
            seen[label] += 1
            split = "val" if seen[label] % VAL_EVERY == 0 else "train"
            gray = Image.fromarray(np.round(pixels * (255.0 / 16.0)).astype(np.uint8), mode="L")
            image = gray.resize((DIGITS_SIZE, DIGITS_SIZE), Image.BICUBIC).convert("RGB")
            out = staging / split / str(label)
            out.mkdir(parents=True, exist_ok=True)
            image.save(out / f"{index:04d}.jpg", quality=95)
        (staging / ".complete").touch()
        try:
            staging.rename(target)
        except OSError:
            if not (target / ".complete").exists():  # a stale partial folder, not another rank's finished one
                shutil.rmtree(target, ignore_errors=True)
                staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
