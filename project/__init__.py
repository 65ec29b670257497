"""ResNet image classification on ImageNet with PyTorch Lightning: `python -m project fit --config ...`."""

import project.strategies  # noqa: F401  registers strategy="dp"
from project.data import ImageNetDataModule
from project.model import ImageClassifier

__all__ = ["ImageClassifier", "ImageNetDataModule", "cli_main"]


def cli_main(args=None, **kwargs):
    """Imported lazily so `import project` does not pull in the CLI machinery."""
    from project.cli import cli_main as _cli_main

    return _cli_main(args, **kwargs)
