"""Image classifiers with PyTorch Lightning: `python -m project fit --config configs/quickstart.yaml`."""

import project.engine.strategies  # noqa: F401  registers strategy="dp"
from project.engine.cli import cli_main
from project.data import ImageNetDataModule
from project.model import ImageClassifier

__all__ = ["ImageClassifier", "ImageNetDataModule", "cli_main"]
