"""The images to predict: every image file under a folder (searched recursively), in sorted path order.

    python -m project predict --config configs/quickstart.yaml --ckpt_path <run>/checkpoints/last.ckpt \
        --data.predict_root path/to/images
"""

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch.utils.data import Dataset
from torchvision.datasets.folder import IMG_EXTENSIONS

from project.errors import MissingInputError
from project.data.decoders import Decoder, image_loader


def list_images(root: str | os.PathLike) -> list[Path]:
    """Image files under `root` (hidden folders skipped), sorted by their path relative to `root`: a stable order."""
    root = Path(root).expanduser()
    if not root.is_dir():
        raise MissingInputError(
            f"predict root {root} is not a folder; pass --data.predict_root pointing to a folder of images "
            f"(any depth, extensions {', '.join(IMG_EXTENSIONS)})"
        )
    found = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        found += [Path(dirpath, name).relative_to(root) for name in filenames if name.lower().endswith(IMG_EXTENSIONS)]
    if not found:
        raise MissingInputError(
            f"predict root {root} holds no images; expected files with an extension in {IMG_EXTENSIONS} "
            "at any depth below it"
        )
    # Sorted as POSIX strings, so the order (and the CSV written from it) is the same on every machine.
    return [root / rel for rel in sorted(found, key=lambda p: p.as_posix())]


class ImagePathDataset(Dataset):
    """Yields (image, index); `paths[index]` names the file, so predictions can be written back under its path.

    decoder: as the data module's `data.decoder`. A device decoder ("nvjpeg", "torchcodec-cuda") decodes with its CPU
    counterpart here (torchvision, torchcodec: project.data.decoders.image_loader), on purpose: predict batches are
    decoded and transformed in the workers, so the eval preset runs exactly as the CPU pipeline runs it.
    """

    def __init__(self, root: str | os.PathLike, transform: Callable | None = None, *, decoder: Decoder = "auto"):
        self.root = Path(root).expanduser()
        self.paths = list_images(self.root)
        self.transform = transform
        self.loader: Callable[[str], Any] = image_loader(decoder)

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> tuple[Any, int]:
        image = self.loader(str(self.paths[index]))
        if self.transform is not None:
            image = self.transform(image)
        return image, index
