"""Image classifiers with PyTorch Lightning: `python -m project fit --config configs/quickstart.yaml`.

Your room: the model, the networks, the recipe and the data. The machinery is the library classifier_engine (engine/),
which this package imports only through its public API.
"""

from project.data import ImageNetDataModule
from project.model import ImageClassifier

__all__ = ["ImageClassifier", "ImageNetDataModule"]
