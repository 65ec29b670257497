"""Image classifiers with PyTorch Lightning: `python -m project fit --config configs/quickstart.yaml`.

Your room: the model, the networks, the recipe and the data. The machinery is the library classifier_engine (engine/),
which this package imports only through its public API.
"""

import classifier_engine

from project.data import ImageNetDataModule
from project.model import ImageClassifier, backbone_replaces_arch
from project.weights import apply_weights_eval_sizes

# What a config that names no class builds, and the room's config hooks (python -m project hands them to the engine).
DEFAULTS = dict(model=ImageClassifier, data=ImageNetDataModule, config_hooks=[apply_weights_eval_sizes],
                tidy_hooks=[backbone_replaces_arch])


def cli_main(args=None, **kwargs):
    """`python -m project ARGS` in-process (notebooks, tests): the engine's CLI with this template's defaults."""
    return classifier_engine.cli_main(args, **{**DEFAULTS, **kwargs})


def main(argv=None) -> None:
    """`python -m project ARGS`: one line and exit 2 for a user's error."""
    classifier_engine.main(argv, **DEFAULTS)


__all__ = ["DEFAULTS", "ImageClassifier", "ImageNetDataModule", "cli_main", "main"]
