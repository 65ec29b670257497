"""Does this process train, or only spawn those that do (ddp_spawn)? The one use of a private launcher class."""

import lightning as L
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher


def trains_in_this_process(trainer: L.Trainer) -> bool:
    return not isinstance(trainer.strategy.launcher, _MultiProcessingLauncher)


def spawned_by_lightning(trainer: L.Trainer) -> bool:
    """In a training hook: is this a rank ddp_spawn started (its trainer came pickled, with the spawning launcher)?"""
    return isinstance(trainer.strategy.launcher, _MultiProcessingLauncher)
