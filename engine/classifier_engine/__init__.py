"""classifier-engine: the machinery under a Lightning image-classification template (README.md beside this package).

    python -m classifier_engine fit --model.class_path my_models.MyModule --data.class_path my_data.MyData

The public API is `__all__` below: a template's room imports these names and nothing else (CHANGELOG.md says what
changes between releases). Imported on first use, so `import classifier_engine.errors` stays light.
"""

from importlib import import_module
from typing import Any

__version__ = "0.1.0"

_PUBLIC = {
    # the entry point: LightningCLI with the run's safety rails, and `python -m ...` (export and sweep included)
    "cli_main": "classifier_engine.cli",
    "main": "classifier_engine.entry",
    # the run plan's decisions: a template's own passes return them (cli_main(passes=...); --plan prints them)
    "Decision": "classifier_engine.run_plan",
    # the contract the engine reads of a model and a data module
    "ClassificationModel": "classifier_engine.contract",
    "ClassificationData": "classifier_engine.contract",
    "Monitor": "classifier_engine.contract",
    "EvalPreprocessing": "classifier_engine.contract",
    # one-line errors: raised with what is wrong, where, and the fix
    "ConfigError": "classifier_engine.errors",
    "CheckpointError": "classifier_engine.errors",
    "MissingInputError": "classifier_engine.errors",
    # typed, checked options (PositiveInt, UnitInterval, ...) for __init__ signatures and option groups
    "options": "classifier_engine",
    # randomness as a pure function of (seed, epoch, batch): the same after a resume and on every rank
    "StepSeed": "classifier_engine.seeds",
    "batch_seed": "classifier_engine.seeds",
    # strategy fsdp2: shard a network in configure_model, recompute activations
    "shard": "classifier_engine.strategies.fsdp",
    "checkpoint_activations": "classifier_engine.strategies.fsdp",
    # a checkpoint read weights-only (a sharded one too), with one-line errors
    "load_checkpoint": "classifier_engine.run.checkpoint_io",
    # image data modules: folders of class folders, manifests, shards, and their base
    "ImageDataModule": "classifier_engine.data",
    "ImageFolderDataModule": "classifier_engine.data",
    "ManifestDataModule": "classifier_engine.data",
    "ShardDataModule": "classifier_engine.data",
}
__all__ = list(_PUBLIC)


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module 'classifier_engine' has no attribute {name!r}")
    module = import_module(_PUBLIC[name])
    value = import_module("classifier_engine.options") if name == "options" else getattr(module, name)
    globals()[name] = value
    return value
