"""ImageNetDataModule: the data the template trains on: ImageNet, any folder of class folders, the embedded digits.

    python -m project fit --config configs/quickstart.yaml                        # --data.root embedded:digits
    python -m project fit --config configs/ddp_8gpu.yaml --data.root /datasets/imagenet
"""

from classifier_engine import ImageFolderDataModule


class ImageNetDataModule(ImageFolderDataModule):
    """ROOT/train/<class>/ and ROOT/val/<class>/ (ImageNet's layout; tools/prepare_imagenet.py writes it), with the
    ImageNet presets. Every option: `python -m project fit --data.help ImageNetDataModule`. Your own data: a
    LightningDataModule of your own (docs/your-own-project.md), or a subclass of this one with other defaults."""
