"""ImageFolderDataModule: ImageFolder-layout data (ROOT/train/<class>/, ROOT/val/<class>/) with role-named presets.

    python -m classifier_engine fit --config CONFIG  # embedded digits, no download
    python -m classifier_engine fit --config CONFIG --trainer.devices=8 --data.root /datasets/imagenet
"""

from pathlib import Path
from typing import Optional

from classifier_engine.data.embedded import resolve_root
from classifier_engine.data.image_data import ImageDataModule, Samples
from classifier_engine.data.layout import check_layout, folder_samples, read_class_labels
from classifier_engine.errors import ConfigError


class ImageFolderDataModule(ImageDataModule):
    """ImageNet (or any ImageFolder-layout data set): class count and names are read from the train folders; a val
    split may lack some classes (labelled by name)."""

    def __init__(self, root: Optional[str] = None, **options):
        """
        Args:
            root: folder holding train/<class>/ and val/<class>/ (ImageNet layout), or "embedded:digits".
            **options: the options every image data module has (classifier_engine.data.image_data.ImageDataModule).
        """
        super().__init__(**options)  # the options are checked first: nothing is read or written before
        if root is None:
            raise ConfigError("data.root is not set: pass --data.root /path/to/imagenet (holding train/ and val/), "
                              "or --data.root embedded:digits for the built-in quickstart data")
        self.root = resolve_root(root)
        # Read here, not in setup(): the CLI links data.num_classes into the model right after instantiation.
        self.class_names: list[str] = check_layout(self.root)
        self.num_classes = len(self.class_names)
        # Folder names (wnids for ImageNet) stay the keys; labels are the human names prepare_imagenet wrote.
        self.class_labels: list[str] = read_class_labels(self.root, self.class_names)

    def samples(self, split: str) -> Samples:
        # ImageNet's labelled test set is its val set; a ROOT/test/ folder takes precedence when present.
        if split == "test" and not (self.root / "test").is_dir():
            split = "val"
        return folder_samples(self.root / split, self.class_names)

    def predict_images(self) -> Path:
        return self.root / "val"
