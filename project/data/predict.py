"""The images to predict: every image file under a folder (searched recursively), each once, in sorted path order.

    python -m project predict --config configs/quickstart.yaml --ckpt_path <run>/checkpoints/last.ckpt \
        --data.predict_root path/to/images

What counts as an image file: a name ending in an image extension (torchvision's IMG_EXTENSIONS, any case: .JPG too)
that is a regular file, or a symlink to one, at any depth. Skipped: names starting with "." (hidden files and folders:
.thumbnails/, macOS' ._photo.jpg), other extensions, FIFOs, sockets and devices (opening a FIFO would block).
Symlinked folders are followed, each real folder once (a link back to a parent is not a loop); a file reached by
several paths (symlinks, hard links) is listed once, under the path met first in the sorted walk. A dangling symlink
with an image name is listed and, like a corrupt file, stops the run naming it (data.on_corrupt=error) or is skipped
(data.on_corrupt=skip). A folder that cannot be listed (no permission) is an error naming it: predicting a silent
subset would be worse. Names need not be UTF-8: paths stay exactly what the filesystem holds (os.fsencode(path) is
the name's bytes), and the CSV writes those bytes (prediction_writer.py).
"""

import logging
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch.utils.data import Dataset, get_worker_info
from torchvision.datasets.folder import IMG_EXTENSIONS

from project.data.decoders import Decoder, OnCorrupt, image_loader
from project.engine.errors import ConfigError, MissingInputError, UnreadableImageError, shown

logger = logging.getLogger(__name__)


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


class ImagePathDataset(Dataset):
    """Yields (image, index); `paths[index]` names the file, so predictions can be written back under its path.

    decoder: as the data module's `data.decoder`. A device decoder ("nvjpeg", "torchcodec-cuda") decodes with its CPU
    counterpart here (torchvision, torchcodec: project.data.decoders.image_loader), on purpose: predict batches are
    decoded and transformed in the workers, so the eval preset runs exactly as the CPU pipeline runs it.
    on_corrupt: as `data.on_corrupt`: a file that cannot be read (corrupt, vanished, a dangling link, no permission)
    stops the run with its path ("error"), or yields None and a warning naming it ("skip"; collate_readable drops it,
    and the predictions CSV leaves it out and names it).
    """

    def __init__(self, root: str | os.PathLike, transform: Callable | None = None, *, decoder: Decoder = "auto",
                 on_corrupt: OnCorrupt = "error"):
        if on_corrupt not in ("error", "skip"):
            raise ConfigError(f"on_corrupt must be 'error' or 'skip', got {on_corrupt!r}")
        self.root = Path(root).expanduser()
        self.paths = list_images(self.root)
        self.transform = transform
        self.loader: Callable[[str], Any] = image_loader(decoder)
        self.on_corrupt = on_corrupt
        self.skipped = 0  # per process: each DataLoader worker counts its own

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> tuple[Any, int] | None:
        path = self.paths[index]
        try:
            image = self.loader(str(path))
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
        if self.transform is not None:
            image = self.transform(image)
        return image, index
