"""Image classifiers with PyTorch Lightning: `python -m project fit --config configs/quickstart.yaml`.

Your room: the model, the networks, the recipe and the data. The machinery is the library classifier_engine (engine/),
which this package imports only through its public API.
"""

import classifier_engine

from project.data import ImageNetDataModule
from project.model import ImageClassifier, learning_rate, network_choice
from project.weights import weights_eval_sizes

# What a config that names no class builds, and the room's passes of the run plan (`--plan` shows their decisions).
DEFAULTS = dict(model=ImageClassifier, data=ImageNetDataModule,
                passes=[network_choice, weights_eval_sizes, learning_rate])


def cli_main(args=None, **kwargs):
    """`python -m project ARGS` in-process (notebooks, tests): the engine's CLI with this template's defaults."""
    return classifier_engine.cli_main(args, **{**DEFAULTS, **kwargs})


def main(argv=None) -> None:
    """`python -m project ARGS`: one line and exit 2 for a user's error."""
    classifier_engine.main(argv, **DEFAULTS)


__all__ = ["DEFAULTS", "ImageClassifier", "ImageNetDataModule", "cli_main", "main"]
