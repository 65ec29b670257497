"""Image classifiers with PyTorch Lightning: `python -m project fit --config configs/quickstart.yaml`.

The room (the model, the networks, the data) around the machinery in engine/classifier_engine/, which gets its defaults here.
"""

from project.data import ImageNetDataModule
from classifier_engine.cli import cli_main, main, use_defaults
from project.model import ImageClassifier, backbone_replaces_arch
from project.weights import apply_weights_eval_sizes

use_defaults(ImageClassifier, ImageNetDataModule, config_hooks=[apply_weights_eval_sizes],
             tidy_hooks=[backbone_replaces_arch])

__all__ = ["ImageClassifier", "ImageNetDataModule", "cli_main", "main"]
