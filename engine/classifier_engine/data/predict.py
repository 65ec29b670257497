"""The images to predict: every image file at any depth under a folder, once, in sorted order (docs/data.md).

    python -m classifier_engine predict --config CONFIG --ckpt_path RUN/checkpoints/last.ckpt \\
        --data.predict_root path/to/images
"""

import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Optional

import torch
from torchvision.datasets.folder import IMG_EXTENSIONS
from torchvision.transforms import v2

from classifier_engine.contract import eval_preprocessing
from classifier_engine.data.decoders import Decoder, OnCorrupt
from classifier_engine.data.image_folders import DecodedImages
from classifier_engine.data.layout import is_data
from classifier_engine.data.transforms import eval_preset
from classifier_engine.errors import MissingInputError, shown


def _image_file(path: Path) -> Optional[tuple[int, int]]:
    """(device, inode) of a regular file, a link to one or a dangling link, with an image extension; else None."""
    if not path.name.lower().endswith(IMG_EXTENSIONS):
        return None
    try:
        info = os.stat(path)
    except OSError:  # a dangling link or a link loop: listed, so that reading it reports it (on_corrupt)
        info = os.lstat(path)
        return (info.st_dev, info.st_ino) if stat.S_ISLNK(info.st_mode) else None
    return (info.st_dev, info.st_ino) if stat.S_ISREG(info.st_mode) else None


def list_images(root: str | os.PathLike) -> list[Path]:
    """Every image file under `root` once (see the module docstring), sorted by its path relative to `root`."""
    root = Path(root).expanduser()
    if not root.is_dir():
        raise MissingInputError(f"predict root {shown(root)} is not a folder; pass --data.predict_root pointing to a "
                                f"folder of images (any depth, extensions {', '.join(IMG_EXTENSIONS)})")

    def unlistable(error: OSError):
        raise MissingInputError(f"cannot list {shown(error.filename)} under predict root {shown(root)} "
                                f"({error.strerror}): make it readable, or move it out of the predict root") from error

    found, seen = [], set()  # each file and each real folder once, under the path met first
    # Depth first, in sorted order: "the path met first" is the same on every run.
    for folder, subfolders, files in os.walk(root, onerror=unlistable, followlinks=True):
        info = os.stat(folder)
        if (info.st_dev, info.st_ino) in seen:  # a symlink back to a parent, or a second link to a folder walked
            subfolders.clear()
            continue
        seen.add((info.st_dev, info.st_ino))
        subfolders[:] = sorted(filter(is_data, subfolders))
        for path in (Path(folder, name) for name in sorted(files) if is_data(name)):
            identity = _image_file(path)
            if identity is not None and identity not in seen:
                seen.add(identity)
                found.append(path)
    if not found:
        raise MissingInputError(f"predict root {shown(root)} holds no images; expected files with an extension in "
                                f"{IMG_EXTENSIONS} at any depth below it (names starting with '.' are skipped)")
    # Sorted as POSIX strings, so the order (and the CSV written from it) is the same on every machine.
    return sorted(found, key=lambda path: path.relative_to(root).as_posix())


class ImagePathDataset(DecodedImages):
    """Yields (image, index), `paths[index]` naming the file; decoded in the workers whatever `decoder` (a device
    decoder's CPU counterpart), so the eval preset runs as the CPU pipeline runs it."""

    def __init__(self, root: str | os.PathLike | list[Path], transform: Callable | None = None, *,
                 decoder: Decoder = "auto", on_corrupt: OnCorrupt = "error"):
        # A folder (every image below it), or the paths themselves (a manifest's, in its order).
        self.paths = list(root) if isinstance(root, list) else list_images(root)
        super().__init__([(str(path), index) for index, path in enumerate(self.paths)], transform, decoder=decoder,
                         on_corrupt=on_corrupt)


def eval_transform(datamodule: object) -> v2.Compose:
    """How an image file becomes the network's input: the data module's eval_preprocessing() (resize the short side,
    center-crop, normalize), else the contract's default: RGB pixels scaled to [0, 1], no resize, no normalization."""
    if (offered := eval_preprocessing(datamodule)) is None:
        return v2.Compose([v2.ToImage(), v2.ToDtype(torch.float32, scale=True)])
    return eval_preset(resize_size=offered.resize, crop_size=offered.crop, mean=offered.mean, std=offered.std)
