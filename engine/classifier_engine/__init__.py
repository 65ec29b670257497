"""The machinery: keep it as it is. The CLI, the run wing, compat, strategies, errors, trackers, sweeps and export.

Nothing here imports the room around it (the model, the networks, the data): `python -m project` hands the default
model and data classes to `cli_main`, and any LightningModule / LightningDataModule comes in by `class_path`.
"""

from classifier_engine.cli import cli_main

__all__ = ["cli_main"]
