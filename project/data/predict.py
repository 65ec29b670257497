"""The images to predict: every image file under a folder (searched recursively), each once, in sorted path order
(what counts as an image file, links, names that are not UTF-8: docs/imagenet.md).

    python -m project predict --config configs/quickstart.yaml --ckpt_path RUN/checkpoints/last.ckpt \\
        --data.predict_root path/to/images
"""

import os
import stat
from collections.abc import Callable
from pathlib import Path

from torchvision.datasets.folder import IMG_EXTENSIONS

from project.data.decoders import Decoder, OnCorrupt
from project.data.image_folders import DecodedImages
from project.engine.errors import MissingInputError, shown


def _is_listed_file(entry: os.DirEntry) -> bool:
    """A regular file (or a link to one), or a dangling link, with an image extension."""
    if not entry.name.lower().endswith(IMG_EXTENSIONS):
        return False
    try:
        return stat.S_ISREG(entry.stat().st_mode)
    except OSError:  # a dangling link or a link loop: listed, so that reading it reports it (on_corrupt)
        return entry.is_symlink()


def _identity(entry: os.DirEntry) -> tuple[int, int]:
    try:
        info = entry.stat()
    except OSError:
        info = entry.stat(follow_symlinks=False)
    return info.st_dev, info.st_ino


def list_images(root: str | os.PathLike) -> list[Path]:
    """Every image file under `root` once (see the module docstring), sorted by its path relative to `root`."""
    root = Path(root).expanduser()
    if not root.is_dir():
        raise MissingInputError(
            f"predict root {shown(root)} is not a folder; pass --data.predict_root pointing to a folder of images "
            f"(any depth, extensions {', '.join(IMG_EXTENSIONS)})"
        )
    found, seen_files, seen_folders = [], set(), set()
    folders = [root]
    while folders:  # depth first, in sorted order: "the path met first" is the same on every run
        folder = folders.pop()
        try:
            info = folder.stat()
            if (info.st_dev, info.st_ino) in seen_folders:
                continue  # a symlink back to a parent, or a second link to a folder already walked
            seen_folders.add((info.st_dev, info.st_ino))
            with os.scandir(folder) as listing:
                entries = sorted((e for e in listing if not e.name.startswith(".")), key=lambda e: e.name)
        except OSError as error:
            raise MissingInputError(
                f"cannot list {shown(folder)} under predict root {shown(root)} ({error.strerror}): make it readable, "
                "or move it out of the predict root"
            ) from error
        subfolders = []
        for entry in entries:
            if entry.is_dir():  # follows symlinks; False for a dangling one
                subfolders.append(Path(entry.path))
            elif _is_listed_file(entry):
                identity = _identity(entry)
                if identity not in seen_files:
                    seen_files.add(identity)
                    found.append(Path(entry.path))
        folders += reversed(subfolders)
    if not found:
        raise MissingInputError(
            f"predict root {shown(root)} holds no images; expected files with an extension in {IMG_EXTENSIONS} "
            "at any depth below it (names starting with '.' are skipped)"
        )
    # Sorted as POSIX strings, so the order (and the CSV written from it) is the same on every machine.
    return sorted(found, key=lambda path: path.relative_to(root).as_posix())


class ImagePathDataset(DecodedImages):
    """Yields (image, index); `paths[index]` names the file, so predictions can be written back under its path.

    decoder: as the data module's `data.decoder`. A device decoder ("nvjpeg", "torchcodec-cuda") decodes with its CPU
    counterpart here (project.data.decoders.image_loader), on purpose: predict batches are decoded and transformed in
    the workers, so the eval preset runs exactly as the CPU pipeline runs it. on_corrupt: as `data.on_corrupt` (with
    "skip", collate_readable drops the image and the predictions CSV leaves it out and names it).
    """

    def __init__(self, root: str | os.PathLike | list[Path], transform: Callable | None = None, *,
                 decoder: Decoder = "auto", on_corrupt: OnCorrupt = "error"):
        # A folder (every image below it), or the paths themselves (a manifest's, in its order).
        self.paths = list(root) if isinstance(root, list) else list_images(Path(root).expanduser())
        super().__init__([(str(path), index) for index, path in enumerate(self.paths)], transform, decoder=decoder,
                         on_corrupt=on_corrupt)
